"""
metrics.jsonl and log.txt: RunLog writes them (train_gpt2.py, rank 0; it also holds the log directory's lock and feeds
the trackers), read_metrics reads them (plot.py), with what the run record describes of its evaluations.

log.txt holds the lines printed during the run. metrics.jsonl holds one JSON object per line, appended and flushed
per record, each with "kind" and "time" (Unix seconds). The kinds and their other keys:
  run         one per launch, first: step (where it starts: 0 or the resumed checkpoint's), max_steps,
              tokens_per_step, resumed_from (checkpoint path or null), device, device_name, dtype, compile,
              world_size, grad_accum, versions, git (commit, "-dirty" if changed, or null), config (every resolved
              setting), changes (the settings a resume's command line changed), restart (torchrun's restart count),
              per_node (processes per node: what a resume launches), environment (the variables set that change
              how torch compiles and runs: TORCHINDUCTOR_*, NCCL_*, ...), evaluations ({kind: its description}: the
              evaluation records of the run, their headline number and how plot.py draws them, descriptions.py; a
              run record without it: val, hellaswag and core as below), stop_grace_s (seconds a
              launcher leaves a stop before it kills the process: torchrun's --shutdown-timeout; null: none)
  memory      one per launch, after run: step, params, grads, optimizer, activations, total: the bytes each GPU
              (or process) is planned to hold (memory.memory_plan)
  train       one per optimizer step: step, loss, lr, grad_norm, dt_ms, tok_per_s (all ranks), mfu (a fraction,
              null where the device's peak is unknown), tokens (seen after the step: (step + 1) * tokens_per_step),
              skipped (true: a non-finite step not applied), peak_mem (bytes rank 0's GPU has held at most since
              the launch's first step; null off CUDA)
  val         an evaluation's (evaluation.py): step, val_loss, tokens (seen before the step: step * tokens_per_step)
  hellaswag   step, acc, acc_norm, n (items scored), tokens (as for val)
  core        step, core (the mean centred accuracy), centered ({task: centred accuracy}), tokens
  (any kind a run record describes: step, tokens and its headline number, at least)
  checkpoint  step (steps completed: a resume starts there), path, seconds (the write's)
  sample      step, index, text: one of the samples printed at that step
  timing      step, data_ms, copy_ms, forward_ms, backward_ms, optimizer_ms, eval_ms: mean ms per step of each
              phase since the last timing record (--timing-breakdown)
  end         step (max_steps when finished, else the last step that ran, -1 for none), reason: finished, signal,
              nonfinite or out_of_memory; absent when the process was killed or is still running

Readers skip the kinds they do not use, so kinds can be added. A line that holds no usable record (a write cut
short by a kill, damage, a used kind without one of its required keys or with a value of another type) is skipped
with one warning naming it; a file in which no line is a record is an error.
"""

import json
import os
import shlex
import shutil
import socket
import sys
import time
from contextlib import contextmanager

import checkpoint  # the checkpoints' names (torch-free on import, as this file is)
from common import UserError, json_line_problem, out_of_space, to_devnull
from descriptions import described

METRICS_FILE = "metrics.jsonl"
TEXT_LOG_FILE = "log.txt"
LOCK_FILE = "trainer.lock"  # held by the writing trainer for its whole run; says who holds it

# the keys a reader relies on, per kind, and their types; the other keys above are optional for a reader. An
# evaluation's kind is described in the run record: step, tokens and its headline number are required of it
REQUIRED = {"run": {"step": int},
            "train": {"step": int, "loss": float, "tokens": int, "tok_per_s": float, "dt_ms": float},
            "checkpoint": {"step": int, "path": str},
            "end": {"step": int, "reason": str}}
# optional: a number or null
NUMBERS = ("time", "mfu", "max_steps", "tokens_per_step", "world_size", "per_node", "peak_mem")
TYPE_WORDS = {int: "an integer", float: "a number", str: "text"}


# Writing: a run's resume command, its log and records
def resume_command(log_dir, world_size=1, per_node=None):
    """The shell command that continues the run in log_dir with as many processes (a resume refuses another count);
    on several nodes, N (each node's rank) and HOST:PORT (the first node's address) are the user's to fill in."""
    args = f"train_gpt2.py --log-dir {shlex.quote(log_dir)} --resume"
    if world_size <= 1:
        return f"python {args}"
    per_node = per_node or world_size
    if per_node >= world_size:
        return f"torchrun --standalone --nproc_per_node={world_size} {args}"
    return (f"torchrun --nnodes={world_size // per_node} --node_rank=N --nproc_per_node={per_node} "
            f"--rdzv-endpoint=HOST:PORT {args}")


class RunLog:
    """log.txt and metrics.jsonl of one run: rank 0 writes, the other ranks' RunLog does nothing. hold(), or else
    the first write, takes the directory's lock until close(). A stdout whose reader went away ends the printing,
    not the run."""

    def __init__(self, log_dir, active):
        self.active = active
        self.log_dir = log_dir
        self.text = self.metrics = self.lock = None  # opened at the first write: bad input leaves no trace
        self.trackers = None
        self.printing = True  # False once stdout is gone
        self.made = None  # what hold() made ("dir", "lock"): a launch refused before its first line removes it
        self.held = None  # the records of a round in progress (round()), written when it completes

    def hold(self):
        """Take the lock before anything of this launch touches the directory: a launch it refuses changes nothing."""
        if self.active and self.lock is None:
            made_dir = not os.path.isdir(self.log_dir)
            os.makedirs(self.log_dir, exist_ok=True)
            path = os.path.join(self.log_dir, LOCK_FILE)
            made_lock = not os.path.exists(path)
            f = open(path, "a+")  # its lock ends with the file or the process: a kill -9 leaves nothing to clean up
            if not _try_lock(f):
                raise _in_use(self.log_dir, f)
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
            self.lock = f
            self.made = "dir" if made_dir else "lock" if made_lock else None

    def _open(self):
        if self.text is None:
            self.hold()
            # line-buffered: a crash or a kill loses at most the line being written, whose cut end is ended here
            # so that this launch's first line does not run into it
            self.text, self.metrics = (open(os.path.join(self.log_dir, name), "a", buffering=1)
                                       for name in (TEXT_LOG_FILE, METRICS_FILE))
            for f in (self.text, self.metrics):
                if f.tell() and not _ends_a_line(f.name):
                    self._append(f, "\n")

    def line(self, msg):
        if self.active:
            self._open()
            self._append(self.text, msg + "\n")
            if self.printing:
                try:
                    print(msg, flush=True)
                except BrokenPipeError:
                    self.printing = False
                    to_devnull(sys.stdout)
                    try:
                        print(f"note: stdout was closed; training goes on, its lines only in {self.text.name}",
                              file=sys.stderr, flush=True)
                    except BrokenPipeError:  # stderr went into the same pipe (2>&1)
                        to_devnull(sys.stderr)

    def record(self, kind, **fields):
        if self.held is not None:
            self.held.append((kind, fields, time.time()))
            return
        self._write(kind, fields, time.time())

    @contextmanager
    def round(self):
        """Records made inside are written at its end, or none of them where cancel() was called within: a round
        of evaluations that a stop cuts short records nothing (its lines are printed as they come)."""
        self.held = []
        try:
            yield self
        finally:
            held, self.held = self.held, None
            for kind, fields, when in held or []:
                self._write(kind, fields, when)

    def cancel(self):
        self.held = []

    def _write(self, kind, fields, when):
        if self.active:
            self._open()
            self._append(self.metrics, json.dumps(dict(kind=kind, **fields, time=when)) + "\n")
            if self.trackers is not None:
                self.trackers.send(kind, fields)

    def close(self):
        """Close the files and the trackers, and release the lock (its holder's line goes with it)."""
        if self.trackers is not None:
            self.trackers.close()
        if self.lock is not None:
            self.lock.truncate(0)
            if self.text is None and self.made:  # refused before its first line: take back what it made,
                # while it still holds the lock (no other trainer is in the directory)
                if self.made == "dir":
                    shutil.rmtree(self.log_dir, ignore_errors=True)  # and what its trackers made in it
                else:
                    os.remove(os.path.join(self.log_dir, LOCK_FILE))
        for f in (self.text, self.metrics, self.lock):
            if f is not None:
                try:
                    f.close()
                except OSError:  # what a failed write left in its buffer: that write was reported
                    pass

    def _append(self, f, text):
        try:
            f.write(text)
            f.flush()
        except OSError as e:
            why = "no space left on its disk" if out_of_space(e, self.log_dir) else (e.strerror or str(e))
            saved = [os.path.basename(p) for p in checkpoint.list_checkpoints(self.log_dir)]
            then = (f"the run's checkpoints are intact (the last: {saved[-1]}): free space under --log-dir, then "
                    "--resume continues from it" if saved else "no checkpoint was written yet: free space under "
                    "--log-dir, then --resume starts the run again")
            raise UserError(f"could not write {f.name} ({why}); {then}")


def _ends_a_line(path):
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _try_lock(f):
    """Whether this process now holds f's lock; a file system or platform without locks counts as free."""
    try:
        import fcntl
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        return False
    except (ImportError, OSError):
        pass
    return True


def _in_use(log_dir, f):
    f.seek(0)
    holder = f.read().strip() or "another process"
    f.close()
    return UserError(f"{log_dir} is in use by a trainer that is still running ({holder}): wait for it to end or "
                     "stop it (it checkpoints on SIGTERM), or use another --log-dir")


def check_not_running(log_dir):
    """UserError when a trainer holds log_dir's lock now; creates nothing."""
    path = os.path.join(log_dir, LOCK_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            if not _try_lock(f):
                raise _in_use(log_dir, f)


def resumed_before(log_dir):
    """The --resume paths (checkpoints, directories) the launches into log_dir were given, absolute."""
    try:
        launches = read_metrics(log_dir)["launches"]
    except UserError:
        return set()
    given = [(launch["run"] or {}).get("config", {}).get("resume") for launch in launches]
    return {os.path.abspath(g) for g in given if g not in (None, "latest")}


def steps_logged(log_dir):
    """Whether log_dir's metrics.jsonl holds a finished step (a launch that failed before one blocks no new run)."""
    path = os.path.join(log_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return any(b'"kind": "train"' in line for line in f)


# Reading
_warned = set()  # metrics files already warned about: once per file per process


def _decode(line):
    """(record or None, what is wrong with the line or None). A write cut by a kill leaves a partial line that the
    next launch's first record follows: that record is read, with the cut named."""
    try:
        rec, why = json.loads(line), None
    except ValueError as e:
        rec, why = None, json_line_problem(line, e)
        for start in [i for i, c in enumerate(line) if c == "{" and i > 0]:
            try:
                rec, why = json.loads(line[start:]), "a write cut short by a kill, then a record"
                break
            except ValueError:
                pass
    if rec is not None and not (isinstance(rec, dict) and isinstance(rec.get("kind"), str)):
        return None, 'not a record (a JSON object with a "kind")'
    return rec, why


def _check(rec, required):
    """What is wrong with a record of a kind a reader uses (required: {kind: {key: type}}), or None."""
    kind = rec["kind"]
    for key, want in dict(required[kind], **{k: float for k in NUMBERS if rec.get(k) is not None}).items():
        value = rec.get(key)
        if value is None:
            return f"a {kind!r} record without {key!r}"
        if isinstance(value, bool) or not isinstance(value, (int, float) if want is float else want):
            return f"{key!r} is {value!r}, not {TYPE_WORDS[want]}"
    return None


def read_records(path):
    """(the records of a metrics file, every kind, in file order; {kind: description} of its evaluations). What no
    reader can use is skipped with a warning."""
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8", errors="replace").split("\n")
    decoded, skipped = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec, why = _decode(line)
        if why is not None:
            skipped.append((n, why))
        if rec is not None:
            decoded.append((n, rec))
    evaluations = described(rec for _, rec in decoded)
    required = dict(REQUIRED, **{kind: {"step": int, "tokens": int, d["field"]: float}
                                 for kind, d in evaluations.items()})
    records = []
    for n, rec in decoded:
        why = _check(rec, required) if rec["kind"] in required else None
        if why is None:
            records.append(rec)
        else:
            skipped.append((n, why))
    skipped = [f"line {n}: {why}" for n, why in sorted(skipped)]  # in file order
    if skipped and not records:
        raise UserError(f"{path} is not JSON records of a run ({skipped[0]}): pass the --log-dir of a "
                        "train_gpt2.py run")
    if skipped and path not in _warned:
        _warned.add(path)
        more = f", and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        print(f"warning: {path}: skipped what no reader can use: {'; '.join(skipped[:3])}{more}", file=sys.stderr,
              flush=True)
    return records, evaluations


def read_metrics(log_dir):
    """{"path", "launches", "evaluations" ({kind: description}, read_records'), and per kind of step record (train,
    checkpoint and each evaluation's) a list sorted by step}; a launch is {"run", "start", "last_time",
    "first_train_step", "end" (its end record or None)}. Where a resumed launch starts at step s, the later record
    for a step wins, and what the earlier launch logged past s (an abandoned branch) is dropped."""
    path = os.path.join(log_dir, METRICS_FILE)
    if not os.path.isdir(log_dir):
        raise UserError(f"{log_dir} is not a directory: pass the --log-dir of a train_gpt2.py run")
    if not os.path.isfile(path):
        raise UserError(f"{log_dir} has no {METRICS_FILE}: is it a log directory written by train_gpt2.py?")
    metrics = _read(path)
    if not metrics["launches"]:
        raise UserError(f"{path} has no records: the run has not logged anything yet")
    return metrics


def read_launches(log_dir):
    """read_metrics(log_dir)["launches"] ([] before the first record): how train_gpt2.sbatch reads the launches."""
    path = os.path.join(log_dir, METRICS_FILE)
    return _read(path)["launches"] if os.path.isfile(path) else []


def _read(path):
    records, evaluations = read_records(path)
    by_step = {kind: {} for kind in ["train", *evaluations, "checkpoint"]}  # one record per step of these
    launches = []
    for rec in records:
        kind = rec["kind"]
        if kind not in REQUIRED and kind not in by_step:
            continue
        if kind == "run" or not launches:
            launches.append({"run": rec if kind == "run" else None, "start": rec.get("time"),
                             "last_time": None, "first_train_step": None, "end": None})
        if kind == "run":
            for k, recs in by_step.items():  # drop the abandoned branch
                for step in [s for s in recs if s + (k == "train") > rec["step"]]:  # train: after its step
                    del recs[step]
        launch = launches[-1]
        if rec.get("time") is not None:
            launch["last_time"] = rec["time"]
        if kind in by_step:
            by_step[kind][rec["step"]] = rec
        if kind == "train" and launch["first_train_step"] is None:
            launch["first_train_step"] = rec["step"]
        if kind == "end":
            launch["end"] = rec
    metrics = {kind: [recs[s] for s in sorted(recs)] for kind, recs in by_step.items()}
    return dict(metrics, path=path, launches=launches, evaluations=evaluations)
