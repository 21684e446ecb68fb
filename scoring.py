"""
Scoring continuations with a GPT: the evaluation that HellaSwag (hellaswag.py) and CORE (core.py)
share. evaluate() runs one on every rank, the same steps for both: each rank renders its share of
the items (rank::world_size) as rows, the model scores the rows in eval mode batch by batch (a stop
request and FSDP's collective forwards keep all ranks in step), each item is judged from its
options' scores, and the tallies are summed over ranks. The benchmark supplies the pieces that are
its own (hellaswag.HellaSwag, core.Core): how an item becomes rows, what its options' scores make
of it, and what the summed tallies say.

An item becomes one row or more: a prefix its options share, then each option as its own
sequence (its own context, if any, and the continuation that is scored), side by side:

    multiple choice   prefix = the question, options = ([], each answer)       (HellaSwag too)
    schema            prefix = nothing,      options = (each context, the one continuation)
    language model    prefix = the context,  options = ([], the continuation)

An attention mask lets each option see the prefix and itself only, and positions restart where
the prefix ends, so every option is scored exactly as in its own sequence while the prefix is
computed once. Rows are sorted by length and a batch of them shares one forward pass. What comes
out per option: the summed loss of its continuation tokens, their count, and whether each of them
was the model's greedy prediction.

Also here: the trainer's hook around evaluate(), the command line the two scripts share, and the
download of their data into a cache.
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
from device import autocast, compile_blocker, device_name, pick_dtype

SEQ_BUCKET = 32  # a compiled model's sequence lengths are padded to a multiple of this: few shapes
LOGIT_CHUNK = 2 ** 27  # at most this many logits are upcast to float32 at once (512 MB)
CONNECT_TIMEOUT = 5  # seconds to wait for a download's host to answer before calling it offline


# ----------------------------------------------------------------------------------------------
# One evaluation


def evaluate(model, bench, device, dtype="float32", batch_size=None, rank=0, world_size=1, progress=False,
             should_stop=None, lockstep=False, share=None):
    """bench.result() of the summed tallies over bench.items, or None when should_stop said so.
    Every rank calls it: each scores its share of the items, and the tallies are summed over ranks
    when torch.distributed is initialised and world_size > 1.
    model: a GPT (model(idx, pos=, mask=) -> (logits, loss)), also torch.compile'd; the model
    itself, not a DDP wrapper. It is put in eval mode and its train/eval state restored afterwards.
    bench: the benchmark's pieces (hellaswag.HellaSwag, core.Core):
        name      the progress bar's word for it
        items     what is shared out over the ranks
        rows(item, block_size) -> the item as rows for scored_batches, its options in order
        tallies   (slots, marks): how many tallies, and how many marks an item earns in its tally
        marks(item, sums, counts, exact) -> (slot, marks): from the scores of the item's options
                  (scored_batches'), its tally and its marks there (ints, or bools: right or not)
        result(tally) -> the result, from the tallies summed over ranks: a list per slot, each
                  mark's count and then the items'
    batch_size: rows per forward pass (default: default_batch_size(device)).
    progress: show a tqdm bar; should_stop, lockstep: see drain; share: this rank's share_of() the
    bench, when it was rendered before (the trainer renders it once for the run)."""
    batch_size = batch_size or default_batch_size(device)
    share = share or share_of(bench, model.config.block_size, rank, world_size)
    distributed = world_size > 1 and tdist.is_available() and tdist.is_initialized()
    # as many batches on every rank, at least the longest share's: every item is a row or more,
    # and where the rows per item vary (CORE), the ranks ask each other
    batches = torch.tensor([n_batches(max(len(share.rows), share.longest), batch_size)], device=device)
    if distributed:
        tdist.all_reduce(batches, op=tdist.ReduceOp.MAX)
    was_training = model.training
    model.eval()
    try:
        scored = drain(model, scored_batches(model, share.rows, device, dtype, batch_size), int(batches.item()),
                       device, dtype, should_stop, lockstep, bench.name if progress else None)
    finally:
        model.train(was_training)
    if scored is STOPPED:
        return None
    slots, n_marks = bench.tallies
    tally = torch.zeros(slots, n_marks + 1, dtype=torch.long)  # per slot: each mark's count, then the items'
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
    """What one rank scores of a benchmark: its items, their rows for scored_batches, and where each
    item's options start among the rows' options (and where the last one ends). The same at every
    evaluation of a run."""
    items: list
    rows: list
    option_start: list
    longest: int  # the items in the longest share, rank 0's


def share_of(bench, block_size, rank=0, world_size=1):
    """This rank's Share of bench.items (items rank::world_size), rendered for a model of block_size."""
    mine = [bench.items[k] for k in shard(len(bench.items), rank, world_size)]
    rows, option_start = [], [0]
    for item in mine:
        these = bench.rows(item, block_size)
        rows += these
        option_start.append(option_start[-1] + n_options(these))
    return Share(mine, rows, option_start, len(shard(len(bench.items), 0, world_size)))


def shard(n, rank, world_size):
    """Indices of the items rank scores: every item once over all ranks, none twice."""
    return range(rank, n, world_size)


def n_batches(n_rows, batch_size):
    """Forward passes for n_rows at batch_size rows each."""
    return -(-n_rows // batch_size)


def default_batch_size(device):
    """Rows per forward pass: 16 on a GPU; 4 on CPU, where a forward is compute-bound already and
    larger batches measured slower (BENCHMARKS.md)."""
    return 16 if device.startswith("cuda") else 4


STOPPED = object()  # what drain() returns when a stop request ended it


def drain(model, scores, batches, device, dtype, should_stop=None, lockstep=False, progress=None):
    """Run `scores` (a scored_batches generator over this rank's share of the rows) to its end and
    return its last result (None for an empty share), or STOPPED. batches: the same number on every
    rank, at least the batches of the longest share.
    should_stop: None, or a function called before each batch; when it returns True, drain returns
    STOPPED at once. It may be a collective (an all-reduce of every rank's flag): every rank calls it
    `batches` times, also where its own share is shorter or used up, and all ranks see the same
    answers, so all stop together.
    lockstep: every rank makes that same number of forward passes too (under FSDP each forward
    gathers parameters from all ranks): a rank past its share runs a one-token pass instead.
    progress: a description for a tqdm bar, or None."""
    steps = range(batches)
    if progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc=progress, unit="batch", dynamic_ncols=True)
    last = None
    for _ in steps:
        if should_stop is not None and should_stop():
            return STOPPED
        scored = next(scores, None)
        if scored is not None:
            last = scored
        elif lockstep:  # past the end of this rank's share: keep the others' collectives company
            with torch.no_grad(), autocast(device, dtype):
                model(torch.zeros((1, 1), dtype=torch.long, device=device))
    return last


# ----------------------------------------------------------------------------------------------
# Scoring rows


@torch.no_grad()
def scored_batches(model, rows, device, dtype="float32", batch_size=4):
    """Scores rows batch by batch: yields (sums, counts, exact) after each forward pass, the same
    three tensors each time (float64, float64, bool; one entry per option, the rows' options in
    order) with the rows scored so far filled in; once, with no forward pass, when there is nothing
    to score. rows: [(prefix, [(own context, continuation)])], each at most the model's block_size
    long once packed.
    An option with an empty continuation is not scored: sum 0 and count 0 (so its mean is NaN) and
    exact True, what a mean and an all() over no tokens give. An option the same as one before it
    (the same prefix, context and continuation: in its row, or a row of its own) is scored once and
    shares that one's scores: the same tokens elsewhere in a row, or in another batch, can round
    differently in the last bits, and a pick between equal options must not follow the batching."""
    total = n_options(rows)
    stand_in = list(range(total))  # each option's scores come from this one: itself, or the first one like it
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
    counts = torch.tensor([len(c) for _, options in rows for _, c in options], dtype=torch.float64)
    sums = torch.zeros(total, dtype=torch.float64)
    exact = counts == 0
    stand_in = torch.tensor(stand_in, dtype=torch.long)
    copies = torch.nonzero(stand_in != torch.arange(total)).flatten()
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
        losses, greedy = target_scores(logits, torch.tensor(where, device=device),
                                       torch.tensor(targets, device=device))
        option_of = torch.tensor(option_of)
        sums.index_add_(0, option_of, losses.double().cpu())
        missed = torch.zeros(total, dtype=torch.long).index_add_(0, option_of, (~greedy).long().cpu())
        touched = torch.zeros(total, dtype=torch.bool)
        touched[option_of] = True
        exact |= touched & (missed == 0)
        sums[copies], exact[copies] = sums[stand_in[copies]], exact[stand_in[copies]]
        yield sums, counts, exact
    if rows and not todo:
        # every option was judged without its scores (nothing to score): a one-token pass all the
        # same, so that each batch is one forward, which FSDP's ranks make in step (drain)
        with autocast(device, dtype):
            model(torch.zeros((1, 1), dtype=torch.long, device=device))
        yield sums, counts, exact


def n_options(rows):
    """How many options the rows hold in all."""
    return sum(len(options) for _, options in rows)


def pack(prefix, options):
    """One row, as lists: tokens; pos, each token's position in its own sequence (an option starts
    where the prefix ends); seg, 0 for the prefix and j + 1 for option j; where, the index of the
    token that predicts each continuation token (the one before it in its own sequence), option by
    option, in order. options: [(own context tokens, continuation tokens)]; a continuation's first
    token needs something before it, in the option's context or the prefix."""
    tokens, pos, seg, where = list(prefix), list(range(len(prefix))), [0] * len(prefix), []
    for j, (own, continuation) in enumerate(options):
        assert continuation and (own or prefix), "a continuation needs a token before it"
        start = len(tokens)
        tokens += own + continuation
        pos += range(len(prefix), len(prefix) + len(own) + len(continuation))
        seg += [j + 1] * (len(own) + len(continuation))
        first = start + len(own)  # the continuation's first token
        before = first - 1 if own else len(prefix) - 1
        where += [before] + list(range(first, first + len(continuation) - 1))
    return tokens, pos, seg, where


def attention_mask(seg):
    """(B, 1, T, T) bool from seg (B, T): token i sees token j <= i when j is prefix (seg 0) or in
    i's own segment. Padding (seg -1) sees the prefix and padding, so no row is all False."""
    T = seg.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    sees = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # (B, T, T)
    return (sees & causal)[:, None]


def target_scores(logits, where, targets):
    """For targets at flat positions `where` of logits (B, T, V): each one's loss (float32) and
    whether it was the argmax. Only the scored positions are upcast and normalised, a chunk at a
    time so bf16 logits don't double in memory. Padded ids hold -inf: logsumexp and a gather never
    multiply -inf by zero, and they are never the argmax."""
    flat = logits.view(-1, logits.size(-1))
    step = max(1, LOGIT_CHUNK // flat.size(1))
    losses, greedy = [], []
    for i in range(0, len(where), step):
        lg = flat[where[i:i + step]].float()  # (scored positions, V)
        t = targets[i:i + step]
        losses.append(torch.logsumexp(lg, dim=-1) - lg.gather(-1, t[:, None]).squeeze(-1))
        greedy.append(lg.argmax(dim=-1) == t)
    return torch.cat(losses), torch.cat(greedy)


# ----------------------------------------------------------------------------------------------
# Inside train_gpt2.py


class TrainingHook:
    """An evaluation inside train_gpt2.py (HellaSwag, CORE), called at the top of a step:
    hook(raw_model, dtype, should_stop) -> the result, or None (should_stop said so, or there is no
    data). load() -> the benchmark with its items (a UserError when they cannot be had), at the
    first call; if they cannot be had on any rank, that is said once in the run's log and the
    evaluation stays off for the rest of the run (the ranks agree first: the reductions inside
    would hang otherwise). This rank's share is rendered then too, once for the run. On a terminal
    rank 0 shows a bar, elsewhere one line: scoring 10,042 items takes minutes on a slow GPU.
    name: the record kind and the log's word for it; lockstep: every rank makes the same number of
    forward passes (FSDP); report(result) -> (the log line's text, the record's fields)."""

    def __init__(self, name, load, ranks, log, lockstep):
        self.name, self.load, self.ranks, self.log, self.lockstep = name, load, ranks, log, lockstep
        self.bench = self.share = None
        self.failed = False

    def __call__(self, raw_model, dtype, should_stop):
        if self.failed:
            return None
        ranks = self.ranks
        if self.bench is None:
            bench, error = None, None
            try:
                bench = self.load()
            except UserError as e:
                error = str(e)
            if not all(parallel.gather(bench is not None, ranks)):
                self.failed = True
                self.log.line(f"{self.name}: skipped for this run ({error or 'data missing on another rank'})")
                return None
            self.bench = bench
            self.share = share_of(bench, raw_model.config.block_size, ranks.rank, ranks.world_size)
        bar = ranks.is_master and sys.stdout.isatty()
        if ranks.is_master and not bar:
            self.log.line(f"{self.name}: scoring {len(self.bench.items):,} items on {ranks.world_size} rank(s)...")
        return evaluate(raw_model, self.bench, ranks.device, dtype, rank=ranks.rank, world_size=ranks.world_size,
                        progress=bar, should_stop=should_stop, lockstep=self.lockstep, share=self.share)

    def report(self, result):
        """(the log line's text, the record's fields): the benchmark's report of the result."""
        return self.bench.report(result)


# ----------------------------------------------------------------------------------------------
# The command line hellaswag.py and core.py share


def add_arguments(p, json_holds):
    """The flags of a scoring script besides its data: the model, batching, device, dtype, compile
    and --json (json_holds: what its JSON line holds)."""
    p.add_argument("--model", required=True,
                   help="Hugging Face name or directory (gpt2, gpt2-medium, ...), a checkpoint written "
                        "by train_gpt2.py, or a log directory (its latest checkpoint)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="items per forward pass (default: 16 on a GPU; 4 on CPU, where larger "
                        "batches measured slower, see BENCHMARKS.md)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--dtype", default="auto",
                   help="autocast dtype: auto, bfloat16, float16, float32 (default auto: bf16 on recent "
                        "GPUs, fp32 on CPU); losses are always computed in float32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model first")
    p.add_argument("--json", action="store_true",
                   help=f"print one JSON line ({json_holds}) on stdout; the summary goes to stderr")


def check_counts(args, names):
    """One line for a count flag below 1 (--limit, --batch-size)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def run_script(args, load, describe_data, show):
    """A scoring script's main, under torchrun too: load() -> the benchmark with its items; the
    model from --model; describe_data(bench) -> what the first line says of the items; evaluate();
    show(result, seconds) -> the summary's text. The summary goes to stdout, or to stderr with
    --json, where stdout holds only the JSON line."""
    ranks = parallel.setup_distributed(args.device)
    summary = sys.stderr if args.json else sys.stdout
    try:
        blocker = compile_blocker(ranks.device) if args.compile else None
        if blocker:  # else inductor's traceback, at the first forward pass
            raise UserError(f"--compile: {blocker}; leave it out")
        dtype = pick_dtype(args.dtype, ranks.device)
        bench = load()
        model, what = checkpoint.load_model(args.model, ranks.device)
        if args.compile:
            model = torch.compile(model)
        common.print0(f"{bench.name}: {describe_data(bench)}, {what}, {ranks.world_size} process(es) on "
                      f"{device_name(ranks.device)}, {dtype}", file=summary)
        t0 = time.time()
        result = evaluate(model, bench, ranks.device, dtype, args.batch_size, ranks.rank, ranks.world_size,
                          progress=ranks.is_master)
        common.print0(show(result, time.time() - t0), file=summary)
        if args.json:
            common.print0(json.dumps({**result, "model": args.model}))
    finally:
        parallel.teardown_distributed()


# ----------------------------------------------------------------------------------------------
# Data downloaded once


def download(url, path, what, hint, fill, timeout, present=os.path.isfile):
    """path, downloaded from url the first time: once present(path), no network is asked.
    fill(response, tmp) writes what urlopen(url) answers into tmp, a new directory beside path, and
    returns what in tmp is to be at path; a rename puts it there, so path is whole or absent, also
    when every rank downloads at once. what: the data's name in the one-line errors; hint: what to
    do instead (the flag for a local copy); timeout: seconds of silence from the server before the
    download is given up."""
    if present(path):
        return path
    # probed first: offline, urllib alone can wait out a dropped connection for the whole read timeout
    problem = common.unreachable(url, CONNECT_TIMEOUT)
    if problem:
        raise UserError(f"{what} is not in the cache ({path}) and {problem}; {hint}")
    cache_dir = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", dir=cache_dir)
        with urllib.request.urlopen(url, timeout=timeout) as response:
            made = fill(response, tmp)
        common.fsync_path(made)
        try:
            os.replace(made, path)
        except OSError:
            if not present(path):  # else another rank (or process) put a whole one there first
                raise
        common.fsync_path(cache_dir)  # the rename too
    except (urllib.error.URLError, OSError, zipfile.BadZipFile) as e:
        raise UserError(f"could not download {what} from {url} ({getattr(e, 'reason', None) or e}); {hint}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return path
