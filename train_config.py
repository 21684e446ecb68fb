"""
The trainer's settings: every flag with its unit and default, the range each numeric flag must lie in,
the checks between flags, and which settings a resumed run may change. A room that owns its settings declares
them itself (the Flags of model, dataloader, optim, checkpoint, export, trackers, device, parallel and profiling,
each evaluation class: their flags, ranges, paths, the settings fixed on resume or a launch's own, defaults and
checks; rooms()), composed here with the trainer's own (the log directory, the batch, the steps, clipping, the plot,
the seed). They are resolved once and then only read: parse_args(argv), then resolve(args, resume), which puts a
resumed run's own settings (its checkpoint, which checkpoint.resume_point found) under the flags the command line
names. stored() is what checkpoints and the run header keep.
"""

import argparse
import math
import os

import checkpoint
import common
import dataloader
import device
import evaluation
import export
import model
import optim
import parallel
import profiling
import trackers
from common import UserError
from model import SIZES, block_options, shape_setting


def build_parser(description=None):
    p = common.ArgumentParser(prog="train_gpt2.py", description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    model.Flags.add_flags(a)  # the model's: its shape and --init-from
    # data and logs
    dataloader.Flags.add_flags(a)
    a("--log-dir", default="log", help="logs, metrics.jsonl, checkpoints and the exported model (default: log)")
    # batch
    a("--total-batch-size", type=int, default=524288, help="tokens per optimizer step over all GPUs (default: 2**19)")
    a("--micro-batch-size", default="auto", help="sequences per forward pass per GPU, or auto (default): on CUDA the "
                                                 "largest that fits and divides the batch; on a CPU (or MPS), with no "
                                                 "memory to fit, the largest that divides it up to 8")
    # optimizer and schedule (the optimizers' own: optim.py)
    a("--max-steps", type=int, default=19073, help="optimizer steps (default: 19073 = 10B tokens / 2**19)")
    optim.Flags.add_flags(a)
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this; 0 = off (default: 1.0)")
    a("--on-nonfinite", choices=["stop", "skip"], default="stop",
      help="a NaN/inf loss or gradient norm: stop the run (default) or skip that step")
    # evaluation, sampling (each evaluation's own: evaluation.py), checkpoints
    for ev in evaluation.REGISTRY:
        ev.add_flags(a)
    checkpoint.Flags.add_flags(a)
    export.Flags.add_flags(a)
    trackers.Flags.add_flags(a)
    a("--plot", action=argparse.BooleanOptionalAction, default=True,
      help="redraw LOG_DIR/plot.png at each evaluation when matplotlib is installed (default: on)")
    # hardware: the device's and the process group's (device.py's and parallel.py's own), reproducibility, profiling
    device.Flags.add_flags(a)
    parallel.Flags.add_flags(a)
    a("--deterministic", action="store_true", help="deterministic kernels, for reproducibility studies (slower)")
    a("--seed", type=int, default=1337, help="seed for initialisation and sampling (default: 1337)")
    profiling.Flags.add_flags(a)
    return p


# Every numeric flag's range, checked right after parsing: {what the range asks for: its test}, and the flags in each
# (an evaluation's own in its `ranges`).
BOUNDS = {"at least 1": lambda v: v >= 1, "0 or more": lambda v: v >= 0, "a positive number": lambda v: v > 0,
          "at least 0 and below 1": lambda v: 0 <= v < 1, "between 0 and 1": lambda v: 0 <= v <= 1,
          # the seed goes to numpy too (np.random.seed), which takes nothing outside 0..2**32-1
          "between 0 and 2**32-1 = 4294967295": lambda v: 0 <= v < 2 ** 32}
RANGES = {  # the trainer's own (each room's in its Flags' `ranges`)
    **dict.fromkeys(("total_batch_size", "max_steps"), "at least 1"),
    "grad_clip": "0 or more", "seed": "between 0 and 2**32-1 = 4294967295"}

# --resume takes every setting of the run from its checkpoint. A flag given on the command line that differs from the
# stored run is applied, and printed, unless it would change the math in the middle of the run: those are refused. The
# micro-batch does not change the math (the total batch does, and the data position is counted in sequences): a run
# whose micro-batch was fitted fits it again on the GPU it resumes on, and another value may be given. Where the run
# is written, which checkpoint continues it and what is profiled are this launch's own.
# The trainer's own fixed settings; each room's are in its Flags' `fixed_on_resume` (the model's: its shape, a block's
# own settings included; the data's shuffle; the optimizer).
FIXED_ON_RESUME = ("total_batch_size", "seed")
LAUNCH_ONLY = ("log_dir",)  # the trainer's own; a room's in its Flags' `launch_only` (--resume, what is profiled)
# stored absolute, as resolved where the launch ran: a resume from another working directory reads the
# same files, and a --resume given again is known for the same path (resolve); an evaluation's own in its `paths`
PATH_FLAGS = ("init_from", "resume")


def parse_args(argv=None, description=None):
    """The command line, checked, with the defaults that scale with the run; .given: the flags it named."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    for name in [name for name in vars(args) if name.startswith("_")]:  # an action's own note (parallel.Sharding)
        delattr(args, name)
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # a second parse that keeps only what was given
    args.given = frozenset(name for name in vars(parser.parse_args(argv)) if not name.startswith("_"))
    if args.micro_batch_size != "auto":
        try:
            args.micro_batch_size = int(args.micro_batch_size)
        except ValueError:
            raise UserError(f"--micro-batch-size {args.micro_batch_size!r}: give a whole number or 'auto'")
        if args.micro_batch_size < 1:
            raise UserError("--micro-batch-size must be at least 1")
    ranges = {**RANGES, **{k: v for room_ranges in hooks("ranges") for k, v in room_ranges.items()}}
    order = [action.dest for action in parser._actions]  # by range, then in the command line's order
    for name, what in sorted(ranges.items(), key=lambda kv: (list(BOUNDS).index(kv[1]), order.index(kv[0]))):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and BOUNDS[what](value)):
            raise UserError(f"--{name.replace('_', '-')} must be {what} (got {value})")
    common.check_output_dir(args.log_dir, "--log-dir")
    for name in PATH_FLAGS + tuple(p for room_paths in hooks("paths") for p in room_paths):
        value = getattr(args, name)
        if value is not None and value != "latest" and (name != "init_from" or os.path.exists(value)):
            setattr(args, name, os.path.abspath(value))  # (an --init-from that is no file is a hub name)
    # defaults that scale with the run, resolved here so that the rest reads one value
    for flag_defaults in hooks("flag_defaults"):
        flag_defaults(args)
    return args


def rooms():
    """The rooms whose flags are their own, with what each may say of them (ranges, paths, fixed_on_resume,
    launch_only, flag_defaults(args), check_flags(cfg, said), settle_flags(values, given)), in the order their checks
    run (of two bad flags, the first one's is said): the model's and the profiler's (once the trainer's own, so first),
    the data's, the optimizers', each evaluation's (registered ones included), the checkpoints', the export's, the
    trackers', the device's and the process group's."""
    return [model.Flags, profiling.Flags, dataloader.Flags, optim.Flags, *evaluation.REGISTRY, checkpoint.Flags,
            export.Flags, trackers.Flags, device.Flags, parallel.Flags]


def hooks(name):
    """Each room's hook of that name, in the rooms' order, where it has one."""
    return [getattr(room, name) for room in rooms() if hasattr(room, name)]


def check_relations(cfg, resumed=False):
    """The checks between flags, once the settings are resolved (a resume's: with the run's own)."""
    def said(key):  # a setting as a refusal names it: as typed, or where its value came from
        text = f"--{key.replace('_', '-')} {getattr(cfg, key)}"
        return text if key in cfg.given else f"{text} ({'the run' if resumed else 'the default'}'s)"
    if cfg.total_batch_size % cfg.block_size:
        raise UserError(f"{said('total_batch_size')} is not a multiple of {said('block_size')}")
    if cfg.init_from and not resumed:  # what it names exists, before a flag beside it is refused on its account
        checkpoint.model_kind(cfg.init_from)
    for check_flags in hooks("check_flags"):  # then each room's own, in their order
        check_flags(cfg, said)


# Resolving: the flags, then the stored run


class Settings(argparse.Namespace):
    """A launch's settings, read-only once resolved: every flag by its name, and .given."""

    def __init__(self, values):
        self.__dict__.update(values)

    def __setattr__(self, name, value):
        raise AttributeError(f"the settings are read-only once resolved: {name} is set where they are resolved")


def resolve(args, resume=None):
    """The launch's Settings, and what the command line changed of a resumed run (checkpoint.Resume, or None for a
    new run): its own settings under the flags the command line names, then every check between them."""
    values = dict(vars(args))
    changes = stored_run(values, args.given, resume) if resume is not None else []
    for settle_flags in hooks("settle_flags"):
        settle_flags(values, args.given)
    cfg = Settings(values)
    check_relations(cfg, resumed=resume is not None)
    if resume is not None and cfg.max_steps < resume.step:
        raise UserError(f"--max-steps {cfg.max_steps} is fewer than the {resume.step} steps {resume.path} has "
                        "done: give more, or leave it out to keep the run's")
    if resume is not None and cfg.profile_steps and cfg.profile_steps[0] < resume.step:
        raise UserError(f"--profile-steps {cfg.profile_steps[0]}:{cfg.profile_steps[1]} starts before step "
                        f"{resume.step}, where this launch resumes {resume.path}: profile steps from {resume.step} on")
    return cfg, changes


def stored_run(values, given, resume):
    """The run's settings (resume.settings) into values; a flag the command line named that differs is refused where
    it is fixed on resume, else applied and returned as a line. Settings an older run did not store keep their
    defaults."""
    stored, changes, options = resume.settings, [], block_options()
    launch_only = LAUNCH_ONLY + tuple(name for room_own in hooks("launch_only") for name in room_own)
    # a block's own settings are the run's shape too, fixed as the sizes are
    fixed = FIXED_ON_RESUME + tuple(options) + tuple(name for own in hooks("fixed_on_resume") for name in own)
    for key, now in sorted(values.items()):
        if key in launch_only or (key not in stored and key not in options):  # a block's own: its shape says
            continue
        was = stored.get(key)
        if key in SIZES or key in options:  # None where the preset or the block's default
            was = shape_setting(resume.shape, key)  # set it, or the run predates the setting: its shape says
        if key == "micro_batch_size" and key not in given and stored.get("micro_batch_auto"):
            continue  # fitted: fit again, on the device this launch has ("auto", as parsed)
        if key not in given or now == was:
            values[key] = stored.get(key)
            continue
        flag = "--" + key.replace("_", "-")
        if key in fixed:
            trained = f"without {flag}" if was is None else f"with {flag} {was}"
            raise UserError(f"cannot resume {resume.path}: the run was trained {trained} and this command asks for "
                            f"{flag} {now}; drop {flag} to continue the run as it was, or use a new --log-dir for "
                            "a new run")
        changes.append(f"{flag} {was} -> {now} (from the command line)")
    return changes


def command_line(settings):
    """The flags of {setting: value}, by name: True a bare flag, False its --no- form, None none (the default)."""
    out = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out


def stored(cfg, micro_batch):
    """The settings as checkpoints keep them, with the micro-batch trained with and whether it was fitted."""
    out = {k: v for k, v in vars(cfg).items() if k != "given"}
    out.update(micro_batch_size=micro_batch, micro_batch_auto=cfg.micro_batch_size == "auto")
    return out
