"""
Train GPT-2 from scratch (or fine-tune it) on pre-tokenized shards written by fineweb.py.

    python train_gpt2.py                                          # one GPU, or CPU
    torchrun --standalone --nproc_per_node=8 train_gpt2.py        # one node

The defaults reproduce GPT-2 124M on FineWeb-Edu 10B: 524,288 tokens per step, 19,073 steps. Pass
--resume always: it continues the run in --log-dir if there is one, else starts it. This file reads
as a run goes: main and train, setup (everything the loop needs, on a Run), the loop, one step.
"""

import gc
import math
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

import checkpoint
import common
import dataloader
import device
import evaluation
import export
import memory
import optim
import parallel
import plot
import train_config
import trackers
from common import UserError
from metrics import RunLog, resume_command
from model import GPT, config_from, config_of
from profiling import PhaseTimer, StepProfiler
from provenance import environment, git_commit, versions


@record  # under torchrun, a failed rank's error file: torchrun's summary shows that error as the root cause
def main(argv=None):
    sys.exit(train(argv))


def train(argv=None):
    """Train with the command line argv; returns the exit status (0, or 3: a non-finite loss). The
    settings are resolved before the process group forms, since its device and timeout are among them."""
    args = train_config.parse_args(argv, description=__doc__)
    resume = checkpoint.resume_point(args.resume, args.log_dir)
    cfg, changes = train_config.resolve(args, resume)
    finished = resume and resume.finished_line(cfg.max_steps, cfg.export_hf, cfg.log_dir)
    if finished:
        common.print0(finished)
        return 0
    evaluations = evaluation.prepare(cfg)  # what they read, read once: where the run has steps to go
    trackers.check_installed(cfg)  # the packages of --wandb and --tensorboard, where the run has them on
    ranks = parallel.setup_distributed(cfg.device, 60 * cfg.dist_timeout, cfg.dist_backend,
                                       group_of_one=cfg.sharding == "fsdp")
    log = RunLog(cfg.log_dir, ranks.is_master)
    try:
        run = setup(cfg, ranks, log, resume, changes, evaluations)
        del resume  # the checkpoint it read is back in the model and optimizer: free its host memory
        status = loop(run)
        # before the group goes: DDP's reducer must not hold the last reference to gloo's process group, whose
        # destructor would then join gloo's threads with the GIL held while one of them waits for it to free a
        # gathered tensor (a hang at the end of a run; pytorch/pytorch#56297). The run and the evaluations, which
        # hold the model, go first.
        del run, evaluations
        if torch.distributed.is_initialized():
            gc.collect()
    finally:
        log.close()
    # not after an error: a rank's destroy_process_group can wait there, in NCCL's finalize, for the
    # ranks that wait for it; without it the group ends when torchrun stops the others
    parallel.teardown_distributed()
    return status


# The run: everything the loop needs, built once by setup()


@dataclass
class Run:
    cfg: train_config.Settings   # every setting, resolved once and read-only
    ranks: parallel.Ranks
    log: RunLog
    choice: device.Choice        # what the device allows: dtype, compile, peak FLOP/s, capacity, ...
    fsdp: bool
    micro_batch: int             # sequences per forward pass per rank (--micro-batch-size, or fitted)
    grad_accum: int              # micro-batches per optimizer step
    raw_model: GPT               # the GPT itself: checkpoints, samples, HellaSwag (sharded in place under FSDP)
    model: torch.nn.Module       # what trains: compiled, DDP-wrapped or FSDP-sharded
    optimizer: optim.Optimizers  # with the run's optimizer settings and learning-rate schedule
    scaler: torch.amp.GradScaler
    train_loader: dataloader.TokenLoader
    checkpoints: checkpoint.Checkpointer
    start_step: int              # steps already done when this launch began
    evaluations: evaluation.Evaluations  # those that are on: validation, HellaSwag, CORE, samples
    plotter: object              # plot.PlotWriter, on rank 0 with --plot
    gpu: device.CudaMemory       # the GPU's memory counters (None off CUDA): the steps' peak

    dtype = property(lambda self: self.choice.dtype)  # the autocast dtype: float32, bfloat16 or float16

    def resume_command(self):
        return resume_command(self.cfg.log_dir, self.ranks.world_size, self.ranks.per_node)


# Set-up, one job at a time: device, model, batch, data, optimizer, restore, trackers, header


def setup(cfg, ranks, log, resume, changes, evaluations):
    """The Run of this launch, new or continuing `resume`. Every check that can refuse the launch comes before its
    first write into the log directory, and before an old branch's later checkpoints are set aside."""
    checkpoints = checkpoint.Checkpointer(cfg.log_dir, cfg.keep_checkpoints, ranks, log, resume)
    choice = device.choose(ranks.device, cfg.dtype, cfg.compile, "compile" in cfg.given, cfg.memory_snapshot)
    device.configure_backends(choice, cfg.deterministic)
    dtype = choice.dtype
    fsdp = cfg.sharding == "fsdp"
    if fsdp and ranks.backend == "gloo" and ranks.device_type == "cuda":
        raise UserError("--sharding fsdp over gloo on CUDA: gloo has no CUDA path for the whole-tensor gathers of "
                        "FSDP2's checkpoints, export and whole-matrix optimizers (pytorch/pytorch#152645); drop "
                        "--dist-backend gloo (NCCL, one process per GPU)")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    raw_model, origin = build_model(cfg, checkpoints)
    raw_model.to(ranks.device)
    # FSDP replaces the parameters with shards: the micro-batch probe and the optimizer come after this
    model = parallel.wrap_model(raw_model, cfg.sharding, ranks.device, dtype, cfg.activation_checkpointing,
                                choice.compile)
    # fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 and fp32 do not
    scaler = torch.amp.GradScaler(ranks.device_type, enabled=(dtype == "float16"))
    gpu = device.CudaMemory(ranks.device) if ranks.device_type == "cuda" else None
    if cfg.micro_batch_size == "auto":  # the largest that fits, tried on the model as it trains
        trial = trial_step(StepParts(model, None, scaler, ranks, dtype))
        micro_batch = memory.choose_micro_batch(cfg.total_batch_size, ranks, model, layout_of(cfg, dtype), trial, gpu)
    else:
        micro_batch = cfg.micro_batch_size
    tokens_per_micro = micro_batch * cfg.block_size * ranks.world_size
    if cfg.total_batch_size % tokens_per_micro:
        raise UserError(f"--total-batch-size {cfg.total_batch_size} is not divisible by micro-batch x block "
                        f"size x GPUs = {micro_batch} x {cfg.block_size} x {ranks.world_size} = {tokens_per_micro}")
    data = dataloader.Data(cfg.data_dir, raw_model.config.vocab_size, cfg.shuffle_seed, ranks.device)
    train_loader = dataloader.TokenLoader(data, "train", micro_batch, cfg.block_size, ranks)
    plotter = plot.PlotWriter(cfg.log_dir) if cfg.plot and ranks.is_master else None
    evaluations.start(evaluation.Context(ranks, log, model, raw_model, fsdp, dtype, micro_batch, cfg.total_batch_size,
                                         cfg.seed, plotter))
    optimizer = optim.build(raw_model, cfg, ranks.device_type, choice)
    log.hold()  # the lock first: a launch it refuses must not touch the directory
    start_step = checkpoints.restore(model=model, optimizer=optimizer, scaler=scaler, train_loader=train_loader,
                                     config=train_config.stored(cfg, micro_batch), fsdp=fsdp)
    optimizer.settle()  # the settings of this launch, over the param groups the checkpoint brought back
    if ranks.is_master:  # W&B and TensorBoard where they are on, fed by the log's records
        log.trackers = trackers.start(cfg, start_step)
    checkpoints.begin()  # every check passed: a resume from an older step may set the later checkpoints aside
    run = Run(cfg=cfg, ranks=ranks, log=log, choice=choice, fsdp=fsdp, micro_batch=micro_batch,
              grad_accum=cfg.total_batch_size // tokens_per_micro, raw_model=raw_model, model=model,
              optimizer=optimizer, scaler=scaler, train_loader=train_loader,
              evaluations=evaluations, checkpoints=checkpoints, start_step=start_step,
              plotter=plotter, gpu=gpu)
    write_header(run, origin, changes)
    return run


def build_model(cfg, checkpoints):
    """The GPT on the CPU and where it came from: of the resumed run's shape (whose weights Checkpointer.restore puts
    back), pretrained weights (--init-from, cut to --block-size) or a preset."""
    try:
        start = checkpoints.starting_model(cfg.init_from, cfg.block_size)
    except ValueError as e:  # a resumed shape whose block, or block's setting, this process has not registered
        raise UserError(f"cannot build the model the run starts from: {e}")
    if start is not None:
        return start
    try:
        config = config_from(cfg)
    except ValueError as e:
        raise UserError(str(e))
    return GPT(config), f"{cfg.model} preset" if config == config_of(cfg.model, cfg.block_size) else "custom shape"


def write_header(run, origin, changes):
    """The run record and the lines that say what produced this run and how it is laid out: what they
    say is gathered first (the device, the processes, the model, the memory plan), then written."""
    cfg, ranks, log, model, choice = run.cfg, run.ranks, run.log, run.raw_model, run.choice
    name = choice.name
    blocker = None if choice.compile else choice.compile_blocker
    warnings = choice.warnings(cfg.deterministic, run.micro_batch * cfg.block_size)
    if ranks.shares_gpus:
        warnings.append(f"{ranks.per_node} processes share {ranks.gpus} GPU(s) over gloo, their collectives through "
                        "host memory: a way to try a node's paths, far slower than one process per GPU over NCCL")
    if run.fsdp and not ranks.multi:
        warnings.append("--sharding fsdp with one process shards nothing (a group of one runs FSDP2's paths): launch "
                        "it with torchrun --nproc_per_node=N to shard over N GPUs")
    grace = ranks.stop_grace
    late = common.stop_grace_warning(4 * model.num_params(non_embedding=False) + run.optimizer.state_bytes(), grace)
    warnings += [late] if late else []
    plan = memory.memory_plan(model, layout_of(cfg, run.dtype), run.micro_batch, ranks.world_size, run.optimizer)
    memory_line = memory.format_memory_plan(plan, choice.capacity, "GPU" if choice.capacity else "process")
    commit = git_commit()
    resume_path = run.checkpoints.last_path  # the checkpoint resumed from, none written yet
    log.record("run", step=run.start_step, max_steps=cfg.max_steps, tokens_per_step=cfg.total_batch_size,
               resumed_from=resume_path, device=ranks.device, device_name=name, dtype=run.dtype,
               compile=choice.compile, world_size=ranks.world_size, grad_accum=run.grad_accum, versions=versions(),
               git=commit, config=train_config.stored(cfg, run.micro_batch), changes=changes,
               restart=ranks.restart, per_node=ranks.per_node, environment=environment(),
               evaluations=run.evaluations.describe(), stop_grace_s=grace and grace[0])
    start = f"resuming {resume_path} at step {run.start_step} with the run's settings" if resume_path else "new run"
    if ranks.restart:
        start += f" | torchrun restart {ranks.restart} (after a worker failed)"
    log.line(f"run: {start} | model {origin}, {model.num_params() / 1e6:.1f}M parameters")
    for change in changes:
        log.line(f"resume: {change}")
    log.line(f"device {ranks.device} ({name}) | dtype {run.dtype} | {choice.mfu_basis} | world size "
             f"{ranks.world_size} | compile {'on' if choice.compile else 'off'}{f' ({blocker})' if blocker else ''} | "
             f"git {commit} | torch {torch.__version__}")
    notes = "".join(f" | {note}" for note in run.evaluations.notes())
    log.line(f"batch {cfg.total_batch_size} tokens/step = micro-batch {run.micro_batch} x {cfg.block_size} "
             f"tokens x {ranks.world_size} rank(s) x {run.grad_accum} accumulation step(s)"
             f"{memory.how_chosen(cfg.micro_batch_size, ranks.device_type)}{notes}")
    log.line(run.optimizer.describe(resumed=resume_path is not None))
    log.line(f"memory ({cfg.sharding if run.fsdp else 'DDP' if ranks.multi else 'one process'}"
             f"{', activation checkpointing' if cfg.activation_checkpointing else ''}): {memory_line}")
    log.record("memory", step=run.start_step, **plan)
    for w in warnings:
        log.line(f"warning: {w}")


# The training loop


def loop(run):
    """Evaluation at the top of each step (step 0 shows the untrained model), one optimizer step, its log line,
    checkpoints; then the export. Returns the exit status."""
    cfg, ranks = run.cfg, run.ranks
    stop = common.StopFlag()
    timer = PhaseTimer(ranks.device, cfg.timing_breakdown)
    profiler = StepProfiler(cfg.profile_steps, ranks.device, os.path.join(cfg.log_dir, "profile"),
                            f"rank{ranks.rank}", run.log.line, cfg.memory_snapshot)
    parts = StepParts(run.model, run.optimizer, run.scaler, ranks, run.dtype, run.grad_accum, cfg.grad_clip)
    done = run.start_step  # optimizer steps completed
    try:
        for step in range(run.start_step, cfg.max_steps):
            with profiler.step(step):
                # ---- evaluation: validation loss, HellaSwag, CORE and samples, when due
                timer.start()
                if not evaluation.evaluate(run.evaluations, step, cfg.max_steps, stop):
                    return stopped(run, done, stop)
                timer.mark("eval")

                # ---- one optimizer step over grad_accum micro-batches
                t0 = time.perf_counter()
                lr = run.optimizer.at_step(step)
                result = train_step(parts, run.train_loader, stop, timer)
                if diverged(run, result.loss, result.finite) and cfg.on_nonfinite == "stop":
                    return stop_on_nonfinite(run, step, result.loss, result.norm)
                done = step + 1
                log_step(run, step, result, lr, time.perf_counter() - t0)
                timer.step_done(run.log, step)

                # ---- checkpoint: on schedule, at the end, and when a stop was asked for
                if result.stopping:
                    return stopped(run, done, stop)
                if done == cfg.max_steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                    run.checkpoints.save(done)
    except Exception as e:  # the allocator's error, raised anywhere in a step: one line, and the run's end
        if not memory.is_allocation_failure(e):
            raise
        run.log.record("end", step=done - 1, reason="out_of_memory")
        raise UserError(out_of_memory(run, e)) from e
    if cfg.export_hf:
        export_hf(run)
    return end(run, "finished", cfg.max_steps)


def out_of_memory(run, e):
    """What to say where a step ran out of the device's memory."""
    cuda = run.ranks.device_type == "cuda"
    where = "GPU" if cuda else run.ranks.device_type.upper()
    fit = " (auto fits one)" if cuda else ""
    return (f"out of {where} memory at a micro-batch of {run.micro_batch} x {run.cfg.block_size} tokens "
            f"({common.first_line(e, 60)}...): pass a smaller --micro-batch-size{fit}, or "
            f"--activation-checkpointing; the checkpoints written are kept")


def diverged(run, loss, finite):
    """fp16's gradient scaler skips a step whose gradients overflowed, which is normal; a non-finite loss diverged."""
    return not math.isfinite(loss) or (not finite and not run.scaler.is_enabled())


def layout_of(cfg, dtype):
    """The memory plan's Layout of this run's steps."""
    return memory.Layout(dtype, cfg.block_size, cfg.sharding, cfg.activation_checkpointing)


def stop_on_nonfinite(run, step, loss, norm):
    """--on-nonfinite stop: say where to go back to, and end with exit status 3."""
    rates = run.optimizer.rates()
    last = run.checkpoints.last_path  # written by this run, or resumed from
    if last:
        advice = f"The last good checkpoint is {last}: resume from it with a lower {rates}"
    else:  # --resume with no checkpoint starts the run afresh
        advice = f"No checkpoint was written yet: start the run again (--resume) with a lower {rates}"
    run.log.line(f"step {step} | loss {loss} | grad_norm {norm}: non-finite; stopping. {advice}, "
                 "or pass --on-nonfinite skip")
    run.log.record("end", step=step, reason="nonfinite")
    return 3


def log_step(run, step, result, lr, dt):
    """The step's line and train record (result: its StepResult): tokens/s over all ranks, MFU over the device's
    peak."""
    loss, norm, finite = result.loss, result.norm, result.finite
    tok_per_s = run.cfg.total_batch_size / dt
    mfu = run.raw_model.estimate_mfu(tok_per_s / run.ranks.world_size, run.choice.peak_flops)
    mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    skipped = ("" if finite else " | skipped (non-finite)" if diverged(run, loss, finite) else
               " | skipped (float16 gradient overflow: the loss scale is lowered)")
    run.log.line(f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | grad_norm {norm:.4f} | "
                 f"dt_ms {1000 * dt:.1f} | tok_per_s {tok_per_s:.0f} | mfu {mfu_text}{skipped}")
    run.log.record("train", step=step, loss=loss, lr=lr, grad_norm=norm, dt_ms=1000 * dt, tok_per_s=tok_per_s,
                   mfu=mfu, tokens=(step + 1) * run.cfg.total_batch_size, skipped=not finite,
                   peak_mem=run.gpu.peak() if run.gpu else None)


def stopped(run, done, stop):
    """A stop request ended the run after `done` steps: checkpoint them unless that is done, say how to go on."""
    run.checkpoints.save(done)  # unless the directory holds it
    run.log.line(f"stopped by {stop.signal or 'a signal on another rank'} after {done} steps; "
                 f"continue with: {run.resume_command()}")
    return end(run, "signal", done - 1)


def end(run, reason, step):
    """The end record (step: max_steps when finished, else the last step that ran, -1 for none), the last plot."""
    run.log.record("end", step=step, reason=reason)
    if run.gpu:  # what the steps took, beside the plan in the header
        run.log.line(f"peak GPU memory {run.gpu.peak() / 2 ** 30:.1f} GiB of "
                     f"{run.choice.capacity / 2 ** 30:.1f} GiB (rank {run.ranks.rank})")
    if run.plotter:
        run.plotter.kick()
        run.plotter.join()
    return 0


def export_hf(run):
    """LOG_DIR/hf: the final model in Hugging Face's format, where it is GPT-2's architecture (a run started with
    --init-from a variant's checkpoint may not be)."""
    problem = run.raw_model.export_problem()
    if problem:
        run.log.line(f"not exported to Hugging Face's format: {problem}; its checkpoints hold the model")
        return
    # the command to export again carries the flag: a run trained with --no-export-hf stores it off
    out = export.run_export(run.model, run.ranks, run.cfg.log_dir, run.resume_command() + " --export-hf",
                            run.checkpoints.last_path)
    if out is not None:
        run.log.line(f"exported the final model to {out} (transformers.GPT2LMHeadModel.from_pretrained loads it)")


# One optimizer step. train_step is called by the loop and by bench/ladder.py, so that a speed-up
# the ladder measures is a speed-up of training.


@dataclass
class StepParts:
    """What an optimizer step works with, its batches aside: made once by the loop (and by the micro-batch auto-fit,
    bench/ladder.py and bench/device_check.py)."""
    model: torch.nn.Module      # what trains: compiled, DDP-wrapped or FSDP-sharded
    optimizer: optim.Optimizers  # None for the auto-fit's trials, which take no step
    scaler: torch.amp.GradScaler
    ranks: parallel.Ranks
    dtype: str                  # the autocast dtype: float32, bfloat16 or float16
    grad_accum: int = 1         # micro-batches per optimizer step
    grad_clip: float = 0.0      # the cap on the gradients' global norm; 0: none


class StepResult(NamedTuple):
    loss: float       # the mean over the step's micro-batches and ranks
    norm: float       # the gradients' global norm, before clipping
    stopping: bool    # a stop was asked for on some rank
    finite: bool      # the loss and the norm were finite, so the update was made


def train_step(parts, loader, stop=None, timer=None):
    """Forward and backward over grad_accum micro-batches, unscale, clip, and the update unless the loss or the
    gradient norm is not finite (with fp16 the scaler then lowers its scale). The step's one host-device sync
    also carries this rank's stop request to the others, so a request that came during the step ends the run after
    it. Returns its StepResult."""
    model, optimizer, scaler, ranks, grad_accum, grad_clip = (parts.model, parts.optimizer, parts.scaler, parts.ranks,
                                                              parts.grad_accum, parts.grad_clip)
    timer = timer or PhaseTimer(ranks.device)
    model.train()
    loss_accum = torch.zeros((), device=ranks.device)
    for i in range(grad_accum):
        x, y = loader.next_batch(timer=timer)  # marks the "data" and "copy" phases
        loss_accum += micro_step(parts, x, y, i == grad_accum - 1, timer)
    optimizer.unscale_(scaler)
    # the gradients are already all-reduced, so every rank computes the same global norm
    norm = parallel.clip_grad_norm(model, grad_clip if grad_clip > 0 else float("inf"))
    asked = stop is not None and stop.signal is not None
    # the flag is made on the device: a tensor of host data would be a pageable copy, a second sync
    stats = torch.stack([loss_accum, norm.float(), torch.full((), float(asked), device=ranks.device)])
    if ranks.multi:
        stats /= ranks.world_size
        torch.distributed.all_reduce(stats)  # mean loss, the same norm, and > 0 if any rank was signalled
    loss_val, norm_val, stop_any = stats.tolist()
    finite = math.isfinite(loss_val) and math.isfinite(norm_val)
    if finite:  # every optimizer or none: an overflow in one's gradients makes the global norm inf
        optimizer.step()  # unscaled above and known finite: GradScaler.step would only check found_inf again
    scaler.update()  # fp16: the scale comes down after an overflow (a no-op when the scaler is off)
    parallel.zero_grad(model)
    timer.mark("optimizer")
    # one process needs no agreement: a request that came during the update counts for this step too
    stopping = stop_any > 0 or (not ranks.multi and stop is not None and stop.signal is not None)
    return StepResult(loss_val, norm_val, stopping, finite)


def micro_step(parts, x, y, sync, timer):
    """One micro-batch's forward and backward, its gradients added to the step's (all-reduced where sync); its loss
    as its share of the step's mean, detached. The micro-batch auto-fit measures this too."""
    with parallel.grad_sync(parts.model, sync):
        with device.autocast(parts.ranks.device, parts.dtype):
            loss = parts.model(x, y)[1]  # the logits (detached) are let go before the backward
        loss = loss / parts.grad_accum  # the mean over the whole batch, not a sum of means
        timer.mark("forward")
        parts.scaler.scale(loss).backward()
        timer.mark("backward")
    return loss.detach()


def trial_step(parts):
    """The auto-fit's micro-step, micro_step(model, x, y, sync) (memory.choose_micro_batch): one micro-batch a step."""
    timer = PhaseTimer(parts.ranks.device)
    return lambda model, x, y, sync: micro_step(replace(parts, model=model, grad_accum=1), x, y, sync, timer)


if __name__ == "__main__":
    common.run_script(main)
