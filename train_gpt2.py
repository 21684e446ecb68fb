"""
Train GPT-2 from scratch (or fine-tune it) on pre-tokenized shards written by fineweb.py.

    python train_gpt2.py                                          # one GPU, or CPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py        # one node
    torchrun --nnodes=2 --node_rank=N --rdzv-endpoint=HOST:29500 --nproc_per_node=8 train_gpt2.py

The defaults reproduce GPT-2 124M on FineWeb-Edu 10B: 524,288 tokens per step, 19,073 steps.
Pass --resume always: it continues the run in --log-dir if there is one, else starts it.
"""

import argparse
import functools
import math
import os
import random
import signal
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

import checkpoint
import common
import hellaswag
import parallel
import plot
from common import UserError
from metrics import RunLog
from model import GPT, GPTConfig, PRESETS

# ----------------------------------------------------------------------------------------------
# Configuration: every knob is a flag; defaults are the GPT-2 124M reproduction.

DEFAULT_WARMUP = 715  # build-nanogpt's 375M tokens of warm-up, as in the GPT-3 paper, at 2**19 tokens/step
DEFAULT_VAL_TOKENS = 10485760


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a("--warmup-steps", type=int, help=f"linear LR warm-up steps (default: {DEFAULT_WARMUP}, or 10%% of "
                                       "--max-steps when that is fewer, so a short run leaves warm-up)")
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


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.micro_batch_size != "auto":
        try:
            args.micro_batch_size = int(args.micro_batch_size)
        except ValueError:
            raise UserError(f"--micro-batch-size {args.micro_batch_size!r}: give a whole number or 'auto'")
        if args.micro_batch_size < 1:
            raise UserError("--micro-batch-size must be at least 1")
    positive = ["block_size", "total_batch_size", "max_steps", "keep_checkpoints", "val_tokens"]
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ["eval_every", "hellaswag_every", "sample_every", "checkpoint_every",
                 "timing_breakdown", "num_samples", "sample_tokens"]:
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} cannot be negative")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise UserError("--warmup-steps cannot be negative")
    if not (math.isfinite(args.dist_timeout) and args.dist_timeout > 0):
        raise UserError(f"--dist-timeout must be a positive number of minutes (got {args.dist_timeout})")
    if not (math.isfinite(args.max_lr) and args.max_lr > 0):
        raise UserError(f"--max-lr must be a positive number (got {args.max_lr})")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UserError("--min-lr-ratio must be between 0 and 1")
    if args.total_batch_size % args.block_size:
        raise UserError(f"--total-batch-size {args.total_batch_size} is not a multiple of "
                        f"--block-size {args.block_size}")
    common.check_output_dir(args.log_dir, "--log-dir")
    if args.hellaswag_file is not None and not os.path.isfile(args.hellaswag_file):
        raise UserError(f"--hellaswag-file {args.hellaswag_file} does not exist; give the path of a "
                        f"hellaswag_val.jsonl, or leave it out to download the file once")
    # defaults that scale with the run, resolved here so that the rest reads one value
    args.warmup_auto = args.warmup_steps is None
    if args.warmup_auto:
        args.warmup_steps = min(DEFAULT_WARMUP, args.max_steps // 10)
    if args.val_tokens is None:
        between = args.eval_every * args.total_batch_size // 4  # validation costs at most ~10% of training
        args.val_tokens = min(DEFAULT_VAL_TOKENS, between) if args.eval_every else DEFAULT_VAL_TOKENS
    return args


def get_lr(step, args):
    """Linear warm-up, then cosine decay to min_lr at max_steps (GPT-3 paper, appendix B)."""
    max_lr, min_lr = args.max_lr, args.max_lr * args.min_lr_ratio
    if step < args.warmup_steps:  # warmup_steps > 0 here
        return max_lr * (step + 1) / args.warmup_steps
    if step >= args.max_steps:
        return min_lr
    ratio = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


# ----------------------------------------------------------------------------------------------
# The optimizer step: one function, called by the training loop and by bench/ladder.py, so that a
# speed-up the ladder measures is a speed-up of training.


class PhaseTimer:
    """--timing-breakdown: wall time per phase, synchronising the GPU at each boundary."""

    PHASES = ("data", "copy", "forward", "backward", "optimizer", "eval")  # copy: host to device

    def __init__(self, device, enabled):
        self.enabled, self.device = enabled, device
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        self._t = None

    def start(self):
        if self.enabled:
            common.synchronize(self.device)
            self._t = time.perf_counter()

    def mark(self, phase):
        if self.enabled:
            common.synchronize(self.device)
            now = time.perf_counter()
            self.totals[phase] += now - self._t
            self._t = now

    def report(self):
        """Mean ms per step for each phase since the last report, then reset."""
        n = max(1, self.steps)
        out = {k: 1000 * v / n for k, v in self.totals.items()}
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        return out


def train_step(model, optimizer, scaler, loader, grad_accum, dist, dtype, grad_clip=0.0, stop=False,
               timer=None):
    """One optimizer step: forward and backward over grad_accum micro-batches (DDP all-reduces the
    gradients on the last one only), unscale, clip, and the update itself unless the loss or the
    gradient norm is not finite (with fp16 the gradient scaler decides). The step's one host-device
    sync also carries this rank's stop request to the others.
    Returns (mean loss, gradient norm, any rank asked to stop, the loss and norm were finite)."""
    timer = timer or PhaseTimer(dist.device, False)
    model.train()
    loss_accum = torch.zeros((), device=dist.device)
    for micro_step in range(grad_accum):
        host = loader.next_host_batch()
        timer.mark("data")
        x, y = loader.to_device(host)
        loader.prefetch_next()
        timer.mark("copy")
        last = micro_step == grad_accum - 1
        with parallel.grad_sync(model, last):
            with common.autocast(dist.device, dtype):
                _, loss = model(x, y)
            loss = loss / grad_accum  # the mean over the whole batch, not a sum of means
            loss_accum += loss.detach()
            timer.mark("forward")
            scaler.scale(loss).backward()
            timer.mark("backward")
    scaler.unscale_(optimizer)
    # the gradients are already all-reduced, so every rank computes the same global norm
    norm = parallel.clip_grad_norm(model, grad_clip if grad_clip > 0 else float("inf"))
    stats = torch.stack([loss_accum, norm.float(), torch.tensor(float(stop), device=dist.device)])
    if dist.ddp:
        import torch.distributed as tdist
        stats /= dist.world_size
        tdist.all_reduce(stats)  # mean loss, the same norm, and > 0 if any rank was signalled
    loss_val, norm_val, stop_any = stats.tolist()
    finite = math.isfinite(loss_val) and math.isfinite(norm_val)
    if finite or dtype == "float16":
        scaler.step(optimizer)  # with fp16 it skips the update by itself when gradients overflowed
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    timer.mark("optimizer")
    return loss_val, norm_val, stop_any > 0, finite


# ----------------------------------------------------------------------------------------------
# Evaluation: validation loss, HellaSwag and samples, each stoppable between batches


def stop_requested(stop, dist):
    """True on every rank when any rank was signalled (a collective in a multi-process run)."""
    flag = stop.signal is not None
    if dist.ddp:
        import torch.distributed as tdist
        t = torch.tensor([float(flag)], device=dist.device)
        tdist.all_reduce(t)
        flag = t.item() > 0
    return flag


@torch.no_grad()
def validation_loss(model, loader, steps, dist, dtype, should_stop):
    """Mean loss over the first `steps` batches of the val split; None if a stop request came."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=dist.device)
    for _ in range(steps):
        if should_stop():
            model.train()
            return None
        x_val, y_val = loader.next_batch()
        with common.autocast(dist.device, dtype):
            _, loss_val = model(x_val, y_val)
        total += loss_val.float()
    if dist.ddp:
        import torch.distributed as tdist
        tdist.all_reduce(total)  # SUM: gloo has no AVG
        total /= dist.world_size
    model.train()
    return total.item() / steps


def print_samples(raw_model, args, dist, step, log, stop):
    """Rank 0 (every rank under FSDP, where each forward is a collective; the log is rank 0's). A stop
    request ends generation at the next token, except under FSDP (stop=None), where ranks must agree."""
    enc = common.get_tokenizer()
    prompt = torch.tensor([enc.encode(args.sample_prompt)] * args.num_samples, device=dist.device)
    gen = torch.Generator(device=dist.device).manual_seed(args.seed + step)
    raw_model.eval()
    new = []
    for tokens in raw_model.generate_stream(prompt, args.sample_tokens, temperature=1.0, top_k=50, generator=gen):
        new.append(tokens)
        if stop is not None and stop.signal is not None:
            break
    raw_model.train()
    rows = torch.cat([prompt] + [t[:, None] for t in new], dim=1).tolist()
    for i, row in enumerate(rows):
        log.line(f"sample {i} | {enc.decode(row).replace(chr(10), ' ')}")


def evaluate(run, args, dist, log, step, stop):
    """Validation, HellaSwag and samples due at the top of this step. False if a stop request cut
    it short (then nothing of it is logged)."""
    last_step = step == args.max_steps - 1
    due = lambda every: every and (step % every == 0 or last_step)  # noqa: E731
    should_stop = lambda: stop_requested(stop, dist)  # noqa: E731
    evaluated = False
    if run.val_loader is not None and due(args.eval_every):
        val_loss = validation_loss(run.eval_model, run.val_loader, run.val_steps, dist, run.dtype, should_stop)
        if val_loss is None:
            return False
        evaluated = True
        log.line(f"step {step} | val_loss {val_loss:.4f}")
        log.record("val", step=step, val_loss=val_loss, tokens=step * args.total_batch_size)
    if due(args.hellaswag_every):
        result = run.hella(run.raw_model, run.dtype, should_stop)
        if result is None and should_stop():
            return False
        if result is not None:
            evaluated = True
            log.line(f"step {step} | hellaswag acc_norm {result['acc_norm']:.4f} "
                     f"acc {result['acc']:.4f} n {result['n']}")
            log.record("hellaswag", step=step, tokens=step * args.total_batch_size, **result)
    if (dist.is_master or run.fsdp) and step > 0 and due(args.sample_every):
        print_samples(run.raw_model, args, dist, step, log, None if run.fsdp else stop)
    if evaluated and dist.is_master:
        run.plotter.kick()
    return True


# ----------------------------------------------------------------------------------------------
# Set-up: everything the loop needs, built once


def build_model(args, ckpt):
    """The model, from a checkpoint (resume), pretrained weights (--init-from) or a preset."""
    if ckpt is not None:
        return common.model_from_checkpoint(ckpt), "resumed"
    if args.init_from:
        model, what = common.load_model(args.init_from)
        if args.block_size > model.config.block_size:
            raise UserError(f"--block-size {args.block_size} is larger than the {model.config.block_size} "
                            f"positions {args.init_from} was trained with; use --block-size "
                            f"{model.config.block_size} or less")
        if args.block_size < model.config.block_size:
            model.crop_block_size(args.block_size)
        return model.train(), what
    shape = dict(PRESETS[args.model])
    for k in ("n_layer", "n_head", "n_embd"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    try:
        config = GPTConfig(block_size=args.block_size, **shape)
    except ValueError as e:
        raise UserError(str(e))
    return GPT(config), f"{args.model} preset" if shape == PRESETS[args.model] else "custom shape"


def startup_warnings(args, dist, dtype, compile_on, micro_batch):
    warn = []
    if dist.device_type == "cpu" and torch.cuda.is_available():
        warn.append("training on the CPU although a CUDA GPU is present: drop --device cpu")
    if args.deterministic:
        warn.append("--deterministic is on: slower kernels; use it for reproducibility studies only")
    if dist.device_type == "cuda":
        if dtype == "float32" and common.bf16_supported(dist.device):
            warn.append("float32 on a GPU with bfloat16: several times slower; use --dtype auto")
        if not compile_on:
            warn.append("torch.compile is off on CUDA: expect ~1.5-2x slower steps; drop --no-compile")
        if micro_batch * args.block_size < 8192:
            warn.append(f"micro-batch of {micro_batch} x {args.block_size} tokens is small enough for the GPU "
                        "to idle; raise --micro-batch-size (or use auto)")
    return warn


def setup(args, dist, log):
    """Model, optimizer, scaler, loaders and position of this run, fresh or resumed: a namespace."""
    import dataloader  # imported here so --help stays instant
    run = SimpleNamespace(dtype=common.pick_dtype(args.dtype, dist.device))
    compile_on = dist.device_type == "cuda" if args.compile is None else args.compile
    if dist.device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for any fp32 matmul left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False

    run.resume_path, ckpt = checkpoint.load_resume(args, dist, log)  # never silently write over an earlier run
    run.last_ckpt = run.resume_path
    run.saved_step = ckpt["step"] if ckpt is not None else None
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    raw_model, origin = build_model(args, ckpt)
    run.raw_model = raw_model.to(dist.device)
    block_size = raw_model.config.block_size
    if args.sharding == "fsdp" and not dist.ddp:
        raise UserError("--sharding fsdp shards the model over several processes: launch it with "
                        "torchrun --nproc_per_node=N (N >= 2), or drop it on one GPU")
    # FSDP replaces the parameters with shards: the micro-batch probe and the optimizer come after this
    run.model = parallel.wrap_model(raw_model, args.sharding, dist.device_type, dist.local_rank, run.dtype,
                                    args.activation_checkpointing, compile_on)
    # evaluation: compiled but without DDP's gradient hooks; under FSDP the sharded model on every rank
    run.eval_model = getattr(run.model, "module", run.model)
    run.fsdp = args.sharding == "fsdp"

    # batch geometry: say each number once, derive the rest and assert it
    if ckpt is not None:
        micro_batch = ckpt["config"]["micro_batch_size"]
    elif args.micro_batch_size == "auto":
        micro_batch = parallel.choose_micro_batch(args.total_batch_size, dist, raw_model, run.dtype, block_size)
    else:
        micro_batch = args.micro_batch_size
    tokens_per_micro = micro_batch * block_size * dist.world_size
    if args.total_batch_size % tokens_per_micro:
        raise UserError(f"--total-batch-size {args.total_batch_size} is not divisible by micro-batch x block "
                        f"size x GPUs = {micro_batch} x {block_size} x {dist.world_size} = {tokens_per_micro}")
    run.grad_accum = args.total_batch_size // tokens_per_micro
    assert run.grad_accum * tokens_per_micro == args.total_batch_size
    run.config = dict(vars(args), block_size=block_size, micro_batch_size=micro_batch, compile=compile_on,
                      world_size=dist.world_size, grad_accum=run.grad_accum, dtype=run.dtype, device=dist.device)

    loader = functools.partial(dataloader.TokenLoader, args.data_dir, batch_size=micro_batch, seq_len=block_size,
                               rank=dist.rank, world_size=dist.world_size, vocab_size=raw_model.config.vocab_size,
                               device=dist.device)
    run.train_loader = loader("train", shuffle_seed=args.shuffle_seed)
    run.val_loader = loader("val") if args.eval_every else None
    val_note = ""
    if run.val_loader is not None:  # never more than the whole split: repeating it measures nothing new
        run.val_steps = min(max(1, args.val_tokens // tokens_per_micro), run.val_loader.batches_per_epoch)
        whole = run.val_steps == run.val_loader.batches_per_epoch
        val_note = f" | val: {run.val_steps * tokens_per_micro:,} tokens{' (the whole split)' if whole else ''}"

    run.optimizer = raw_model.configure_optimizers(args.weight_decay, args.max_lr, (args.beta1, args.beta2),
                                                   args.eps, dist.device_type)
    # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 and fp32 do not
    run.scaler = torch.amp.GradScaler(dist.device_type, enabled=(run.dtype == "float16"))
    run.start_step = 0
    if ckpt is not None:
        parallel.load_optimizer_state(run.model, run.optimizer, ckpt["optimizer"])
        run.scaler.load_state_dict(ckpt["scaler"])
        try:  # every rank moves in lockstep, so any rank's loader state restores this one
            run.train_loader.load_state_dict(ckpt["ranks"][0]["train_loader"])
        except UserError as e:
            raise UserError(f"cannot resume {run.resume_path}: {e}")
        checkpoint.set_rng_state(ckpt["ranks"][dist.rank]["rng"])
        run.start_step = ckpt["step"]
        del ckpt

    # the run header: what produced this run
    run.device_name = common.device_name(dist.device)
    run.peak_flops = common.peak_flops(run.device_name, run.dtype)
    commit = common.git_commit()
    restart = common.torchrun_restart()
    log.record("run", step=run.start_step, max_steps=args.max_steps, tokens_per_step=args.total_batch_size,
               resumed_from=run.resume_path, device=dist.device, device_name=run.device_name, dtype=run.dtype,
               world_size=dist.world_size, versions=common.versions(), git=commit, config=run.config,
               restart=restart)
    start = f"resuming {run.resume_path} at step {run.start_step}" if run.resume_path else "new run"
    if restart:
        start += f" | torchrun restart {restart} (after a worker failed)"
    log.line(f"run: {start} | model {origin}, {raw_model.num_params() / 1e6:.1f}M parameters")
    log.line(f"device {dist.device} ({run.device_name}) | dtype {run.dtype} | world size {dist.world_size} | "
             f"compile {'on' if compile_on else 'off'} | git {commit} | torch {torch.__version__}")
    log.line(f"batch {args.total_batch_size} tokens/step = micro-batch {micro_batch} x {block_size} tokens "
             f"x {dist.world_size} rank(s) x {run.grad_accum} accumulation step(s)"
             f"{' (auto-fit)' if args.micro_batch_size == 'auto' and run.start_step == 0 else ''}{val_note}")
    log.line(f"lr {args.max_lr:g}: {args.warmup_steps} warm-up steps"
             f"{' (10% of --max-steps; --warmup-steps sets it)' if args.warmup_auto and args.warmup_steps < DEFAULT_WARMUP else ''}"
             f", cosine to {args.max_lr * args.min_lr_ratio:g} at step {args.max_steps}")
    capacity = torch.cuda.get_device_properties(dist.device).total_memory if dist.device_type == "cuda" else None
    plan = parallel.memory_plan(raw_model.num_params(non_embedding=False), dist.world_size, args.sharding,
                                run.dtype, micro_batch, block_size, raw_model.config.n_layer, raw_model.config.n_embd,
                                args.activation_checkpointing)
    log.line(f"memory ({args.sharding if run.fsdp else 'DDP' if dist.ddp else 'one process'}"
             f"{', activation checkpointing' if args.activation_checkpointing else ''}): "
             + parallel.format_memory_plan(plan, capacity, "GPU" if dist.device_type == "cuda" else "process"))
    log.record("memory", step=run.start_step, **plan)
    for w in startup_warnings(args, dist, run.dtype, compile_on, micro_batch):
        log.line(f"warning: {w}")
    run.plotter = plot.PlotWriter(args.log_dir, args.plot and dist.is_master)
    run.hella = hellaswag.TrainingHook(args, dist, log)
    return run


# ----------------------------------------------------------------------------------------------
# The training run


def train(args):
    dist = common.setup_distributed(args.device, timeout_s=60 * args.dist_timeout)
    log = RunLog(args.log_dir, dist.is_master)
    try:
        return _train(args, dist, log)
    finally:
        log.close()
        common.teardown_distributed()


# For tests only: "RANK:STEP" makes that rank SIGKILL itself at the start of that step, in the first
# launch only (not after a torchrun restart), to check that --max-restarts with --resume recovers.
TEST_KILL_ENV = "TRAIN_GPT2_TEST_KILL"


def kill_step_for_tests(dist):
    spec = os.environ.get(TEST_KILL_ENV)
    if not spec or common.torchrun_restart() > 0:
        return None
    rank, step = (int(v) for v in spec.split(":"))
    return step if rank == dist.rank else None


def _train(args, dist, log):
    run = setup(args, dist, log)
    kill_at = kill_step_for_tests(dist)
    stop = common.StopFlag()
    timer = PhaseTimer(dist.device, args.timing_breakdown > 0)
    reason, step = "finished", run.start_step
    for step in range(run.start_step, args.max_steps):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        # ---- evaluation, at the top of the step (so step 0 shows the untrained model)
        timer.start()
        if not evaluate(run, args, dist, log, step, stop):
            reason = "signal"
            break
        timer.mark("eval")

        # ---- one optimizer step over grad_accum micro-batches
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        loss, norm, stopping, finite = train_step(run.model, run.optimizer, run.scaler, run.train_loader,
                                                  run.grad_accum, dist, run.dtype, args.grad_clip,
                                                  stop.signal is not None, timer)
        if not finite and run.dtype != "float16" and args.on_nonfinite == "stop":
            log.line(f"step {step} | loss {loss} | grad_norm {norm}: non-finite; stopping. "
                     f"The last good checkpoint is {run.last_ckpt or 'none (no checkpoint yet)'}: resume from "
                     "it with a lower --max-lr, or pass --on-nonfinite skip")
            log.record("end", step=step, reason="nonfinite")
            return 3
        dt = time.perf_counter() - t0
        tok_per_s = args.total_batch_size / dt
        mfu = run.raw_model.estimate_mfu(tok_per_s / dist.world_size, run.peak_flops)
        mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        log.line(f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | grad_norm {norm:.4f} | "
                 f"dt_ms {1000 * dt:.1f} | tok_per_s {tok_per_s:.0f} | mfu {mfu_text}"
                 + ("" if finite else " | skipped (non-finite)"))
        log.record("train", step=step, loss=loss, lr=lr, grad_norm=norm, dt_ms=1000 * dt, tok_per_s=tok_per_s,
                   mfu=mfu, tokens=(step + 1) * args.total_batch_size, skipped=not finite)
        timer.steps += 1
        if args.timing_breakdown and timer.steps >= args.timing_breakdown:
            ms = timer.report()
            total = sum(ms.values())
            log.line("timing | " + " | ".join(f"{k}_ms {v:.1f} ({100 * v / max(total, 1e-9):.0f}%)"
                                              for k, v in ms.items()))
            log.record("timing", step=step, **{f"{k}_ms": v for k, v in ms.items()})

        # ---- checkpoint: on schedule and at the end
        done = step + 1
        if stopping:
            reason, step = "signal", done
            break
        if done == args.max_steps or (args.checkpoint_every and done % args.checkpoint_every == 0):
            checkpoint.write_checkpoint(run, args, dist, log, done)

    if reason == "signal":  # `step` steps are done: keep them, unless the last checkpoint has them already
        if run.saved_step != step:
            checkpoint.write_checkpoint(run, args, dist, log, step)
        log.line(f"stopped by {stop.signal or 'a signal on another rank'} after {step} steps; "
                 f"continue with: python train_gpt2.py --log-dir {args.log_dir} --resume")
    elif args.export_hf:
        model = run.raw_model
        if run.fsdp:  # every rank helps gather the shards; rank 0 exports a plain copy
            state = parallel.model_state(run.model)
            model = GPT(run.raw_model.config) if dist.is_master else None
            if model is not None:
                model.load_state_dict(state)
        if dist.is_master:
            out = os.path.join(args.log_dir, "hf")
            model.export_hf(out, tokenizer_files=common.gpt2_bpe_files())
            log.line(f"exported the final model to {out} (transformers.GPT2LMHeadModel.from_pretrained loads it)")
    log.record("end", step=args.max_steps if reason == "finished" else step - 1, reason=reason)  # last step run
    if dist.is_master:
        run.plotter.kick()
        run.plotter.join()
    return 0


def main(argv=None):
    args = parse_args(argv)
    sys.exit(train(args))


if __name__ == "__main__":
    common.run_main(main)
