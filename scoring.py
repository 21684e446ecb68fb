"""
Scoring continuations with a GPT, for HellaSwag (hellaswag.py) and CORE (core.py): the evaluation, the
trainer's hook, the scripts' command line and the download of their data.

A benchmark (hellaswag.HellaSwag, core.Core) has: name; items (rank r scores items[r::world_size]);
rows(item, block_size), the item as rows, its options in order; tallies = (slots, marks per item);
marks(item, sums, counts, exact) -> (slot, marks) from its options' scores; result(tally) from each slot's
mark counts and item count, summed over ranks; report(result) -> the trainer's log text and record.

A row is a prefix its options share, then each option as its own sequence (its own context, if any, and the
scored continuation), side by side:

    multiple choice   prefix = the question, options = ([], each answer)       (HellaSwag too)
    schema            prefix = nothing,      options = (each context, the one continuation)
    language model    prefix = the context,  options = ([], the continuation)

An attention mask lets each option see the prefix and itself only, and positions restart where the prefix
ends, so every option is scored as in its own sequence while the prefix is computed once. Per option come
out the summed loss of its continuation tokens, their count, and whether each was the greedy prediction.
"""

import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass

import torch
import torch.distributed as tdist

import checkpoint
import common
import parallel
from common import UserError
from device import autocast, choose, configure_backends

SEQ_BUCKET = 32  # a compiled model's sequence lengths are padded to a multiple of this: few shapes
LOGIT_CHUNK = 2 ** 27  # at most this many logits are upcast to float32 at once (512 MB)
CONNECT_TIMEOUT = 5  # seconds to wait for a download's host to answer before calling it offline
READ_TIMEOUT = 60  # seconds of silence from the server before a download is given up


@dataclass(frozen=True)
class Scoring:
    """How a benchmark is scored: on device, under dtype's autocast, batch_size items' rows at a time (None: 16 on
    CUDA, 4 elsewhere: larger measured slower on a CPU), this rank's share of world_size; progress: a bar; lockstep:
    every rank makes as many forward passes (under FSDP each one gathers the parameters)."""
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int | None = None
    rank: int = 0
    world_size: int = 1
    progress: bool = False
    lockstep: bool = False


def evaluate(model, bench, how=Scoring(), should_stop=None, share=None):
    """bench.result() of the tallies summed over ranks, scored as how (a Scoring) says, or None when should_stop()
    said True; every rank calls it with the GPT itself, not a DDP wrapper. should_stop may be a collective, called by
    every rank before each batch; share: this rank's share_of the bench, where it is already made."""
    device, dtype, rank, world_size = how.device, how.dtype, how.rank, how.world_size
    batch_size = how.batch_size or (16 if device.startswith("cuda") else 4)
    share = share or share_of(bench, model.config.block_size, rank, world_size)
    distributed = world_size > 1 and tdist.is_available() and tdist.is_initialized()
    # every rank runs as many batches as the longest share needs; CORE's rows per item vary, so the ranks ask
    longest = -(-len(bench.items) // world_size)  # the items in the longest share, rank 0's
    batches = torch.tensor([-(-max(len(share.rows), longest) // batch_size)], device=device)
    if distributed:
        tdist.all_reduce(batches, op=tdist.ReduceOp.MAX)
    steps = range(int(batches.item()))
    if how.progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc=bench.name, unit="batch", dynamic_ncols=True)
    batched = scored_batches(model, share.rows, device, dtype, batch_size)
    scored = None
    was_training = model.training
    model.eval()
    try:
        for _ in steps:
            if should_stop is not None and should_stop():
                return None
            batch = next(batched, None)
            if batch is not None:
                scored = batch
            elif how.lockstep:  # past the end of this rank's share
                idle_forward(model, device, dtype)
    finally:
        model.train(was_training)
    slots, n_marks = bench.tallies
    tally = torch.zeros(slots, n_marks + 1, dtype=torch.long)
    for k, item in enumerate(share.items):
        a, b = share.option_start[k], share.option_start[k + 1]
        slot, marks = bench.marks(item, *(scores[a:b] for scores in scored))
        tally[slot] += torch.tensor((*marks, 1))
    tally = tally.to(device)
    if distributed:
        tdist.all_reduce(tally, op=tdist.ReduceOp.SUM)
    return bench.result(tally.tolist())


@dataclass
class Share:
    """What one rank scores: its items, their rows, and where each item's options start (and the last ends)."""
    items: list
    rows: list
    option_start: list


def share_of(bench, block_size, rank=0, world_size=1):
    """This rank's Share of bench.items (items rank::world_size), rendered for a model of block_size."""
    mine = bench.items[rank::world_size]
    rows, option_start = [], [0]
    for item in mine:
        these = bench.rows(item, block_size)
        rows += these
        option_start.append(option_start[-1] + sum(len(options) for _, options in these))
    return Share(mine, rows, option_start)


@torch.no_grad()
def idle_forward(model, device, dtype):
    """A one-token forward pass, for a rank that has nothing to score when the others make theirs."""
    with autocast(device, dtype):
        model(torch.zeros((1, 1), dtype=torch.long, device=device))


@torch.no_grad()
def scored_batches(model, rows, device, dtype="float32", batch_size=4):
    """Scores rows, yielding after each forward pass: the last yield holds every option's (sums, counts, exact), an
    empty continuation's 0, 0, True. An option like one before it shares its scores: scored elsewhere, the same
    tokens can round differently in the last bits, and a pick between equal options must not follow the batching."""
    counts = torch.tensor([len(c) for _, options in rows for _, c in options], dtype=torch.float64)
    stand_in = list(range(len(counts)))  # each option's scores come from this one: itself, or the first one like it
    todo, first_of = [], {}  # todo: the rows to pack, [(prefix, [(option index, own, continuation)])]
    k = 0
    for prefix, options in rows:
        kept, key_prefix = [], tuple(prefix)
        for own, continuation in options:
            key = (key_prefix, tuple(own), tuple(continuation))
            if key in first_of:
                stand_in[k] = first_of[key]
            elif continuation:
                first_of[key] = k
                kept.append((k, own, continuation))
            k += 1
        if kept:
            todo.append((prefix, kept))
    packed = [pack(prefix, [(own, c) for _, own, c in kept]) for prefix, kept in todo]
    compiled = hasattr(model, "_orig_mod")  # torch.compile'd: recompiles for every new shape
    bucket = SEQ_BUCKET if compiled else 8  # eager: just enough rounding for tensor-core shapes
    order = sorted(range(len(todo)), key=lambda i: -len(packed[i][0]))  # longest first: an OOM shows at once
    sums = torch.zeros(len(counts), dtype=torch.float64)
    exact = torch.ones(len(counts), dtype=torch.bool)
    stand_in = torch.tensor(stand_in, dtype=torch.long)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        T = -(-max(len(packed[i][0]) for i in batch) // bucket) * bucket
        B = min(batch_size, len(todo)) if compiled else len(batch)  # compiled: the last batch too
        idx = torch.zeros(B, T, dtype=torch.long)
        pos = torch.zeros(B, T, dtype=torch.long)
        seg = torch.full((B, T), -1, dtype=torch.long)
        where, targets, option_of = [], [], []  # per scored token: flat position predicting it, token, option
        for b, i in enumerate(batch):
            tokens, p, s, w = packed[i]
            n = len(tokens)
            idx[b, :n], pos[b, :n], seg[b, :n] = torch.tensor(tokens), torch.tensor(p), torch.tensor(s)
            where += [b * T + j for j in w]
            for k, _, continuation in todo[i][1]:
                targets += continuation
                option_of += [k] * len(continuation)
        idx, pos, seg = idx.to(device), pos.to(device), seg.to(device)
        with autocast(device, dtype):
            logits, _ = model(idx, pos=pos, mask=attention_mask(seg))
        losses, greedy = target_scores(logits, torch.tensor(where, device=device), torch.tensor(targets, device=device))
        option_of = torch.tensor(option_of)
        sums.index_add_(0, option_of, losses.double().cpu())
        exact[option_of[~greedy.cpu()]] = False
        yield sums[stand_in], counts, exact[stand_in]
    if rows and not todo:  # nothing to score: a forward pass all the same, as the other ranks make theirs
        idle_forward(model, device, dtype)
        yield sums[stand_in], counts, exact[stand_in]


def pack(prefix, options):
    """One row as lists: tokens; pos, each token's position in its own sequence; seg, 0 for the
    prefix and j + 1 for option j; where, the index of the token that predicts each continuation
    token, option by option. options: [(own context, continuation)]."""
    tokens, pos, seg, where = list(prefix), list(range(len(prefix))), [0] * len(prefix), []
    for j, (own, continuation) in enumerate(options):
        first = len(tokens) + len(own)  # the continuation's first token
        before = first - 1 if own else len(prefix) - 1
        where += [before] + list(range(first, first + len(continuation) - 1))
        tokens += own + continuation
        pos += range(len(prefix), len(prefix) + len(own) + len(continuation))
        seg += [j + 1] * (len(own) + len(continuation))
    return tokens, pos, seg, where


def attention_mask(seg):
    """(B, 1, T, T) bool from seg (B, T): token i sees token j <= i when j is prefix (seg 0) or in
    i's own segment. Padding (seg -1) sees the prefix and padding, so no row is all False."""
    T = seg.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    sees = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # (B, T, T)
    return (sees & causal)[:, None]


def target_scores(logits, where, targets):
    """Each target's loss (float32) at flat positions `where` of logits (B, T, V), and whether it
    was the argmax; upcast a chunk at a time, so bf16 logits don't double in memory."""
    flat = logits.view(-1, logits.size(-1))
    step = max(1, LOGIT_CHUNK // flat.size(1))
    losses, greedy = [], []
    for i in range(0, len(where), step):
        lg = flat[where[i:i + step]].float()  # (scored positions, V)
        t = targets[i:i + step]
        losses.append(torch.logsumexp(lg, dim=-1) - lg.gather(-1, t[:, None]).squeeze(-1))
        greedy.append(lg.argmax(dim=-1) == t)
    return torch.cat(losses), torch.cat(greedy)


class TrainingHook:
    """An evaluation in train_gpt2.py: hook(raw_model, dtype, should_stop) -> the result, or None. load() runs at the
    first call; where any rank cannot load (a UserError), the log says so once and the hook stays off."""

    def __init__(self, name, load, ranks, log, lockstep):
        self.name, self.load, self.ranks, self.log, self.lockstep = name, load, ranks, log, lockstep
        self.bench = self.share = None

    def __call__(self, raw_model, dtype, should_stop):
        ranks = self.ranks
        if self.load is not None:  # the first call
            error = None
            try:
                self.bench = self.load()
            except UserError as e:
                error = str(e)
            self.load = None
            if not parallel.any_rank(self.bench is None, ranks):  # agreed first: a lone rank would hang the rest
                self.share = share_of(self.bench, raw_model.config.block_size, ranks.rank, ranks.world_size)
            else:
                self.log.line(f"{self.name}: skipped for this run ({error or 'data missing on another rank'})")
        if self.share is None:
            return None
        bar = ranks.is_master and sys.stdout.isatty()
        if ranks.is_master and not bar:
            self.log.line(f"{self.name}: scoring {len(self.bench.items):,} items on {ranks.world_size} rank(s)...")
        how = Scoring(ranks.device, dtype, rank=ranks.rank, world_size=ranks.world_size, progress=bar,
                      lockstep=self.lockstep)
        return evaluate(raw_model, self.bench, how, should_stop, self.share)


def parse_args(p, argv, json_holds, cache):
    """A scoring script's command line, checked: p holds its data flags; cache: cache_dir's env and name."""
    env, name = cache
    p.add_argument("--cache-dir", default=None, help=f"where the download is kept (default ${env} or ~/.cache/{name})")
    p.add_argument("--model", required=True, help="a checkpoint written by train_gpt2.py, a log directory (its "
                                                  "latest checkpoint), or a Hugging Face name or directory (gpt2, ...)")
    p.add_argument("--batch-size", type=int, help="items per forward pass (default: 16 on a GPU, 4 on CPU)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--dtype", default="auto", help="autocast dtype: auto, bfloat16, float16, float32 (default auto: "
                                                   "bf16 on recent GPUs, fp32 on CPU); losses are always in float32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model first")
    p.add_argument("--json", action="store_true", help=f"one JSON line ({json_holds}) on stdout, the summary on stderr")
    args = p.parse_args(argv)
    for flag, value in (("--limit", args.limit), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    return args


def run_script(args, load, describe_data, show):
    """A scoring script's main, under torchrun too: describe_data(bench) -> what the first line says of its items;
    show(result, seconds) -> the summary, on stdout, or on stderr with --json (stdout: the JSON line alone)."""
    ranks = parallel.setup_distributed(args.device)
    summary = sys.stderr if args.json else sys.stdout
    try:
        choice = choose(ranks.device, args.dtype, args.compile, compile_typed=True)  # not inductor's traceback
        dtype = choice.dtype
        bench = load()
        model, what = checkpoint.load_model(args.model, ranks.device)
        configure_backends(choice, deterministic=False)
        if choice.compile:
            model = torch.compile(model)
        common.print0(f"{bench.name}: {describe_data(bench)}, {what}, {ranks.world_size} process(es) on "
                      f"{choice.name}, {dtype}", file=summary)
        t0 = time.time()
        result = evaluate(model, bench, Scoring(ranks.device, dtype, args.batch_size, ranks.rank, ranks.world_size,
                                                progress=ranks.is_master))
        common.print0(show(result, time.time() - t0), file=summary)
        if args.json:
            common.print0(json.dumps({**result, "model": args.model}))
    finally:
        parallel.teardown_distributed()


def cache_dir(given, env, name):
    return given or os.environ.get(env) or os.path.join(os.path.expanduser("~"), ".cache", name)


def download(url, path, what, hint, unpack=None, present=os.path.isfile):
    """path, downloaded from url the first time: saved in a new directory beside path, unpack(saved file, that
    directory) -> what is to be at path (default: the saved file), renamed into place, so path is whole or
    absent, also when every rank downloads at once. what: the data's name in errors; hint: what to do instead."""
    if present(path):
        return path
    # probed first: offline, urllib alone can wait out a dropped connection for the whole read timeout
    problem = common.unreachable(url, CONNECT_TIMEOUT)
    if problem:
        raise UserError(f"{what} is not in the cache ({path}) and {problem}; {hint}")
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{os.path.basename(path)}.", dir=directory,
                                         ignore_cleanup_errors=True) as tmp:
            saved = os.path.join(tmp, "download")
            with urllib.request.urlopen(url, timeout=READ_TIMEOUT) as response, open(saved, "wb") as f:
                shutil.copyfileobj(response, f)
            made = unpack(saved, tmp) if unpack else saved
            common.fsync_path(made)
            try:
                os.replace(made, path)
            except OSError:
                if not present(path):  # else another rank (or process) put a whole one there first
                    raise
        common.fsync_path(directory)  # the rename too
    except (urllib.error.URLError, OSError, zipfile.BadZipFile) as e:
        raise UserError(f"could not download {what} from {url} ({getattr(e, 'reason', None) or e}); {hint}")
    return path
