"""
The trainer's settings: every flag of train_gpt2.py with its unit and default, the range each
numeric flag must lie in, the checks between flags, and which settings a resumed run may change.
parse_args() returns them resolved (the defaults that scale with the run filled in), as the
namespace the trainer reads and every checkpoint stores (settings()).
"""

import argparse
import math
import os

import common
import hellaswag
from common import UserError
from model import PRESETS

DEFAULT_WARMUP = 715  # build-nanogpt's 375M tokens of warm-up, as in the GPT-3 paper, at 2**19 tokens/step
DEFAULT_VAL_TOKENS = 10485760
DEFAULT_MUON_LR = 0.02  # Keller Jordan's Muon and nanochat's matrix learning rate (BENCHMARKS.md: the sweep)


def build_parser(description=None):
    """Every flag of the trainer, with its unit and default; description: what --help says first."""
    p = common.ArgumentParser(prog="train_gpt2.py", description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    # model
    a("--model", default="gpt2", choices=sorted(PRESETS), help="architecture preset (default: gpt2, 124M)")
    a("--n-layer", type=int, help="override the preset's number of layers")
    a("--n-head", type=int, help="override the preset's number of attention heads")
    a("--n-embd", type=int, help="override the preset's embedding width")
    a("--block-size", type=int, default=1024, help="context length T in tokens (default: 1024)")
    a("--init-from", help="start from pretrained weights: a Hugging Face name (gpt2, ...) or directory, "
                          "a checkpoint file or a log directory; the architecture comes from it")
    # data and logs
    a("--data-dir", default="edu_fineweb10B", help="token shards from fineweb.py (default: edu_fineweb10B)")
    a("--shuffle-seed", type=int, help="shuffle shard and window order per epoch with this seed "
                                       "(default: off, shards in order)")
    a("--log-dir", default="log", help="logs, metrics.jsonl, checkpoints and the exported model (default: log)")
    # batch
    a("--total-batch-size", type=int, default=524288,
      help="tokens per optimizer step, over all GPUs and accumulation steps (default: 524288 = 2**19)")
    a("--micro-batch-size", default="auto",
      help="sequences per forward pass per GPU, or 'auto' (default): on CUDA the largest that fits in "
           "memory and divides the batch; 8 or fewer elsewhere")
    # optimizer and schedule
    a("--max-steps", type=int, default=19073, help="optimizer steps (default: 19073 = 10B tokens / 2**19)")
    a("--max-lr", type=float, default=6e-4, help="peak learning rate (default: 6e-4)")
    a("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of --max-lr (default: 0.1)")
    a("--lr-schedule", choices=["cosine", "wsd"], default="cosine",
      help="after warm-up: cosine decay to the final LR (default, GPT-2/3's), or wsd: hold the peak, then "
           "decay linearly over the last 20%% of --max-steps")
    a("--warmup-steps", type=int, help=f"linear LR warm-up steps (default: {DEFAULT_WARMUP}, or 10%% of "
                                       "--max-steps when that is fewer, so a short run leaves warm-up)")
    a("--optimizer", choices=["adamw", "muon"], default="adamw",
      help="adamw (default, GPT-2's recipe); muon: Muon (momentum orthogonalised by Newton-Schulz) for the "
           "attention and MLP matrices, AdamW as above for the embeddings, gains and biases: the optimizer "
           "of today's GPT-2 speed records, reported to reach the same loss in ~1.3x fewer tokens")
    a("--muon-lr", type=float, default=DEFAULT_MUON_LR,
      help=f"Muon's peak learning rate, on the same warm-up and decay as --max-lr (default: {DEFAULT_MUON_LR})")
    a("--muon-momentum", type=float, default=0.95, help="Muon's Nesterov momentum (default: 0.95)")
    a("--weight-decay", type=float, default=0.1, help="AdamW weight decay on 2-D weights (default: 0.1)")
    a("--beta1", type=float, default=0.9, help="AdamW beta1 (default: 0.9)")
    a("--beta2", type=float, default=0.95, help="AdamW beta2 (default: 0.95)")
    a("--eps", type=float, default=1e-8, help="AdamW epsilon (default: 1e-8)")
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this; 0 = off (default: 1.0)")
    a("--on-nonfinite", choices=["stop", "skip"], default="stop",
      help="a NaN/inf loss or gradient norm: stop the run (default) or skip that step")
    # evaluation, sampling, checkpoints
    a("--eval-every", type=int, default=250, help="validation loss every N steps; 0 = off (default: 250)")
    a("--val-tokens", type=int, help=f"tokens per validation, never more than the whole val split (default: "
                                     f"{DEFAULT_VAL_TOKENS} = 20 x 2**19, or a quarter of the tokens trained "
                                     "between two validations when that is fewer)")
    a("--hellaswag-every", type=int, default=250, help="HellaSwag every N steps; 0 = off (default: 250)")
    a("--hellaswag-file", help="local hellaswag_val.jsonl (default: download once to the cache)")
    a("--hellaswag-limit", type=int, help="score only the first N HellaSwag items (default: all 10,042)")
    a("--core-every", type=int, default=0,
      help="CORE (core.py: 22 in-context tasks, nanochat's yardstick) every N steps; 0 = off (default: 0)")
    a("--core-bundle", help="the unzipped DCLM eval_bundle for CORE (default: download it once to the cache)")
    a("--core-limit", type=int, default=500,
      help="items per CORE task (default: 500, as nanochat scores it during training)")
    a("--sample-every", type=int, default=250, help="print samples every N steps; 0 = off (default: 250)")
    a("--sample-prompt", default="Hello, I'm a language model,", help="prompt for the samples")
    a("--num-samples", type=int, default=4, help="samples each time (default: 4)")
    a("--sample-tokens", type=int, default=32, help="new tokens per sample (default: 32)")
    a("--checkpoint-every", type=int, default=5000, help="checkpoint every N steps, and always at the end (default: 5000)")
    a("--keep-checkpoints", type=int, default=2, help="keep the last K checkpoints (default: 2)")
    a("--resume", nargs="?", const="latest",
      help="continue from a checkpoint: a path, or no value for the latest in --log-dir (starts fresh if none)")
    a("--export-hf", action=argparse.BooleanOptionalAction, default=True,
      help="export the final model in Hugging Face format to LOG_DIR/hf (default: on)")
    a("--wandb", metavar="PROJECT", help="also send every record to this Weights & Biases project, from rank 0 "
                                         "(pip install wandb; WANDB_MODE=offline logs to LOG_DIR/wandb, no account)")
    a("--wandb-run", metavar="NAME", help="the W&B run's name (default: the log directory's name)")
    a("--wandb-id", metavar="ID", help="the W&B run to continue (default: a new one; --resume continues the run's "
                                       "own, stored in its checkpoints)")
    a("--no-wandb", dest="wandb", action="store_const", const=None,
      help="send nothing to W&B: with --resume, turns off the project the run was started with")
    a("--tensorboard", action=argparse.BooleanOptionalAction, default=False,
      help="also write every record as TensorBoard events to LOG_DIR/tb (pip install tensorboard); "
           "--no-tensorboard turns it off in a resumed run that had it")
    a("--plot", action=argparse.BooleanOptionalAction, default=True,
      help="redraw LOG_DIR/plot.png at each evaluation when matplotlib is installed (default: on)")
    # hardware
    a("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps")
    a("--dtype", default="auto", help="auto (bf16 on Ampere+, fp16 on T4/V100, fp32 on CPU), "
                                      "bfloat16, float16 or float32")
    a("--compile", action=argparse.BooleanOptionalAction, default=None,
      help="torch.compile the model (default: on for CUDA, off elsewhere)")
    a("--sharding", choices=["none", "fsdp"], default="none",
      help="none (default): DDP, every GPU holds the whole model and optimizer; fsdp: FSDP2 shards "
           "parameters, gradients and AdamW state over the GPUs (GPT-2 XL on 16-24 GB cards)")
    a("--fsdp", dest="sharding", action="store_const", const="fsdp", help="the same as --sharding fsdp")
    a("--activation-checkpointing", action="store_true",
      help="recompute each block's activations in backward: ~30%% more compute, far less memory")
    a("--dist-timeout", type=float, default=15.0,
      help="minutes a collective may wait for the other ranks before the group fails, so that a dead or "
           "hung rank ends the run (and torchrun --max-restarts starts it again) instead of hanging it "
           "(default: 15; raise it if a checkpoint takes longer to write)")
    a("--deterministic", action="store_true",
      help="deterministic kernels for reproducibility studies (slower; data order never depends on it)")
    a("--seed", type=int, default=1337, help="seed for initialisation and sampling (default: 1337)")
    a("--timing-breakdown", type=int, default=0, metavar="N",
      help="every N steps print where the time went (batch preparation, host-to-device copy, forward, "
           "backward, optimizer, evaluation); "
           "adds synchronisation, so off (0) by default")
    return p


# Every numeric flag's range, checked right after parsing: (flags, test, what the test asks for).
RANGES = [
    (("n_layer", "n_head", "n_embd", "block_size", "total_batch_size", "max_steps", "keep_checkpoints",
      "val_tokens", "hellaswag_limit", "core_limit", "num_samples", "sample_tokens"), lambda v: v >= 1, "at least 1"),
    (("warmup_steps", "eval_every", "hellaswag_every", "core_every", "sample_every", "checkpoint_every", "timing_breakdown",
      "shuffle_seed", "weight_decay", "grad_clip"), lambda v: v >= 0, "0 or more"),
    (("max_lr", "eps", "dist_timeout", "muon_lr"), lambda v: v > 0, "a positive number"),
    (("beta1", "beta2", "muon_momentum"), lambda v: 0 <= v < 1, "at least 0 and below 1"),
    (("min_lr_ratio",), lambda v: 0 <= v <= 1, "between 0 and 1"),
    # the seed goes to numpy too (np.random.seed), which takes nothing outside 0..2**32-1
    (("seed",), lambda v: 0 <= v < 2 ** 32, "between 0 and 2**32-1 = 4294967295"),
]

# --resume takes every setting of the run from its checkpoint. A flag given on the command line
# that differs from the stored run is applied, and printed, unless it would change the math in the
# middle of the run: those are refused. The micro-batch does not change the math (the total batch
# does, and the data position is counted in sequences): a run whose micro-batch was fitted fits it
# again on the GPU it resumes on, and another value may be given. Where the run is written and
# which checkpoint continues it are this launch's own.
FIXED_ON_RESUME = ("model", "n_layer", "n_head", "n_embd", "block_size", "init_from", "total_batch_size",
                   "shuffle_seed", "seed", "optimizer")
LAUNCH_ONLY = ("log_dir", "resume")


def parse_args(argv=None, description=None):
    """The command line, checked (one-line errors), with the defaults that scale with the run
    resolved; .given holds the flags the command line named (their dest names)."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # a second parse that keeps only what was given
    args.given = frozenset(vars(parser.parse_args(argv)))
    if args.micro_batch_size != "auto":
        try:
            args.micro_batch_size = int(args.micro_batch_size)
        except ValueError:
            raise UserError(f"--micro-batch-size {args.micro_batch_size!r}: give a whole number or 'auto'")
        if args.micro_batch_size < 1:
            raise UserError("--micro-batch-size must be at least 1")
    for names, test, what in RANGES:
        for name in names:
            value = getattr(args, name)
            if value is not None and not (math.isfinite(value) and test(value)):
                raise UserError(f"--{name.replace('_', '-')} must be {what} (got {value})")
    common.check_output_dir(args.log_dir, "--log-dir")
    if args.hellaswag_file is not None:
        if not os.path.isfile(args.hellaswag_file):
            raise UserError(f"--hellaswag-file {args.hellaswag_file} does not exist; give the path of a "
                            f"hellaswag_val.jsonl, or leave it out to download the file once")
        # read now, as far as the run will read it: a file named on the command line that cannot be
        # scored is bad input, not a HellaSwag "skipped" found at the end of the run
        try:
            hellaswag.load_items(args.hellaswag_file, limit=args.hellaswag_limit, flag="--hellaswag-file")
        except UserError as e:
            raise UserError(f"--hellaswag-file: {e}")
    if args.core_bundle is not None:  # the same for a bundle: its tasks and the items the run will score
        import core
        try:
            core.load_tasks(args.core_bundle, None, args.core_limit, "--core-bundle")
        except UserError as e:
            raise UserError(f"--core-bundle: {e}")
    # defaults that scale with the run, resolved here so that the rest reads one value
    if args.warmup_steps is None:
        args.warmup_steps = min(DEFAULT_WARMUP, args.max_steps // 10)
    if args.val_tokens is None:
        between = args.eval_every * args.total_batch_size // 4  # validation costs at most ~10% of training
        args.val_tokens = min(DEFAULT_VAL_TOKENS, between) if args.eval_every else DEFAULT_VAL_TOKENS
    check_relations(args, parsing=True)
    return args


def check_relations(cfg, parsing=False):
    """The checks between flags (after parsing, and again once a resume has restored the run's settings)."""
    if cfg.total_batch_size % cfg.block_size:
        raise UserError(f"--total-batch-size {cfg.total_batch_size} is not a multiple of "
                        f"--block-size {cfg.block_size}")
    # a resume's optimizer and init-from are the run's, known once its checkpoint is read: train()
    # checks again then
    given = getattr(cfg, "given", frozenset()) if not (parsing and cfg.resume) else frozenset()
    for flag in ("muon_lr", "muon_momentum"):
        if flag in given and cfg.optimizer != "muon":
            raise UserError(f"--{flag.replace('_', '-')} is a setting of --optimizer muon, and this run uses "
                            f"{cfg.optimizer}: add --optimizer muon, or drop it")
    for flag in ("model", "n_layer", "n_head", "n_embd"):
        if flag in given and cfg.init_from:
            raise UserError(f"--{flag.replace('_', '-')} has no effect with --init-from: the architecture comes "
                            f"from {cfg.init_from}; drop it")
    if cfg.warmup_steps > cfg.max_steps:
        raise UserError(f"--warmup-steps {cfg.warmup_steps} is more than --max-steps {cfg.max_steps}: the run "
                        "would end before the learning rate reaches its peak; lower it, or raise --max-steps")


def settings(cfg):
    """The run's settings as stored in checkpoints and the run header: every flag, resolved."""
    return {k: v for k, v in vars(cfg).items() if k != "given"}
