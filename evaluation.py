"""What a training run evaluates at the top of a step: the validation loss, HellaSwag, CORE and samples, each a class
registered in REGISTRY. Each reads its inputs once, before the process group forms (prepare: a bad one is one line,
nothing of an evaluation that is off is read), starts with what the run gives it (start: the ranks, the models, the
log), runs every N steps and at the last, and is stoppable by a stop request. What it records describes itself
(describe, in the run record): the log's checks, the plot, the summary and the trackers learn its kind from there.

A new evaluation: a class deriving Evaluation in a file of its own, with its flags (add_flags: they join the trainer's
command line, with their ranges and paths), and one line that registers it (register()).
"""

import functools
import itertools
import os
from dataclasses import dataclass

import torch

import common
import core
import dataloader
import device
import descriptions
import hellaswag
import parallel
from common import UserError

DEFAULT_VAL_TOKENS = 10485760
GPT2_VAL_LOSS = 3.2924  # OpenAI's GPT-2 124M on the FineWeb-Edu val shard, as measured by build-nanogpt


@dataclass
class Context:
    """What a run gives its evaluations when they start."""
    ranks: object          # parallel.Ranks
    log: object            # metrics.RunLog
    model: object          # what trains: compiled, DDP-wrapped or FSDP-sharded
    raw_model: object      # the GPT itself (sharded in place under FSDP)
    fsdp: bool             # every forward is a collective: every rank evaluates
    dtype: str             # the autocast dtype
    micro_batch: int       # sequences per forward pass per rank
    tokens_per_step: int   # what a record's "tokens" counts in: tokens seen before the step
    seed: int
    plotter: object = None  # plot.PlotWriter, redrawn after a round that recorded a plotted number


class Evaluation:
    """One evaluation, due every `every` steps and at the last step. run(step, stop) logs what it found and returns
    True, or None where it recorded nothing: a stop request cut it short (stop: the run's common.StopFlag), or it is
    skipped. A plotted one records `kind` records holding its number `field`, of which `best` is the better way."""
    kind = field = label = None  # its records' kind, their headline number, and the name the plot and summary use
    best = "max"                 # or "min"
    panel = None                 # the plot's panel it joins (None: one of its own)
    # how plot.py shows it, in its description (describe): all optional
    title = ylabel = None        # its panel's title and y label (None: the label, the field and which way is better)
    references = ()              # ((value, legend, colour), ...): published figures drawn across its panel
    against = None               # what the summary sets its best and final against: the references, in short
    axis = None                  # (low, high, margin below, margin above): its panel's y range holds low..high too
    first = False                # True: its panel comes right after the loss's
    sample = None                # {"field", "whole", "chance"}: records whose field is under whole scored a sample
    tasks = None                 # {"field", "whole", "title", "of"}: a mean over len(field) tasks, set against the
    #                              references (whose they are: "of") over whole tasks only, else titled `title`
    agree_after = False          # True: the ranks meet after it, whatever it returned (not every rank runs it)
    ranges = {}                  # {its numeric flag: "at least 1", "0 or more", ...}: train_config.BOUNDS checks it
    paths = ()                   # its flags that name files: stored absolute, so a resume elsewhere reads the same

    @staticmethod
    def add_flags(add):
        """Its command-line flags, among the trainer's (add: the parser's add_argument); its settings are theirs."""

    @staticmethod
    def flag_defaults(args):
        """Its flags' defaults that depend on other settings, set in the parsed args."""

    def __init__(self, every):
        self.every = every
        self.ctx = None

    @classmethod
    def prepare(cls, cfg):
        """The evaluation the settings turn on, its inputs read, or None where it is off."""
        raise NotImplementedError

    def start(self, ctx):
        self.ctx = ctx

    def due(self, step, max_steps):
        return bool(self.every) and (step % self.every == 0 or step == max_steps - 1)

    def note(self):
        """What the run header says of it, or ''."""
        return ""

    @classmethod
    def describe(cls):
        """What the run record says of its records (metrics.py, plot.py and trackers.py read it): the plot draws and
        the summary writes an evaluation from this alone."""
        return descriptions.description(cls.field, cls.best, cls.label, cls.panel or cls.kind,
                                        **{key: getattr(cls, key) for key in descriptions.SHOWN})

    def record(self, step, text, **fields):
        """Its line and its record at step."""
        self.ctx.log.line(f"step {step} | {text}")
        self.ctx.log.record(self.kind, step=step, tokens=step * self.ctx.tokens_per_step, **fields)

    def stop_check(self, stop):
        return stop_check(stop, self.ctx.ranks)


class Validation(Evaluation):
    """The mean loss over the val split's first sequences: --val-tokens, at most the whole split, counted in
    sequences of each rank, so that a resume with another micro-batch validates the same tokens."""
    kind, field, label, best, panel = "val", "val_loss", "val loss", "min", "loss"
    references = ((GPT2_VAL_LOSS, f"OpenAI GPT-2 124M (val loss on FineWeb-Edu val shard: {GPT2_VAL_LOSS})", "black"),)
    against = f"OpenAI GPT-2 124M: {GPT2_VAL_LOSS}"
    ranges = {"eval_every": "0 or more", "val_tokens": "at least 1"}

    @staticmethod
    def add_flags(add):
        add("--eval-every", type=int, default=250, help="validation loss every N steps; 0 = off (default: 250)")
        add("--val-tokens", type=int, help=f"tokens per validation, at most the whole val split (default: "
                                           f"{DEFAULT_VAL_TOKENS}, or a quarter of those trained between validations)")

    @staticmethod
    def flag_defaults(args):
        if args.val_tokens is None:
            between = args.eval_every * args.total_batch_size // 4  # validation costs at most ~10% of training
            args.val_tokens = min(DEFAULT_VAL_TOKENS, between) if args.eval_every else DEFAULT_VAL_TOKENS

    def __init__(self, every, data_dir, val_tokens):
        super().__init__(every)
        self.data_dir, self.val_tokens = data_dir, val_tokens

    @classmethod
    def prepare(cls, cfg):
        return cls(cfg.eval_every, cfg.data_dir, cfg.val_tokens) if cfg.eval_every else None

    def start(self, ctx):
        super().start(ctx)
        ranks, config = ctx.ranks, ctx.raw_model.config
        data = dataloader.Data(self.data_dir, config.vocab_size, device=ranks.device)
        self.loader = dataloader.TokenLoader(data, "val", ctx.micro_batch, config.block_size, ranks,
                                             whole_batches=False)  # a short last batch is filled: one sequence will do
        split = self.loader.num_sequences
        self.sequences = max(1, min(self.val_tokens // config.block_size, split) // ranks.world_size)
        self.whole = self.sequences == split // ranks.world_size
        self.tokens = self.sequences * config.block_size * ranks.world_size

    def run(self, step, stop):
        model = getattr(self.ctx.model, "module", self.ctx.model)  # compiled, without DDP's gradient hooks
        val_loss = validation_loss(model, self.loader, self.sequences, self.ctx.ranks, self.ctx.dtype,
                                   self.stop_check(stop))
        if val_loss is None:
            return None
        self.record(step, f"val_loss {val_loss:.4f}", val_loss=val_loss)
        return True

    def note(self):
        return f"val: {self.tokens:,} tokens{' (the whole split)' if self.whole else ''}"


class Scored(Evaluation):
    """A benchmark scored through scoring.TrainingHook on the uncompiled model: its data read once, at prepare where
    the command line names it (a bad one is one line), else at its first call (a download; or a file a resumed run
    stored that is gone: then it says it is skipped). every_flag and data_flag name its settings; read(cfg) reads its
    data, bench(data) makes the scoring.TrainingHook benchmark of it."""
    every_flag = data_flag = None

    def __init__(self, every, load):
        super().__init__(every)
        self.load = load

    @classmethod
    def prepare(cls, cfg):
        every, now = getattr(cfg, cls.every_flag), named(cfg, cls.data_flag, cls.every_flag)
        if not (every or now):
            return None
        read = functools.partial(cls.read, cfg)
        if now:
            try:
                data = read()
            except UserError as e:
                raise UserError(f"--{cls.data_flag.replace('_', '-')}: {e}")
            read = lambda: data  # noqa: E731
        return cls(every, lambda: cls.bench(read())) if every else None

    def start(self, ctx):
        super().start(ctx)
        from scoring import TrainingHook
        self.hook = TrainingHook(self.kind, self.load, ctx.ranks, ctx.log, ctx.fsdp)

    def run(self, step, stop):
        with parallel.uncompiled(self.ctx.raw_model):
            result = self.hook(self.ctx.raw_model, self.ctx.dtype, self.stop_check(stop))
        if result is None:
            return None
        text, fields = self.hook.bench.report(result)
        self.record(step, f"{self.kind} {text}", **fields)
        return True


def named(cfg, flag, every):
    """Whether a data flag is to be read now: typed on this command line, or a resumed run's whose file is there."""
    path = getattr(cfg, flag)
    return path is not None and (flag in cfg.given or (getattr(cfg, every) and os.path.exists(path)))


class HellaSwag(Scored):
    kind, field, label = "hellaswag", "acc_norm", "HellaSwag"
    title, ylabel, axis, first = "HellaSwag (acc_norm, 0-shot)", "accuracy", (0.24, 0.35, 0.005, 0.01), True
    references = ((hellaswag.GPT3_HELLASWAG, f"GPT-3 124M {hellaswag.GPT3_HELLASWAG} (Brown et al. 2020)", "firebrick"),
                  (hellaswag.GPT2_HELLASWAG, f"OpenAI GPT-2 124M HellaSwag {hellaswag.GPT2_HELLASWAG}", "black"),
                  (hellaswag.CHANCE, f"chance {hellaswag.CHANCE} (four endings)", "gray"))
    against = f"GPT-2 124M: {hellaswag.GPT2_HELLASWAG}, GPT-3 124M: {hellaswag.GPT3_HELLASWAG}"
    sample = dict(field="n", whole=hellaswag.N_ITEMS, chance=hellaswag.CHANCE)  # --hellaswag-limit scores a sample
    every_flag, data_flag = "hellaswag_every", "hellaswag_file"
    ranges, paths = {"hellaswag_every": "0 or more", "hellaswag_limit": "at least 1"}, ("hellaswag_file",)

    @staticmethod
    def add_flags(add):
        add("--hellaswag-every", type=int, default=250, help="HellaSwag every N steps; 0 = off (default: 250)")
        add("--hellaswag-file", help="local hellaswag_val.jsonl (default: download once to the cache)")
        add("--hellaswag-limit", type=int, help="score only the first N HellaSwag items (default: all 10,042)")

    @staticmethod
    def read(cfg):
        return hellaswag.load_items(cfg.hellaswag_file, limit=cfg.hellaswag_limit, flag="--hellaswag-file")

    @staticmethod
    def bench(items):
        return hellaswag.HellaSwag(items)


class Core(Scored):
    kind, field, label = "core", "core", "CORE"
    title = f"CORE ({core.N_CORE_TASKS} in-context tasks, centred accuracy: 0 = chance)"
    ylabel, axis = "CORE", (0.0, None, 0.01, 0.02)
    references = ((core.GPT2_CORE["1.5B"], f"OpenAI GPT-2 1.5B CORE {core.GPT2_CORE['1.5B']} (nanochat)", "firebrick"),
                  (core.GPT2_CORE["124M"], f"OpenAI GPT-2 124M CORE {core.GPT2_CORE['124M']} (nanochat)", "black"))
    against = f"GPT-2 124M: {core.GPT2_CORE['124M']}, 1.5B: {core.GPT2_CORE['1.5B']}"
    # a custom bundle's mean is over other tasks than GPT-2's figures
    tasks = dict(field="centered", whole=core.N_CORE_TASKS, title="CORE (centred accuracy: 0 = chance)", of="GPT-2's")
    every_flag, data_flag = "core_every", "core_bundle"
    ranges, paths = {"core_every": "0 or more", "core_limit": "at least 1"}, ("core_bundle",)

    @staticmethod
    def add_flags(add):
        add("--core-every", type=int, default=0, help="CORE (core.py) every N steps; 0 = off (default: 0)")
        add("--core-bundle", help="the unzipped DCLM eval_bundle for CORE (default: download it once to the cache)")
        add("--core-limit", type=int, default=500, help="items per CORE task (default: 500, as nanochat's training)")

    @staticmethod
    def read(cfg):
        return core.load_tasks(cfg.core_bundle, None, cfg.core_limit, "--core-bundle")

    @staticmethod
    def bench(tasks):
        return core.Core(tasks)

    def start(self, ctx):
        load = self.load
        self.load = lambda: self._noted(load())  # a task with fewer examples than shots: said once, in the log
        super().start(ctx)

    def _noted(self, bench):
        for note in core.fewer_shots(bench.tasks, "--core-limit"):
            self.ctx.log.line(note)
        return bench


class Samples(Evaluation):
    """Text continuing the prompt (token ids), from rank 0, or from every rank under FSDP, where every forward is a
    collective (and so unstoppable). A failure is one line and training goes on, but under FSDP, where the ranks would
    no longer meet in the same collectives, it ends the run. After step 0: the untrained model's text says nothing."""
    agree_after = True
    ranges = {"sample_every": "0 or more", "num_samples": "at least 1", "sample_tokens": "at least 1"}

    @staticmethod
    def add_flags(add):
        add("--sample-every", type=int, default=250, help="print samples every N steps; 0 = off (default: 250)")
        add("--sample-prompt", default="Hello, I'm a language model,", help="prompt for the samples")
        add("--num-samples", type=int, default=4, help="samples each time (default: 4)")
        add("--sample-tokens", type=int, default=32, help="new tokens per sample (default: 32)")

    def __init__(self, every, prompt, num_samples, sample_tokens):
        super().__init__(every)
        self.prompt, self.num_samples, self.sample_tokens = prompt, num_samples, sample_tokens

    @classmethod
    def prepare(cls, cfg):
        if not (cfg.sample_every or "sample_prompt" in cfg.given):  # a prompt typed is checked though sampling is off
            return None
        import sample
        from tokenizer import get_tokenizer
        try:
            prompt = sample.encode_prompt(get_tokenizer(), cfg.sample_prompt, cfg.block_size)
        except UserError as e:
            raise UserError(f"--sample-prompt: {e}")
        return cls(cfg.sample_every, prompt, cfg.num_samples, cfg.sample_tokens) if cfg.sample_every else None

    def due(self, step, max_steps):
        return step > 0 and super().due(step, max_steps)

    def run(self, step, stop):
        ctx = self.ctx
        if not (ctx.ranks.is_master or ctx.fsdp):
            return None
        import sample
        try:
            generator = torch.Generator(device=ctx.ranks.device).manual_seed(ctx.seed + step)
            with parallel.uncompiled(ctx.raw_model), device.autocast(ctx.ranks.device, ctx.dtype):
                texts = sample.training_samples(ctx.raw_model, self.prompt, self.num_samples, self.sample_tokens,
                                                generator, None if ctx.fsdp else stop)
        except Exception as e:  # noqa: BLE001
            if ctx.fsdp:  # the other ranks may be inside a collective forward: this rank cannot go on alone
                raise
            ctx.log.line(f"step {step} | samples failed, training goes on ({type(e).__name__}: "
                         f"{common.first_line(e)})")
            return None
        if texts is None:  # a stop request cut them short
            return None
        for i, text in enumerate(texts):
            ctx.log.line(f"sample {i} | {text}")
            ctx.log.record("sample", step=step, index=i, text=text)
        return True


REGISTRY = []  # the evaluations a run may have, in the order they run at a step


def register(cls):
    """Make an Evaluation class part of every run that its prepare() turns on."""
    REGISTRY.append(cls)
    return cls


class Evaluations(list):
    """Those that are on, in the order they run, and what the run header and record say of them."""

    def start(self, ctx):
        self.ctx = ctx
        for ev in self:
            ev.start(ctx)

    def notes(self):
        return [note for ev in self if (note := ev.note())]

    def describe(self):
        return {ev.kind: ev.describe() for ev in self if ev.kind}


def prepare(cfg):
    """The evaluations the settings turn on, their inputs read (before the process group forms)."""
    return Evaluations(ev for cls in REGISTRY if (ev := cls.prepare(cfg)) is not None)


def evaluate(evaluations, step, max_steps, stop):
    """The evaluations due at the top of this step, in turn. False if a stop request cut one short (then nothing of
    the round is logged): the ranks agree on it after any evaluation that recorded nothing, and after one that not
    every rank runs."""
    if not evaluations:
        return True
    ctx = evaluations.ctx
    evaluated = False
    with ctx.log.round() as round_:  # a round a stop cuts short records nothing: the resume evaluates it again
        for ev in evaluations:
            if not ev.due(step, max_steps):
                continue
            done = ev.run(step, stop)
            if (done is None or ev.agree_after) and parallel.any_rank(stop.signal is not None, ctx.ranks):
                round_.cancel()
                return False
            evaluated = evaluated or (done is not None and ev.kind is not None)
    if evaluated and ctx.plotter:
        ctx.plotter.kick()
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


for _evaluation in (Validation, HellaSwag, Core, Samples):
    register(_evaluation)
