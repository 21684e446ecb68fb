"""
train_gpt2.py as tests/test_slurm.py's jobs run it (linked as train_gpt2.py into the directory they
start in): the trainer itself, which also appends to $SLURM_TRAINER_LOG, for each launch and rank,
one JSON line when it holds and one when its loop ends:
  {"rank", "hold": STEP}   with HOLD=N, a launch that starts before step N holds at the start of
                           its first step until a stop request comes: the test stops it there and
                           nowhere else, however fast the machine
  {"rank", "stopping": SIGNAL}  the held launch has its stop request; with RELEASE=PATH it goes on
                           (trains the step, writes the checkpoint) only once PATH exists
  {"rank", "stop": the stop request's signal or null, "cpus": the CPUs the process may run on,
   "child": the exit status of a child process (a sleep) started as the loop began, with the
   default SIGUSR1, or null where it outlived the loop, "stop_s": seconds from the held launch's
   stop request (or its release) to the loop's end: the step and the stop's checkpoint}
"""
import inspect
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import common  # noqa: E402
import train_gpt2  # noqa: E402

real_loop, real_step = train_gpt2.loop, train_gpt2.train_step
launch = {}


def note(**fields):
    with open(os.environ["SLURM_TRAINER_LOG"], "a") as f:
        f.write(json.dumps(dict(rank=int(os.environ.get("RANK", "0")), **fields)) + "\n")


def loop(run):
    launch["start"] = run.start_step
    try:
        return real_loop(run)
    finally:
        child, stop, going = launch.get("child"), launch.get("stop"), launch.get("going")
        note(stop=stop and stop.signal, cpus=len(os.sched_getaffinity(0)), child=child and child.poll(),
             stop_s=going and round(time.monotonic() - going, 2))
        if child is not None:
            child.kill()


def train_step(*args, **kwargs):
    if "child" not in launch:  # the first step of this launch: the loop catches stop requests now
        launch["child"] = subprocess.Popen(["sleep", "3600"])
        launch["stop"] = inspect.signature(real_step).bind(*args, **kwargs).arguments["stop"]
        if launch["start"] < int(os.environ.get("HOLD", "0")):
            note(hold=launch["start"])
            while launch["stop"].signal is None:
                time.sleep(0.05)
            note(stopping=launch["stop"].signal)
            while os.environ.get("RELEASE") and not os.path.exists(os.environ["RELEASE"]):
                time.sleep(0.05)
            launch["going"] = time.monotonic()
    return real_step(*args, **kwargs)


if __name__ == "__main__":
    train_gpt2.loop, train_gpt2.train_step = loop, train_step
    common.run_main(train_gpt2.main)
