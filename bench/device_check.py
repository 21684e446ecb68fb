"""
Run the real scripts on one machine, end to end, and print one table: the check for the paths
that CI never runs (CUDA autocast in bf16 and fp16, torch.compile, fused AdamW, flash attention,
pinned prefetch, the memory probe, compiled evaluation, SIGTERM and resume on a GPU).

    python bench/device_check.py --data-dir DIR                      # GPT-2 124M on a GPU
    python bench/device_check.py --data-dir DIR --device cpu --small  # the same steps, tiny, on CPU

DIR holds shards from fineweb.py (a few million tokens are enough: the loader wraps around).
Steps, each a subprocess with its own time limit; a failure is reported and the rest go on:
  train      train_gpt2.py with the defaults of the 124M recipe (batch, compile, dtype, auto
             micro-batch), validation, HellaSwag, samples, --timing-breakdown and two steps under
             --profile-steps (the trace in OUT/run/profile/); stopped with SIGTERM part-way
  resume     --resume to the end: steps continue from the checkpoint the signal wrote
  fp16       a short run with --dtype float16 (the T4/V100 path, with the gradient scaler)
  eager      a short run with --no-compile, for the compile speed-up
  muon       a short run with --optimizer muon (compiled, Newton-Schulz on the GPU)
  hellaswag  hellaswag.py on the run's checkpoint, with --compile where the GPU can compile
  sample     sample.py on the run's checkpoint
  bench_hellaswag, bench_sample, bench_core   the benchmarks of BENCHMARKS.md on this device
  compile_gate   whether torch.compile can run here (Triton needs compute capability 7.0+), and
                 what the trainer's header says about it
  syncs      host-device syncs in one training step (CUDA's sync debug mode), AdamW and Muon, bf16
             and fp16 with the gradient scaler: 1 expected, the read of the step's loss and norm
  probe      the micro-batch auto-fit with this process allowed 30% of the GPU's memory: sizes that
             fit on the whole card fail here, and the probe must take a smaller one and train
  oom_snapshot   a micro-batch of a million tokens with --memory-snapshot: out of memory at the
             first step (exit status 2 and one line expected), and the snapshot it wrote in OUT/oom/profile/
  micro_a, micro_b   the eager run's recipe compiled (its losses must be eager's), then its middle
             checkpoint resumed with --micro-batch-size 4 (a GPU with less memory): same data, same
             losses (within 1e-2, relative: the result 'losses' where they are not)
  two_ranks, fsdp, activation_checkpointing, peer   a node's paths on the GPUs at hand (bench/node_paths.py):
             torchrun with 2 processes sharing one GPU over gloo against one process, FSDP2 in a group of one (and
             over 2 devices where there are 2) with an exact resume and the export, the recipe with activation
             checkpointing against without, and build-nanogpt's own trainer beside ours (with --peer-src)
HellaSwag uses synthetic items written next to the results (the machine may be offline).
Every step's command, exit status, time and output tail go to --out as JSON and text files.
"""

import argparse
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import plot  # noqa: E402
from common import UserError  # noqa: E402
from device import TRITON_MIN_CAPABILITY, pick_device  # noqa: E402
from train_config import command_line as flags  # noqa: E402

PY = sys.executable
ITEMS = "hellaswag_synthetic.jsonl"  # in the results folder: the machine may be offline


def run_step(name, cmd, out_dir, timeout, env, stop_at=None):
    """Run cmd, its output teed to out_dir/name.log. stop_at: (line prefix, signal) sent once a
    line starting with the prefix is printed. Returns {name, cmd, rc, seconds, tail}."""
    t0 = time.time()
    log_path = os.path.join(out_dir, f"{name}.log")
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = t0 + timeout
            for line in proc.stdout:
                log.write(line)
                log.flush()
                lines.append(line.rstrip("\n"))
                if stop_at and line.startswith(stop_at[0]):
                    proc.send_signal(stop_at[1])
                    stop_at = None
                if time.time() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            rc = proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    return {"name": name, "cmd": " ".join(cmd), "rc": rc, "seconds": round(time.time() - t0, 1),
            "tail": lines[-15:]}


def run_logged(cmd, log_path, cwd=ROOT, env=None, timeout=None):
    """Run cmd, its output into log_path; its exit status, or "timeout" where it ran past timeout seconds (then it is
    killed with what it started: with a timeout it runs in a process group of its own)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=timeout is not None)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def speed(log_dir):
    """Steady-state tok/s and MFU of a run, as plot.py summarises them ('' if it logged none)."""
    try:
        s = plot.summarize(log_dir)
    except UserError:
        return ""
    if s["tok_per_s_steady"] is None:
        return ""
    return f"{s['tok_per_s_steady']:,.0f} tok/s" + (f", MFU {s['mfu']:.1%}" if s["mfu"] is not None else "")


def last_timing(log_path):
    """The last --timing-breakdown line in a step's log, as 'data 0.4 copy 0.1 ... (ms)', or ''."""
    if not os.path.isfile(log_path):
        return ""
    with open(log_path) as f:
        lines = [line for line in f if line.startswith("timing |")]
    if not lines:
        return ""
    return " ".join(f"{k} {float(v):.0f}" for k, v in re.findall(r"(\w+)_ms ([\d.]+)", lines[-1])) + " (ms)"


def first_line(log_path, prefix):
    """The first line of a step's log that starts with prefix, or ''."""
    return (lines_of(log_path, prefix) or [""])[0]


def last_line(log_path, prefix):
    """The last line of a step's log that starts with prefix, or ''."""
    return (lines_of(log_path, prefix) or [""])[-1]


def lines_of(log_path, prefix):
    if not os.path.isfile(log_path):
        return []
    with open(log_path) as f:
        return [line.strip() for line in f if line.startswith(prefix)]


def same_losses(log_a, log_b):
    """(how far run b's losses are from run a's at the steps both logged, as a phrase; the largest relative
    difference), or ('', None) where they share no step."""
    try:
        a, b = ({r["step"]: r["loss"] for r in plot.read_metrics(d)["train"]} for d in (log_a, log_b))
    except UserError:
        return "", None
    both = sorted(set(a) & set(b))
    if not both:
        return "", None
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in both)
    return (f"steps {both[0]}-{both[-1]}: losses within {worst:.1e} (relative) of {os.path.basename(log_a)}'s",
            worst)


def write_items(path, n):
    from bench_hellaswag import synthetic_items
    with open(path, "w") as f:
        for item in synthetic_items(n):
            f.write(json.dumps(item) + "\n")


@dataclass(frozen=True)
class Machine:
    """What the steps depend on: the device, and on CUDA the GPU's name, its compute capability and
    how many GPUs there are."""
    device: str
    gpu: str = ""
    capability: tuple = None
    gpus: int = 0


def this_machine(device):
    if not device.startswith("cuda"):
        return Machine(device)
    import torch
    return Machine(device, torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)),
                   torch.cuda.device_count())


class Step(NamedTuple):
    cmd: list
    stop_at: tuple = None  # (line prefix, signal): sent once a line starting with the prefix is printed
    rc: int = 0  # the exit status of a step that did what it checks
    timeout: int = None  # seconds it may take (None: --step-timeout)
    same_as: str = None  # the step whose run this one's losses must match, within LOSS_TOLERANCE, where both ran


# relative: 16-bit runs of one recipe that differ in compile or micro-batch stay under 1e-3 (an H200, bf16 and fp16,
# 12 steps); a graph compiled for the other dtype was 9e-2 off
LOSS_TOLERANCE = 1e-2


def count_syncs(data_dir, device):
    """Print the host-device syncs in one training step (CUDA's sync debug mode), for AdamW and for
    Muon with AdamW, in bf16 where the GPU has it and in fp16 with the gradient scaler; exit status 1
    unless each is 1, the read of the step's loss, norm and stop flag together."""
    import warnings
    import torch
    import optim
    import train_gpt2
    from dataloader import Data, TokenLoader
    from device import bf16_supported, muon_dtype
    from model import GPT, GPTConfig
    from parallel import Ranks
    counts = {}
    for dtype in (["bfloat16"] if bf16_supported(device) else []) + ["float16"]:
        for name in ("adamw", "muon"):
            torch.manual_seed(0)
            model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=256)).to(device)
            opt = optim.configure(model, optim.Settings(0.1, 6e-4, muon_lr=0.02 if name == "muon" else None),
                                  device_type="cuda", muon_dtype=muon_dtype(device))
            scaler = torch.amp.GradScaler("cuda", enabled=dtype == "float16")
            loader = TokenLoader(Data(data_dir, device=device), "train", 4, 256)

            def step():
                train_gpt2.train_step(train_gpt2.StepParts(model, opt, scaler, Ranks(device=device), dtype, 2, 1.0),
                                      loader)
            step()  # the first step allocates the optimizer's state
            torch.cuda.synchronize(device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(3):
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts[f"{name} {dtype}"] = syncs_in(str(w.message) for w in caught) / 3
    print("syncs per step | " + ", ".join(f"{k} {v:g}" for k, v in counts.items()), flush=True)
    sys.exit(0 if all(v == 1 for v in counts.values()) else 1)


# what CUDA's sync debug mode warns at each synchronizing call; the first time it is switched on, PyTorch also
# warns once that the mode is a prototype ("Synchronization debug mode is ..."), which is no sync
SYNC_WARNING = "called a synchronizing CUDA operation"


def syncs_in(messages):
    return sum(SYNC_WARNING in m for m in messages)


SYNCS = "import sys; sys.path.insert(0, 'bench'); import device_check; device_check.count_syncs(*sys.argv[1:])"
# the probe's process may take 30% of the GPU's memory: the sizes that fit on the whole card do not
PROBE = ("import runpy, sys, torch; torch.cuda.set_per_process_memory_fraction(0.3); sys.argv = sys.argv[1:]; "
         "runpy.run_path(sys.argv[0], run_name='__main__')")
GATE = ("import sys, torch, device; d = sys.argv[1]; "
        "print('capability', torch.cuda.get_device_capability(d) if d.startswith('cuda') else '-', "
        "'| compile', 'off: ' + device.compile_blocker(d) if device.compile_blocker(d) else 'allowed')")


SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, total_batch_size=512)  # --small: a tiny model


def trainer_flags(args, out, name, **settings):
    """train_gpt2.py's flags for a run into out/name: by default a short one, no evaluation, nothing
    exported; settings (by name) over these."""
    return flags(dict(dict(data_dir=args.data_dir, log_dir=os.path.join(out, name), device=args.device,
                           max_steps=12, warmup_steps=2, eval_every=0, hellaswag_every=0, sample_every=0,
                           export_hf=False, plot=False, **(SMALL if args.small else {})), **settings))


def on_the_run(args, out, compiles):
    """The steps both plans run on the train step's run and beside it: the scripts on its checkpoint, the syncs of
    a step, the auto-fit under memory pressure and an out-of-memory snapshot (the last three CUDA's alone)."""
    items, log_dir = os.path.join(out, ITEMS), os.path.join(out, "run")
    trainer = functools.partial(trainer_flags, args, out)
    return {
        "hellaswag": Step([PY, "hellaswag.py", "--model", log_dir, "--data-file", items, "--device", args.device,
                           "--json"] + (["--compile"] if compiles else [])),
        "sample": Step([PY, "sample.py", "--model", log_dir, "--device", args.device, "--num-samples", "2",
                        "--max-new-tokens", "24" if args.small else "64", "--seed", "1"]),  # within --small's context
        "syncs": Step([PY, "-c", SYNCS, args.data_dir, args.device]),
        "probe": Step([PY, "-c", PROBE, "train_gpt2.py"] + trainer("probe", max_steps=3)),
        # a step of a million tokens per micro-batch runs out of memory on any GPU: the snapshot is written
        "oom_snapshot": Step([PY, "train_gpt2.py"] + trainer("oom", block_size=1024, micro_batch_size=1024,
                                                             total_batch_size=1024 * 1024, compile=False,
                                                             memory_snapshot=True, max_steps=2), rc=2),
    }


NODE_PATHS = ("two_ranks", "fsdp", "activation_checkpointing", "peer")  # bench/node_paths.py's steps


def node_paths(args, out, limits=None):
    """{name: Step} of a node's paths on this machine; the peer's where --peer-src names build-nanogpt's trainer."""
    limits = limits or {}
    common_flags = ["--data-dir", args.data_dir, "--out", out, "--device", args.device] + (["--small"] if args.small
                                                                                            else [])
    steps = {name: Step([PY, os.path.join("bench", "node_paths.py"), name] + common_flags, timeout=limits.get(name))
             for name in NODE_PATHS}
    if args.peer_src:
        steps["peer"].cmd.extend(["--peer-src", args.peer_src, "--steps", str(args.peer_steps)]
                                 + (["--peer-script", args.peer_script] if args.peer_script else []))
    else:
        del steps["peer"]
    return steps


def plan(args, machine, out):
    """{name: Step} of every step this machine runs, in order; args: parse_args()'s, out: the results
    folder. The commands name each setting once."""
    if args.quick:
        return quick_plan(args, machine, out)
    cuda = machine.device.startswith("cuda")
    compiles = not cuda or machine.capability >= TRITON_MIN_CAPABILITY
    items = os.path.join(out, ITEMS)
    if args.small:
        bench_hs = ["--items", "40", "--n-layer", "2", "--n-head", "2", "--n-embd", "64"]
        bench_gen = ["--new-tokens", "16", "--repeats", "1"]
    else:
        bench_hs, bench_gen = ["--items", "2000"], []
    trainer = functools.partial(trainer_flags, args, out)

    every = max(2, args.steps // 2)
    train = trainer("run", max_steps=args.steps, warmup_steps=min(10, args.steps), eval_every=every,
                    val_tokens=4096 if args.small else 1048576, hellaswag_every=every, hellaswag_file=items,
                    hellaswag_limit=200, sample_every=every, checkpoint_every=every, timing_breakdown=10,
                    profile_steps=f"{every // 2}:{every // 2 + 1}", export_hf=None, plot=None)
    bench_dtype = ["--dtype", "auto"]  # bf16 where the GPU has it, fp16 on a T4 or P100, fp32 on CPU
    shared = on_the_run(args, out, compiles)
    steps = {
        "train": Step([PY, "train_gpt2.py"] + train, (f"step {(3 * args.steps) // 4:5d} |", signal.SIGTERM)),
        "resume": Step([PY, "train_gpt2.py"] + train + ["--resume"]),
        "fp16": Step([PY, "train_gpt2.py"] + trainer("fp16", dtype="float16")),
        "eager": Step([PY, "train_gpt2.py"] + trainer("eager", compile=False)),
        "muon": Step([PY, "train_gpt2.py"] + trainer("muon", optimizer="muon")),
        "hellaswag": shared["hellaswag"],
        "sample": shared["sample"],
        "bench_hellaswag": Step([PY, "bench/bench_hellaswag.py", "--device", args.device, "--batch-sizes", "1,16,64"]
                                + bench_dtype + bench_hs),
        "bench_sample": Step([PY, "bench/bench_sample.py", "--device", args.device] + bench_dtype + bench_gen),
        "bench_core": Step([PY, "bench/bench_core.py", "--device", args.device, "--batch-sizes", "1,16,64"]
                           + bench_dtype + (["--items", "4", "--n-layer", "2", "--n-head", "2", "--n-embd", "64"]
                                            if args.small else ["--items", "200"])),
        # the GPU-readiness checks: compile gating, the probe under memory pressure, a resume with a
        # smaller micro-batch, FSDP
        "compile_gate": Step([PY, "-c", GATE, args.device]),
        "syncs": shared["syncs"],
        "probe": shared["probe"],
        "oom_snapshot": shared["oom_snapshot"],
        # the eager run's recipe, compiled: the same losses
        "micro_a": Step([PY, "train_gpt2.py"] + trainer("micro_a", checkpoint_every=6), same_as="eager"),
        "micro_b": Step([PY, "train_gpt2.py", "--log-dir", os.path.join(out, "micro_b"), "--resume",
                         os.path.join(out, "micro_a", "ckpt_000006.pt"), "--micro-batch-size", "4"],
                        same_as="micro_a"),
        **node_paths(args, out),
    }
    if not cuda:  # float16 autocast, the memory fraction, the allocator's snapshots and sync debugging are CUDA's
        del steps["fp16"], steps["probe"], steps["oom_snapshot"], steps["syncs"]
    return steps


QUICK_STEPS = 20  # the quick run: evaluations, a checkpoint and the resume point at step 10, a trace at 15


def quick_plan(args, machine, out):
    """{name: Step} of --quick, the first call on a GPU, most telling first: the default recipe (compile, the
    device's dtype, the micro-batch auto-fit) trained 20 steps with every evaluation and a checkpoint at step 10,
    resumed from that checkpoint with its micro-batch, the syncs of a step, a node's paths (two ranks on one GPU,
    FSDP2, activation checkpointing, build-nanogpt beside us) and samples from the checkpoint; then, where the
    --budget leaves time, HellaSwag, Muon alone, an out-of-memory snapshot and the auto-fit under memory pressure.
    Each step's limit is what it takes on a cold H200 with room to spare (BENCHMARKS.md)."""
    cuda = machine.device.startswith("cuda")
    compiles = cuda and machine.capability >= TRITON_MIN_CAPABILITY  # on a CPU only the commands are checked
    items, log_dir, half = os.path.join(out, ITEMS), os.path.join(out, "run"), QUICK_STEPS // 2
    trainer = functools.partial(trainer_flags, args, out)
    limits = dict(hellaswag=90, sample=60, syncs=60, probe=90, oom_snapshot=60)
    shared = {name: step._replace(timeout=limits[name]) for name, step in on_the_run(args, out, compiles).items()}
    run = trainer("run", max_steps=QUICK_STEPS, warmup_steps=None, eval_every=half, sample_every=half,
                  val_tokens=4096 if args.small else 2 ** 20, hellaswag_every=half, hellaswag_file=items,
                  hellaswag_limit=40 if args.small else 200, checkpoint_every=half,
                  profile_steps=f"{half + 5}:{half + 5}", plot=None)
    ckpt = os.path.join(log_dir, f"ckpt_{half:06d}.pt")
    steps = {
        "train": Step([PY, "train_gpt2.py"] + run, timeout=240),
        # the step-10 loss from the checkpoint must be the first run's, on the micro-batch it fits again
        "resume": Step([PY, "train_gpt2.py", "--resume", ckpt, "--log-dir", os.path.join(out, "resume"),
                        "--max-steps", str(half + 1), "--eval-every", "0", "--hellaswag-every", "0",
                        "--sample-every", "0", "--no-plot"], timeout=120),
        "syncs": shared["syncs"],
        **node_paths(args, out, dict(two_ranks=180, fsdp=180, activation_checkpointing=150, peer=240)),
        "sample": shared["sample"],
        "hellaswag": shared["hellaswag"],
        "muon": Step([PY, "train_gpt2.py"] + trainer("muon", optimizer="muon", max_steps=6), timeout=120),
        "oom_snapshot": shared["oom_snapshot"],
        "probe": shared["probe"],
    }
    if not cuda:
        del steps["syncs"], steps["oom_snapshot"], steps["probe"]
    return steps


def parse_args(argv=None):
    p = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="token shards from fineweb.py")
    p.add_argument("--out", default="device_check", help="results folder (default: device_check)")
    p.add_argument("--device", default="cuda", help="cuda (default), cpu, ...")
    p.add_argument("--small", action="store_true", help="a tiny model and batch: to try the script on CPU")
    p.add_argument("--quick", action="store_true",
                   help="the first call on a GPU: the default recipe for 20 steps, its resume, the syncs of a step, a "
                        "node's paths on the GPU at hand and the scripts on the checkpoint, in about 9 minutes")
    p.add_argument("--budget", type=int, default=None,
                   help="seconds for all the steps; a step that would not fit is skipped (default: 540 with "
                        "--quick, else none)")
    p.add_argument("--results", default=None,
                   help="also copy the table, the JSON, the logs (one .tgz), the trace and the memory snapshot "
                        "here: at most 8 files")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the train/resume run (default 40)")
    p.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    p.add_argument("--step-timeout", type=int, default=240, help="seconds per step (default 240)")
    p.add_argument("--peer-src", help="build-nanogpt's train_gpt2.py, fetched into an ignored folder: the peer step "
                                      "runs it beside ours (without it, no peer step)")
    p.add_argument("--peer-script", help="the peer script that runs it (default: build_nanogpt_speed.py beside "
                                         "--peer-src)")
    p.add_argument("--peer-steps", type=int, default=15, help="steps of each peer launch (default 15)")
    args = p.parse_args(argv)
    if args.budget is None and args.quick:
        args.budget = 540  # 9 minutes: with the machine's start and the wheels, inside one 10-minute call
    return args


MIN_STEP_SECONDS = 20  # a step with less time left than this is skipped, not started


def main(argv=None):
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    machine = this_machine(pick_device(args.device))
    steps = plan(args, machine, out)
    only = args.only.split(",") if args.only else list(steps)
    if set(only) - set(steps):
        raise UserError(f"--only: no step {', '.join(sorted(set(only) - set(steps)))} on this machine; its steps: "
                        f"{', '.join(steps)}")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    write_items(os.path.join(out, ITEMS), 40 if args.small else 500)
    import torch
    print(f"{machine.gpus} x {machine.gpu} (capability {machine.capability})" if machine.gpus else machine.device,
          f"| torch {torch.__version__} CUDA {torch.version.cuda}", flush=True)
    if "peer" not in steps:
        print("peer: skipped, no --peer-src (build-nanogpt's train_gpt2.py)", flush=True)
    deadline = time.time() + args.budget if args.budget else None
    results = []
    for name, step in steps.items():
        if name not in only:
            continue
        timeout = step.timeout or args.step_timeout
        if deadline is not None:
            left = int(deadline - time.time())
            if left < MIN_STEP_SECONDS:
                print(f"== {name}: skipped, {max(left, 0)} s of the --budget left", flush=True)
                results.append({"name": name, "cmd": shlex.join(step.cmd), "rc": "skipped", "seconds": 0.0,
                                "tail": [], "result": "skipped", "ok": False})
                continue
            timeout = min(timeout, left)
        print(f"== {name} (limit {timeout} s): {shlex.join(step.cmd)}", flush=True)
        r = run_step(name, step.cmd, out, timeout, env, step.stop_at)
        r["result"] = "ok" if r["rc"] == step.rc else f"rc {r['rc']}"
        if step.same_as:
            r["losses"], worst = same_losses(os.path.join(out, step.same_as), os.path.join(out, name))
            r["losses"] = r["losses"] or f"losses not compared: no {step.same_as} run in {out}"
            if worst is not None and worst > LOSS_TOLERANCE and r["result"] == "ok":
                r["result"] = "losses"
        r["ok"] = r["result"] == "ok"
        results.append(r)
        print("\n".join(r["tail"][-5:]), flush=True)
        with open(os.path.join(out, "device_check.json"), "w") as f:
            json.dump(results, f, indent=1)

    # ---- the table: what ran, and the one figure that matters for each step
    figures = {"train": last_timing(os.path.join(out, "train.log")), "resume": speed(os.path.join(out, "run")),
               "fp16": speed(os.path.join(out, "fp16")), "eager": speed(os.path.join(out, "eager")),
               "muon": speed(os.path.join(out, "muon"))}
    if args.quick:
        figures.update(train=f"{micro_batch(os.path.join(out, 'train.log'))}, {speed(os.path.join(out, 'run'))}",
                       resume=same_step_loss(out, QUICK_STEPS // 2))
    for r in results:
        if r["name"] == "hellaswag":
            figures["hellaswag"] = next((l.split("  ")[2] for l in r["tail"] if "items/s" in l and
                                         len(l.split("  ")) > 2), "")
        if r.get("losses"):
            figures[r["name"]] = r["losses"]
        if r["name"].startswith("bench_"):  # the speed ratios the benchmark printed last
            figures[r["name"]] = " / ".join(m for l in r["tail"] for m in re.findall(r"(\d+\.\d+x)", l))
    for name, prefix in (("compile_gate", "capability"), ("probe", "batch "), ("oom_snapshot", "out of memory at"),
                         ("syncs", "syncs per step")):
        figures[name] = first_line(os.path.join(out, f"{name}.log"), prefix)
    for name in NODE_PATHS:  # the figure each prints last
        figures[name] = last_line(os.path.join(out, f"{name}.log"), f"{name} | ").partition(" | ")[2]
    table = [f"{'step':24s} {'result':8s} {'seconds':>8s}  figure"]
    for r in results:
        table.append(f"{r['name']:24s} {r['result']:8s} {r['seconds']:8.1f}  {figures.get(r['name'], '')}")
    with open(os.path.join(out, "device_check.txt"), "w") as f:
        f.write("\n".join(table) + "\n")
    if args.results:
        collect(out, args.results)
    print("\n" + "\n".join(table))
    return 0 if all(r["ok"] for r in results) else 1


def micro_batch(log_path):
    """'micro-batch N' from the header of a trainer's output, or ''."""
    found = re.search(r"micro-batch (\d+)", first_line(log_path, "batch "))
    return f"micro-batch {found.group(1)}" if found else ""


def same_step_loss(out, step):
    """Whether the resumed run's loss at `step` (the checkpoint's) equals the first run's, and both micro-batches."""
    try:
        a, b = ({r["step"]: r["loss"] for r in plot.read_metrics(os.path.join(out, d))["train"]}
                for d in ("run", "resume"))
    except UserError:
        return ""
    if step not in a or step not in b:
        return f"no step {step} in both runs"
    diff = abs(a[step] - b[step])
    verdict = "equal" if diff == 0 else f"differs by {diff:.2e}"
    resumed, first = (micro_batch(os.path.join(out, f"{name}.log")) for name in ("resume", "train"))
    return f"step {step} loss {b[step]:.6f}, {verdict} to the first run's; {resumed} (first run: {first})"


def collect(out, results):
    """The table, the JSON, every step's output and each run's log and metrics (logs.tgz), the first profiler
    trace and the first memory snapshot under 16 MB: at most 8 files into `results`."""
    import glob
    import shutil
    import tarfile
    os.makedirs(results, exist_ok=True)
    for name in ("device_check.txt", "device_check.json"):
        if os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(out, name), results)
    with tarfile.open(os.path.join(results, "logs.tgz"), "w:gz") as tar:
        for path in sorted(glob.glob(os.path.join(out, "*.log")) + glob.glob(os.path.join(out, "*", "log.txt"))
                           + glob.glob(os.path.join(out, "*", "metrics.jsonl"))):
            tar.add(path, os.path.relpath(path, out))
    for pattern in ("*.pt.trace.json.gz", "*.pickle"):
        found = [p for p in sorted(glob.glob(os.path.join(out, "*", "profile", pattern)))
                 if os.path.getsize(p) < 16 * 2 ** 20]
        if found:
            shutil.copy(found[0], results)


if __name__ == "__main__":
    sys.exit(common.run_script(main))
