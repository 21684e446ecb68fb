"""The processes the suite starts, found again wherever they went: each carries the session's mark (MARK) in the
environment it was started with, which its children inherit, so what outlives its test or the session can be named
and ended however it was started (torchrun's ranks, a warm launch, a SLURM job's steps) and wherever it was
reparented; a child forked without a new program shows its parent's first environment instead, so what descends
from this process is its own too. A process that a module keeps on purpose (a SLURM cluster) is started with KEEP in
its environment too, and its fixture ends it; the warm zygote and its keepers are this worker's own, in the zygote's
session. A session started inside another (a test that runs pytest) marks its processes with the outer mark and its
own: they are the outer session's too, and the inner one's end leaves the outer one's alone."""
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
# (30 s: a rank that said an error may wait up to a minute for the others, torchrun ends them at once)
GRACE_S = float(os.environ.get("PROCESS_GRACE_S", "30"))
# helpers torch and Python start beside a test worker, which end with it: Inductor's compile workers (with their
# pool), and, alone, the resource tracker and the fork server of multiprocessing (what the server forks is a test's)
HELPERS = ("torch._inductor.compile_worker", "torch/_inductor/compile_worker")
HELPERS_ALONE = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


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
    """Put the session's mark in this process's environment: a pytest-xdist worker keeps its controller's, a session
    of its own chooses one (below the mark of a session it runs in)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and MARK in os.environ:
        return
    outer = os.environ.get(MARK)
    os.environ[MARK] = (f"{outer}/" if outer else "") + f"{os.getpid()}-{secrets.token_hex(4)}"


def ours(mark):
    """Whether a process of mark is this session's (its own, or of a session inside it)."""
    return mark is not None and (mark == os.environ.get(MARK) or mark.startswith(os.environ.get(MARK) + "/"))


@dataclass(frozen=True)
class Process:
    pid: int
    start: int  # clock ticks after boot: with the pid, one process, whatever pid reuse does later
    ppid: int = field(compare=False)
    sid: int = field(compare=False)
    argv: tuple = field(compare=False)
    env: dict = field(compare=False, hash=False)
    own: bool = field(default=False, compare=False)  # it descends from this process

    def __str__(self):
        test = self.env.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        return (f"pid {self.pid}: {' '.join(self.argv)[:200] or '?'}"
                + (f" (started in {test})" if test else ""))


PF_KTHREAD = 0x00200000  # a kernel thread, in /proc/PID/stat's flags: no arguments or environment, ever
EXEC_S = 10.0  # how long a process may be part-way through exec before it is read as it is


def stat(pid):
    """(state, ppid, session id, start time, flags) of pid, from /proc/PID/stat; None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[3]), int(fields[19]), int(fields[6])
    except (OSError, IndexError, ValueError):
        return None


def proc_file(pid, name):
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def read(pid, own=False):
    """The Process of pid, or None where it is gone, a zombie, a kernel thread, or not of this session (marked, or
    own: descended from this process)."""
    deadline = time.monotonic() + EXEC_S
    while True:
        st = stat(pid)
        if st is None or st[0] in ("Z", "X") or st[4] & PF_KTHREAD:
            return None
        # neither arguments nor environment: part-way through exec (its parent, let go by vfork, may have moved on
        # before the new program's are in place), or exiting; else a program started with an empty environment
        try:
            environ = proc_file(pid, "environ")
            if environ or time.monotonic() > deadline or proc_file(pid, "cmdline"):
                break
        except OSError:
            return None
        time.sleep(0.01)
    env = dict(kv.split("=", 1) for kv in environ.decode(errors="replace").split("\0") if "=" in kv)
    if not own and not ours(env.get(MARK)):
        return None
    try:
        argv = proc_file(pid, "cmdline")
    except OSError:
        return None
    argv = tuple(a.decode(errors="replace") for a in argv.split(b"\0") if a)
    return Process(pid, st[3], st[1], st[2], argv, env, own)


def session():
    """Every live process of this session but this one and its ancestors: those marked, and those descended from
    this process."""
    stats = {int(name): stat(name) for name in os.listdir("/proc") if name.isdigit()}
    mine, pid = set(), os.getpid()
    while pid > 1 and pid not in mine:
        mine.add(pid)
        pid = stats[pid][1] if stats.get(pid) else 1

    def descends(pid):
        seen = set()
        while stats.get(pid) and pid not in seen:
            seen.add(pid)
            pid = stats[pid][1]
            if pid == os.getpid():
                return True
        return False
    found = (read(pid, descends(pid)) for pid in stats if pid not in mine)
    return [p for p in found if p is not None]


def not_helpers(processes):
    """processes but the helpers of torch's and Python's beside this process (and what descends from them), which end
    with it."""
    by_pid = {p.pid: p for p in processes}

    def helper(p):
        if p.ppid == os.getpid() and any(h in " ".join(p.argv) for h in HELPERS_ALONE):
            return True
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
    return [p for p in not_helpers(processes) if (p.own or p.env.get("PYTEST_XDIST_WORKER") == worker)
            and KEEP not in p.env and p.sid != zygote_sid]


def still_there(processes):
    return [p for p in processes if read(p.pid, p.own) == p]


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
