"""Training checkpoints (LOG_DIR/ckpt_NNNNNN.pt): their names, finding the one to resume from, writing and restoring
them (the full state dicts of a model under DDP or FSDP, and every stateful part registered), and loading a model for
the other scripts. A checkpoint is one torch.save file holding the full, unsharded state, the same under DDP or FSDP:
    format        CHECKPOINT_FORMAT
    step          steps completed: a resume starts at this step
    model_config  GPTConfig's fields
    model         the GPT's state dict (unwrapped, uncompiled)
    optimizer     the optimizer's state dict, parameters numbered as on one process
    scaler        the gradient scaler's state (fp16)
    ranks         per rank: the train loader's position and the random states
    world_size    processes of the run that wrote it
    config        every setting of the run (train_gpt2.py's resolved flags)
"""

import glob
import os
import re
import shlex
import time
import zipfile
from collections import namedtuple
from dataclasses import dataclass

import common
import metrics
from common import UserError, atomic_write, first_line, hub_unreachable, out_of_space

# torch, and the modules that import it (model, parallel), are imported where they are used: plot.py and metrics.py
# ask this file for the checkpoints' names, and stay free of torch

CHECKPOINT_FORMAT = "gpt2-train-checkpoint-v1"
TORCH_FILE_MAGIC = (b"PK\x03\x04", b"\x80")  # a torch.save zip (torch >= 1.6), or a pickle (older)
CHECKPOINT_RE = re.compile(r"^ckpt_(\d+)\.pt$")  # LOG_DIR/ckpt_NNNNNN.pt, NNNNNN the steps completed


def checkpoint_path(log_dir, step):
    return os.path.join(log_dir, f"ckpt_{step:06d}.pt")


def step_of(path):
    return int(CHECKPOINT_RE.match(os.path.basename(path)).group(1))


def list_checkpoints(log_dir):
    """log_dir's checkpoint files, oldest first by step, whether they load or not."""
    found = [p for p in glob.glob(os.path.join(glob.escape(log_dir), "ckpt_*.pt"))
             if CHECKPOINT_RE.match(os.path.basename(p))]
    return sorted(found, key=step_of)


def save_file(path, ckpt):
    import torch
    ckpt = dict(ckpt, format=CHECKPOINT_FORMAT)
    try:
        atomic_write(path, lambda f: torch.save(ckpt, f))
    except RuntimeError as e:  # torch's zip writer turns a failed write (a full disk) into "unexpected pos ..."
        if isinstance(e.__context__, OSError):
            raise e.__context__ from None
        raise


def file_head(path):
    """The first bytes of a file given as a checkpoint; UserError where they cannot be torch's (a text, a .jsonl)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head and not head.startswith(TORCH_FILE_MAGIC):  # the unpickler's complaints would say nothing useful
        raise UserError(f"{path} is not a checkpoint: not a torch zip or pickle file (it begins {head!r}); pass a "
                        "ckpt_*.pt written by train_gpt2.py")
    return head


def load_file(path):
    """A checkpoint written by train_gpt2.py, on the CPU; UserError for anything else or damaged (its zip CRCs)."""
    import torch
    head = file_head(path)
    try:
        if head == TORCH_FILE_MAGIC[0]:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            if bad is not None:
                raise ValueError(f"{bad} fails its CRC check")
        try:  # mmap: the ranks of a node that resume together share one copy of the file in the page cache
            ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception:  # a file system without mmap, or a damaged file: read it the plain way
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # an empty or truncated file, pickle garbage, ...
        reason = first_line(e).split(". ")[0].rstrip(".")  # torch's messages run on with advice
        raise UserError(f"{path} is not a readable checkpoint, truncated or corrupt ({reason}); use an "
                        "earlier ckpt_*.pt from the same directory")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a checkpoint written by train_gpt2.py")
    return ckpt


def newest_that_loads(folder):
    """(path, checkpoint, [why each newer one was skipped]) of the newest checkpoint in folder that loads."""
    found = list_checkpoints(folder)
    problems = []
    for path in reversed(found):
        try:
            return path, load_file(path), problems
        except UserError as e:
            problems.append(str(e))
    if found:
        raise UserError(f"none of the {len(found)} checkpoints in {folder} loads (newest: {problems[0]})")
    return None, None, []


# What a checkpoint holds, and putting it back
# a stateful part of the run from two functions: state_dict() and load_state_dict(state)
Part = namedtuple("Part", "state_dict load_state_dict")


BUILT_IN = ("model", "optimizer", "scaler", "train_loader", "rng")  # the parts restore() registers
RESERVED = BUILT_IN + ("step", "model_config", "ranks", "world_size", "config", "format")  # a checkpoint's own keys


class Checkpointer:
    """A run's checkpoints in log_dir, from set-up to end, on every rank: the one it continues (`resume`), checked
    against the ranks, the model it starts from, restored into what trains (compiled, DDP or FSDP); the branch a resume
    from an older step starts; saving and keeping the newest `keep`."""

    def __init__(self, log_dir, keep, ranks, log, resume=None):
        import parallel
        if resume is not None:  # the data's positions count in the processes: as many (every rank says so, once)
            saved = resume.checkpoint.get("world_size", resume.settings.get("world_size"))  # older: in the config
            if saved != ranks.world_size:
                raise UserError(f"cannot resume {resume.path}: it was trained with {saved} process(es) (GPUs), this "
                                f"launch has {ranks.world_size}; launch it with {saved} in all (torchrun "
                                "--nproc_per_node x --nnodes)")
        steps = parallel.gather(resume and resume.step, ranks)  # each rank read the directory: the same step?
        if len(set(steps)) > 1:
            raise UserError(f"the ranks found different checkpoints to resume from (steps {steps}): every node "
                            "must see the same --log-dir (a shared file system)")
        self.log_dir, self.keep, self.ranks, self.log, self.resume = log_dir, keep, ranks, log, resume
        self.last_path = self.last_step = None  # the checkpoint the run stands on: resumed from, then the last written
        self.last_here = False  # whether last_step's checkpoint is in log_dir (not another run's)
        self.warned = False  # that a checkpoint took too long for it (said once)
        self.parts = {}  # name: (a stateful part, whether each rank has its own), as register() takes them

    def starting_model(self, init_from, block_size):
        """(GPT on the CPU, where it came from), asked before begin(): of the resumed run's shape (restore puts its
        weights back), or --init-from's weights cut to block_size; None: a new model of the run's settings."""
        from model import GPT
        if self.resume is not None:
            return GPT.from_shape(self.resume.shape), "resumed"
        if not init_from:
            return None
        model, what = load_model(init_from)
        trained = model.config.block_size
        if block_size > trained:
            raise UserError(f"--block-size {block_size} is larger than the {trained} positions {init_from} was "
                            f"trained with; use --block-size {trained} or less")
        if block_size < trained:
            model.crop_block_size(block_size)
        return model.train(), what

    def register(self, name, part, per_rank=False):
        """Keep part's state_dict() in every checkpoint under name, handed back to its load_state_dict() on resume (as
        torchtitan's checkpointer takes its parts): the run's (rank 0's; a collective under FSDP), or each rank's own
        (per_rank). Registered before restore(), which adds the run's own; a checkpoint without it starts it afresh."""
        if name in RESERVED:
            raise ValueError(f"{name!r} is a checkpoint's own key: register the part under another name")
        self.parts[name] = (part, per_rank)

    def restore(self, *, model, optimizer, scaler, train_loader, config, fsdp):
        """The run's parts (weights, optimizers, scaler, each rank's data position and random state) and those
        registered before: saved from now on, the resumed state put back into them. The step the launch starts at."""
        import parallel
        added = {name: entry for name, entry in self.parts.items() if name not in BUILT_IN}
        self.parts = {"model": (Part(lambda: parallel.model_state(model),
                                     lambda s: parallel.load_model_state(model, s)), False),
                      "optimizer": (Part(lambda: parallel.optimizer_state(model, optimizer),
                                         lambda s: parallel.load_optimizer_state(model, optimizer, s)), False)}

        def load_scale(state):  # a bf16/fp32 run saved no scale: an fp16 resume of it (a T4, say) starts a fresh one
            if state or not scaler.is_enabled():
                scaler.load_state_dict(state)
        self.parts.update(scaler=(Part(scaler.state_dict, load_scale), False), train_loader=(train_loader, True),
                          rng=(parallel.RNG(), True), **added)
        self.model, self.config, self.fsdp = model, config, fsdp
        if self.resume is None:
            return 0
        ckpt, path = self.resume.checkpoint, self.resume.path
        check_weights_fit(parallel.unwrap(model), ckpt["model"], path)
        mine = ckpt["ranks"][self.ranks.rank]
        for name, (part, per_rank) in self.parts.items():
            if name not in (mine if per_rank else ckpt):
                if name in BUILT_IN:
                    raise UserError(f"{path} holds no {name}: it is not a whole checkpoint of this trainer; use "
                                    "an earlier ckpt_*.pt from the same directory")
                self.log.line(f"resume: {path} holds no {name}: it starts afresh")
                continue
            try:
                part.load_state_dict(mine[name] if per_rank else ckpt[name])
            except UserError as e:  # a loader state of other data, say
                raise UserError(f"cannot resume {path}: {e}")
        self.last_path, self.last_step = path, ckpt["step"]
        self.last_here = in_log_dir(path, self.log_dir)  # every rank read the file: the same answer
        return ckpt["step"]

    def begin(self):
        """Once every check of the launch has passed on every rank: say which newer checkpoints did not load, and where
        a resume of the run's own older checkpoint starts a branch, set the later ones aside."""
        import parallel
        if self.resume is None:
            return
        parallel.gather(None, self.ranks)  # every rank got this far: only then may rank 0 move files
        for problem in self.resume.skipped:
            self.log.line(f"resume: skipped {problem}")
        step = self.resume.step
        mine = self.ranks.is_master and in_log_dir(self.resume.path, self.log_dir)  # rank 0, on its own run's
        later = [p for p in list_checkpoints(self.log_dir) if step_of(p) > step] if mine else []
        if later:
            # out of every reader's sight, the old branch's later checkpoints and export
            dest = os.path.join(self.log_dir, "superseded", f"after_step_{step}_{time.strftime('%Y%m%d-%H%M%S')}")
            os.makedirs(dest)
            moved = later + [p for p in [os.path.join(self.log_dir, "hf")] if os.path.isdir(p)]
            for p in moved:
                os.replace(p, os.path.join(dest, os.path.basename(p)))
            self.log.line(f"resume: a new branch from step {step}: moved the old branch's later "
                          f"{', '.join(os.path.basename(p) for p in moved)} to {dest}")
        self.resume = None  # its state is in the model and optimizer now: the host memory it holds goes

    def save(self, step):
        """Write ckpt_<step>.pt (step: steps completed) from rank 0, unless this run's directory holds it already
        (every rank answers alike, without a look at rank 0's files: a rank that answered otherwise would call the
        save's collectives alone). A resume of another directory's checkpoint needs one of its own."""
        import parallel
        if self.last_step == step and self.last_here:
            return
        self.last_step, self.last_here = step, True
        per_rank = parallel.gather({name: part.state_dict() for name, (part, each) in self.parts.items() if each},
                                   self.ranks)
        if self.ranks.is_master or self.fsdp:  # under FSDP the weights' and moments' gathers are collectives
            shared = {name: part.state_dict() for name, (part, each) in self.parts.items() if not each}
        if not self.ranks.is_master:
            self.last_path = checkpoint_path(self.log_dir, step)  # rank 0's, written
            return
        ckpt = {"step": step, "model_config": parallel.unwrap(self.model).shape(), **shared, "ranks": per_rank,
                "world_size": self.ranks.world_size, "config": self.config}
        path = checkpoint_path(self.log_dir, step)
        os.makedirs(self.log_dir, exist_ok=True)
        for stale in common.left_by_kills(self.log_dir, "ckpt_*.pt"):
            os.remove(stale)
        started = time.perf_counter()
        try:
            save_file(path, ckpt)
        except OSError as e:  # a full disk or a vanished mount: atomic_write left the earlier files whole
            why = "no space left on its disk" if out_of_space(e, self.log_dir) else (e.strerror or str(e))
            raise UserError(f"could not write checkpoint {path} ({why}); the previous checkpoint "
                            f"{self.last_path or '(none yet)'} is intact: free space under --log-dir, then --resume")
        for old in list_checkpoints(self.log_dir)[:-self.keep]:
            os.remove(old)
        seconds = time.perf_counter() - started
        self.log.record("checkpoint", step=step, path=path, seconds=seconds)
        self.log.line(f"checkpoint {path} ({os.path.getsize(path) / 1e9:.2f} GB in {seconds:.1f} s)")
        late = common.stop_grace_warning(None, self.ranks.stop_grace, seconds)
        if late and not self.warned:
            self.log.line(f"warning: {late}")
            self.warned = True
        self.last_path = path


class Flags:
    """This room's flags in the trainer's command line (train_config composes every room's)."""
    ranges, launch_only = {"checkpoint_every": "0 or more", "keep_checkpoints": "at least 1"}, ("resume",)

    @staticmethod
    def add_flags(a):
        a("--checkpoint-every", type=int, default=5000, help="checkpoint every N steps and at the end (default: 5000)")
        a("--keep-checkpoints", type=int, default=2, help="keep the last K checkpoints (default: 2)")
        a("--resume", nargs="?", const="latest",
          help="continue from a checkpoint: a path, or no value for the latest in --log-dir (starts fresh if none)")


# Resuming: which checkpoint
@dataclass(frozen=True)
class Resume:
    """The run a launch continues: its checkpoint's path, its step, its settings (train_config reads them), its
    model's shape, and why newer checkpoints were passed over. The rest is Checkpointer's to put back."""
    path: str
    checkpoint: dict
    skipped: list

    step = property(lambda self: self.checkpoint["step"])
    settings = property(lambda self: self.checkpoint["config"])  # every setting of the run, as train_config stores them
    shape = property(lambda self: self.checkpoint["model_config"])  # GPT.from_shape's

    def finished_line(self, max_steps, export_hf, log_dir):
        """What a launch says where nothing is left to do, else None: max_steps are done and, with export_hf,
        LOG_DIR/hf holds weights written after this checkpoint (an export cut short by a full disk is still owed)."""
        from model import shape_export_problem
        weights = os.path.join(log_dir, "hf", "model.safetensors")
        exported = os.path.isfile(weights) and os.path.getmtime(weights) >= os.path.getmtime(self.path)
        if self.step == max_steps and (exported or not export_hf or shape_export_problem(self.shape)):
            return (f"{log_dir}: the run already finished its {self.step} steps ({self.path}); pass a larger "
                    "--max-steps to train on")


def resume_point(resume, log_dir):
    """The Resume a launch continues (None: a new run), as find_resume() says it. A --resume PATH given again (a
    requeued job) goes on from log_dir's own newest checkpoint; another run's checkpoint is refused where log_dir
    holds a run of its own (their checkpoints, export and metrics would mix)."""
    holds_run = bool(list_checkpoints(log_dir)) or metrics.steps_logged(log_dir)
    if resume is None:  # never silently write over an earlier run
        metrics.check_not_running(log_dir)
        if holds_run:
            raise UserError(f"{log_dir} already holds a run: pass --resume to continue it, "
                            "or a new --log-dir for a new run")
        return None
    again = holds_run and resume != "latest" and resume in metrics.resumed_before(log_dir)
    path, ckpt, skipped = find_resume("latest", log_dir) if again else (None, None, [])
    if path is None:
        path, ckpt, skipped = find_resume(resume, log_dir)
    if holds_run and not again and path is not None and not in_log_dir(path, log_dir):
        aside = os.path.join(os.path.abspath(log_dir), "superseded")
        if os.path.dirname(os.path.dirname(os.path.abspath(path))) == aside:
            raise UserError(f"--resume {resume}: that is a checkpoint of {log_dir}'s own earlier branch, set aside "
                            "when the run was resumed from an older step; --resume alone continues the run, and "
                            f"--log-dir NEW --resume {shlex.quote(path)} continues that branch in a new directory")
        raise UserError(f"--resume {resume}: {log_dir} holds another run; continue {path} in a new "
                        f"--log-dir (or an empty one), or start a new run from its weights with --init-from "
                        f"{shlex.quote(path)}")
    return Resume(path, ckpt, skipped) if ckpt is not None else None


def find_resume(resume, log_dir):
    """(path, checkpoint, [why each newer one was skipped]) to resume from; resume: "latest" (the newest in
    log_dir that loads), a log directory, or a checkpoint file (which must load)."""
    if resume != "latest" and not os.path.isdir(resume):
        if not os.path.exists(resume):
            raise UserError(f"--resume {resume}: no such file; pass a ckpt_*.pt file, a log directory, "
                            "or --resume alone for the latest in --log-dir")
        return resume, load_file(resume), []
    folder = log_dir if resume == "latest" else resume
    try:
        path, ckpt, skipped = newest_that_loads(folder)
    except UserError as e:
        raise UserError(f"{e}; start a new run with a new --log-dir")
    if path is None and resume != "latest":
        raise UserError(f"--resume {resume}: no ckpt_*.pt in that directory")
    return path, ckpt, skipped  # (None, None, []) for --resume with nothing to continue yet: it is always safe


def in_log_dir(path, log_dir):
    """Whether path lies in log_dir itself (not in another run's directory, nor in superseded/)."""
    return (path is not None and os.path.isdir(log_dir)
            and os.path.samefile(os.path.dirname(os.path.abspath(path)), log_dir))


# Models for the other scripts
def model_from_checkpoint(ckpt, path):
    from model import GPT
    try:
        model = GPT.from_shape(ckpt["model_config"])
        check_weights_fit(model, ckpt["model"], path)
        model.load_state_dict(ckpt["model"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{path} is damaged: its model does not load ({type(e).__name__}: {first_line(e, 160)}); "
                        "use an earlier ckpt_*.pt from the same directory")
    return model


def check_weights_fit(model, weights, path):
    """UserError naming the first weight missing from `weights`, of another shape there, or not the model's."""
    expected = model.state_dict()
    problems = []
    for key, tensor in expected.items():
        if key not in weights:
            problems.append(f"{key} {tuple(tensor.shape)} is missing")
        elif weights[key].shape != tensor.shape:
            problems.append(f"{key} has shape {tuple(weights[key].shape)} there, {tuple(tensor.shape)} in the model "
                            "its config describes")
    problems += [f"{key} is not a weight of the model its config describes" for key in weights if key not in expected]
    if problems:
        raise UserError(f"{path} does not hold the model its config describes: {problems[0]}; use an earlier "
                        "ckpt_*.pt from the same directory")


def model_from_hub(name):
    from model import GPT
    try:
        return GPT.from_pretrained(name, local_files_only=True)
    except OSError:  # not cached
        problem = hub_unreachable()
    if problem:
        raise UserError(f"model {name!r} is not in the Hugging Face cache, and {problem}; download it once "
                        "on a machine with network access, or pass a local checkpoint / directory")
    try:
        return GPT.from_pretrained(name)
    except OSError as e:
        raise UserError(f"could not load model {name!r} from the Hugging Face hub ({first_line(e, 160)}); "
                        "check the name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) and the network, "
                        "or pass a local checkpoint / directory")


def model_kind(spec):
    """What a --model / --init-from names, before anything is loaded: 'file' (a checkpoint, by its first bytes), 'hf'
    (a Hugging Face directory), 'dir' (a log directory) or 'hub' (a hub name); UserError where it can be none."""
    if os.path.isfile(spec):
        file_head(spec)
        return "file"
    if os.path.isfile(os.path.join(spec, "config.json")):
        return "hf"
    if os.path.isdir(spec):
        return "dir"
    if re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", spec) and not spec.endswith(".pt"):
        return "hub"
    raise UserError(f"model {spec!r} not found: pass a checkpoint file, a log directory, "
                    "a Hugging Face directory, or a name such as gpt2")


def load_model(spec, device="cpu"):
    """(GPT in eval mode on device, where it came from) from a checkpoint file, a log directory (its newest
    checkpoint that loads), a Hugging Face directory, or a hub name such as gpt2."""
    from model import GPT
    kind = model_kind(spec)
    if kind == "file":
        model, what = model_from_checkpoint(load_file(spec), spec), f"checkpoint {spec}"
    elif kind == "hf":
        try:
            model, what = GPT.from_pretrained(spec), f"Hugging Face directory {spec}"
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{spec} could not be loaded as a GPT-2 model: {str(e)[:200]}")
    elif kind == "dir":
        path, ckpt, skipped = newest_that_loads(spec)
        if path is None:
            raise UserError(f"{spec} has no ckpt_*.pt checkpoint and no config.json; "
                            "train one with python train_gpt2.py --log-dir " + shlex.quote(spec))
        model, what = model_from_checkpoint(ckpt, path), f"checkpoint {path}"
        if skipped:  # as the trainer's --resume does: the newest one may be cut short by a full disk
            what += f" (skipped {len(skipped)} newer that do not load: {skipped[0]})"
    else:
        model, what = model_from_hub(spec), f"Hugging Face model {spec}"
    return model.to(device).eval(), what
