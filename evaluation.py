"""What a training run evaluates at the top of a step: the validation loss, HellaSwag, CORE and samples, each
built only where it is on, and each stoppable by a stop request between batches."""

import itertools
import os

import torch

import common
import device
import parallel
from common import UserError


def build(cfg, ranks, log, fsdp, block_size):
    """HellaSwag's and CORE's hooks, the plot writer and the samples' prompt (checked now, so that one that cannot
    be sampled from is refused at start), each where it is on, else None."""
    out = dict(hellaswag=None, core=None, plotter=None, sample_prompt=None)
    if cfg.hellaswag_every:
        import hellaswag
        out["hellaswag"] = hellaswag.training_hook(cfg.hellaswag_file, cfg.hellaswag_limit, ranks, log, fsdp)
    if cfg.core_every:
        import core
        out["core"] = core.training_hook(cfg.core_bundle, cfg.core_limit, ranks, log, fsdp)
    if cfg.plot and ranks.is_master:
        import plot
        out["plotter"] = plot.PlotWriter(cfg.log_dir)
    if cfg.sample_every or "sample_prompt" in cfg.given:
        import sample
        from tokenizer import get_tokenizer
        try:
            out["sample_prompt"] = sample.encode_prompt(get_tokenizer(), cfg.sample_prompt, block_size)
        except UserError as e:
            raise UserError(f"--sample-prompt: {e}")
    return out


def check_files(cfg):
    """--hellaswag-file and --core-bundle, read now as far as the run will read them: one that cannot be
    scored is bad input, not a "skipped" found hours into the run. One a resumed run stored but that is
    gone (a copied run) is no reason to refuse the resume: that evaluation says it is skipped."""
    def named(flag, every):
        path = getattr(cfg, flag)
        return path is not None and (flag in cfg.given or (getattr(cfg, every) and os.path.exists(path)))
    if named("hellaswag_file", "hellaswag_every"):
        import hellaswag
        try:
            hellaswag.load_items(cfg.hellaswag_file, limit=cfg.hellaswag_limit, flag="--hellaswag-file")
        except UserError as e:
            raise UserError(f"--hellaswag-file: {e}")
    if named("core_bundle", "core_every"):
        import core
        try:
            core.load_tasks(cfg.core_bundle, None, cfg.core_limit, "--core-bundle")
        except UserError as e:
            raise UserError(f"--core-bundle: {e}")


def evaluate(run, step, stop):
    """Validation, HellaSwag, CORE and samples due at the top of this step. False if a stop request
    cut it short (then nothing of it is logged)."""
    cfg, ranks, log = run.cfg, run.ranks, run.log
    last_step = step == cfg.max_steps - 1
    due = lambda every: every and (step % every == 0 or last_step)  # noqa: E731
    evaluated = False
    if run.val_loader is not None and due(cfg.eval_every):
        model = getattr(run.model, "module", run.model)  # compiled, without DDP's gradient hooks
        val_loss = validation_loss(model, run.val_loader, run.val_sequences, ranks, run.dtype, stop_check(stop, ranks))
        if val_loss is None:
            return False
        evaluated = True
        log.line(f"step {step} | val_loss {val_loss:.4f}")
        log.record("val", step=step, val_loss=val_loss, tokens=step * cfg.total_batch_size)
    for hook, every in ((run.hellaswag, cfg.hellaswag_every), (run.core, cfg.core_every)):
        if hook is None or not due(every):
            continue
        with parallel.uncompiled(run.raw_model):
            result = hook(run.raw_model, run.dtype, stop_check(stop, ranks))
        if result is None and parallel.any_rank(stop.signal is not None, ranks):
            return False
        if result is not None:
            evaluated = True
            text, fields = hook.report(result)
            log.line(f"step {step} | {hook.name} {text}")
            log.record(hook.name, step=step, tokens=step * cfg.total_batch_size, **fields)
    if step > 0 and due(cfg.sample_every):
        if ranks.is_master or run.fsdp:
            log_samples(run, step, stop)
        if parallel.any_rank(stop.signal is not None, ranks):  # samples cut short record nothing: stop before the step
            return False
    if evaluated and run.plotter:
        run.plotter.kick()
    return True


STOP_CHECK_EVERY = 8  # evaluation batches between two questions to the ranks about a stop request


def stop_check(stop, ranks):
    """Called before each batch of an evaluation: whether any rank was asked to stop, asked of the ranks before
    the first batch and every STOP_CHECK_EVERY after (a collective and a sync; every rank calls it as often)."""
    calls = itertools.count()
    return lambda: next(calls) % STOP_CHECK_EVERY == 0 and parallel.any_rank(stop.signal is not None, ranks)


@torch.no_grad()
def validation_loss(model, loader, sequences, ranks, dtype, should_stop):
    """Mean loss per token over the val split's first `sequences` sequences on each rank; None if a stop request
    came. A last batch of fewer sequences is filled up to the micro-batch (padded), so every forward has one shape."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=ranks.device)
    for done in range(0, sequences, loader.B):
        if should_stop():
            model.train()
            return None
        n = min(loader.B, sequences - done)
        x_val, y_val = loader.next_batch(n)
        if n < loader.B:
            x_val, y_val = padded(x_val, y_val, loader.B)
        with device.autocast(ranks.device, dtype):
            _, loss_val = model(x_val, y_val)
        total += loss_val.float() * n  # the batch's mean, weighted by its real sequences
    if ranks.multi:
        torch.distributed.all_reduce(total)  # SUM: gloo has no AVG
    model.train()
    return total.item() / (sequences * ranks.world_size)


def padded(x, y, size):
    """x and y (n, T) with rows added up to `size` (inputs 0, targets -1, which the loss ignores), as views of
    (size, T+1) tensors as the loader's batches are: a compiled model compiles no graph for new strides."""
    xs, ys = x.new_zeros(size, x.size(1) + 1), y.new_full((size, y.size(1) + 1), -1)
    xs[:len(x), :-1] = x
    ys[:len(y), 1:] = y
    return xs[:, :-1], ys[:, 1:]


def log_samples(run, step, stop):
    """The samples of this step, each a log line and a record. Under FSDP every forward is a collective, so every
    rank samples, unstoppable. A failure is one line and training goes on, but under FSDP, where the ranks would
    no longer meet in the same collectives, it ends the run."""
    import sample
    cfg = run.cfg
    try:
        with parallel.uncompiled(run.raw_model):
            texts = sample.training_samples(run.raw_model, run.sample_prompt, cfg.num_samples, cfg.sample_tokens,
                                            cfg.seed + step, run.ranks.device, run.dtype, None if run.fsdp else stop)
    except Exception as e:  # noqa: BLE001
        if run.fsdp:  # the other ranks may be inside a collective forward: this rank cannot go on alone
            raise
        run.log.line(f"step {step} | samples failed, training goes on ({type(e).__name__}: {common.first_line(e)})")
        return
    for i, text in enumerate(texts or []):  # None: a stop request cut them short
        run.log.line(f"sample {i} | {text}")
        run.log.record("sample", step=step, index=i, text=text)
