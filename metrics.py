"""
The metrics.jsonl format in one place: RunLog writes it (train_gpt2.py, rank 0), read_metrics
reads it (plot.py and whatever else summarises a run); versions() and git_commit() are the
provenance a run header (and a data manifest) records.

A log directory holds log.txt (the lines printed during the run, for people and grep) and
metrics.jsonl: one JSON object per line, appended, flushed after each record. Every record has
"kind" and "time" (Unix seconds when written). The kinds and their other keys:

  run         one per launch of the trainer, first: step (the step it starts at: 0, or the
              resumed checkpoint's), max_steps, tokens_per_step, resumed_from (checkpoint path
              or null), device, device_name, dtype, compile, world_size, grad_accum, versions
              ({python, torch, ...}), git (commit, "-dirty" if changed, or null), config (every
              resolved setting, as checkpoints store it), changes (the settings a resume's command
              line changed, one line each), restart (how many times torchrun --max-restarts had
              started the group again), per_node (processes per node: what a resume launches)
  memory      one per launch, after run: step, params, grads, optimizer, activations, total:
              the bytes each GPU (or process) is planned to hold (parallel.memory_plan)
  train       one per optimizer step: step, loss, lr, grad_norm, dt_ms, tok_per_s (all ranks),
              mfu (a fraction, null where the device's peak is unknown), tokens (seen after the
              step: (step + 1) * tokens_per_step), skipped (true: a non-finite step not applied)
  val         step, val_loss, tokens (seen before the step: step * tokens_per_step)
  hellaswag   step, acc, acc_norm, n (items scored), tokens (as for val)
  core        step, core (the mean centred accuracy), centered ({task: centred accuracy}), tokens
  checkpoint  step (steps completed: a resume starts there), path
  sample      step, index, text: one of the samples printed at that step
  timing      step, data_ms, copy_ms, forward_ms, backward_ms, optimizer_ms, eval_ms: mean ms
              per step of each phase since the last timing record (--timing-breakdown)
  end         step (finished: max_steps; otherwise the last step that ran, -1 for none),
              reason: finished, signal or nonfinite; absent when the process was killed or is
              still running

read_metrics skips the kinds it does not use (timing, and any a newer trainer adds), so kinds
can be added without breaking readers; a kind it uses without one of its REQUIRED keys is an
error.
"""

import json
import os
import platform
import queue
import socket
import subprocess
import sys
import threading
import time

from common import UserError, first_line, to_devnull, unreachable

METRICS_FILE = "metrics.jsonl"
TEXT_LOG_FILE = "log.txt"
LOCK_FILE = "trainer.lock"  # held by the writing trainer for its whole run; says who holds it

# the keys a reader relies on, per kind; the other keys above are optional for a reader
REQUIRED = {"run": ("step",),
            "train": ("step", "loss", "tokens", "tok_per_s", "dt_ms"),
            "val": ("step", "val_loss", "tokens"),
            "hellaswag": ("step", "acc_norm", "tokens"),
            "core": ("step", "core", "tokens"),
            "checkpoint": ("step", "path"),
            "end": ("step", "reason")}
STEP_KINDS = ("train", "val", "hellaswag", "core", "checkpoint")  # read_metrics keeps one record per step

# ----------------------------------------------------------------------------------------------
# Provenance: what produced a run


def versions(*extra):
    """Versions of Python, torch (and its CUDA), numpy, tiktoken and the `extra` modules that import:
    what a run header or a data manifest records about the software that wrote it."""
    import importlib

    torch_version, cuda = torch_versions()
    out = {"python": platform.python_version(), "torch": torch_version, "cuda": cuda}
    for name in ("numpy", "tiktoken") + extra:
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return out


def torch_versions():
    """torch.__version__ and torch.version.cuda, without importing torch where it is not imported
    yet: fineweb.py records them but runs no torch, whose import is a second of its start-up. Both
    are plain assignments in torch/version.py, the file torch takes them from."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__, torch.version.cuda
    import importlib.util
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    if spec is None:
        return None, None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    file_spec = importlib.util.spec_from_file_location("torch_version_file", path)
    version = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(version)
    return version.__version__, version.cuda


def git_commit():
    """The short commit of this checkout ('-dirty' with uncommitted changes), or None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------------------------
# Writing


class RunLog:
    """log.txt and metrics.jsonl of one run. Rank 0 writes; other ranks hold a RunLog that does
    nothing, so the training loop calls it without asking which rank it is. hold(), or else the
    first write, takes the log directory's lock (one trainer per directory) until close(). With
    trackers (a Trackers), every record goes to them too. A stdout whose reader went away (a pipe
    into head) ends the printing, not the run: log.txt keeps every line."""

    def __init__(self, log_dir, active):
        self.active = active
        self.log_dir = log_dir
        self.text = self.metrics = self.lock = None  # opened at the first write: bad input leaves no trace
        self.trackers = None
        self.printing = True  # False once stdout is gone
        self.made_dir = False  # hold() made the directory: a launch refused before writing removes it again

    def hold(self):
        """Take the log directory's lock now (rank 0), before anything of this launch touches the
        directory (trackers, checkpoints set aside): a launch refused by the lock leaves it as it was."""
        if self.active and self.lock is None:
            self.made_dir = not os.path.isdir(self.log_dir)
            os.makedirs(self.log_dir, exist_ok=True)
            self.lock = take_lock(self.log_dir)

    def _open(self):
        if self.text is None:
            self.hold()
            # line-buffered: a crash or a kill loses at most the line being written
            self.text = open(os.path.join(self.log_dir, TEXT_LOG_FILE), "a", buffering=1)
            self.metrics = open(os.path.join(self.log_dir, METRICS_FILE), "a", buffering=1)

    def line(self, msg):
        """Append msg to log.txt and print it."""
        if self.active:
            self._open()
            self.text.write(msg + "\n")
            if self.printing:
                try:
                    print(msg, flush=True)
                except BrokenPipeError:
                    self._stdout_gone()

    def _stdout_gone(self):
        self.printing = False
        to_devnull(sys.stdout)
        path = os.path.join(self.log_dir, TEXT_LOG_FILE)
        try:
            print(f"note: stdout was closed; training goes on, its lines only in {path}", file=sys.stderr,
                  flush=True)
        except BrokenPipeError:  # stderr went into the same pipe (2>&1)
            to_devnull(sys.stderr)

    def record(self, kind, **fields):
        """Append {"kind": kind, **fields, "time": now} to metrics.jsonl."""
        if self.active:
            self._open()
            self.metrics.write(json.dumps(dict(kind=kind, **fields, time=time.time())) + "\n")
            self.metrics.flush()
            if self.trackers is not None:
                self.trackers.send(kind, fields)

    def close(self):
        """Close the files and the trackers, and release the lock (its holder's line goes with it)."""
        if self.trackers is not None:
            self.trackers.close()
        if self.lock is not None:
            self.lock.truncate(0)
        for f in (self.text, self.metrics, self.lock):
            if f is not None:
                f.close()
        if self.made_dir and self.text is None:  # refused before its first line: leave no directory behind
            try:
                os.remove(os.path.join(self.log_dir, LOCK_FILE))
                os.rmdir(self.log_dir)  # only where nothing else was written into it
            except OSError:
                pass


def _try_lock(f):
    """True when this process now holds f's exclusive lock; False when another process does. A file
    system without locks (some network mounts) or a platform without fcntl counts as free."""
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


def take_lock(log_dir):
    """Lock log_dir for this trainer (an open file: the lock ends when it is closed or the process
    dies, so a kill -9 leaves nothing to clean up); UserError naming the holder when it is taken."""
    f = open(os.path.join(log_dir, LOCK_FILE), "a+")
    if not _try_lock(f):
        raise _in_use(log_dir, f)
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def check_not_running(log_dir):
    """UserError when a trainer holds log_dir's lock now; creates nothing."""
    path = os.path.join(log_dir, LOCK_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            if not _try_lock(f):
                raise _in_use(log_dir, f)


def steps_logged(log_dir):
    """Whether log_dir's metrics.jsonl holds a finished training step: a launch that failed
    before its first step leaves only its header, and must not block a new run."""
    path = os.path.join(log_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return any(b'"kind": "train"' in line for line in f)


# ----------------------------------------------------------------------------------------------
# Experiment trackers: Weights & Biases and TensorBoard, optional


def check_tracker_installed(package):
    """UserError naming the pip install when the package of a tracking flag (--wandb, --tensorboard:
    each flag is named after its package) is missing."""
    import importlib.util
    if importlib.util.find_spec(package) is None:
        raise UserError(f"--{package} needs the {package} package, which is not installed: pip install {package}")


class Trackers:
    """The run's records, sent to Weights & Biases and/or TensorBoard (LOG_DIR/tb) as they are
    written to metrics.jsonl, with the same step numbers: numbers as scalars named KIND/FIELD,
    text (samples, checkpoint paths) as text, the run header as the run's configuration. A
    background thread does the sending, so a slow tracker never holds up a step (the records are
    plain numbers already: no device sync). Rank 0 only.

    A resumed run replays the steps after its checkpoint; neither tracker then holds a step twice.
    TensorBoard is told to hide what earlier launches logged from start_step on (purge_step), as
    metrics.jsonl keeps the later record of a step. W&B keeps a step once it has it, so a step below
    the last one the W&B run holds (run.step: the server's, when it continues a run) is not sent."""

    CONFIG_KINDS = ("run", "memory")  # what the run is, not something that changes with the steps

    def __init__(self, log_dir, wandb_project=None, wandb_run=None, wandb_id=None, tensorboard=False, start_step=0):
        self.wandb = self.writer = None
        if wandb_project:
            self.wandb = start_wandb(log_dir, wandb_project, wandb_run, wandb_id)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(log_dir, "tb"), purge_step=start_step)
        self.queue = queue.Queue()
        if self.wandb is not None and start_step > 0:
            self.replay(log_dir, start_step)
        self.thread = threading.Thread(target=self._send_all, name="trackers", daemon=True)
        self.thread.start()

    REPLAYED_KINDS = ("val", "hellaswag", "core", "train")  # in the trainer's order within a step

    def replay(self, log_dir, start_step):
        """Queue for W&B the records of metrics.jsonl that a killed launch may never have handed to
        W&B's service (a kill -9 loses what it had queued), up to start_step, where this launch begins:
        those after the last launch that ended (and so finished its W&B run), and from the W&B run's
        step on (what it holds: the server's, online; 0 offline, where it cannot know). A step W&B
        holds already is not sent twice (see _send)."""
        try:
            m = read_metrics(log_dir)
        except UserError:
            return  # nothing logged yet
        held = self.wandb.step
        for launch in m["launches"]:
            end = launch["end"]
            if end is not None:  # its end record's step: max_steps when finished, else its last step
                held = max(held, end["step"] + (end["reason"] != "finished"))
        records = [(r["step"], self.REPLAYED_KINDS.index(kind), kind, r) for kind in self.REPLAYED_KINDS
                   for r in m[kind] if held <= r["step"] < start_step]
        for _, _, kind, r in sorted(records, key=lambda t: t[:2]):
            self.queue.put((kind, {k: v for k, v in r.items() if k not in ("kind", "time")}, ("wandb",)))

    @property
    def wandb_id(self):
        return self.wandb.id if self.wandb is not None else None

    def send(self, kind, fields):
        self.queue.put((kind, fields, ("wandb", "tensorboard")))

    def _send_all(self):
        while (item := self.queue.get()) is not None:
            try:
                self._send(*item)
                if self.writer is not None and self.queue.empty():
                    self.writer.flush()  # else a killed run loses up to 2 minutes of events
            except Exception as e:  # a tracker must never take the run down
                print(f"tracking: a {item[0]} record was not sent ({type(e).__name__}: {e})", file=sys.stderr,
                      flush=True)

    def _send(self, kind, fields, to):
        """Send one record to the trackers named in `to` (a replayed one goes to W&B only:
        TensorBoard's files keep what a killed launch wrote)."""
        step = fields.get("step")
        if kind in self.CONFIG_KINDS:
            if self.wandb is not None:
                self.wandb.config.update({kind: fields}, allow_val_change=True)
            if self.writer is not None:
                self.writer.add_text(kind, "    " + json.dumps(fields, indent=1).replace("\n", "\n    "), step)
            return
        if step is None:
            return
        if kind == "sample":  # one text per sample
            values = {f"sample/{fields['index']}": fields["text"]}
        else:  # a dict of numbers (CORE's per task) as one scalar each: core/centered/arc_easy
            values = {}
            for k, v in fields.items():
                if k != "step" and v is not None:
                    values.update({f"{kind}/{k}/{kk}": vv for kk, vv in v.items()} if isinstance(v, dict)
                                  else {f"{kind}/{k}": v})
        if self.writer is not None and "tensorboard" in to:
            for name, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(name, value, step)
                elif isinstance(value, str):
                    self.writer.add_text(name, value, step)
        if self.wandb is not None and "wandb" in to and step >= self.wandb.step:  # lower: W&B has it already
            self.wandb.log(values, step=step)

    def close(self):
        """Send what is queued, then end the W&B run and close the TensorBoard files."""
        self.queue.put(None)
        self.thread.join()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def new_wandb_id():
    """An id for a new W&B run: 8 lowercase letters and digits, as W&B makes its own."""
    import secrets
    import string
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def start_wandb(log_dir, project, name, run_id):
    """A W&B run (files under LOG_DIR/wandb), continuing run_id when given. Offline
    (WANDB_MODE=offline) it needs no account; online, an unreachable server is one line at once."""
    import wandb
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode not in ("offline", "disabled", "dryrun"):
        problem = unreachable(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
        if problem:
            raise UserError(f"--wandb: {problem}; set WANDB_MODE=offline to log to {log_dir}/wandb and "
                            "`wandb sync` it later")
    try:
        return wandb.init(project=project, name=name, id=run_id, resume="allow" if run_id else None, dir=log_dir)
    except Exception as e:  # no API key, a project that cannot be made, ...
        raise UserError(f"--wandb: could not start a W&B run ({type(e).__name__}: {first_line(e, 200)}); "
                        "run `wandb login`, or set WANDB_MODE=offline")


# ----------------------------------------------------------------------------------------------
# Reading

_warned = set()  # metrics files already warned about: once per file per process


def _decode(line):
    """(record, recovered) for one line, or (None, False). A write cut by a kill leaves a partial
    line, and the next launch appends its first record right after it: then the complete record
    at the end of the line is returned, with recovered=True."""
    try:
        rec = json.loads(line)
        return (rec, False) if isinstance(rec, dict) and isinstance(rec.get("kind"), str) else (None, False)
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    for start in [i for i, c in enumerate(line) if c == "{" and i > 0]:
        try:
            rec, end = decoder.raw_decode(line, start)
        except ValueError:
            continue
        if not line[end:].strip() and isinstance(rec, dict) and isinstance(rec.get("kind"), str):
            return rec, True
    return None, False


def read_records(path):
    """(line number, record) pairs of a metrics file, every kind, in file order. Unreadable lines
    at the end (a write cut by a kill, or the zeros a power loss leaves) are skipped with one
    warning; anywhere else they are an error."""
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8", errors="replace").split("\n")
    records, bad, cut = [], [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec, recovered = _decode(line)
        if rec is None:
            bad.append(n)
            continue
        if bad:
            raise UserError(f"{path}:{bad[0]} is not a metrics record (a JSON object with a \"kind\"), "
                            "and records follow it: the file is damaged or is not train_gpt2.py's")
        if recovered:
            cut.append(n)
        records.append((n, rec))
    if (bad or cut) and path not in _warned:
        _warned.add(path)
        where = ", ".join(map(str, cut + bad))
        print(f"warning: {path}: skipped {len(cut) + len(bad)} record(s) cut short by a kill "
              f"(line {where})", file=sys.stderr, flush=True)
    return records


def _state(kind, step):
    """How many steps the model had taken when this record was written."""
    return step + 1 if kind == "train" else step


def read_metrics(log_dir):
    """Parse log_dir/metrics.jsonl into {"path", "launches", "train", "val", "hellaswag",
    "checkpoint"}: the step kinds are lists sorted by step, one record per step; "launches" has
    one dict per launch, in order: {"run": its run record, "start": its time, "last_time": time
    of its last record, "first_train_step": step of its first train record, "end": its end
    record or None}.
    A resumed run appends a new "run" record that starts at step s, then logs steps from s on
    again. The later record for a step wins; what the earlier launch logged past s (up to its
    crash) belongs to an abandoned branch and is dropped, even where the new launch has not
    reached it yet."""
    log_dir = os.fspath(log_dir)
    path = os.path.join(log_dir, METRICS_FILE)
    if not os.path.isdir(log_dir):
        raise UserError(f"{log_dir} is not a directory: pass the --log-dir of a train_gpt2.py run")
    if not os.path.isfile(path):
        raise UserError(f"{log_dir} has no {METRICS_FILE}: is it a log directory written by train_gpt2.py?")
    by_step = {kind: {} for kind in STEP_KINDS}
    launches = []
    for n, rec in read_records(path):
        kind = rec["kind"]
        if kind not in REQUIRED:
            continue
        for field in REQUIRED[kind]:
            if rec.get(field) is None:
                raise UserError(f"{path}:{n}: a {kind!r} record without {field!r}: the file is damaged "
                                "or was written by another program")
        if not isinstance(rec["step"], int):
            raise UserError(f"{path}:{n}: step {rec['step']!r} is not an integer")
        if kind == "run" or not launches:
            launches.append({"run": rec if kind == "run" else None, "start": rec.get("time"),
                             "last_time": None, "first_train_step": None, "end": None})
        if kind == "run":
            for k, recs in by_step.items():  # drop the abandoned branch
                for step in [s for s in recs if _state(k, s) > rec["step"]]:
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
    if not launches:
        raise UserError(f"{path} has no records: the run has not logged anything yet")
    metrics = {kind: [recs[s] for s in sorted(recs)] for kind, recs in by_step.items()}
    return dict(metrics, path=path, launches=launches)
