"""
Experiment trackers, both optional: Weights & Biases (--wandb) and TensorBoard (--tensorboard). The
trainer's RunLog hands them every record it writes to metrics.jsonl (rank 0), and a resumed run
replays to W&B what a killed launch may never have sent it.
"""

import json
import os
import queue
import sys
import threading

from common import UserError, first_line, unreachable
from metrics import read_metrics


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


