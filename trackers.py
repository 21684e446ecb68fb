"""The optional experiment trackers, W&B (--wandb) and TensorBoard (--tensorboard), fed every record by RunLog."""

import argparse
import importlib.util
import json
import os
import queue
import secrets
import sys
import threading

from common import UserError, first_line, unreachable
from metrics import read_metrics


class Flags:
    """This room's flags in the trainer's command line (train_config composes every room's)."""

    @staticmethod
    def add_flags(a):
        a("--wandb", metavar="PROJECT", help="also send every record to this W&B project (pip install wandb)")
        a("--wandb-run", metavar="NAME", help="the W&B run's name (default: the log directory's name)")
        a("--wandb-id", metavar="ID", help="the W&B run to continue (default: a new one, or a resumed run's own)")
        a("--no-wandb", dest="wandb", action="store_const", const=None, help="send nothing to W&B (on a resume too)")
        a("--tensorboard", action=argparse.BooleanOptionalAction, default=False,
          help="also write every record as TensorBoard events to LOG_DIR/tb (pip install tensorboard)")

    @staticmethod
    def settle_flags(values, given):
        if values["wandb"] and not values["wandb_id"]:  # a new W&B run: its id now, so every checkpoint holds it
            values["wandb_id"] = secrets.token_hex(4)


def start(cfg, start_step):
    """The Trackers of the run's settings (--wandb, --tensorboard) from start_step on, or None where neither is on."""
    if not (cfg.wandb or cfg.tensorboard):
        return None
    name = cfg.wandb_run or os.path.basename(os.path.abspath(cfg.log_dir))
    return Trackers(cfg.log_dir, cfg.wandb, name, cfg.wandb_id, cfg.tensorboard, start_step)


def check_installed(cfg):
    """UserError naming the pip install when the package of a tracking flag the run has on is missing."""
    for package in ("wandb", "tensorboard"):
        if getattr(cfg, package) and importlib.util.find_spec(package) is None:
            raise UserError(f"--{package} needs the {package} package, which is not installed: pip install {package}")


class Trackers:
    """Records sent from a background thread to W&B and/or TensorBoard (LOG_DIR/tb): numbers as scalars named
    KIND/FIELD, text as text, the run header as configuration. No step is sent twice: TensorBoard hides what earlier
    launches logged from start_step on (purge_step), and W&B gets no step below the last one its run holds."""

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

    def replay(self, log_dir, start_step):
        """Queue for W&B the records below start_step that a killed launch may never have sent (a kill -9
        loses W&B's queue): from the later of the W&B run's step and the end of the last launch that ended."""
        try:
            m = read_metrics(log_dir)
        except UserError:
            return  # nothing logged yet
        held = self.wandb.step
        for launch in m["launches"]:
            end = launch["end"]
            if end is not None:  # its end record's step: max_steps when finished, else its last step
                held = max(held, end["step"] + (end["reason"] != "finished"))
        kinds = [*m["evaluations"], "train"]  # in the trainer's order within a step: its evaluations, then the step
        records = [r for kind in kinds for r in m[kind] if held <= r["step"] < start_step]
        for r in sorted(records, key=lambda r: r["step"]):  # stable: a step's kinds stay in that order
            self.queue.put((r["kind"], {k: v for k, v in r.items() if k not in ("kind", "time")}, ("wandb",)))

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
        """Send one record to the trackers named in `to` (a replayed one to W&B only: TensorBoard's
        files keep what a killed launch wrote)."""
        step = fields["step"]
        if kind in self.CONFIG_KINDS:
            if self.wandb is not None:
                self.wandb.config.update({kind: fields}, allow_val_change=True)
            if self.writer is not None:
                self.writer.add_text(kind, "    " + json.dumps(fields, indent=1).replace("\n", "\n    "), step)
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
        self.queue.put(None)
        self.thread.join()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def start_wandb(log_dir, project, name, run_id):
    """A W&B run (files under LOG_DIR/wandb), continuing run_id when given; online, an unreachable
    server is one line at once."""
    import wandb
    if os.environ.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun"):
        problem = unreachable(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
        if problem:
            raise UserError(f"--wandb: {problem}; set WANDB_MODE=offline to log to {log_dir}/wandb and "
                            "`wandb sync` it later")
    try:
        return wandb.init(project=project, name=name, id=run_id, resume="allow" if run_id else None, dir=log_dir)
    except Exception as e:  # no API key, a project that cannot be made, ...
        raise UserError(f"--wandb: could not start a W&B run ({type(e).__name__}: {first_line(e, 200)}); "
                        "run `wandb login`, or set WANDB_MODE=offline")
