"""
The training-speed ladder: what each well-known speed-up buys on *this* machine, measured.

Each rung adds one change to the rung before it, in the order of the build-nanogpt story:
fp32 -> TF32 -> bf16 autocast -> torch.compile -> flash attention -> padded vocabulary ->
fused AdamW -> async data prefetch, then extras (cuDNN attention first, a 2x micro-batch, Muon
for the block matrices (its cost per step; its loss differs, being another optimizer) and, on
request, compile's max-autotune). Every rung trains a fresh model (same seed, weights and
data) with the trainer's own code: train_gpt2.train_step on dataloader.TokenLoader batches, with
train_gpt2.py's learning-rate schedule, AdamW and clipping; so a speed-up the ladder measures is
a speed-up of training. Warm-up steps (compilation happens there) are left out; whole timed
steps are measured with CUDA events (a synchronised perf_counter elsewhere), the median
reported. Each rung runs in a fresh process with a compile cache of its own, so compiled graphs
and memory don't leak between rungs, and a crash or an out-of-memory fails that rung while the
ladder goes on; a rung that compiles is skipped, with the reason, on a GPU that torch.compile
cannot run on. The whole ladder runs --repeats times, the rungs taking turns, and each speed-up
is the median of the pairs of neighbouring rungs measured in the same turn, with the range of the
pairs: a speed-up whose range reaches 1.0x is marked as this machine's noise (bench/measure.py).

    python bench/ladder.py                        # GPT-2 124M on a GPU, a tiny model on CPU
    python bench/ladder.py --list-rungs
    python bench/ladder.py --rungs fp32,bf16,compile --micro-batch-size 32 --json-out ladder.json
    python bench/ladder.py --override compile=false   # every rung, without torch.compile
    python bench/ladder.py --rungs bf16,compile --profile-steps 6:7   # and a trace of two timed steps

A table comes last; the JSON holds every step time and the environment. MFU is model FLOPs
(6N + 12LdT per token, nanoGPT's convention) over the GPU's dense bf16 peak (fp16 where it has
no bf16) for every rung, fp32 ones included: one yardstick for the table.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import measure  # noqa: E402

import common  # noqa: E402
from device import (autocast, compile_blocker, device_name, muon_dtype, peak_flops, pick_device,  # noqa: E402
                    pick_dtype)
from provenance import git_commit, versions  # noqa: E402
from parallel import Ranks  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import profiling  # noqa: E402
import train_config  # noqa: E402
import train_gpt2  # noqa: E402
from common import UserError, first_line  # noqa: E402
from dataloader import Data, TokenLoader  # noqa: E402
from model import GPT, GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, PRESETS, GPTConfig  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Defaults. The step's hyperparameters (learning-rate schedule, AdamW, clipping, seed) are those
# train_gpt2.py resolves: the ladder's steps are a default run's first (its log dir is not written).

TRAIN = train_config.parse_args(["--log-dir", tempfile.gettempdir()])
MODELS = {"tiny": dict(n_layer=2, n_head=2, n_embd=64), **PRESETS}
# GPT-2 124M on a GPU; elsewhere something that finishes in minutes on two cores
CUDA_DEFAULTS = dict(model="gpt2", block_size=1024, micro_batch_size=16, warmup_steps=5, steps=20)
OTHER_DEFAULTS = dict(model="tiny", block_size=64, micro_batch_size=4, warmup_steps=2, steps=5)
GRAD_ACCUM = 2  # two micro-steps, so the 2x micro-batch rung keeps the same tokens per step


# ----------------------------------------------------------------------------------------------
# The rungs. A rung's settings are the baseline plus every change up to it in ladder order,
# whether or not the earlier rungs are run: a rung name always means the same configuration.

# the fp32 rung, as its description says; compile_mode applies when compile is on (--compile-mode)
BASELINE = dict(tf32=False, dtype="float32", compile=False, compile_mode="default", attention="math",
                padded_vocab=False, fused_adamw=False, prefetch=False, batch_x2=False, optimizer="adamw")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class Rung:
    name: str
    change: dict
    description: str
    default: bool = True  # part of the ladder unless --rungs names otherwise
    settings: dict = field(default_factory=dict)  # filled by plan_rungs
    overridden: dict = field(default_factory=dict)  # what --override set for this rung
    skipped: str = None  # why it cannot run on this device (a rung that compiles where compile cannot)


RUNGS = [
    Rung("fp32", {}, "fp32 eager, math attention, vocab 50257, for-each AdamW, synchronous data"),
    Rung("tf32", dict(tf32=True), "+ TF32 tensor cores for fp32 matmuls (CUDA only)"),
    Rung("bf16", dict(dtype="auto"), "+ bf16 autocast (fp16 + GradScaler on GPUs without bf16)"),
    Rung("compile", dict(compile=True), "+ torch.compile"),
    Rung("flash", dict(attention="auto"), "+ SDPA free to pick flash / cuDNN / mem-efficient attention"),
    Rung("padded-vocab", dict(padded_vocab=True), f"+ vocabulary padded {GPT2_VOCAB_SIZE} -> {PADDED_VOCAB_SIZE}"),
    Rung("fused-adamw", dict(fused_adamw=True), "+ fused AdamW"),
    Rung("prefetch", dict(prefetch=True), "+ batches prefetched by a thread into pinned memory"),
    Rung("cudnn-attn", dict(attention="cudnn"), "+ SDPA priority cuDNN > flash > mem-efficient > math"),
    Rung("micro-batch-x2", dict(batch_x2=True), "+ 2x micro-batch, half the accumulation steps"),
    Rung("muon", dict(optimizer="muon"), "+ Muon for the block matrices (--optimizer muon): what Newton-Schulz "
                                         "costs per step; another optimizer, so another loss"),
    Rung("max-autotune", dict(compile_mode="max-autotune-no-cudagraphs"),
         "+ compile mode max-autotune-no-cudagraphs (minutes of autotuning)", default=False),
]
RUNG_NAMES = [r.name for r in RUNGS]
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
# the other settings are booleans
CHOICES = dict(dtype=("float32", "bfloat16", "float16", "auto"), compile_mode=COMPILE_MODES,
               attention=("math", "auto", "flash", "efficient", "cudnn"), optimizer=("adamw", "muon"))


def parse_override(text):
    """'[RUNG:]KEY=VALUE' -> (rung name or None, key, parsed value)."""
    rung, spec = None, text
    if ":" in spec.split("=", 1)[0]:
        rung, spec = spec.split(":", 1)
        if rung not in RUNG_NAMES:
            raise UserError(f"--override {text}: unknown rung {rung!r} (rungs: {', '.join(RUNG_NAMES)})")
    if "=" not in spec:
        raise UserError(f"--override {text}: write KEY=VALUE or RUNG:KEY=VALUE")
    key, value = (part.strip() for part in spec.split("=", 1))
    key = key.replace("-", "_")
    if key not in BASELINE:
        raise UserError(f"--override {text}: unknown setting {key!r} (settings: {', '.join(BASELINE)})")
    if key in CHOICES:
        if value not in CHOICES[key]:
            raise UserError(f"--override {text}: {value!r} is not one of {', '.join(CHOICES[key])}")
        return rung, key, value
    if value.lower() not in BOOLEANS:
        raise UserError(f"--override {text}: {value!r} is not a boolean (true/false)")
    return rung, key, BOOLEANS[value.lower()]


def plan_rungs(selected, compile_mode="default", overrides=(), blocker=None):
    """The rungs to run, in ladder order, each a Rung with its cumulative settings, after
    overrides: first those for every rung, then those naming the rung. blocker: why torch.compile
    cannot run on the device (device.compile_blocker), which skips the rungs that compile."""
    plan, settings = [], dict(BASELINE, compile_mode=compile_mode)
    for rung in RUNGS:
        settings = dict(settings, **rung.change)
        if rung.name not in selected:
            continue
        overridden = {}
        for scope in (None, rung.name):
            overridden.update({k: v for r, k, v in overrides if r == scope})
        final = dict(settings, **overridden)
        plan.append(Rung(rung.name, rung.change, rung.description, rung.default, final, overridden,
                         f"torch.compile: {blocker} (--override compile=false runs it without)"
                         if blocker and final["compile"] else None))
    return plan


def parse_args(argv=None):
    p = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    by_device = lambda k: f" (default: {CUDA_DEFAULTS[k]} on CUDA, {OTHER_DEFAULTS[k]} elsewhere)"  # noqa: E731
    a("--model", choices=sorted(MODELS), help="model shape" + by_device("model"))
    for flag, what in (("--n-layer", "layers"), ("--n-head", "attention heads"), ("--n-embd", "embedding width")):
        a(flag, type=int, metavar="N", default=None, help=f"{what} (default: the --model's)")
    a("--block-size", type=int, metavar="T", help="sequence length T in tokens" + by_device("block_size"))
    a("--micro-batch-size", type=int, metavar="B", help="sequences per forward" + by_device("micro_batch_size"))
    a("--grad-accum", type=int, metavar="N", default=GRAD_ACCUM, help=f"micro-batches per step (default: {GRAD_ACCUM})")
    a("--warmup-steps", type=int, metavar="N", help="untimed steps first (compilation)" + by_device("warmup_steps"))
    a("--steps", type=int, metavar="N", help="timed steps; the median is reported" + by_device("steps"))
    a("--device", metavar="DEVICE", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    a("--rungs", metavar="LIST", default="default", help="comma-separated rung names, default (not max-autotune), all")
    a("--list-rungs", action="store_true", help="print the rungs and what each adds, then exit")
    a("--compile-mode", choices=COMPILE_MODES, default="default",
      help="torch.compile mode of the compile rungs (default: default); the max-autotune rung uses its own")
    a("--override", action="append", default=[], metavar="[RUNG:]KEY=VALUE",
      help="change a setting for every rung, or for one rung with RUNG: (repeatable); keys: "
           + ", ".join(BASELINE) + ". E.g. --override compile=false, --override flash:attention=cudnn")
    a("--json-out", metavar="PATH", help="the JSON, rewritten after each rung (default: log/ladder-DEVICE-TIME.json)")
    a("--rung-timeout", type=float, metavar="SECONDS", default=1200.0,
      help="seconds a rung may take, compilation included, before it is killed and marked failed (default: 1200)")
    a("--repeats", type=int, metavar="N", default=3,
      help="run every rung N times, the rungs taking turns; speed-ups are shown with their spread (default: 3)")
    a("--seed", type=int, metavar="N", default=TRAIN.seed, help=f"seed of weights and data (default: {TRAIN.seed})")
    a("--profile-steps", type=profiling.step_window, metavar="A:B",
      help="torch.profiler over steps A to B (counted from 0, warm-up steps included) of each rung's first "
           "repeat: a Chrome trace per rung in profile/ beside --json-out, and the operations with the most "
           "time after the rung (default: off)")
    a("--in-process", action="store_true",
      help="run the rungs in this process (for debugging and tests: compile caches and memory carry over)")
    a("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one rung from a spec file
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.worker or args.list_rungs:
        return args

    args.device = pick_device(args.device)
    defaults = CUDA_DEFAULTS if args.device.startswith("cuda") else OTHER_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.model_config = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in MODELS[args.model].items()}
    args.model_config["block_size"] = args.block_size
    for k, value in dict(args.model_config, micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum,
                         warmup_steps=args.warmup_steps, steps=args.steps, repeats=args.repeats).items():
        if value < 1:
            raise UserError(f"--{k.replace('_', '-')} must be at least 1 (got {value})")
    try:
        GPTConfig(**args.model_config)
    except ValueError as e:  # e.g. a width that the heads do not divide
        raise UserError(str(e))
    if args.rung_timeout <= 0:
        raise UserError("--rung-timeout must be positive")
    if args.profile_steps and args.profile_steps[1] >= args.warmup_steps + args.steps:
        raise UserError(f"--profile-steps {args.profile_steps[0]}:{args.profile_steps[1]}: a rung runs steps 0 to "
                        f"{args.warmup_steps + args.steps - 1} ({args.warmup_steps} warm-up, {args.steps} timed)")

    if args.rungs in ("default", "all"):
        args.rung_list = [r.name for r in RUNGS if r.default or args.rungs == "all"]
    else:
        args.rung_list = [n.strip() for n in args.rungs.split(",") if n.strip()]
        unknown = [n for n in args.rung_list if n not in RUNG_NAMES]
        if unknown or not args.rung_list:
            raise UserError(f"--rungs: unknown rung(s) {', '.join(unknown) or '(none given)'}; "
                            f"choose from {', '.join(RUNG_NAMES)} (see --list-rungs)")
    args.overrides = [parse_override(o) for o in args.override]
    if args.json_out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.json_out = os.path.join("log", f"ladder-{args.device.replace(':', '')}-{stamp}.json")
    return args


# ----------------------------------------------------------------------------------------------
# One rung, in its own process: build, warm up, time.


def low_precision_dtype(device):
    """bf16 where the device has it, fp16 on older GPUs (T4, V100); CPUs and MPS do bf16."""
    return pick_dtype("auto", device) if device.startswith("cuda") else "bfloat16"


def build_model(model_config, padded_vocab, seed, device):
    """A fresh GPT with the same initial weights whatever the vocabulary: the unpadded model is
    the padded one with its 47 extra rows cut off, so padding changes shapes, never the math."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(GPTConfig(**model_config, padded_vocab_size=PADDED_VOCAB_SIZE))
        if padded_vocab:
            return model
        small = GPT(GPTConfig(**model_config, padded_vocab_size=GPT2_VOCAB_SIZE))
    sd = model.state_dict()
    for k in ("transformer.wte.weight", "lm_head.weight"):  # one tied tensor, listed twice
        sd[k] = sd[k][:GPT2_VOCAB_SIZE]
    small.load_state_dict(sd)
    return small


def attention_context(choice):
    """Which SDPA kernels attention may use: 'auto' lets PyTorch choose."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if choice == "auto":
        return contextlib.nullcontext()
    B = SDPBackend
    if choice == "cudnn":  # an order of preference, not one kernel (a TypeError on a torch without set_priority)
        return sdpa_kernel([B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH], set_priority=True)
    return sdpa_kernel([dict(math=B.MATH, flash=B.FLASH_ATTENTION, efficient=B.EFFICIENT_ATTENTION)[choice]])


ATTENTION_OPS = [  # aten op name (substring) -> what the table calls it; most specific first
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_flash_attention_for_cpu", "flash (cpu)"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "mem-efficient"),
    ("_scaled_dot_product_fused_attention_overrideable", "overrideable"),
    ("_scaled_dot_product_attention_math", "math"),
]


def attention_kernel(model, loader, device, dtype, compiled):
    """Which SDPA kernel a forward + backward really used, read from the profiler's op names."""
    from torch.profiler import ProfilerActivity, profile
    x, y = loader.next_batch()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss.backward()
    names = {e.key for e in prof.key_averages()}
    for op, label in ATTENTION_OPS:
        if any(op in n for n in names):
            return label
    return "fused by compile" if compiled else "unknown"  # inductor generated its own attention code


def run_rung(spec):
    """Run one rung from its spec dict; return its result dict (status ok or failed)."""
    s, device = spec["settings"], spec["device"]
    result = dict(name=spec["name"], description=spec["description"], settings=s, status="failed", notes=[],
                  profile=[])
    notes = result["notes"]
    B, T, accum = spec["micro_batch_size"], spec["block_size"], spec["grad_accum"]
    if s["batch_x2"]:
        B, accum = 2 * B, accum // 2 if accum % 2 == 0 else accum
        if accum == spec["grad_accum"]:
            notes.append("odd --grad-accum: tokens per step doubled")
    result.update(micro_batch_size=B, grad_accum=accum, tokens_per_step=B * T * accum)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        kind = device.split(":")[0]
        if kind == "cuda" and ":" in device:
            torch.cuda.set_device(device)  # CUDA events record on the current device
        result["env"] = env = dict(device=device, device_name=device_name(device),
                                   torch_threads=torch.get_num_threads())
        if kind == "cuda":
            props = torch.cuda.get_device_properties(device)
            env.update(cudnn=torch.backends.cudnn.version(), capability=f"{props.major}.{props.minor}",
                       gpu_memory_bytes=props.total_memory)
        changed = set(spec["changed"])  # notes only where this rung's own change does not apply
        if kind != "cuda" and s["tf32"] and "tf32" in changed:
            notes.append(f"TF32 n/a on {kind}")
        if kind != "cuda" and s["attention"] == "cudnn" and "attention" in changed:
            notes.append(f"cuDNN attention n/a on {kind}")
        # TF32, the same switches as train_gpt2.py (cuDNN's for any convolution; there are none)
        torch.backends.cuda.matmul.allow_tf32 = s["tf32"]
        torch.backends.cudnn.allow_tf32 = s["tf32"]
        result["dtype"] = dtype = low_precision_dtype(device) if s["dtype"] == "auto" else s["dtype"]
        if dtype == "float16" and "dtype" in changed:
            notes.append("fp16 + GradScaler (no bf16 here)")

        t0 = time.perf_counter()
        raw_model = build_model(spec["model_config"], s["padded_vocab"], spec["seed"], device)
        # as train_gpt2.setup builds them; a compile mode the trainer has no flag for is applied here
        default_mode = s["compile_mode"] == "default"
        model = parallel.wrap_model(raw_model, "none", device, dtype, compile=s["compile"] and default_mode)
        if s["compile"] and not default_mode:
            model = torch.compile(model, mode=s["compile_mode"])
        settings = replace(optim.settings_of(TRAIN),
                           muon_lr=TRAIN.muon_lr if s["optimizer"] == "muon" else None)
        optimizer = optim.configure(raw_model, settings, kind, fused=s["fused_adamw"], muon_dtype=muon_dtype(device))
        scaler = torch.amp.GradScaler(kind, enabled=(dtype == "float16"))
        loader = TokenLoader(Data(spec["data_dir"], device=device, prefetch=s["prefetch"]), "train", B, T)
        result["build_s"] = time.perf_counter() - t0

        ranks = Ranks(device=device)
        # what the rung's optimizer did, beyond its losses: how far one block matrix moved
        moved = raw_model.transformer.h[0].attn.c_attn.weight
        start_weights = moved.detach().float().clone()

        schedule = optim.schedule_of(TRAIN)

        parts = train_gpt2.StepParts(model, optimizer, scaler, ranks, dtype, accum, TRAIN.grad_clip)

        def step(i):  # as train_gpt2.py's loop calls it
            optimizer.set_lrs(schedule, i, TRAIN.max_lr, TRAIN.muon_lr)
            return train_gpt2.train_step(parts, loader)

        warmup, steps, window = spec["warmup_steps"], spec["steps"], spec["profile_steps"]
        profiler = profiling.StepProfiler(window, device, spec["profile_dir"], spec["name"], result["profile"].append)
        if window and window[1] >= warmup:
            notes.append(f"steps {window[0]}-{window[1]} profiled: the profiler's cost is in their times")
        with attention_context(s["attention"]):
            t0 = time.perf_counter()
            for i in range(warmup):
                with profiler.step(i):
                    step(i)  # compilation, allocator growth, optimizer state: all here
            result["warmup_s"] = time.perf_counter() - t0
            if kind == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            timer, losses, skipped = measure.StepTimer(device), [], 0
            for i in range(warmup, warmup + steps):
                with profiler.step(i):  # around the timer: the trace is written after the step's time
                    timer.start()
                    loss, _, _, finite = step(i)
                    timer.stop()
                losses.append(loss)
                skipped += not finite
            step_ms = timer.times_ms()
            result["peak_mem_bytes"], result["peak_mem_kind"] = measure.peak_memory(device)
            result["attention_kernel"] = attention_kernel(model, loader, device, dtype, s["compile"])
        median = statistics.median(step_ms)
        tps = result["tokens_per_step"] / (median / 1e3)
        peak_dtype = low_precision_dtype(device)
        peak = peak_flops(device_name(device), peak_dtype)
        optimizers = getattr(optimizer, "optimizers", [optimizer])
        result.update(optimizers=[type(o).__name__ for o in optimizers],
                      optimizer_state=sum(len(o.state) for o in optimizers),
                      weight_change=float((moved.detach().float() - start_weights).norm()))
        result.update(status="ok", step_ms=step_ms, wall_ms=timer.wall, median_ms=median,
                      min_ms=min(step_ms), max_ms=max(step_ms), tokens_per_s=tps, losses=losses,
                      final_loss=losses[-1], mfu_peak_dtype=peak_dtype,
                      mfu=raw_model.estimate_mfu(tps, peak, seq_len=T))
        if skipped:
            notes.append(f"non-finite loss: {skipped} update(s) skipped")
    except Exception as e:  # an out-of-memory or a missing kernel fails this rung, not the ladder
        traceback.print_exc()
        oom = isinstance(e, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
        result["reason"] = ("out of memory: " if oom else "") + f"{type(e).__name__}: {first_line(e)}"
    finally:  # as they were, for the caller (--in-process)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return result


# ----------------------------------------------------------------------------------------------
# The ladder: one process per rung, a JSON after every rung, the table last.

SHARD_NAME = "ladder_train_000001.npy"


def write_shards(data_dir, n_tokens, seed):
    """Random GPT-2 token ids in fineweb's shard format (np.uint16 .npy); the same for every rung."""
    tokens = np.random.default_rng(seed).integers(0, GPT2_VOCAB_SIZE, size=n_tokens, dtype=np.uint16)
    np.save(os.path.join(data_dir, SHARD_NAME), tokens)


def run_rung_subprocess(spec, work_dir, timeout):
    """Run one rung in a fresh Python; a crash, hang or kill becomes a failed result."""
    spec_path, log_path = (os.path.join(work_dir, spec["name"] + ext) for ext in (".spec.json", ".log"))
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = worker_command(spec_path)
    rc = reason = None
    with open(log_path, "w") as log:
        # its own process group, so a kill takes its compile workers too; and on Linux it dies with
        # the ladder, so a killed ladder leaves nothing running on the GPU
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env(work_dir), cwd=ROOT,
                                start_new_session=True, preexec_fn=die_with_parent)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            reason = f"timed out after {timeout:.0f} s (--rung-timeout)"
        finally:  # the timeout, or Ctrl-C: end the rung's process group, then go on / stop
            if rc is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    with open(log_path) as f:
        tail = f.read().strip().splitlines()[-20:]
    if os.path.exists(spec["result_path"]):
        with open(spec["result_path"]) as f:
            result = json.load(f)
        if rc != 0:
            result["notes"].append(f"worker exit status {rc}")
    else:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        reason = reason or f"worker died (exit status {rc}): {last[:300]}"
        result = dict(name=spec["name"], description=spec["description"], settings=spec["settings"],
                      status="failed", notes=[], reason=reason)
    if result["status"] != "ok":
        result["log_tail"] = tail
    return result


def worker_env(work_dir):
    """The environment of a rung's process: a compile cache of its own. Inductor's on-disk cache is shared by the
    processes of a machine and its key leaves out the SDPA kernel choice: on an H100 the flash rung loaded the
    compile rung's math-attention graph (4.8 s of warm-up instead of 43) and measured the same step time."""
    return dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-",
                                                                                         dir=work_dir))


def worker_command(spec_path):
    return [sys.executable, os.path.abspath(__file__), "--worker", spec_path]


def die_with_parent():
    """In the child, before exec: ask Linux to SIGKILL it when the ladder's process ends."""
    if sys.platform.startswith("linux"):
        import ctypes
        with contextlib.suppress(AttributeError, OSError):  # no prctl in this libc: the rung timeout still applies
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def combine(runs):
    """One rung's result from its repeats: failed if any failed (with the first reason), else the
    median repeat's figures, tokens_per_s the median over repeats, and every repeat under "repeats"."""
    failed = next((r for r in runs if r["status"] != "ok"), None)
    if failed is not None:
        return dict(failed, repeats=runs)
    tps = [r["tokens_per_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    return dict(mid, tokens_per_s=measure.spread(tps)[0], tokens_per_s_all=tps, repeats=runs,
                notes=sorted({n for r in runs for n in r["notes"]}))


def add_speedups(rungs):
    """Speed-up over the previous rung that ran and over the first one, each the median of the
    pairs measured in the same turn, with every pair's ratio and the verdict (measure.verdict)."""
    ok = [r for r in rungs if r["status"] == "ok"]
    for i, r in enumerate(ok):
        for key, other in (("prev", ok[i - 1] if i else r), ("base", ok[0])):
            ratios = measure.paired_ratios(r["tokens_per_s_all"], other["tokens_per_s_all"])
            r[f"speedup_{key}"], r[f"speedup_{key}_pairs"] = measure.spread(ratios)[0], ratios
            r[f"speedup_{key}_verdict"] = measure.verdict(ratios) if i else ""


def environment():
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # Linux: the model name, not just "x86_64"
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return dict(versions(), platform=platform.platform(), cpu=cpu, cpu_count=os.cpu_count(),
                git=git_commit())


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


def format_table(doc):
    """The fixed-width table: a title line, a header, one row per rung."""
    c, m, env = doc["config"], doc["config"]["model_config"], doc.get("device_env") or {}
    title = (f"Training-speed ladder | {env.get('device_name', c['device'])} | torch {doc['env']['torch']}"
             + (f" CUDA {doc['env']['cuda']}" if doc["env"]["cuda"] else "")
             + f" | L{m['n_layer']} H{m['n_head']} d{m['n_embd']} B={c['micro_batch_size']} T={c['block_size']}"
             f" accum={c['grad_accum']}"
             f" | median of {c['steps']} steps after {c['warmup_steps']} warm-up"
             f" | {doc['flops_per_token'] / 1e6:.0f} MFLOP/token")
    cols = [("rung", 15, "<"), ("tok/s", 10, ">"), ("+/-", 5, ">"), ("ms/step", 9, ">"), ("MFU", 6, ">"),
            ("peak mem", 10, ">"), ("loss", 8, ">"), ("vs prev", 19, ">"), ("vs base", 7, ">"), ("warm-up", 8, ">"),
            ("attention", 16, "<"), ("note", 0, "<")]
    lines = [title, "  ".join(f"{h:{a}{w}}" for h, w, a in cols).rstrip()]
    for r in doc["rungs"]:
        notes = list(r.get("notes", []))
        if r["status"] == "ok":
            mid, lo, hi = measure.spread(r["tokens_per_s_all"])
            cells = [r["name"], f"{mid:,.0f}", f"{50 * (hi - lo) / mid:.0f}%", f"{r['median_ms']:.1f}",
                     "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%", fmt_bytes(r["peak_mem_bytes"]),
                     f"{r['final_loss']:.4f}", measure.ratio_text(r["speedup_prev_pairs"]) if r is not doc["rungs"][0]
                     else "", f"{r['speedup_base']:.2f}x{r['speedup_base_verdict']}",
                     f"{r['warmup_s']:.{0 if r['warmup_s'] >= 10 else 1}f} s", r["attention_kernel"]]
        else:
            cells = [r["name"], r["status"].upper()] + [""] * 9
            notes.insert(0, r.get("reason", ""))
        cells.append("; ".join(n for n in notes if n)[:110])
        lines.append("  ".join(f"{v:{a}{w}}" for v, (_, w, a) in zip(cells, cols)).rstrip())
    return "\n".join(lines + [f"{doc['config']['repeats']} repeat(s); +/-: half the range of tok/s over the "
                               f"repeats; {measure.LEGEND}"])


def run_ladder(args):
    plan = plan_rungs(args.rung_list, args.compile_mode, args.overrides, compile_blocker(args.device))
    with torch.device("meta"):  # FLOPs from the shapes alone; the padded model, as the trainer runs it
        flops_per_token = GPT(GPTConfig(**args.model_config)).flops_per_token(args.block_size)
    config = {k: getattr(args, k) for k in ("device", "model", "model_config", "block_size", "micro_batch_size",
                                            "grad_accum", "warmup_steps", "steps", "repeats", "compile_mode",
                                            "seed", "rung_timeout", "in_process", "profile_steps")}
    config.update(rungs=[r.name for r in plan], overrides=args.override)
    doc = dict(schema="ladder-v1", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=shlex.join(["python", os.path.relpath(os.path.abspath(__file__)), *args.argv]),
               env=environment(), device_env=None, config=config, flops_per_token=flops_per_token,
               trainer={k: getattr(TRAIN, k) for k in ("max_lr", "min_lr_ratio", "warmup_steps", "max_steps",
                                                        "weight_decay", "beta1", "beta2", "eps", "grad_clip")},
               rungs=[])
    tokens_per_step = args.micro_batch_size * args.block_size * args.grad_accum
    print(f"ladder: {len(plan)} rung(s) x {args.repeats} repeat(s) on {args.device}, {args.model} {args.model_config}, "
          f"{tokens_per_step:,} tokens/step, {args.warmup_steps} warm-up + {args.steps} timed steps each, "
          f"{'in this process' if args.in_process else 'each in a fresh process'}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    work_dir = tempfile.mkdtemp(prefix="ladder-")
    runs, finished = {rung.name: [] for rung in plan}, False
    try:
        steps_per_rung = args.warmup_steps + args.steps + 1  # + the profiled micro-batch
        # twice that: the 2x micro-batch rung doubles tokens per step when --grad-accum is odd
        write_shards(work_dir, 2 * steps_per_rung * tokens_per_step + 1, args.seed)
        for rep in range(args.repeats):  # the rungs take turns: a passing load falls on all of them alike
            for i, rung in enumerate(plan):
                if runs[rung.name] and runs[rung.name][-1]["status"] != "ok":
                    continue  # a rung that failed (out of memory, a timeout) fails again: no need to wait
                spec = dict(config, name=rung.name, description=rung.description, settings=rung.settings,
                            changed=sorted(set(rung.change) | set(rung.overridden)), data_dir=work_dir,
                            result_path=os.path.join(work_dir, f"{rung.name}.{rep}.result.json"),
                            profile_steps=args.profile_steps if rep == 0 else None,
                            profile_dir=os.path.join(os.path.dirname(os.path.abspath(args.json_out)), "profile"))
                print(f"[{rep + 1}/{args.repeats}: {i + 1}/{len(plan)}] {rung.name:15s} {rung.description}", flush=True)
                if rung.skipped:
                    result = dict(name=rung.name, description=rung.description, settings=rung.settings,
                                  status="skipped", notes=[], reason=rung.skipped)
                elif args.in_process:
                    torch._dynamo.reset()
                    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
                        result = run_rung(spec)
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()  # give the next rung what this one held
                else:
                    result = run_rung_subprocess(spec, work_dir, args.rung_timeout)
                if rung.overridden:
                    result["notes"].append("override " + ",".join(f"{k}={v}" for k, v in rung.overridden.items()))
                doc["device_env"] = doc["device_env"] or result.get("env")
                runs[rung.name].append(result)
                doc["rungs"] = [combine(r) for r in runs.values() if r]
                add_speedups(doc["rungs"])
                if result["status"] == "ok":
                    print(f"    {result['tokens_per_s']:,.0f} tok/s, {result['median_ms']:.1f} ms/step, "
                          f"loss {result['final_loss']:.4f}, warm-up {result['warmup_s']:.1f} s, "
                          f"attention {result['attention_kernel']}", flush=True)
                else:
                    print(f"    {result['status'].upper()}: {result.get('reason')}", flush=True)
                for line in result.get("profile", []):
                    print(f"    {line}", flush=True)
                common.atomic_write(args.json_out, lambda f: f.write(json.dumps(doc, indent=1).encode()))
        finished = True
    finally:  # also when stopped (Ctrl-C, SIGTERM): the table of what did run still comes last
        shutil.rmtree(work_dir, ignore_errors=True)
        if not finished:
            print(f"stopped after {sum(map(len, runs.values()))} rung run(s) of {len(plan) * args.repeats}", flush=True)
        if doc["rungs"]:
            print(f"wrote {args.json_out}", flush=True)
            print(format_table(doc), flush=True)
    return doc


def main(argv=None):
    args = parse_args(argv)
    if args.worker:  # one rung, in the fresh process run_rung_subprocess started
        with open(args.worker) as f:
            spec = json.load(f)
        result = run_rung(spec)  # a crash leaves no result file: the ladder reports the log's last line
        with open(spec["result_path"], "w") as f:
            json.dump(result, f)
        return 0
    if args.list_rungs:
        for r in RUNGS:
            print(f"{r.name:15s} {r.description}{'' if r.default else '  [opt-in: --rungs all or by name]'}")
        return 0
    # SIGTERM (timeout, a job scheduler) unwinds like Ctrl-C, so the running rung is killed too
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        doc = run_ladder(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if any(r["status"] == "ok" for r in doc["rungs"]) else 1


if __name__ == "__main__":
    sys.exit(common.run_script(main))
