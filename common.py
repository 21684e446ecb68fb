"""What every script shares: one-line errors and the exit path, stop requests, rank-0 printing,
file-system helpers and the connection probe asked before a download. Imports nothing from the project."""

import argparse
import contextlib
import errno
import gc
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback


# Errors and the exit path: bad input gets one line, a non-zero exit and no traceback.
class UserError(Exception):
    """A problem the user can fix; its message says what is wrong and what to do."""


def first_line(e, limit=300):
    """The first line of an exception's message (its type's name when it has none), for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (argparse's message, not the whole usage), exit status 2."""

    def error(self, message):
        say_error(f"error: {' '.join(message.split())} (see --help)")
        sys.exit(2)


_joined_process_group = False  # set by mark_joined_process_group(); decides how run_main exits
_store = None  # the process group's key-value store (torchrun's), once joined: where the ranks compare errors
# how gloo and NCCL say that a collective failed because another rank went away
PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
                 "remote process exited")
PEER_GRACE_S = 5.0
# a rank that met an error waits this long for the others to meet it (ranks reach a check of their flags or files
ERROR_WAIT_S = 15.0  # a second or two apart, more on a loaded machine; only an error of one rank's own waits it out)


def mark_joined_process_group(store=None):
    global _joined_process_group, _store
    _joined_process_group, _store = True, store


def torchrun_restart():
    """How many times torchrun --max-restarts has started this group again (0: the first launch)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(store):
    """The keys of this torchrun attempt: after a restart, the failed attempt's are still in the store, where a rank
    could read a dead peer's address (pytorch/pytorch#135712)."""
    import torch.distributed as tdist
    return tdist.PrefixStore(f"attempt_{torchrun_restart()}", store)


# Errors under torchrun: every rank meets a bad flag or file, one rank a fault of its own part of the data
def say_error(line):
    """Print an error line once for the ranks that met it: the lowest of them prints it, prefixed with their ranks
    unless every rank met it (compared through torchrun's store; without one each says its own, with its rank)."""
    record_error(line)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "RANK" in os.environ:
        _saying.update(line=f"rank {rank}: {line}", mine=True)  # what a SIGTERM from torchrun says before exit 2
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGTERM, _leave_saying)
        try:
            store = error_store()
            met = ranks_that_met(store, line, rank, world)
        except Exception:  # noqa: BLE001  (no store to compare through: a launcher without torchrun's agent)
            store, met = None, [rank]
        if met[0] != rank:  # a lower rank says it: none leaves (torchrun then ends all) before all that met it know
            _saying["mine"] = False
            with contextlib.suppress(Exception):  # (a store on the sayer's rank goes with it)
                store.set(f"error/heard/{rank}", "1")
                wait_for(store, [f"error/done/{met[0]}"], 70.0)
            return
        if len(met) < world:
            line = f"rank{'s' if len(met) > 1 else ''} {', '.join(map(str, met))}: {line}"
        _saying["line"] = line
        print(line, file=sys.stderr, flush=True)
        _saying["mine"] = False
        with contextlib.suppress(Exception):  # (no store: nothing to wait for)
            wait_for(store, [f"error/heard/{r}" for r in met[1:]], 60.0)
            store.set(f"error/done/{rank}", "1")
        return
    print(line, file=sys.stderr, flush=True)


_saying = {"line": None, "mine": False}  # the error line this rank is to say, while it is still to say it


def _leave_saying(signum, frame):
    """torchrun's SIGTERM, once another rank has left: this rank's line said where that is its part, exit status 2."""
    with contextlib.suppress(Exception):
        if _saying["mine"]:
            print(_saying["line"], file=sys.stderr, flush=True)
        sys.stdout.flush()
    os._exit(2)


def record_error(line):
    """Under torchrun, this rank's error file (TORCHELASTIC_ERROR_FILE) holds the one line, so that torchrun's summary
    names it as the root cause in those words: torch's @record wrote the error's traceback there."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    with contextlib.suppress(OSError), open(path, "w") as f:  # unwritable: the summary says less, stderr the same
        # the layout torch's ErrorHandler writes and torchrun reads
        json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                              "timestamp": str(int(time.time()))}}}, f)


def error_store():
    """The group's store while the group lives (rank 0 may host it), else torchrun's agent's."""
    import torch.distributed as tdist
    return _store if _store is not None and tdist.is_initialized() else agent_store()


def ranks_that_met(store, line, rank, world):
    """The ranks that posted this same line to the store within ERROR_WAIT_S of this one's post (all, at once)."""
    keys = [f"error/{r}" for r in range(world)]
    store.set(keys[rank], line)
    wait_for(store, keys)
    return [r for r, key in enumerate(keys) if store.check([key]) and store.get(key).decode() == line]


def wait_for(store, keys, seconds=None):
    """Until the store holds every key, or seconds (ERROR_WAIT_S) have passed."""
    deadline = time.monotonic() + (ERROR_WAIT_S if seconds is None else seconds)
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.05)


def agent_store():
    """torchrun's store before this process joins the group: its agent hosts it (TORCHELASTIC_USE_AGENT_STORE)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise RuntimeError("no torchrun agent's store")
    import datetime
    import torch.distributed as tdist
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=datetime.timedelta(seconds=10))
    return attempt_store(store)


def run_script(main):
    """run_main(main) for a script, its imports done: what they made lives as long as the process, so the collector
    leaves it out from here on (gc.freeze: a trainer spends about 1.4 s less CPU, most of it at the exit)."""
    gc.freeze()
    return run_main(main)


def run_main(main):
    """Call main(); a UserError becomes one line on stderr and exit status 2, a closed stdout (`| head`) status 1."""
    try:
        result = main()
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at the interpreter's exit
    except BrokenPipeError:
        to_devnull(sys.stdout)  # the interpreter's own flush at exit would fail again
        exit_process(1)
    except UserError as e:
        say_error(f"error: {e}")
        exit_process(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        exit_process(130)
    except SystemExit as e:
        exit_process(e.code)
    except BaseException as e:
        if not _joined_process_group:
            raise
        if any(m in str(e) for m in PEER_FAILURES):  # another rank failed: its error says why, this one says so
            line = f"rank {os.environ.get('RANK', '0')}: stopped, another rank failed ({first_line(e, 120)})"
            record_error(line)
            print(line, file=sys.stderr, flush=True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun first sees the rank whose failure caused this
            time.sleep(PEER_GRACE_S)                       # one, and ends this one at once
        else:
            traceback.print_exc()
        exit_process(1)
    if _joined_process_group:
        exit_process(0)
    return result


def exit_process(code):
    """sys.exit(code); a process in a process group flushes and leaves by os._exit instead, because gloo's threads
    can abort the interpreter's shutdown with SIGABRT, failing a finished run (pytorch/pytorch#179291)."""
    if not _joined_process_group:
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # sys.exit("message") prints it, status 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def to_devnull(stream):
    """Point stream's file descriptor at /dev/null, so that writes after its reader went away fail no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())  # on the way out: an error here leaves one descriptor open, no more
    os.close(devnull)


def print0(*args, **kwargs):
    """print on rank 0 only, flushed (notebooks and nohup otherwise hold output back)."""
    if int(os.environ.get("RANK", "0")) == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


# Stop requests (SIGTERM, Ctrl-C, and SIGUSR1: train_gpt2.sbatch's warning before Slurm's time limit)
# are noted, not obeyed at once, so that a long job ends cleanly at its next safe point.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name))


class StopFlag:
    """.signal: None, or the name of the first of STOP_SIGNALS received since it was made."""

    def __init__(self):
        self.signal = None
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread (e.g. imported in a notebook worker)
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if self.signal is None:  # the first request is the one the run reports
            self.signal = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once


# A stop's checkpoint is written within the launcher's grace: torchrun kills the ranks --shutdown-timeout seconds
# after passing its SIGTERM on, SLURM a job's processes KillWait seconds after its own (30 by default, both)
LAUNCHER_GRACE_S = 30
CHECKPOINT_BYTES_PER_S = 250e6  # below bench/bench_stop.py's slowest write rate here (BENCHMARKS.md)


def launcher_argv(pid=None):
    """The command line of the nearest torchrun above this process (read from Linux's /proc), or None."""
    pid = os.getppid() if pid is None else pid
    while pid > 1:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # its parent's
        except (OSError, ValueError, IndexError):
            return None
        if any(os.path.basename(a) == "torchrun" or a == "torch.distributed.run" for a in argv[:3]):
            return argv
    return None


def _option(argv, name, env, default):
    """torchrun's option --name (or --name_with_underscores, or its PET_ environment variable) as it reads it."""
    spellings = (f"--{name}", f"--{name.replace('-', '_')}")
    for i, a in enumerate(argv):
        if a in spellings and i + 1 < len(argv):
            return argv[i + 1]
        if a.split("=", 1)[0] in spellings and "=" in a:
            return a.split("=", 1)[1]
        if i > 0 and a.endswith(".py"):
            break  # the training script: what follows is its own
    return env.get("PET_" + name.upper().replace("-", "_"), default)


def stop_grace(env=None, argv=None):
    """(seconds, whose grace, how to lengthen it) a launcher leaves a stop between its SIGTERM and the kill that
    follows, or None where nothing kills the process after a SIGTERM (a plain python launch)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        argv = (launcher_argv() or []) if argv is None else argv
        handled = _option(argv, "signals-to-handle", env, "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
        if "SIGTERM" in handled.split(","):  # else torchrun leaves it to the ranks (train_gpt2.sbatch's)
            seconds = _option(argv, "shutdown-timeout", env, env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", ""))
            try:
                seconds = float(seconds) if seconds else LAUNCHER_GRACE_S
            except ValueError:
                seconds = LAUNCHER_GRACE_S
            return seconds, "torchrun waits after passing a SIGTERM on", (
                "give torchrun a longer --shutdown-timeout, or send the SIGTERM to the ranks (pkill -TERM -f "
                "train_gpt2.py), which torchrun then waits for")
    if "SLURM_JOB_ID" in env:
        return LAUNCHER_GRACE_S, "SLURM waits after a SIGTERM by default (KillWait: preemption, scancel)", (
            "ask for a longer KillWait where the cluster preempts, and keep the batch script's --signal=B:USR1@ lead "
            "before the time limit (300 s in train_gpt2.sbatch) above it")
    return None


def stop_grace_warning(checkpoint_bytes, grace, seconds=None):
    """A line where a stop's checkpoint of checkpoint_bytes may outlast the launcher's grace: estimated at
    CHECKPOINT_BYTES_PER_S, or `seconds`, measured, more than half of it. None where it fits or nothing kills."""
    if grace is None:
        return None
    limit, whose, remedy = grace
    if seconds is None:
        need = checkpoint_bytes / CHECKPOINT_BYTES_PER_S
        if need <= limit:
            return None
        what = f"a stop's checkpoint (~{checkpoint_bytes / 1e9:.1f} GB, ~{need:.0f} s at " \
               f"{CHECKPOINT_BYTES_PER_S / 1e6:.0f} MB/s) may not be written"
    else:
        if seconds <= limit / 2:
            return None
        what = f"this checkpoint took {seconds:.0f} s: a stop (its step, then its checkpoint) may not end"
    return f"{what} within the {limit:g} s {whose}: {remedy}"


# Files
def check_output_dir(path, flag):
    """UserError unless `path` is, or can be made as, a directory this process may write in (made later)."""
    if not path:
        raise UserError(f"{flag} is empty: pass a directory (it is made if missing)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file, not a directory: pass a directory (it is made if missing)")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):  # the nearest existing directory is where it will be made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"cannot write to {flag} {path}: {parent} is a file, so it cannot be made; "
                        "pass a directory path")
    try:  # a real write, not os.access: that says yes to root on a read-only file system
        os.rmdir(tempfile.mkdtemp(prefix=".write-test", dir=parent))
    except OSError as e:
        raise UserError(f"cannot write to {flag} {path} ({e.strerror or e} in {parent}): "
                        "pass a directory you can write to")


TMP = ".tmp"  # atomic_file's temporary beside path: .NAME.tmpPID


def left_by_kills(directory, names="*"):
    """The temporary files atomic_file left in directory for files named like names (a glob pattern) when a kill -9
    cut its write short: never renamed, so never read."""
    import glob
    return glob.glob(os.path.join(glob.escape(directory), f".{names}{TMP}*"))


def atomic_write(path, write_fn):
    """write_fn(f) into a temporary file beside path, then renamed over it: a kill leaves the old file or the new."""
    def write_file(tmp):
        with open(tmp, "wb") as f:
            write_fn(f)
    atomic_file(path, write_file)


def atomic_file(path, write_path):
    """write_path(tmp) makes a temporary file beside path (by its name: for writers that open the file themselves),
    which is fsynced and renamed over path: a failure or a kill leaves the old file or the new, and no temporary
    (a kill -9 leaves one: left_by_kills finds it)."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}{TMP}{os.getpid()}")
    try:
        write_path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # its errors raised (a full disk may show only here), unlike fsync_path's
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_path(d)  # make the rename itself durable


def atomic_directory(path, write_fn):
    """write_fn(tmp) fills a new directory that then takes path's place: a failure or a kill leaves the older one."""
    parent, name = os.path.split(os.path.abspath(path))
    tmp, old = os.path.join(parent, f".{name}.tmp"), os.path.join(parent, f".{name}.old")

    def settle():  # a kill or a failure between the two renames below: the older directory goes back
        if os.path.isdir(old) and not os.path.exists(path):
            os.rename(old, path)
        for d in (tmp, old):
            shutil.rmtree(d, ignore_errors=True)
    settle()
    try:
        os.makedirs(tmp)
        write_fn(tmp)
        for root, _, files in os.walk(tmp):
            for f in files:
                fsync_path(os.path.join(root, f))
        if os.path.exists(path):  # a directory cannot be renamed over one that holds files
            os.rename(path, old)
        os.rename(tmp, path)
    finally:
        settle()
    fsync_path(parent)


def fsync_path(path):
    """fsync a file, or a directory (so that a rename in it is durable), where the file system allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def out_of_space(e, directory, needed=0):
    """Whether e, raised writing into directory, means the disk is full. Not every writer says so with an
    errno: numpy reports a short write, safetensors its own error naming Rust's "os error 28"."""
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
            f"os error {code})" in str(e) for code in (errno.ENOSPC, errno.EDQUOT)):
        return True
    try:
        return shutil.disk_usage(directory).free <= needed
    except OSError:
        return False


def json_line_problem(line, error):
    """In words, what is wrong with a JSON line that json.loads refused with `error`; a line cut short says so."""
    if error.pos >= len(line.rstrip()) or error.msg.startswith("Unterminated string"):
        return "not complete JSON: the line ends before its value does (cut short?)"
    return f"not JSON ({error.msg})"


# The network, asked before a download: an offline machine gets one line at once, not a minute of retries.
def unreachable(url, timeout=5.0):
    """Why url's host cannot be reached; None when a connection opens or a proxy (no probe can judge it) is set."""
    from urllib.parse import urlparse
    parts = urlparse(url)
    proxies = ("HTTP_PROXY", "http_proxy") if parts.scheme == "http" else ("HTTPS_PROXY", "https_proxy")
    if any(os.environ.get(v) for v in proxies + ("ALL_PROXY", "all_proxy")):
        return None
    host, port = parts.hostname, parts.port or (80 if parts.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as e:  # no DNS, refused, timed out
        return f"{host} cannot be reached ({getattr(e, 'strerror', None) or e})"


def hub_unreachable(timeout=5.0):
    """unreachable() for the Hugging Face hub (HF_ENDPOINT), which HF_HUB_OFFLINE also turns off."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    return unreachable(os.environ.get("HF_ENDPOINT") or "https://huggingface.co", timeout)
