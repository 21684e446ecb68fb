"""What a training run evaluates at the top of a step: a list of evaluations (the validation loss, HellaSwag, CORE,
samples), each built only where it is on, each run every N steps and at the last, each stoppable by a stop request.
Adding one: a class here with its flags in train_config.py."""

import itertools
import os

import torch

import common
import dataloader
import device
import parallel
from common import UserError


class Evaluation:
    """One evaluation, due every `every` steps and at the last step. run(run, step, stop) logs what it found and
    returns True, or None where it recorded nothing: a stop request cut it short (stop: the run's common.StopFlag),
    or it is skipped."""
    agree_after = False  # True: the ranks meet after it, whatever it returned (not every rank runs it)
    plotted = True       # what it records is on the plot

    def __init__(self, every):
        self.every = every

    def due(self, step, max_steps):
        return bool(self.every) and (step % self.every == 0 or step == max_steps - 1)

    def note(self, ranks, block_size):
        """What the run header says of it, or ''."""
        return ""


class Validation(Evaluation):
    """The mean loss over the val split's first sequences: --val-tokens, at most the whole split, counted in
    sequences of each rank, so that a resume with another micro-batch validates the same tokens."""

    def __init__(self, every, data_dir, val_tokens, micro_batch, block_size, vocab_size, ranks):
        super().__init__(every)
        self.loader = dataloader.TokenLoader(data_dir, "val", micro_batch, block_size, ranks.rank, ranks.world_size,
                                             vocab_size, device=ranks.device,
                                             whole_batches=False)  # a short last batch is filled: one sequence will do
        self.sequences = max(1, min(val_tokens // block_size, self.loader.num_sequences) // ranks.world_size)
        self.whole = self.sequences == self.loader.num_sequences // ranks.world_size

    def run(self, run, step, stop):
        model = getattr(run.model, "module", run.model)  # compiled, without DDP's gradient hooks
        val_loss = validation_loss(model, self.loader, self.sequences, run.ranks, run.dtype, stop_check(stop, run.ranks))
        if val_loss is None:
            return None
        run.log.line(f"step {step} | val_loss {val_loss:.4f}")
        run.log.record("val", step=step, val_loss=val_loss, tokens=step * run.cfg.total_batch_size)
        return True

    def note(self, ranks, block_size):
        tokens = self.sequences * block_size * ranks.world_size
        return f"val: {tokens:,} tokens{' (the whole split)' if self.whole else ''}"


class Scored(Evaluation):
    """A benchmark scored through scoring.TrainingHook (HellaSwag, CORE) on the uncompiled model."""

    def __init__(self, every, hook):
        super().__init__(every)
        self.hook = hook

    def run(self, run, step, stop):
        with parallel.uncompiled(run.raw_model):
            result = self.hook(run.raw_model, run.dtype, stop_check(stop, run.ranks))
        if result is None:
            return None
        text, fields = self.hook.bench.report(result)
        run.log.line(f"step {step} | {self.hook.name} {text}")
        run.log.record(self.hook.name, step=step, tokens=step * run.cfg.total_batch_size, **fields)
        return True


class Samples(Evaluation):
    """Text continuing `prompt` (token ids), from rank 0, or from every rank under FSDP, where every forward is a
    collective (and so unstoppable). A failure is one line and training goes on, but under FSDP, where the ranks would
    no longer meet in the same collectives, it ends the run. After step 0: the untrained model's text says nothing."""
    agree_after, plotted = True, False

    def __init__(self, every, prompt):
        super().__init__(every)
        self.prompt = prompt

    def due(self, step, max_steps):
        return step > 0 and super().due(step, max_steps)

    def run(self, run, step, stop):
        if not (run.ranks.is_master or run.fsdp):
            return None
        import sample
        cfg = run.cfg
        try:
            with parallel.uncompiled(run.raw_model):
                texts = sample.training_samples(run.raw_model, self.prompt, cfg.num_samples, cfg.sample_tokens,
                                                cfg.seed + step, run.ranks.device, run.dtype,
                                                None if run.fsdp else stop)
        except Exception as e:  # noqa: BLE001
            if run.fsdp:  # the other ranks may be inside a collective forward: this rank cannot go on alone
                raise
            run.log.line(f"step {step} | samples failed, training goes on ({type(e).__name__}: "
                         f"{common.first_line(e)})")
            return None
        if texts is None:  # a stop request cut them short
            return None
        for i, text in enumerate(texts):
            run.log.line(f"sample {i} | {text}")
            run.log.record("sample", step=step, index=i, text=text)
        return True


def build(cfg, ranks, log, fsdp, micro_batch, block_size, vocab_size):
    """The evaluations that are on, in the order they run."""
    out = []
    if cfg.eval_every:
        out.append(Validation(cfg.eval_every, cfg.data_dir, cfg.val_tokens, micro_batch, block_size, vocab_size, ranks))
    if cfg.hellaswag_every:
        import hellaswag
        out.append(Scored(cfg.hellaswag_every,
                          hellaswag.training_hook(cfg.hellaswag_file, cfg.hellaswag_limit, ranks, log, fsdp)))
    if cfg.core_every:
        import core
        out.append(Scored(cfg.core_every, core.training_hook(cfg.core_bundle, cfg.core_limit, ranks, log, fsdp)))
    if cfg.sample_every:
        out.append(Samples(cfg.sample_every, sample_prompt(cfg, block_size)))
    return out


def sample_prompt(cfg, block_size):
    import sample
    from tokenizer import get_tokenizer
    try:
        return sample.encode_prompt(get_tokenizer(), cfg.sample_prompt, block_size)
    except UserError as e:
        raise UserError(f"--sample-prompt: {e}")


def check_inputs(cfg):
    """--hellaswag-file, --core-bundle and --sample-prompt, read now as far as the run will read them: one that
    cannot be used is bad input, not a "skipped" found hours into the run. A file a resumed run stored but that is
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
    if cfg.sample_every or "sample_prompt" in cfg.given:
        sample_prompt(cfg, cfg.block_size)


def evaluate(run, step, stop):
    """The evaluations due at the top of this step, in turn. False if a stop request cut one short (then nothing of
    it is logged): the ranks agree on it after any evaluation that recorded nothing, and after one that not every
    rank runs."""
    evaluated = False
    with run.log.round() as round_:  # a round a stop cuts short records nothing: the resume evaluates it again
        for ev in run.evaluations:
            if not ev.due(step, run.cfg.max_steps):
                continue
            done = ev.run(run, step, stop)
            if (done is None or ev.agree_after) and parallel.any_rank(stop.signal is not None, run.ranks):
                round_.cancel()
                return False
            evaluated = evaluated or (done is not None and ev.plotted)
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
