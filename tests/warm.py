"""A Python that starts warm: launches of the scripts for tests that are about what a run does, not about its
process, forked from a parent that has already imported torch, torch._dynamo and the project (about 3 s of CPU per
process on two cores, paid once per test worker instead of once per launch).

    shim = warm.python()   # an executable path to use where sys.executable would be
    subprocess.run([shim, "train_gpt2.py", ...])                      # a real process, running the real script
    subprocess.run([shim, "-m", "torch.distributed.run", ..., "train_gpt2.py", ...])  # its ranks start warm too

The shim is a small Python script (no torch) that hands its command line, environment, working directory and
standard streams to the warm parent (the zygote) over a Unix socket; the zygote forks a keeper, the keeper forks the
child that runs the command in a session of its own and reports its exit status, which the shim exits with (a child
killed by a signal kills the shim with that signal). Signals the shim receives are passed to the child; a shim
killed outright takes the child's session with it. In the child sys.executable is the shim, so the processes it
starts (torchrun's ranks) start warm as well.

Where a warm start could differ from a cold one the shim runs the real interpreter instead: interpreter options it
does not know, file descriptors beyond the standard three (a process pool's pipes), and an environment that differs
from the zygote's in what torch, Triton, OpenMP or Python read when they are imported (TORCHINDUCTOR_*, OMP_*,
PYTHONPATH, ...). Tests whose subject is the process itself (a kill -9, a closed stdout, an old torch, a memory
limit, torchrun's restarts, SLURM) use sys.executable."""
import atexit
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a fresh process reads at import or start-up: a request whose environment differs here starts cold
IMPORT_TIME = ("TORCH", "PYTORCH", "TRITON", "OMP_", "MKL_", "KMP_", "GOMP_", "CUDA", "PYTHONPATH", "PYTHONHASHSEED",
               "LD_")
# read as the process runs: torchrun's settings for its ranks, and the compile caches' folders (read at each use,
# torch/_inductor/runtime/cache_dir_utils.py)
RUN_TIME = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# not matplotlib, transformers or huggingface_hub: they read MPLBACKEND and HF_* as they are imported
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.launcher.api", "numpy", "train_gpt2", "sample", "hellaswag",
           "core", "plot", "fineweb")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
             signal.SIGALRM, signal.SIGCONT)

SHIM = r'''#!{python} -S
# a warm start of {python} (tests/warm.py): run its command in a child of the zygote at {socket}
import json, os, signal, socket, sys
COLD = [{python!r}] + sys.argv[1:]
def cold():
    os.execv(COLD[0], COLD)
args = sys.argv[1:]
unbuffered = False
while args and args[0] in ("-u", "-B"):
    unbuffered = unbuffered or args[0] == "-u"
    args = args[1:]
fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
extra = [fd for fd in fds if fd > 2 and os.path.exists("/proc/self/fd/%d" % fd)]
if (not args or (args[0].startswith("-") and args[0] not in ("-m", "-c")) or args[0] == "-"
        or (args[0] in ("-m", "-c") and len(args) < 2) or extra):
    cold()
env = dict(os.environ)
if unbuffered:
    env["PYTHONUNBUFFERED"] = "1"
conn = socket.socket(socket.AF_UNIX)
try:
    conn.connect({socket!r})
except OSError:
    cold()
request = json.dumps(dict(argv=args, env=env, cwd=os.getcwd(), shim=os.path.abspath(sys.argv[0]))).encode()
socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
reader = conn.makefile("r")
line = reader.readline()
if not line:
    sys.exit("warm python: the zygote at {socket} is gone")
pid = json.loads(line)["pid"]
def forward(sig, frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
for sig in {forwarded}:
    signal.signal(sig, forward)
line = reader.readline()
status = json.loads(line) if line else dict(signal=signal.SIGKILL)
if "signal" in status:
    if status["signal"] != signal.SIGKILL:
        signal.signal(status["signal"], signal.SIG_DFL)
    os.kill(os.getpid(), status["signal"])
os._exit(status["exit"])
'''


def python():
    """The path of a warm python for this process, its zygote started at the first call (one per test worker, in a
    temporary directory of its own, which also holds its log: zygote.log); the real interpreter where fork is not
    available."""
    global _shim
    if _shim is None:
        if not hasattr(os, "fork") or not hasattr(socket, "send_fds") or not hasattr(os, "pidfd_open"):
            return sys.executable
        tmp_dir = tempfile.mkdtemp(prefix="warm-")  # short: a socket's path is limited to 107 bytes
        atexit.register(shutil.rmtree, tmp_dir, True)  # the zygote leaves once this process has
        path = os.path.join(tmp_dir, "zygote.sock")
        log = open(os.path.join(tmp_dir, "zygote.log"), "w")
        global _zygote
        _zygote = subprocess.Popen([sys.executable, os.path.abspath(__file__), path, str(os.getpid())],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=environment(),
                                   start_new_session=True)
        atexit.register(stop_zygote)
        log.close()
        _shim = os.path.join(tmp_dir, "python")
        with open(_shim, "w") as f:
            f.write(SHIM.format(python=sys.executable, socket=path, forwarded="(%s)" % ", ".join(
                str(int(s)) for s in FORWARDED)))
        os.chmod(_shim, 0o755)
        deadline = time.monotonic() + 300
        while not os.path.exists(path + ".ready"):  # the imports, once
            if time.monotonic() > deadline:
                raise RuntimeError(f"the warm python's zygote did not start: {tmp_dir}/zygote.log")
            time.sleep(0.05)
    return _shim


_shim = None
_zygote = None


def zygote_session():
    """The session of this process's zygote and its keepers (the zygote's pid), or None before it starts. The
    children it runs are each in a session of their own."""
    return None if _zygote is None else _zygote.pid


def stop_zygote():
    """End the zygote and its keepers (their session's process group) and reap the zygote."""
    if _zygote is not None and _zygote.poll() is None:
        try:
            os.killpg(_zygote.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _zygote.wait()


def environment():
    """The environment the tests' processes run in (tests/runs.py's ENV), which the zygote imports under: this
    process's as it was when this module was imported, before torch's imports here added to it."""
    return dict(_BASE, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


_BASE = dict(os.environ)


def import_time(env, set_by_imports=None):
    """What of env the imports read, with what they set themselves where env does not say."""
    return {k: v for k, v in {**(set_by_imports or {}), **env}.items()
            if k.startswith(IMPORT_TIME) and not k.startswith(RUN_TIME)}


# ----------------------------------------------------------------------------------------------
# The zygote, its keepers and their children


def serve(path, parent):
    sys.path[0] = ROOT
    before = dict(os.environ)  # torch sets TORCHINDUCTOR_CACHE_DIR as it is imported
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    import tokenizer
    tokenizer.get_tokenizer()  # the BPE tables, built once
    # what the imports made lives as long as the children: their collections need not walk it (nor copy its pages)
    gc.collect()
    gc.freeze()
    set_by_imports = {k: v for k, v in os.environ.items() if k not in before}
    mine = import_time(before, set_by_imports)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the keepers are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    open(path + ".ready", "w").close()
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        if os.getppid() != parent:  # the test worker is gone: so are we
            os._exit(0)
        if not ready:
            continue
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            keep(conn, mine, set_by_imports)
        conn.close()


def receive(conn):
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = int.from_bytes(msg[:8], "big")
    while len(msg) < 8 + size:
        msg += conn.recv(1 << 20)
    return json.loads(msg[8:8 + size]), fds


def keep(conn, mine, set_by_imports):
    """The keeper of one request: fork its child, tell the shim its pid, then its exit status; if the shim goes
    first (killed), kill the child's session."""
    try:
        request, fds = receive(conn)
    except (OSError, ValueError):
        os._exit(1)
    pid = os.fork()
    if pid == 0:
        conn.close()
        child(request, fds, mine, set_by_imports)
    for fd in fds:
        os.close(fd)
    conn.sendall((json.dumps(dict(pid=pid)) + "\n").encode())
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status, usage = os.wait4(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            with open(os.path.join(os.path.dirname(request["shim"]), "zygote.log"), "a") as log:
                log.write(json.dumps(dict(cpu=round(usage.ru_utime + usage.ru_stime, 2), argv=request["argv"][:3],
                                          test=request["env"].get("PYTEST_CURRENT_TEST", ""), end=time.time())) + "\n")
            try:
                conn.sendall((json.dumps(dict(exit=code) if code >= 0 else dict(signal=-code)) + "\n").encode())
            except OSError:
                pass
            os._exit(0)
        if not conn.recv(1):  # the shim died
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def child(request, fds, mine, set_by_imports):
    """Become the process the command line asks for, as a fresh interpreter would run it; or run the real interpreter
    where a warm start could differ."""
    import io
    import random
    import runpy
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    why = cold_because(argv, mine, set_by_imports)
    if why:
        with open(os.path.join(os.path.dirname(request["shim"]), "zygote.log"), "a") as log:
            log.write(f"cold ({why}): {argv[:3]}\n")
        os.execv(REAL, [REAL] + argv)
    for k, v in set_by_imports.items():  # as the imports would set them in a fresh process
        os.environ.setdefault(k, v)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False), line_buffering=True)
    sys.stdout = io.TextIOWrapper(io.open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.open(2, "wb", buffering=0, closefd=False), write_through=True,
                                  errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.executable = request["shim"]
    random.seed()
    import numpy as np
    np.random.seed()
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1]] + argv[2:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c"] + argv[2:]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            script = os.path.abspath(argv[0])
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.realpath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 (the interpreter's own report, then exit status 1)
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename in STARTUP_FILES:
            tb = tb.tb_next  # the frames of this start-up, which a fresh interpreter does not have
        sys.excepthook(kind, value.with_traceback(tb), tb)
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    finish()
    os._exit(code & 0xFF)


REAL = sys.executable
STARTUP_FILES = (os.path.abspath(__file__), "<frozen runpy>")


def cold_because(argv, mine, set_by_imports):
    """Why a warm start of argv could differ from a cold one ('' where it could not): an environment that differs in
    what imports read, or modules beside the script (or in the working directory) that would shadow those preloaded
    (a copy of the project at another revision)."""
    if processes.KEEP in os.environ:  # a forked child shows the zygote's environment where the suite looks for it
        return "kept by a fixture (its environment says so)"
    theirs = import_time(os.environ, set_by_imports)
    if theirs != mine:
        changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        return "environment: " + ", ".join(changed)
    if argv[0] not in ("-m", "-c") and not os.path.isfile(argv[0]):
        return "no such script"  # the interpreter's own one line
    where = os.getcwd() if argv[0] in ("-m", "-c") else os.path.dirname(os.path.realpath(argv[0]))
    for name in os.listdir(where) if os.path.isdir(where) else ():
        module = sys.modules.get(name[:-3]) if name.endswith(".py") else None
        if module is not None and os.path.realpath(getattr(module, "__file__", "") or "") != \
                os.path.realpath(os.path.join(where, name)):
            return f"{os.path.join(where, name)} shadows the preloaded {name[:-3]}"
    return ""


def finish():
    """What the interpreter does on its way out: wait for threads, run atexit, flush."""
    import atexit
    import threading
    try:
        threading._shutdown()
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
