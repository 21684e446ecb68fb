"""The processes the suite starts, found again wherever they went: each carries the session's mark (MARK) in the
environment it was started with, which its children inherit, so what outlives its test or the session can be named
and ended however it was started (torchrun's ranks, a warm launch, a SLURM job's steps) and wherever it was
reparented. A process that a module keeps on purpose (a SLURM cluster) is started with KEEP in its environment too,
and its fixture ends it; the warm zygote and its keepers are this worker's own, in the zygote's session."""
import contextlib
import os
import secrets
import signal
import time
from dataclasses import dataclass, field

MARK = "GPT2_TRAIN_TEST_SESSION"
KEEP = "GPT2_TRAIN_TEST_KEEP"
# how long a process that is ending may take to be gone before it is killed (a keeper ending its child's session
# after the shim died, a worker tearing down): waited only where something is still there, so only a leak pays it
GRACE_S = float(os.environ.get("PROCESS_GRACE_S", "10"))
# helpers torch and Python start beside a test worker, which end with it: Inductor's compile workers, the resource
# tracker of multiprocessing's spawned children
HELPERS = ("torch._inductor.compile_worker", "torch/_inductor/compile_worker", "multiprocessing.resource_tracker",
           "multiprocessing.forkserver")


@contextlib.contextmanager
def kept(owner):
    """Processes started inside carry KEEP (their environment is this one's): a fixture that keeps them beyond a
    test, and ends them itself, says so."""
    os.environ[KEEP] = owner
    try:
        yield
    finally:
        del os.environ[KEEP]


def mark_session():
    """Put the session's mark in this process's environment (the first process of the session chooses it)."""
    os.environ.setdefault(MARK, f"{os.getpid()}-{secrets.token_hex(4)}")


@dataclass(frozen=True)
class Process:
    pid: int
    start: int  # clock ticks after boot: with the pid, one process, whatever pid reuse does later
    ppid: int = field(compare=False)
    sid: int = field(compare=False)
    argv: tuple = field(compare=False)
    env: dict = field(compare=False, hash=False)

    def __str__(self):
        test = self.env.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        return (f"pid {self.pid}: {' '.join(self.argv)[:200] or '?'}"
                + (f" (started in {test})" if test else ""))


def read(pid):
    """The Process of pid, or None where it is gone, a zombie, or not of this session."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
        if env.get(MARK) != os.environ.get(MARK):
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except (OSError, IndexError, ValueError):
        return None
    return Process(pid, int(fields[19]), int(fields[1]), int(fields[3]), argv, env)


def session():
    """Every live process of this session but this one and its ancestors."""
    mine = set()
    pid = os.getpid()
    while pid > 1:
        mine.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    found = (read(int(name)) for name in os.listdir("/proc") if name.isdigit() and int(name) not in mine)
    return [p for p in found if p is not None]


def not_helpers(processes):
    """processes but the helpers of torch's and Python's beside this process (and what descends from them), which end
    with it."""
    by_pid = {p.pid: p for p in processes}

    def helper(p):
        while p is not None:
            if p.ppid == os.getpid() and any(h in " ".join(p.argv) for h in HELPERS):
                return True
            p = by_pid.get(p.ppid)
        return False
    return [p for p in processes if not helper(p)]


def of_tests(processes, zygote_sid=None):
    """Those of processes that this process's tests started and that should end with their test: this worker's,
    neither kept by a module (KEEP), nor the warm zygote's own (its session), nor this process's helpers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return [p for p in not_helpers(processes) if p.env.get("PYTEST_XDIST_WORKER") == worker and KEEP not in p.env
            and p.sid != zygote_sid]


def still_there(processes):
    return [p for p in processes if read(p.pid) == p]


def end(processes, grace=GRACE_S):
    """Wait up to grace seconds for processes to end by themselves, then kill what is left (SIGKILL) and
    wait for it to be gone (what a process started is in the list too: it was started by a test as well). What had to be
    killed."""
    deadline = time.monotonic() + grace
    left = still_there(processes)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = still_there(processes)
    for p in left:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while still_there(left) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
