"""
train_gpt2.sbatch on a real SLURM: a two-node job, a stop request mid-run and the job requeueing
itself, a requeue from outside (as a preempting partition does), the time limit, the runs that must
not be requeued, and one process per GPU.

The cluster, started once for the module, is Debian's SLURM and munge (apt-get install slurmctld
slurmd slurm-client munge; the tests skip without them, or without root, which slurmd needs to
run jobs), on loopback, in a temporary directory holding everything it writes:
  - munged with a fresh key, on a socket of its own;
  - slurmctld, and two slurmd started with -N n1 and -N n2, each on a port of its own: two nodes
    whose NodeAddr is 127.0.0.1, with 2 CPUs and 2 stand-in GPUs each (gres.conf names /dev/null
    and /dev/zero as their devices), in one partition;
  - slurm.conf written there (SLURM_CONF points the client commands at it): proctrack/linuxproc,
    task/none, no cgroups, no accounting; the default KillWait (30 s) and credential lifetime.
Each daemon runs in the foreground as a child of the test process and is stopped by its PID at the
end, after any job left over is cancelled.

Jobs are submitted as a user would, with the #SBATCH lines of the script, and these on the command
line in their place: the test partition, no GPUs (`--gpus-per-node=0`) and NPROC_PER_NODE=1 (one CPU
process per node) unless a test says otherwise, the job's output in the test's directory. The tests
wait on records the trainer writes and on the job's state in SLURM, never on a guess of how long
something takes (the time limit's test waits on SLURM's clock); the timeouts only bound a hang. A
requeued job's start is held back by SLURM for its credential lifetime (2 minutes); the tests start
it at once (`scontrol update StartTime=now`), in the second after the requeue (a credential of the
same second as the requeue's revocation is refused).
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import checkpoint
import metrics
from runs import ENV, ROOT, TINY, run

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
SCRIPT = os.path.join(ROOT, "train_gpt2.sbatch")
PARTITION = "tiny"
STEPS = 50  # long enough that a stop request sent after the first step lands well before the end


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


pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(condition, what, timeout=300, describe=lambda: ""):
    """Poll condition() until it is true; the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{describe()}")
        time.sleep(0.1)


class Cluster:
    """munged, slurmctld and two slurmd (nodes n1 and n2) on loopback, under one directory."""

    def __init__(self, root):
        self.root = root
        ctld_port, n1_port, n2_port = free_ports(3)
        socket_path = os.path.join(root, "munge.socket")
        self.conf = os.path.join(root, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=tiny
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
GresTypes=gpu
NodeName=n1 NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 Gres=gpu:2 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 Gres=gpu:2 State=UNKNOWN
PartitionName={PARTITION} Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")
        with open(os.path.join(root, "gres.conf"), "w") as f:  # two stand-in GPUs per node
            f.write("NodeName=n[1-2] Name=gpu File=/dev/null\nNodeName=n[1-2] Name=gpu File=/dev/zero\n")
        self.env = {k: v for k, v in ENV.items() if not k.startswith("SLURM_")}
        self.env.update(SLURM_CONF=self.conf,
                        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        os.makedirs(os.path.join(root, "state"))
        key = os.path.join(root, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.daemons = []
        self.start([FOUND["munged"], "--foreground", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                    f"--seed-file={root}/munged.seed"])
        wait_for(lambda: os.path.exists(socket_path), "munged's socket", 60, self.logs)
        self.start([FOUND["slurmctld"], "-D", "-f", self.conf])
        for node in ("n1", "n2"):
            self.start([FOUND["slurmd"], "-D", "-f", self.conf, "-N", node])
        wait_for(lambda: self.run("sinfo", "-h", "-N", "-o", "%T", check=False).split() == ["idle", "idle"],
                 "both nodes idle", 120, self.logs)

    def start(self, cmd):
        log = open(os.path.join(self.root, os.path.basename(cmd[0]) + f"-{len(self.daemons)}.out"), "w")
        self.daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env))
        log.close()

    def stop(self):
        self.run("scancel", f"--partition={PARTITION}", check=False)
        try:
            wait_for(lambda: not self.run("squeue", "-h", check=False).strip(), "the jobs to end", 120)
        finally:
            for p in reversed(self.daemons):  # the slurmds, slurmctld, then munged
                p.terminate()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

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

    def sbatch(self, out_dir, nodes, args, *options, gpus=0):
        """Submit train_gpt2.sbatch with the trainer flags args, as a user would; the job's id. With
        no GPUs, NPROC_PER_NODE=1 sets one process per node."""
        p = subprocess.run(["sbatch", "--parsable", f"--partition={PARTITION}", f"--gpus-per-node={gpus}",
                            f"--nodes={nodes}", f"--output={out_dir}/slurm-%j.out", f"--chdir={ROOT}", *options,
                            SCRIPT, *args], capture_output=True, text=True, timeout=120,
                           env=dict(self.env, **({} if gpus else {"NPROC_PER_NODE": "1"})))
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
                 describe=lambda: f"{fields}\n{job_output(out_dir, job_id)}")
        return fields

    def start_requeued(self, job_id, out_dir, restarts=1, **updates):
        """Start a requeued job now rather than after SLURM's delay (updates: other fields to set)."""
        self.wait_state(job_id, ("PENDING",), restarts, out_dir)
        # the relaunch's credential must be of a later second than the requeue's revocation
        time.sleep(1 - time.time() % 1 + 0.05)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now",
                 *(f"{k}={v}" for k, v in updates.items()))


@pytest.fixture(scope="module")
def cluster():
    root = tempfile.mkdtemp(prefix="slurm-")  # short: a socket's path is limited to 107 bytes
    os.chmod(root, 0o711)  # munged wants its socket's directory searchable by every user
    c = None
    try:
        c = Cluster(root)
        yield c
    finally:
        if c is not None:
            c.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_job_left(cluster):
    """A failed test's job would hold the nodes: it is cancelled before the next test."""
    yield
    cluster.run("scancel", f"--partition={PARTITION}", check=False)
    wait_for(lambda: not cluster.run("squeue", "-h", check=False).strip(), "the jobs to end", 120)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """The run the SLURM jobs make, in one process without a stop: its log directory."""
    log_dir = str(tmp_path_factory.mktemp("one_process"))
    run(trainer_args(data_dir, log_dir))
    return log_dir


def trainer_args(data_dir, log_dir, steps=STEPS):
    return TINY + ["--data-dir", data_dir, "--log-dir", str(log_dir), "--max-steps", str(steps),
                   "--checkpoint-every", "1000"]


def job_output(out_dir, job_id):
    path = os.path.join(out_dir, f"slurm-{job_id}.out")
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def train_records(log_dir):
    """Every train record in metrics.jsonl, in the order written (a step logged twice is there twice)."""
    path = os.path.join(log_dir, metrics.METRICS_FILE)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # a line being written
                continue
            if r["kind"] == "train":
                out.append(r)
    return out


def wait_for_step(log_dir, step, out_dir, job_id):
    wait_for(lambda: any(r["step"] >= step for r in train_records(log_dir)), f"step {step} in {log_dir}",
             describe=lambda: job_output(out_dir, job_id))


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


def stopped_and_finished(cluster, nodes, stop, data_dir, log_dir, out_dir):
    """Submit the run, stop it with the command `stop` JOB once it has trained a step, start its
    requeued job and let it finish: the job's output and the run's launches, checked to be two,
    the first stopped in the middle of the run, the second finishing it from there."""
    job = cluster.sbatch(out_dir, nodes, trainer_args(data_dir, log_dir))
    wait_for_step(log_dir, 0, out_dir, job)
    cluster.run(*stop, job)
    cluster.start_requeued(job, out_dir)
    fields = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 1, out_dir)
    out = job_output(out_dir, job)
    assert fields["JobState"] == "COMPLETED", out[-3000:]
    launches = check_continued(log_dir, 2)
    assert [l["end"]["reason"] for l in launches] == ["signal", "finished"]
    assert launches[0]["end"]["step"] < STEPS - 1  # the stop landed in the middle of the run
    return out, launches


def test_two_nodes_stopped_mid_run_requeue_themselves_and_match_one_process(cluster, data_dir, reference,
                                                                          tmp_path):
    """sbatch --nodes=2: one torchrun on each node, one run of 2 ranks (gloo, CPU). scancel
    --signal=TERM in the middle of it: the trainer finishes its step and writes its checkpoint, the
    job requeues itself and its next allocation finishes the run; the losses are the one-process
    run's, to float rounding (2 ranks sum their gradients in another order)."""
    log_dir = tmp_path / "log"
    out, launches = stopped_and_finished(cluster, 2, ["scancel", "--signal=TERM"], data_dir, log_dir, tmp_path)
    assert [l["run"]["world_size"] for l in launches] == [2, 2]
    assert "stopped by SIGTERM after" in out and "requeued (1 of at most 20)" in out
    assert "allocation 2: the run finished its 50 steps" in out
    got = [r["loss"] for r in train_records(log_dir)]
    assert got == pytest.approx([r["loss"] for r in train_records(reference)], rel=1e-5)


def test_a_job_requeued_mid_run_resumes_where_it_stopped(cluster, data_dir, reference, tmp_path):
    """scontrol requeue, as a partition with PreemptMode=REQUEUE does: SLURM sends SIGTERM to the
    job and its steps, the trainer writes its checkpoint within KillWait, SLURM requeues the job
    (the script does not requeue it again), and the next allocation continues from that step: the
    losses and weights are bit for bit those of the run that never stopped."""
    log_dir = tmp_path / "log"
    out, _ = stopped_and_finished(cluster, 1, ["scontrol", "requeue"], data_dir, log_dir, tmp_path)
    assert "SLURM requeued the job (scontrol requeue, or a preemption)" in out and "requeued (" not in out
    assert [r["loss"] for r in train_records(log_dir)] == [r["loss"] for r in train_records(reference)]
    a = checkpoint.load_file(checkpoint.latest_checkpoint(reference))["model"]
    b = checkpoint.load_file(checkpoint.latest_checkpoint(str(log_dir)))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_jobs_past_their_time_limit_continue_in_the_next_allocation(cluster, data_dir, tmp_path):
    """Two jobs with --time=1, side by side on the two nodes. The first keeps the script's warning,
    whose lead (5 minutes) is longer than the limit, so SLURM warns the script at its first time
    check: the script passes it on as SIGUSR1 until the trainer has it, the trainer stops after its
    step with a checkpoint, and the job requeues itself. Its next allocation (given a longer limit, so
    that it is not warned at once too) continues from that step; a plain scancel then ends the job,
    which stops the trainer the same way and is not requeued. The second job gets no warning the
    trainer sees (--signal=B:CONT@1): at the limit SLURM sends SIGTERM, the trainer stops the same way
    within KillWait, and the script requeues the timed-out job."""
    warned, cut = tmp_path / "warned", tmp_path / "cut"
    args = lambda log_dir: trainer_args(data_dir, log_dir, steps=100000)  # noqa: E731
    job = cluster.sbatch(tmp_path, 1, args(warned), "--time=1")
    cut_job = cluster.sbatch(tmp_path, 1, args(cut), "--time=1", "--signal=B:CONT@1")

    cluster.start_requeued(job, tmp_path, TimeLimit=30)
    cluster.wait_state(job, ("RUNNING",), 1, tmp_path)
    wait_for_step(warned, metrics.read_metrics(warned)["launches"][0]["end"]["step"] + 2, tmp_path, job)
    cluster.run("scancel", job)
    fields = cluster.wait_state(job, ("CANCELLED", "COMPLETED", "FAILED"), 1, tmp_path)
    out = job_output(tmp_path, job)
    assert fields["JobState"] == "CANCELLED", out[-3000:]
    launches = check_continued(warned, 2)
    assert [l["end"]["reason"] for l in launches] == ["signal", "signal"]
    assert out.count("stopped by SIGUSR1 after") == 1 and out.count("stopped by SIGTERM after") == 1
    assert (f"allocation 1: the trainer stopped after {launches[1]['run']['step']} steps and wrote their "
            "checkpoint: requeued (1 of at most 20)") in out
    assert "allocation 2: the trainer stopped after" in out and "SLURM ended the job (scancel" in out

    cluster.wait_state(cut_job, ("PENDING",), 1, tmp_path)
    out = job_output(tmp_path, cut_job)
    (launch,) = metrics.read_metrics(cut)["launches"]
    steps = launch["end"]["step"] + 1
    assert launch["end"]["reason"] == "signal" and checkpoint.step_of(checkpoint.latest_checkpoint(str(cut))) == steps
    assert "DUE TO TIME LIMIT" in out and f"stopped by SIGTERM after {steps} steps" in out
    assert (f"allocation 1: the trainer stopped after {steps} steps and wrote their checkpoint, at the time "
            "limit") in out and "requeued (1 of at most 20)" in out


def test_runs_that_cannot_go_on_are_not_requeued(cluster, data_dir, reference, tmp_path):
    """A finished run submitted again: the job ends at once, exit 0, writing nothing. The same run
    with its weights spoiled and more steps to go: the loss is not finite, the job fails with exit
    status 3 and is not requeued (it would fail again). A bad flag for the trainer: it refuses to
    start, the job fails and is not requeued, nothing is written; a bad --max-requeues: one line,
    exit status 2. A run stopped mid-way by a job that may not requeue itself (--max-requeues 0):
    its checkpoint is written, the job is not requeued and says how to continue."""
    finished = str(tmp_path / "finished")
    shutil.copytree(reference, finished)
    spoiled = str(tmp_path / "spoiled")
    shutil.copytree(reference, spoiled)
    path = checkpoint.latest_checkpoint(spoiled)
    ckpt = checkpoint.load_file(path)
    ckpt["model"] = {k: torch.full_like(v, float("nan")) for k, v in ckpt["model"].items()}
    checkpoint.save_file(path, ckpt)
    before = sorted((f, os.path.getmtime(os.path.join(finished, f))) for f in os.listdir(finished))
    fresh, capped = tmp_path / "fresh", tmp_path / "capped"
    jobs = [cluster.sbatch(tmp_path, 1, ["--log-dir", finished]),
            cluster.sbatch(tmp_path, 1, ["--log-dir", spoiled, "--max-steps", str(STEPS + 2)]),
            cluster.sbatch(tmp_path, 1, TINY + ["--log-dir", str(fresh), "--max-steps", "many"]),
            cluster.sbatch(tmp_path, 1, ["--max-requeues", "some", "--log-dir", str(fresh)]),
            cluster.sbatch(tmp_path, 1, trainer_args(data_dir, capped) + ["--max-requeues", "0"])]
    wait_for_step(capped, 0, tmp_path, jobs[4])
    cluster.run("scancel", "--signal=TERM", jobs[4])
    states = [cluster.wait_state(j, ("COMPLETED", "FAILED", "CANCELLED"), 0, tmp_path) for j in jobs]
    outs = [job_output(tmp_path, j) for j in jobs]

    assert states[0]["JobState"] == "COMPLETED" and states[0]["ExitCode"] == "0:0", outs[0][-3000:]
    assert "already finished its 50 steps" in outs[0] and "nothing to train" in outs[0]
    assert sorted((f, os.path.getmtime(os.path.join(finished, f))) for f in os.listdir(finished)) == before

    assert states[1]["JobState"] == "FAILED" and states[1]["ExitCode"] == "3:0", outs[1][-3000:]
    assert metrics.read_metrics(spoiled)["launches"][-1]["end"] == dict(
        metrics.read_metrics(spoiled)["launches"][-1]["end"], reason="nonfinite", step=STEPS)
    assert "the loss was not finite at step 50: not requeued" in outs[1]

    assert states[2]["JobState"] == "FAILED", outs[2][-3000:]
    assert "error: argument --max-steps: invalid int value: 'many'" in outs[2]
    assert "the trainer did not start (its output is above): not requeued" in outs[2]
    assert states[3]["JobState"] == "FAILED" and states[3]["ExitCode"] == "2:0", outs[3][-3000:]
    assert outs[3] == "error: --max-requeues 'some' is not a whole number: give how many times the job may " \
                      "requeue itself\n"
    assert not fresh.exists()

    assert states[4]["JobState"] == "FAILED", outs[4][-3000:]
    (launch,) = metrics.read_metrics(capped)["launches"]
    assert launch["end"]["reason"] == "signal"
    assert checkpoint.step_of(checkpoint.latest_checkpoint(str(capped))) == launch["end"]["step"] + 1
    assert "not requeued: --max-requeues 0 reached (requeued 0 times); sbatch the same command to continue" \
           in outs[4]


def test_one_process_per_gpu_that_slurm_gives_the_node(cluster, data_dir, tmp_path):
    """Without NPROC_PER_NODE, a node runs one process per GPU of the job's on it: 2 here (the
    cluster's stand-in GPUs; the run itself is on the CPU)."""
    log_dir = tmp_path / "log"
    job = cluster.sbatch(tmp_path, 1, trainer_args(data_dir, log_dir, steps=2), gpus=2)
    fields = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 0, tmp_path)
    out = job_output(tmp_path, job)
    assert fields["JobState"] == "COMPLETED", out[-3000:]
    (launch,) = metrics.read_metrics(log_dir)["launches"]
    assert launch["run"]["world_size"] == 2 and "the run finished its 2 steps" in out
