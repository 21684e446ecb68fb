"""
Training checkpoints: what one holds (weights, optimizer, gradient scaler, step, every rank's data
position and random state, the run's configuration), writing it, and resuming from it: finding
the newest checkpoint that loads, checking that the run continues under the settings it was
trained with, and agreeing on it across ranks. The file format itself (atomic writes, the format
tag, the one loader every script uses) is common.py's.
"""

import glob
import os
import random
from dataclasses import asdict

import numpy as np
import torch

import common
import parallel
from common import UserError, print0
from metrics import METRICS_FILE


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_checkpoint(run, args, dist, log, step):
    run.saved_step = step  # on every rank: whether to write another is decided collectively
    per_rank = common.gather({"train_loader": run.train_loader.state_dict(), "rng": rng_state()}, dist)
    states = None
    if dist.is_master or run.fsdp:  # under FSDP every rank takes part in gathering the full state
        states = parallel.model_state(run.model), parallel.optimizer_state(run.model, run.optimizer)
    if not dist.is_master:
        return
    path = common.checkpoint_path(args.log_dir, step)
    for stale in glob.glob(os.path.join(glob.escape(args.log_dir), ".ckpt_*.pt.tmp*")):
        os.remove(stale)  # left by a process killed mid-write; never read, since never renamed
    try:
        common.save_checkpoint(path, checkpoint_dict(run, step, per_rank, *states))
    except OSError as e:  # a full disk or a vanished mount: atomic_write left the earlier files whole
        raise UserError(f"could not write checkpoint {path} ({e.strerror or e}); the previous checkpoint "
                        f"{run.last_ckpt or '(none yet)'} is intact: free space under --log-dir, then --resume")
    for old in common.list_checkpoints(args.log_dir)[:-args.keep_checkpoints]:
        os.remove(old)
    log.record("checkpoint", step=step, path=path)
    log.line(f"checkpoint {path}")
    run.last_ckpt = path


def checkpoint_dict(run, step, per_rank, model_state, optimizer_state):
    """Full (unsharded) state, the same file whether the run used DDP or FSDP."""
    return {
        "step": step,  # steps completed: a resume starts at this step
        "model_config": asdict(run.raw_model.config),
        "model": model_state,
        "optimizer": optimizer_state,
        "scaler": run.scaler.state_dict(),
        "ranks": per_rank,
        "config": run.config,
    }


# the settings a checkpoint cannot be resumed under if they change
RESUME_INVARIANTS = ("block_size", "total_batch_size", "micro_batch_size", "world_size", "shuffle_seed")


def find_checkpoint(args, log):
    """(path, checkpoint) to resume from, or (None, None) to start fresh. Plain --resume takes the
    newest checkpoint in --log-dir that loads and says which newer ones it skipped (a file cut
    short by a full disk, say); a file named on the command line must load."""
    if args.resume is None:
        if os.path.exists(os.path.join(args.log_dir, METRICS_FILE)):
            raise UserError(f"{args.log_dir} already holds a run: pass --resume to continue it, "
                            "or a new --log-dir for a new run")
        return None, None
    if args.resume != "latest" and not os.path.isdir(args.resume):
        if not os.path.exists(args.resume):
            raise UserError(f"--resume {args.resume}: no such file; pass a ckpt_*.pt file, a log directory, "
                            "or --resume alone for the latest in --log-dir")
        return args.resume, common.load_checkpoint(args.resume)
    folder = args.log_dir if args.resume == "latest" else args.resume
    found = common.list_checkpoints(folder)
    if not found:
        if args.resume == "latest":
            return None, None  # nothing to continue yet: --resume is always safe to pass
        raise UserError(f"--resume {args.resume}: no ckpt_*.pt in that directory")
    problems = []
    for path in reversed(found):
        try:
            ckpt = common.load_checkpoint(path)
        except UserError as e:
            problems.append(str(e))
            continue
        for problem in problems:
            log.line(f"resume: skipped {problem}")
        return path, ckpt
    raise UserError(f"none of the {len(found)} checkpoints in {folder} loads (newest: {problems[0]}); "
                    "start a new run with a new --log-dir")


def check_resume_compatible(ckpt, args, dist, path):
    saved = ckpt["config"]
    now = dict(vars(args), world_size=dist.world_size)
    for key in RESUME_INVARIANTS:
        if key == "micro_batch_size" and now[key] == "auto":
            continue  # auto on resume means: the size the run was fitted with
        if saved.get(key) != now.get(key):
            flag = "world size (GPUs)" if key == "world_size" else "--" + key.replace("_", "-")
            raise UserError(f"cannot resume {path}: it was trained with {flag} = {saved.get(key)}, "
                            f"this run has {now.get(key)}; use the same setting, or a new --log-dir")
    for key in ("n_layer", "n_head", "n_embd"):
        value = getattr(args, key)
        if value is not None and value != ckpt["model_config"][key]:
            raise UserError(f"cannot resume {path}: its model has {key} = {ckpt['model_config'][key]}, "
                            f"--{key.replace('_', '-')} asks for {value}; drop the flag or use a new --log-dir")
    if os.path.abspath(saved["data_dir"]) != os.path.abspath(args.data_dir):
        print0(f"note: resuming with --data-dir {args.data_dir} (the run began with {saved['data_dir']}); "
               "the data loader checks that it is the same data")


def load_resume(args, dist, log):
    """Find, load and check the checkpoint to continue from: (path, checkpoint) or (None, None).
    Every rank reads the same directory; they must agree on the step, or the run would mix two."""
    path, ckpt = find_checkpoint(args, log)
    if ckpt is not None:
        check_resume_compatible(ckpt, args, dist, path)
    steps = common.gather(None if ckpt is None else ckpt["step"], dist)
    if len(set(steps)) > 1:
        raise UserError(f"the ranks found different checkpoints to resume from (steps {steps}): every node "
                        "must see the same --log-dir (a shared file system)")
    return path, ckpt


