"""
HellaSwag (Zellers et al. 2019) in the completion style used for GPT-2: the context followed by
each of the 4 endings; the model's loss over the ending tokens picks the answer.
  acc       the ending with the lowest summed loss
  acc_norm  the ending with the lowest mean loss per ending token
For OpenAI's GPT-2 124M this gives acc 0.2859, acc_norm 0.2955 on the 10,042 validation items
(GPT-3 124M: 0.337, from the GPT-3 paper). Follows build-nanogpt's hellaswag.py, batched (scoring.py: the engine shared with core.py).

    python hellaswag.py --model gpt2                  # Hugging Face name or directory
    python hellaswag.py --model log/ --limit 500      # latest checkpoint written by train_gpt2.py
    torchrun --nproc_per_node=8 hellaswag.py --model log/ckpt_019073.pt --json

The trainer imports load_items() and evaluate(); evaluate() is rank-aware, takes a
torch.compile'd model, and stops between batches when its should_stop says so.
Offline: --data-file path/to/hellaswag_val.jsonl, or the copy cached by an earlier download.
"""

import bz2
import gzip
import json
import lzma
import os
import urllib.error
import urllib.request

import torch
import torch.distributed as tdist

import common
import scoring
from tokenizer import EOT_TOKEN, get_tokenizer

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_VAL_ITEMS = 10042
N_ENDINGS = 4
CONNECT_TIMEOUT = 5  # seconds to wait for the download's host to answer before calling it offline
READ_TIMEOUT = 30  # seconds of silence from the server before a download is given up

# ----------------------------------------------------------------------------------------------
# Data


def default_cache_dir():
    """Where the downloaded file is kept: $HELLASWAG_CACHE or ~/.cache/gpt2-hellaswag."""
    return os.environ.get("HELLASWAG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gpt2-hellaswag")


OFFLINE_HINT = "pass a local copy with {flag} path/to/" + HELLASWAG_FILE


def download(cache_dir=None, flag="--data-file"):
    """Path of the cached validation file, fetched once: once cached, no network is asked. Safe
    when every rank calls it at once: each writes its own temporary file and renames it into
    place."""
    cache_dir = cache_dir or default_cache_dir()
    path = os.path.join(cache_dir, HELLASWAG_FILE)
    if os.path.isfile(path):
        return path
    # probed first: offline, urllib alone can wait out a dropped connection for the whole read timeout
    problem = common.unreachable(HELLASWAG_URL, CONNECT_TIMEOUT)
    if problem:
        raise common.UserError(f"HellaSwag is not in the cache ({path}) and {problem}; "
                               + OFFLINE_HINT.format(flag=flag))
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with urllib.request.urlopen(HELLASWAG_URL, timeout=READ_TIMEOUT) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise common.UserError(f"could not download HellaSwag from {HELLASWAG_URL} ({reason}); "
                               + OFFLINE_HINT.format(flag=flag))
    common.atomic_write(path, lambda f: f.write(data))
    return path


def parse_item(line, where):
    """One line of the official jsonl -> {ctx, endings, label}; UserError naming the line otherwise."""
    fix = (f"each line must be a JSON object with ctx (a string), endings ({N_ENDINGS} strings) "
           f"and label (0-{N_ENDINGS - 1})")
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise common.UserError(f"{where}: malformed HellaSwag line, {common.json_line_problem(line, e)}; {fix}")
    if not isinstance(d, dict):
        raise common.UserError(f"{where}: malformed HellaSwag line (not an object); {fix}")
    ctx, endings, label = d.get("ctx"), d.get("endings"), d.get("label")
    if isinstance(label, str) and label.isdigit():
        label = int(label)  # some re-distributions store the label as a string
    if "ctx" not in d:
        problem = "no 'ctx'"
    elif not isinstance(ctx, str):
        problem = "'ctx' is not a string"
    elif "endings" not in d:
        problem = "no 'endings'"
    elif not (isinstance(endings, list) and all(isinstance(e, str) for e in endings)):
        problem = "'endings' is not a list of strings"
    elif len(endings) != N_ENDINGS:
        problem = f"{len(endings)} endings, not {N_ENDINGS}"
    elif "label" not in d:
        problem = "no 'label'"
    elif isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < N_ENDINGS:
        problem = f"label {d['label']!r} is not 0-{N_ENDINGS - 1}"
    else:
        return {"ctx": ctx, "endings": endings, "label": label}
    raise common.UserError(f"{where}: malformed HellaSwag line ({problem}); {fix}")


COMPRESSED = ((b"\x1f\x8b", "gzip", gzip), (b"\xfd7zXZ\x00", "xz", lzma), (b"BZh", "bz2", bz2))  # first bytes


def open_text(path):
    """path as UTF-8 text, read through gzip, xz or bz2 when its first bytes say it is compressed
    (a .jsonl.gz copy, say); the name of the compression (or None)."""
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, kind, module in COMPRESSED:
        if head.startswith(magic):
            return module.open(path, "rt", encoding="utf-8", errors="replace"), kind
    return open(path, encoding="utf-8", errors="replace"), None


def load_items(data_file=None, cache_dir=None, limit=None, flag="--data-file"):
    """HellaSwag validation items (dicts with ctx, endings, label), the first `limit` if given.
    data_file: a local jsonl in the official format, or a gzip/xz/bz2 copy of one; else the official
    file, downloaded once into cache_dir (default ~/.cache/gpt2-hellaswag, or $HELLASWAG_CACHE).
    flag: the option an error names for a local copy (the trainer's is --hellaswag-file)."""
    path = data_file if data_file is not None else download(cache_dir, flag)
    if os.path.isdir(path):
        raise common.UserError(f"HellaSwag file {path} is a directory: pass the {HELLASWAG_FILE} file itself")
    if not os.path.isfile(path):
        raise common.UserError(f"HellaSwag file {path} does not exist")
    items, kind = [], None
    try:
        f, kind = open_text(path)
        with f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(items) >= limit:
                    break
                if line.strip():
                    items.append(parse_item(line, f"{path} line {lineno}"))
    except (OSError, EOFError, lzma.LZMAError) as e:  # a damaged archive, or a read error
        what = f"{kind}-compressed " if kind else ""
        raise common.UserError(f"cannot read {what}HellaSwag file {path}: {getattr(e, 'strerror', None) or e}")
    if not items:
        raise common.UserError(f"{path} holds no HellaSwag items (the file is empty): pass the {HELLASWAG_FILE} "
                               f"from github.com/rowanz/hellaswag, or leave out {flag} to download it")
    return items


# ----------------------------------------------------------------------------------------------
# Scoring


def render(item, enc, block_size):
    """An item as (context tokens, [ending tokens] * 4); ending j is scored after context + " " +
    ending j. When context + the longest ending exceeds block_size, the context loses tokens from
    the front, the same for all 4 endings (the endings are what gets scored); an ending longer than
    block_size - 1 keeps its first block_size - 1 tokens. An empty context becomes <|endoftext|>,
    so that something predicts the ending's first token."""
    ctx = enc.encode_ordinary(item["ctx"]) or [EOT_TOKEN]
    # as in GPT-2's evaluation, the space belongs to the ending
    endings = [enc.encode_ordinary(" " + e)[:block_size - 1] for e in item["endings"]]
    cut = max(0, len(ctx) + max(len(e) for e in endings) - block_size)
    return ctx[cut:], endings


def scored_batches(model, items, device, dtype="float32", batch_size=4):
    """Scores items batch by batch (scoring.scored_batches: the context once, the 4 endings side by
    side in one row): yields (sums, counts) after each forward pass, each (n, 4) float64 on the CPU,
    the same two tensors each time with the rows of the items scored so far filled in."""
    enc = get_tokenizer()
    block_size = scoring.model_block_size(model)
    rows = []
    for item in items:
        ctx, endings = render(item, enc, block_size)
        rows.append((ctx, [([], e) for e in endings]))
    for sums, counts, _ in scoring.scored_batches(model, rows, device, dtype, batch_size):
        yield sums.view(-1, N_ENDINGS), counts.view(-1, N_ENDINGS)


def score_items(model, items, device, dtype="float32", batch_size=4, progress=False):
    """Summed ending loss and ending token count, each (n, 4) float64 on the CPU, for items in the
    order given (see scored_batches)."""
    batches = scored_batches(model, items, device, dtype, batch_size)
    if progress:
        from tqdm import tqdm
        batches = tqdm(batches, total=scoring.n_batches(len(items), batch_size), desc="hellaswag", unit="batch",
                       dynamic_ncols=True)
    sums = counts = torch.zeros(0, N_ENDINGS, dtype=torch.float64)
    for sums, counts in batches:
        pass
    return sums, counts


def evaluate(model, items, device, dtype="float32", batch_size=None, rank=0, world_size=1, progress=False,
             should_stop=None, lockstep=False):
    """{"acc", "acc_norm", "n"} over all items. Each rank scores its share (items rank::world_size);
    the counts are summed over ranks when torch.distributed is initialised and world_size > 1, so
    every rank must call this. model: a GPT (model(idx, pos=, mask=) -> (logits, loss)), also
    torch.compile'd; pass the model itself, not a DDP wrapper. It is put in eval mode and its
    train/eval state restored afterwards. batch_size: items per forward pass, one packed row
    each (default: scoring.default_batch_size(device)).
    should_stop: None, or a function called before each batch; when it returns True, evaluate
    returns None at once (a stop request must not wait for 10,042 items); it may be a collective,
    and lockstep keeps FSDP's forwards in step (see scoring.drain)."""
    batch_size = batch_size or scoring.default_batch_size(device)
    mine = [items[i] for i in scoring.shard(len(items), rank, world_size)]
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        batches = scoring.n_batches(scoring.n_batches(len(items), world_size), batch_size)  # the longest share's
        scored = scoring.drain(model, scored_batches(model, mine, device, dtype, batch_size), batches, device, dtype,
                               should_stop, lockstep, "hellaswag" if progress else None)
        if scored is scoring.STOPPED:
            return None
        if mine:
            sums, counts = scored
            labels = torch.tensor([item["label"] for item in mine])
            correct = int((sums.argmin(dim=1) == labels).sum())
            correct_norm = int(((sums / counts).argmin(dim=1) == labels).sum())
        else:
            correct = correct_norm = 0
    finally:
        if hasattr(model, "train"):
            model.train(was_training)
    totals = torch.tensor([correct, correct_norm, len(mine)], dtype=torch.long, device=device)
    if world_size > 1 and tdist.is_available() and tdist.is_initialized():
        tdist.all_reduce(totals, op=tdist.ReduceOp.SUM)
    correct, correct_norm, n = totals.tolist()
    return {"acc": correct / n if n else 0.0, "acc_norm": correct_norm / n if n else 0.0, "n": n}


# ----------------------------------------------------------------------------------------------
# During training


def training_hook(data_file, limit, ranks, log, lockstep):
    """HellaSwag inside train_gpt2.py (scoring.TrainingHook): data_file, limit: the trainer's
    --hellaswag-file and --hellaswag-limit; ranks: its parallel.Ranks; lockstep: every rank makes
    the same number of forward passes (FSDP)."""
    def score(raw_model, items, dtype, should_stop, progress):
        return evaluate(raw_model, items, ranks.device, dtype, rank=ranks.rank, world_size=ranks.world_size,
                        progress=progress, should_stop=should_stop, lockstep=lockstep)

    def report(result):
        return f"acc_norm {result['acc_norm']:.4f} acc {result['acc']:.4f} n {result['n']}", result
    return scoring.TrainingHook("hellaswag", lambda _: load_items(data_file, limit=limit, flag="--hellaswag-file"),
                                len, score, report, ranks, log)


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    """The command line, checked: one-line errors for bad values."""
    p = common.ArgumentParser(description="HellaSwag accuracy of a GPT-2 model (completion style).")
    p.add_argument("--data-file", default=None,
                   help=f"local copy of {HELLASWAG_FILE} (offline use); default: download it once")
    p.add_argument("--cache-dir", default=None,
                   help="where the download is kept (default $HELLASWAG_CACHE or ~/.cache/gpt2-hellaswag)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items (default: all)")
    scoring.add_arguments(p, "acc, acc_norm, n")
    args = p.parse_args(argv)
    scoring.check_counts(args, ("limit", "batch_size"))
    return args


def main(argv=None):
    """python hellaswag.py (or under torchrun): score a model, print acc and acc_norm."""
    args = parse_args(argv)

    def score(model, items, ranks, dtype):
        return evaluate(model, items, ranks.device, dtype, args.batch_size, ranks.rank, ranks.world_size,
                        progress=ranks.is_master)

    def show(result, seconds):
        n = result["n"]
        return (f"acc {result['acc']:.4f} ({round(result['acc'] * n)}/{n})  "
                f"acc_norm {result['acc_norm']:.4f} ({round(result['acc_norm'] * n)}/{n})  "
                f"{n / seconds:.1f} items/s  (OpenAI GPT-2 124M: acc 0.2859, acc_norm 0.2955)")
    scoring.run_script(args, "hellaswag", lambda: load_items(args.data_file, args.cache_dir, args.limit),
                       lambda items: f"{len(items)} items", score, show)


if __name__ == "__main__":
    common.run_main(main)
