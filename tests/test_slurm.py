"""
train_gpt2.sbatch on a real SLURM: a job that needs five allocations (stop requests before the time
limit, a requeue from outside as a preempting partition does, a damaged line in its records), a
two-node job, the time limit, the runs that must not be requeued and how they say so, and one
process per GPU; every trainer on all the CPUs of its node, and a stop request that reaches the
trainers alone.

The cluster, started once for the module, is Debian's SLURM and munge (apt-get install slurmctld
slurmd slurm-client munge; the tests skip without them, or without root, which slurmd needs to
run jobs), on loopback, in a temporary directory holding everything it writes:
  - munged with a fresh key, on a socket of its own;
  - slurmctld, and eight slurmd started with -N n1 ... -N n8, each on a port of its own: nodes whose
    NodeAddr is 127.0.0.1, with 2 CPUs and 2 stand-in GPUs each (gres.conf names /dev/null and
    /dev/zero as their devices), in one partition;
  - slurm.conf written there (SLURM_CONF points the client commands at it): proctrack/linuxproc,
    task/affinity binding each task to the cores it was given (TaskPluginParam=Cores, as GPU
    clusters do), no cgroups, no accounting; KillWait of KILL_WAIT_S (below); a credential lifetime of
    5 s (cred_expire, the least SLURM takes), which a requeued job waits out before it starts again
    (2 minutes by default), and a scheduler that looks every second; a job's processes get the
    niceness of the sbatch that submitted it (PropagatePrioProcess).
Each daemon runs in the foreground as a child of the test process; at the end any job left over is
killed and cancelled, the daemons are stopped by their PIDs, and every process the cluster started
(each carries the cluster's tests/processes.KEEP mark) is gone before its directory is removed.

Jobs are submitted as a user would, with the #SBATCH lines of the script, and these on the command
line in their place: the test partition, no GPUs (`--gpus-per-node=0`) and NPROC_PER_NODE=1 (one CPU
process per node) unless a test says otherwise, the job's output in the test's directory. They
start in a directory whose train_gpt2.py is tests/slurm_trainer.py: the trainer, which notes the
CPUs it may use, starts a child process, and holds its first step until it is stopped where a test
stops it. Every job is submitted at the start, side by side on the eight nodes, and followed by a
thread of its own (its story); each test waits for its story and checks it. The stories wait on
records the trainer writes and on the job's state in SLURM, never on a guess of how long something
takes (the time limit's story waits on SLURM's clock); the timeouts only bound a hang.
"""
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

import checkpoint
import metrics
import processes
from runs import ENV, ROOT, TINY, run

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
SCRIPT = os.path.join(ROOT, "train_gpt2.sbatch")
TRAINER = os.path.join(ROOT, "tests", "slurm_trainer.py")
PARTITION = "tiny"
NODES = 8
STEPS = 12
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
# What SLURM gives a job's processes between its SIGTERM and its SIGKILL (a requeue, scancel, the time limit): the
# stop's step and checkpoint must fit in it, as docs/clusters.md tells users of their cluster's KillWait. The tiny
# trainer's stop (its "stop_s" notes) took at most 0.65 s here, idle or beside six busy loops and a disk writer, yet
# SLURM's default of 30 s cut a stop short on a loaded machine (its next allocation repeated the step): 120 s. Only a
# process that ignores the SIGTERM waits it out, and teardown kills the jobs' processes instead of signalling them.
KILL_WAIT_S = 120


# the daemons are in sbin, which a PATH may leave out
FOUND = {p: shutil.which(p, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
         for p in PROGRAMS}


def unavailable():
    missing = [p for p, path in FOUND.items() if path is None]
    if missing:
        return (f"SLURM or munge is not installed ({', '.join(missing)} missing): "
                "apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs"
    return None


pytestmark = [pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
              pytest.mark.xdist_group("slurm")]  # one cluster: every test of the module in one process


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(condition, what, timeout=300, describe=lambda: "", every=0.1):
    """Poll condition() every `every` seconds until it is true; the timeout only bounds a hang. A condition
    that asks SLURM polls once a second: each query is a process, a munge credential and an RPC (every 0.1 s,
    the stories' queries cost the module about 50 of its 290 CPU-seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{describe()}")
        if ENDING.wait(every):
            raise AssertionError(f"the module ended while a story waited for {what}")


ENDING = threading.Event()  # the stories' teardown: a story still waiting stops, before the cluster does


class Cluster:
    """munged, slurmctld and NODES slurmd (nodes n1, n2, ...) on loopback, under one directory."""

    def __init__(self, root):
        self.root = root
        ctld_port, *node_ports = free_ports(1 + NODES)
        socket_path = os.path.join(root, "munge.socket")
        self.conf = os.path.join(root, "slurm.conf")
        nodes = "".join(f"NodeName=n{i} NodeAddr=127.0.0.1 Port={port} CPUs=2 Gres=gpu:2 State=UNKNOWN\n"
                        for i, port in enumerate(node_ports, 1))
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=tiny
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5,socket={socket_path}
KillWait={KILL_WAIT_S}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=Cores
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=1
PropagatePrioProcess=1
MpiDefault=none
ReturnToService=2
GresTypes=gpu
{nodes}PartitionName={PARTITION} Nodes=n[1-{NODES}] Default=YES MaxTime=INFINITE State=UP
""")
        with open(os.path.join(root, "gres.conf"), "w") as f:  # two stand-in GPUs per node
            f.write(f"NodeName=n[1-{NODES}] Name=gpu File=/dev/null\nNodeName=n[1-{NODES}] Name=gpu File=/dev/zero\n")
        self.workdir = os.path.join(root, "repo")  # where the jobs start: train_gpt2.py is the noting trainer
        os.makedirs(self.workdir)
        os.symlink(TRAINER, os.path.join(self.workdir, "train_gpt2.py"))
        self.env = {k: v for k, v in ENV.items() if not k.startswith("SLURM_")}
        self.env.update({processes.KEEP: f"the SLURM cluster in {root}"}, SLURM_CONF=self.conf, PYTHONPATH=ROOT,
                        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        os.makedirs(os.path.join(root, "state"))
        key = os.path.join(root, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.key, self.socket_path, self.daemons = key, socket_path, []

    def up(self):
        """Start the daemons, and wait for every node to be idle."""
        root, key, socket_path = self.root, self.key, self.socket_path
        self.start([FOUND["munged"], "--foreground", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                    f"--seed-file={root}/munged.seed"])
        wait_for(lambda: os.path.exists(socket_path), "munged's socket", 60, self.logs)
        self.start([FOUND["slurmctld"], "-D", "-f", self.conf])
        for i in range(1, NODES + 1):
            self.start([FOUND["slurmd"], "-D", "-f", self.conf, "-N", f"n{i}"])
        wait_for(lambda: self.run("sinfo", "-h", "-N", "-o", "%T", check=False).split() == ["idle"] * NODES,
                 "every node idle", 120, self.logs)

    def start(self, cmd):
        log = open(os.path.join(self.root, os.path.basename(cmd[0]) + f"-{len(self.daemons)}.out"), "w")
        self.daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env))
        log.close()

    def stop(self):
        """Cancel the jobs and kill what they still run (a story that failed part-way; a job cancelled as it
        started runs its held trainer until KillWait is out), stop the daemons, then end every process the cluster
        started that is still there (a job step's slurmstepd outlives slurmd), and say which had to be killed."""
        def ended():
            for p in self.job_processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            return not self.run("squeue", "-h", check=False).strip()
        try:
            self.run("scancel", f"--partition={PARTITION}", check=False)  # (a pending job does not start)
            wait_for(ended, "the jobs to end", 120, every=1.0)
        finally:
            for p in reversed(self.daemons):  # the slurmds, slurmctld, then munged
                p.terminate()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            ours = [p for p in processes.session() if p.env.get(processes.KEEP) == self.env[processes.KEEP]]
            killed = processes.end(ours, grace=10)
        assert not killed, "the cluster's processes outlived its jobs and daemons (killed):\n" + "\n".join(
            map(str, killed))

    def job_processes(self):
        """What the jobs run (their scripts, torchrun, the trainers): the cluster's processes but its daemons and
        their slurmstepd."""
        daemons = {d.pid for d in self.daemons}
        return [p for p in processes.session() if p.env.get(processes.KEEP) == self.env[processes.KEEP]
                and p.pid not in daemons and p.ppid not in daemons and not p.argv[0].startswith("slurmstepd")]

    def logs(self):
        out = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.root, name), errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-2000:]}")
        return "\n".join(out)

    def run(self, *cmd, check=True):
        p = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=120)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout}{p.stderr}")
        return p.stdout

    def sbatch(self, out_dir, nodes, args, *options, gpus=0, hold=0, release=None, nice=10):
        """Submit train_gpt2.sbatch with the trainer flags args, as a user would; the job's id. With
        no GPUs, NPROC_PER_NODE=1 sets one process per node; hold, release: the trainer's HOLD and
        RELEASE (see slurm_trainer.py); nice: the niceness of the job's processes
        (PropagatePrioProcess), 10 unless it is the job whose turns make the module's wall time. The
        trainer's notes go to out_dir/trainer.jsonl."""
        env = dict(self.env, HOLD=str(hold), SLURM_TRAINER_LOG=os.path.join(out_dir, "trainer.jsonl"),
                   **({} if gpus else {"NPROC_PER_NODE": "1"}), **({"RELEASE": str(release)} if release else {}))
        p = subprocess.run(["nice", "-n", str(nice), "sbatch", "--parsable", f"--partition={PARTITION}",
                            f"--gpus-per-node={gpus}", f"--nodes={nodes}", f"--output={out_dir}/slurm-%j.out",
                            f"--chdir={self.workdir}", *options, SCRIPT, *args],
                           capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip().split(";")[0]

    def job(self, job_id):
        """The job's fields that the tests read, from scontrol show job."""
        text = self.run("scontrol", "show", "job", "-o", job_id)
        return {key: re.search(rf"\b{key}=(\S*)", text).group(1)
                for key in ("JobState", "Reason", "Restarts", "ExitCode")}

    def wait_state(self, job_id, states, restarts, out_dir):
        """Wait until the job is in one of states after `restarts` requeues; its fields."""
        fields = {}

        def reached():
            fields.update(self.job(job_id))
            return fields["JobState"] in states and int(fields["Restarts"]) == restarts
        wait_for(reached, f"job {job_id} to be {'/'.join(states)} after {restarts} requeue(s)",
                 describe=lambda: f"{fields}\n{job_output(out_dir, job_id)}", every=1.0)
        return fields


@pytest.fixture(scope="module")
def cluster():
    root = tempfile.mkdtemp(prefix="slurm-")  # short: a socket's path is limited to 107 bytes
    os.chmod(root, 0o711)  # munged wants its socket's directory searchable by every user
    c = None
    try:
        c = Cluster(root)
        c.up()  # (stopped below if it fails part-way)
        yield c
    finally:
        if c is not None:
            c.stop()
        shutil.rmtree(root, ignore_errors=True)


def trainer_args(data_dir, log_dir, steps=STEPS):
    return TINY + ["--data-dir", data_dir, "--log-dir", str(log_dir), "--max-steps", str(steps),
                   "--checkpoint-every", "1000"]


def job_output(out_dir, job_id):
    path = os.path.join(out_dir, f"slurm-{job_id}.out")
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def last_line(out):
    return out.rstrip("\n").rsplit("\n", 1)[-1]


def notes(out_dir):
    """What the trainers of the jobs in out_dir noted (slurm_trainer.py), in the order written."""
    path = os.path.join(out_dir, "trainer.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def wait_for_holds(out_dir, step, count, job_id):
    """Wait until `count` trainers hold at the start of `step`."""
    wait_for(lambda: sum(n.get("hold") == step for n in notes(out_dir)) >= count, f"{count} trainer(s) holding at "
             f"step {step}", describe=lambda: job_output(out_dir, job_id))


def train_records(log_dir):
    """Every train record in metrics.jsonl, in the order written (a step logged twice is there twice)."""
    out = []
    with open(os.path.join(log_dir, metrics.METRICS_FILE)) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # the damage a story planted
                continue
            if r["kind"] == "train":
                out.append(r)
    return out


def check_continued(log_dir, allocations):
    """The launches, one per allocation, each started where the one before stopped, with its
    checkpoint: every step trained once, none lost or repeated. The launches."""
    launches = metrics.read_metrics(log_dir)["launches"]
    assert len(launches) == allocations, launches
    for before, after in zip(launches, launches[1:]):
        assert before["end"]["reason"] == "signal"
        assert after["run"]["step"] == before["end"]["step"] + 1  # resumed from the stop's checkpoint
    steps = [r["step"] for r in train_records(log_dir)]
    assert steps == list(range(len(steps)))
    return launches


# ----------------------------------------------------------------------------------------------
# The stories: each submits its job(s), stops them where it says, and returns what the tests check.


def five_allocations(cluster, data_dir, out_dir):
    """One process on one node, held at the start of each of its first 4 steps and stopped there: by
    SLURM's warning before the time limit (scancel --batch --signal=USR1, as SLURM sends it), except
    at step 2, where scontrol requeue stops it as a preempting partition does. After the second
    allocation a line of zeros (what a power loss leaves) is appended to its metrics.jsonl, which
    the next allocations write after."""
    log_dir = out_dir / "log"
    job = cluster.sbatch(out_dir, 1, trainer_args(data_dir, log_dir), hold=4, nice=0)
    for step in range(4):
        wait_for_holds(out_dir, step, 1, job)
        if step == 2:
            cluster.run("scontrol", "requeue", job)
        else:
            cluster.run("scancel", "--batch", "--signal=USR1", job)
        if step == 1:
            # after the second allocation's last record; the third's may come before or after it (one line each,
            # appended), as the next launch after a power loss writes after what the loss left
            wait_for(lambda: int(cluster.job(job)["Restarts"]) == 2, "the second requeue", every=1.0)
            with open(log_dir / metrics.METRICS_FILE, "a") as f:
                f.write("\0" * 40 + "\n")
    return log_dir, cluster.wait_state(job, ENDED, 4, out_dir), job_output(out_dir, job)


def two_nodes(cluster, data_dir, out_dir):
    """sbatch --nodes=2, one process each, held at step 0 and stopped by the warning before the time
    limit, which this script hands to the trainers of both nodes; the job requeues itself and its
    next allocation finishes the run."""
    log_dir = out_dir / "log"
    job = cluster.sbatch(out_dir, 2, trainer_args(data_dir, log_dir), hold=1)
    wait_for_holds(out_dir, 0, 2, job)
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    return log_dir, cluster.wait_state(job, ENDED, 1, out_dir), job_output(out_dir, job)


def warned(cluster, data_dir, out_dir):
    """--time=1 with the script's warning, whose lead (5 minutes) is longer than the limit: SLURM warns
    the script at its first time check, and the trainer (holding) stops on it. Before it goes on
    (RELEASE), the job's limit is raised to 30 minutes, so that the next allocation is not warned at
    once too; a plain scancel ends that one."""
    log_dir = out_dir / "log"
    release = out_dir / "release"
    job = cluster.sbatch(out_dir, 1, trainer_args(data_dir, log_dir), "--time=1", hold=STEPS, release=release)
    wait_for(lambda: any("stopping" in n for n in notes(out_dir)), "the warned trainer to have its stop request",
             describe=lambda: job_output(out_dir, job))
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=30")
    release.touch()
    wait_for_holds(out_dir, 1, 1, job)
    cluster.run("scancel", job)
    return log_dir, cluster.wait_state(job, ENDED, 1, out_dir), job_output(out_dir, job)


def cut(cluster, data_dir, out_dir):
    """--time=1 with no warning the trainer sees (--signal=B:CONT@1): the trainer holds until the
    limit, where SLURM sends SIGTERM; the script requeues the timed-out job, which is then
    cancelled (its next allocation may have started by then: it holds, and stops on the scancel)."""
    log_dir = out_dir / "log"
    job = cluster.sbatch(out_dir, 1, trainer_args(data_dir, log_dir), "--time=1", "--signal=B:CONT@1", hold=STEPS)
    wait_for(lambda: int(cluster.job(job)["Restarts"]) >= 1, "the timed-out job's requeue", every=1.0,
             describe=lambda: job_output(out_dir, job))
    cluster.run("scancel", job)
    fields = cluster.wait_state(job, ENDED, 1, out_dir)
    return log_dir, fields, job_output(out_dir, job)


def gpus(cluster, data_dir, out_dir):
    """Without NPROC_PER_NODE, a node runs one process per GPU of the job's on it: 2 here (the
    cluster's stand-in GPUs; the run itself is on the CPU)."""
    log_dir = out_dir / "log"
    job = cluster.sbatch(out_dir, 1, trainer_args(data_dir, log_dir, steps=2), gpus=2)
    return log_dir, cluster.wait_state(job, ENDED, 0, out_dir), job_output(out_dir, job)


def cannot_go_on(cluster, data_dir, out_dir, reference):
    """The jobs that must not be requeued, and the log directories they ran on: a finished run
    submitted again; that run with its weights spoiled and more steps to go; a bad flag; a bad
    --max-requeues; --help; a log directory whose metrics.jsonl is not a run's; a run (capped) stopped
    after its first step by a job that may not requeue itself (--max-requeues 0), and while it holds,
    a second job on its log directory."""
    finished, spoiled, garbage, capped = (out_dir / name for name in ("finished", "spoiled", "garbage", "capped"))
    shutil.copytree(reference, finished)
    shutil.copytree(reference, spoiled)
    path = checkpoint.list_checkpoints(str(spoiled))[-1]
    ckpt = checkpoint.load_file(path)
    ckpt["model"] = {k: torch.full_like(v, float("nan")) for k, v in ckpt["model"].items()}
    checkpoint.save_file(path, ckpt)
    garbage.mkdir()
    (garbage / metrics.METRICS_FILE).write_text("this is not json\n")
    untouched = {d: sorted((f, os.path.getmtime(d / f)) for f in os.listdir(d)) for d in (finished, garbage)}
    runs = {"finished": ["--log-dir", str(finished)],
            "spoiled": ["--log-dir", str(spoiled), "--max-steps", str(STEPS + 2)],
            "bad flag": TINY + ["--log-dir", str(out_dir / "fresh"), "--max-steps", "many"],
            "bad --max-requeues": ["--max-requeues", "some", "--log-dir", str(out_dir / "fresh")],
            "help": ["--help"],
            "unreadable": trainer_args(data_dir, garbage),
            "capped": trainer_args(data_dir, capped) + ["--max-requeues", "0"]}
    jobs = {name: cluster.sbatch(out_dir, 1, args, hold=1) for name, args in runs.items()}
    wait_for_holds(out_dir, 0, 1, jobs["capped"])
    jobs["second"] = cluster.sbatch(out_dir, 1, trainer_args(data_dir, capped))
    cluster.wait_state(jobs["second"], ENDED, 0, out_dir)
    cluster.run("scancel", "--signal=TERM", jobs["capped"])
    ended = {name: cluster.wait_state(job, ENDED, 0, out_dir) for name, job in jobs.items()}
    jobs = {name: (ended[name]["JobState"], ended[name]["ExitCode"], job_output(out_dir, job))
            for name, job in jobs.items()}
    return jobs, dict(finished=finished, spoiled=spoiled, garbage=garbage, capped=capped), untouched


@pytest.fixture(scope="module")
def stories(cluster, data_dir, tmp_path_factory):
    """Every story started at once, each in a thread of its own (the one that needs the one-process
    reference run once it is made here): {name: its future}, and that reference's log directory."""
    pool = concurrent.futures.ThreadPoolExecutor(6)
    futures = {story.__name__: pool.submit(story, cluster, data_dir, tmp_path_factory.mktemp(story.__name__))
               for story in (five_allocations, two_nodes, cut, warned, gpus)}
    reference = str(tmp_path_factory.mktemp("one_process"))
    run(trainer_args(data_dir, reference))
    futures["cannot_go_on"] = pool.submit(cannot_go_on, cluster, data_dir, tmp_path_factory.mktemp("cannot_go_on"),
                                          reference)
    yield futures, reference
    ENDING.set()  # (a story whose test was not run, or failed before its result)
    pool.shutdown(cancel_futures=True)
    ENDING.clear()


def test_a_job_requeues_itself_through_five_allocations_as_one_process_runs(stories):
    """Each allocation trains its one step, writes its checkpoint and ends; the job requeues itself
    (SLURM requeues it where scontrol requeue stopped it, and the script does not again), and the
    fifth finishes the run: its losses and weights are bit for bit those of one process that never
    stopped. The warnings reached the trainer alone (its child process lived on), and the damaged
    line in the records was skipped with a warning naming it, not taken for a finished run."""
    (futures, reference) = stories
    log_dir, fields, out = futures["five_allocations"].result()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out[-3000:]
    launches = check_continued(log_dir, 5)
    assert [(l["end"]["reason"], l["end"]["step"]) for l in launches] == [("signal", s) for s in range(4)] + [
        ("finished", STEPS)]
    assert [r["loss"] for r in train_records(log_dir)] == [r["loss"] for r in train_records(reference)]
    a = checkpoint.load_file(checkpoint.list_checkpoints(reference)[-1])["model"]
    b = checkpoint.load_file(checkpoint.list_checkpoints(str(log_dir))[-1])["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    for k in range(1, 5):
        stopped = f"allocation {k}: the trainer stopped after {k} steps and wrote their checkpoint"
        assert (f"{stopped}; SLURM requeued the job (scontrol requeue, or a preemption)" if k == 3 else
                f"{stopped}: requeued ({k} of at most 20)") in out
    assert out.count("requeued (") == 3 and last_line(out).endswith("allocation 5: the run finished its 12 steps")
    stops = [n for n in notes(log_dir.parent) if "stop" in n]
    assert [n["stop"] for n in stops] == ["SIGUSR1"] * 2 + ["SIGTERM"] + ["SIGUSR1"] + [None]
    assert all(n["child"] is None for n in stops if n["stop"] == "SIGUSR1")
    assert "metrics.jsonl: skipped what no reader can use: line " in out and ": not JSON (Expecting value)" in out


def test_two_nodes_stopped_mid_run_requeue_themselves_and_match_one_process(stories):
    """One torchrun on each node, one run of 2 ranks (gloo, CPU); the warning reached the trainers of
    both nodes, and neither's child process; the losses are the one-process run's, to float
    rounding (2 ranks sum their gradients in another order)."""
    (futures, reference) = stories
    log_dir, fields, out = futures["two_nodes"].result()
    assert fields["JobState"] == "COMPLETED", out[-3000:]
    launches = check_continued(log_dir, 2)
    assert [l["run"]["world_size"] for l in launches] == [2, 2]
    assert [l["end"]["reason"] for l in launches] == ["signal", "finished"] and launches[0]["end"]["step"] == 0
    assert "stopped by SIGUSR1 after 1 steps" in out and "requeued (1 of at most 20)" in out
    assert "allocation 2: the run finished its 12 steps" in out
    stops = [n for n in notes(log_dir.parent) if "stop" in n]
    assert sorted((n["rank"], n["stop"], n["child"]) for n in stops[:2]) == [(0, "SIGUSR1", None), (1, "SIGUSR1", None)]
    got = [r["loss"] for r in train_records(log_dir)]
    assert got == pytest.approx([r["loss"] for r in train_records(reference)], rel=1e-5)


def test_jobs_past_their_time_limit_continue_in_the_next_allocation(stories):
    """The warned job: SLURM's warning is passed on as SIGUSR1, the trainer stops after its step with
    a checkpoint, and the job requeues itself; its next allocation continues from that step, and a
    plain scancel ends it, stopping the trainer the same way, not requeued. The job cut at the limit:
    SLURM's SIGTERM stops the trainer the same way within KillWait, and the script requeues the
    timed-out job."""
    (futures, _) = stories
    log_dir, fields, out = futures["warned"].result()
    assert fields["JobState"] == "CANCELLED", out[-3000:]
    launches = check_continued(log_dir, 2)
    assert [l["end"]["reason"] for l in launches] == ["signal", "signal"]
    assert out.count("stopped by SIGUSR1 after") == 1 and out.count("stopped by SIGTERM after") == 1
    assert ("allocation 1: the trainer stopped after 1 steps and wrote their checkpoint: requeued (1 of at most "
            "20)") in out
    assert "allocation 2: the trainer stopped after 2 steps" in out and "SLURM ended the job (scancel" in out

    log_dir, fields, out = futures["cut"].result()
    first, *later = metrics.read_metrics(log_dir)["launches"]  # the next allocation's, where it began before scancel
    assert first["end"] == dict(first["end"], reason="signal", step=0), out[-3000:]
    assert checkpoint.step_of(checkpoint.list_checkpoints(str(log_dir))[0]) == 1
    assert [launch["run"]["step"] for launch in later] in ([], [1])
    assert "DUE TO TIME LIMIT" in out and "stopped by SIGTERM after 1 steps" in out
    assert ("allocation 1: the trainer stopped after 1 steps and wrote their checkpoint, at the time limit (the "
            "warning before it came too late: docs/clusters.md): requeued (1 of at most 20)") in out


def test_a_finished_run_submitted_again_ends_at_once_in_the_trainers_words(stories):
    """The job ends at once, exit 0, writing nothing; its last line is the trainer's, and --help's is
    the help's: the script adds nothing where the trainer had nothing to do."""
    jobs, dirs, untouched = stories[0]["cannot_go_on"].result()
    state, code, out = jobs["finished"]
    assert (state, code) == ("COMPLETED", "0:0"), out[-3000:]
    assert last_line(out).startswith(f"{dirs['finished']}: the run already finished its 12 steps")
    assert sorted((f, os.path.getmtime(dirs["finished"] / f)) for f in os.listdir(dirs["finished"])) == \
        untouched[dirs["finished"]]
    state, code, out = jobs["help"]
    assert (state, code) == ("COMPLETED", "0:0"), out[-3000:]
    assert "usage: train_gpt2.py" in out and last_line(out).strip() and "finished" not in out
    assert [line for line in out.splitlines() if line.startswith("train_gpt2.sbatch: ")] == [out.splitlines()[0]]


def test_a_non_finite_loss_is_not_requeued(stories):
    """The finished run with its weights spoiled and more steps to go: the loss is not finite, the
    job fails with exit status 3 and is not requeued (it would fail again)."""
    jobs, dirs, _ = stories[0]["cannot_go_on"].result()
    state, code, out = jobs["spoiled"]
    assert (state, code) == ("FAILED", "3:0"), out[-3000:]
    assert metrics.read_metrics(dirs["spoiled"])["launches"][-1]["end"]["reason"] == "nonfinite"
    assert "the loss was not finite at step 12: not requeued" in out


def test_a_trainer_that_refuses_to_start_has_the_last_word_and_its_exit_status(stories):
    """A bad flag, and a second job on a log directory that a running job holds: the trainer refuses
    to start, and its one line ends the job's output, after none of torchrun's report of it, with its
    exit status, 2; nothing is written."""
    jobs, dirs, _ = stories[0]["cannot_go_on"].result()
    for name, refusal in (("bad flag", "error: argument --max-steps: invalid int value: 'many' (see --help)"),
                          ("second", f"error: {dirs['capped']} is in use by a trainer that is still running (pid ")):
        state, code, out = jobs[name]
        assert (state, code) == ("FAILED", "2:0"), out[-3000:]
        assert last_line(out).startswith("train_gpt2.sbatch: ") and f"not requeued: {refusal}" in last_line(out)
        assert "Traceback" not in out and "ChildFailedError" not in out and "failed (exitcode" not in out
    assert not (dirs["capped"].parent / "fresh").exists()
    assert len(metrics.read_metrics(dirs["capped"])["launches"]) == 1


def test_what_the_script_cannot_read_stops_the_job_before_the_trainer(stories):
    """A bad --max-requeues: one line, exit status 2. A log directory whose metrics.jsonl is not a
    run's records: the script says it cannot tell how a trainer would end there, not that the run had
    finished, and starts none (exit status 2); the file is as it was."""
    jobs, dirs, untouched = stories[0]["cannot_go_on"].result()
    state, code, out = jobs["bad --max-requeues"]
    assert (state, code) == ("FAILED", "2:0"), out[-3000:]
    assert out == "error: --max-requeues 'some' is not a whole number: give how many times the job may requeue itself\n"
    state, code, out = jobs["unreadable"]
    assert (state, code) == ("FAILED", "2:0"), out[-3000:]
    assert out.splitlines()[0] == (f"error: {dirs['garbage'] / metrics.METRICS_FILE} is not JSON records of a run "
                                   "(line 1: not JSON (Expecting value)): pass the --log-dir of a train_gpt2.py run")
    assert "not started: this script reads the log directory's metrics.jsonl" in last_line(out)
    assert sorted((f, os.path.getmtime(dirs["garbage"] / f)) for f in os.listdir(dirs["garbage"])) == \
        untouched[dirs["garbage"]]


def test_a_job_that_may_not_requeue_itself_says_how_to_continue(stories):
    """The run stopped after its first step by a job with --max-requeues 0: its checkpoint is
    written, the job is not requeued and says how to continue."""
    jobs, dirs, _ = stories[0]["cannot_go_on"].result()
    state, code, out = jobs["capped"]
    assert (state, code) == ("FAILED", "1:0"), out[-3000:]
    (launch,) = metrics.read_metrics(dirs["capped"])["launches"]
    assert launch["end"]["reason"] == "signal"
    assert checkpoint.step_of(checkpoint.list_checkpoints(str(dirs["capped"]))[-1]) == launch["end"]["step"] + 1
    assert "not requeued: --max-requeues 0 reached (requeued 0 times); sbatch the same command to continue" in out


def test_one_process_per_gpu_that_slurm_gives_the_node(stories):
    (futures, _) = stories
    log_dir, fields, out = futures["gpus"].result()
    assert fields["JobState"] == "COMPLETED", out[-3000:]
    (launch,) = metrics.read_metrics(log_dir)["launches"]
    assert launch["run"]["world_size"] == 2 and "the run finished its 2 steps" in out


def test_every_trainer_may_run_on_every_cpu_of_its_node(stories):
    """A task gets one CPU unless asked for more, and this cluster binds each task to its CPUs: each
    node's torchrun must be given the node's 2 CPUs, or it and every trainer of the node share one."""
    (futures, _) = stories
    ends = []
    for future in futures.values():
        future.exception()  # every story over, however it went
    out_dirs = [futures[name].result()[0].parent for name in ("five_allocations", "two_nodes", "warned", "cut", "gpus")]
    for out_dir in out_dirs + [futures["cannot_go_on"].result()[1]["capped"].parent]:
        ends += [n for n in notes(out_dir) if "cpus" in n]
    assert len(ends) >= 5 + 2 * 2 + 2 + 1 + 2 + 1 and {n["cpus"] for n in ends} == {2}
