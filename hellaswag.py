"""
HellaSwag (Zellers et al. 2019) in the completion style used for GPT-2: the context followed by
each of the 4 endings; the model's loss over the ending tokens picks the answer.
  acc       the ending with the lowest summed loss
  acc_norm  the ending with the lowest mean loss per ending token
For OpenAI's GPT-2 124M this gives acc 0.2859, acc_norm 0.2955 on the 10,042 validation items
(GPT-3 124M: 0.337, from the GPT-3 paper). Follows build-nanogpt's hellaswag.py, batched.

    python hellaswag.py --model gpt2                  # Hugging Face name or directory
    python hellaswag.py --model log/ --limit 500      # latest checkpoint written by train_gpt2.py
    torchrun --nproc_per_node=8 hellaswag.py --model log/ckpt_019072.pt --json

The trainer imports load_items() and evaluate(); evaluate() is rank-aware and takes a
torch.compile'd model.
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

import torch
import torch.distributed as dist

import common

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_VAL_ITEMS = 10042
N_ENDINGS = 4
SEQ_BUCKET = 32  # a compiled model's sequence lengths are padded to a multiple of this: few shapes
LOGIT_CHUNK = 2 ** 27  # at most this many logits are upcast to float32 at once (512 MB)

# ----------------------------------------------------------------------------------------------
# Data


def default_cache_dir():
    return os.environ.get("HELLASWAG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gpt2-hellaswag")


def download(cache_dir=None):
    """Path of the cached validation file, fetched once. Safe when every rank calls it at once:
    each writes its own temporary file and renames it into place."""
    cache_dir = cache_dir or default_cache_dir()
    path = os.path.join(cache_dir, HELLASWAG_FILE)
    if os.path.isfile(path):
        return path
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with urllib.request.urlopen(HELLASWAG_URL, timeout=60) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise common.UserError(f"could not download HellaSwag from {HELLASWAG_URL} ({reason}); "
                               f"offline, pass a local copy of {HELLASWAG_FILE} with --data-file")
    common.atomic_write(path, lambda f: f.write(data))
    return path


def parse_item(line, where):
    """One line of the official jsonl -> {ctx, endings, label}; UserError naming the line otherwise."""
    fix = "each line must be a JSON object with ctx (string), endings (4 strings) and label (0-3)"
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise common.UserError(f"{where}: malformed HellaSwag line ({e.msg}); {fix}")
    if not isinstance(d, dict):
        raise common.UserError(f"{where}: malformed HellaSwag line (not an object); {fix}")
    ctx, endings, label = d.get("ctx"), d.get("endings"), d.get("label")
    if isinstance(label, str) and label.isdigit():
        label = int(label)  # some re-distributions store the label as a string
    if not isinstance(ctx, str):
        problem = "no ctx string"
    elif not (isinstance(endings, list) and len(endings) == N_ENDINGS and all(isinstance(e, str) for e in endings)):
        problem = f"endings is not a list of {N_ENDINGS} strings"
    elif isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < N_ENDINGS:
        problem = f"label {label!r} is not 0-{N_ENDINGS - 1}"
    else:
        return {"ctx": ctx, "endings": endings, "label": label}
    raise common.UserError(f"{where}: malformed HellaSwag line ({problem}); {fix}")


def load_items(data_file=None, cache_dir=None, limit=None):
    """HellaSwag validation items (dicts with ctx, endings, label), the first `limit` if given.
    data_file: a local jsonl in the official format; else the official file, downloaded once into
    cache_dir (default ~/.cache/gpt2-hellaswag, or $HELLASWAG_CACHE)."""
    path = data_file if data_file is not None else download(cache_dir)
    if not os.path.isfile(path):
        raise common.UserError(f"HellaSwag file {path} does not exist")
    items = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if line.strip():
                items.append(parse_item(line, f"{path} line {lineno}"))
    if not items:
        raise common.UserError(f"{path} holds no HellaSwag items")
    return items


# ----------------------------------------------------------------------------------------------
# Scoring


def render(item, enc, block_size):
    """The 4 rows of an item as (tokens, start): tokens = context + " " + ending, and the ending's
    tokens are tokens[start:]. A row longer than block_size loses tokens from the front of the
    context (the ending is what gets scored). An empty context becomes <|endoftext|>, so that
    something predicts the ending's first token."""
    ctx = enc.encode_ordinary(item["ctx"]) or [common.EOT_TOKEN]
    rows = []
    for ending in item["endings"]:
        end = enc.encode_ordinary(" " + ending)  # the space belongs to the ending, as in GPT-2's eval
        tokens, start = ctx + end, len(ctx)
        cut = max(0, len(tokens) - block_size)
        rows.append((tokens[cut:], max(start - cut, 1)))  # position 0 has nothing before it
    return rows


def model_block_size(model):
    """block_size of a GPT, also through torch.compile (which forwards attributes) or DDP (.module)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(getattr(model, "config", None), "block_size", 1024)


def ending_losses(logits, idx, mask):
    """Summed loss per row over the masked target positions, in float32.
    Only the scored positions are upcast and normalised (the context and the padding are most of
    the sequence), a few rows at a time so bf16 logits don't double in memory. logits (B, T, V)
    hold -inf for padded ids: logsumexp and a gather never multiply -inf by zero."""
    B, T, V = logits.shape
    step = max(1, LOGIT_CHUNK // (T * V))
    sums = []
    for r in range(0, B, step):
        m = mask[r:r + step]                                       # (b, T-1)
        lg = logits[r:r + step, :-1][m].float()                    # (scored positions, V)
        target = idx[r:r + step, 1:][m]
        nll = torch.zeros(m.shape, dtype=torch.float32, device=logits.device)
        nll[m] = torch.logsumexp(lg, dim=-1) - lg.gather(-1, target[:, None]).squeeze(-1)
        sums.append(nll.sum(dim=1))
    return torch.cat(sums)


@torch.no_grad()
def score_items(model, items, device, dtype="float32", batch_size=4, progress=False):
    """Summed ending loss and ending token count, each (n, 4) float64 on the CPU, for items in the
    order given. The 4 * n rows (context + ending) are sorted by length and 4 * batch_size of them
    share a forward pass, so rows of nearly equal length are padded together. Rows are padded on
    the right, which causal attention keeps invisible to the real tokens; padded positions are
    not scored."""
    enc = common.get_tokenizer()
    block_size = model_block_size(model)
    rows = [row for item in items for row in render(item, enc, block_size)]  # row 4*i + j: item i, ending j
    compiled = hasattr(model, "_orig_mod")  # torch.compile'd: recompiles for every new shape
    bucket = SEQ_BUCKET if compiled else 8  # eager: just enough rounding for tensor-core shapes
    rows_per_batch = N_ENDINGS * batch_size
    order = sorted(range(len(rows)), key=lambda r: -len(rows[r][0]))  # longest first: an OOM shows at once
    batches = [order[i:i + rows_per_batch] for i in range(0, len(order), rows_per_batch)]
    sums = torch.zeros(len(rows), dtype=torch.float64)
    counts = torch.zeros(len(rows), dtype=torch.float64)
    if progress:
        from tqdm import tqdm
        batches = tqdm(batches, desc="hellaswag", unit="batch", dynamic_ncols=True)
    for batch in batches:
        longest = max(len(rows[r][0]) for r in batch)
        T = min(-(-longest // bucket) * bucket, block_size)  # render() kept rows <= block_size
        B = min(rows_per_batch, len(rows)) if compiled else len(batch)  # compiled: the last batch too
        idx = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T - 1, dtype=torch.bool)  # mask[:, t]: the target idx[:, t+1] is scored
        for i, r in enumerate(batch):
            tokens, start = rows[r]
            idx[i, :len(tokens)] = torch.tensor(tokens)
            mask[i, start - 1:len(tokens) - 1] = True
        idx, mask = idx.to(device), mask.to(device)
        with common.autocast(device, dtype):
            logits, _ = model(idx)
        sums[batch] = ending_losses(logits, idx, mask)[:len(batch)].double().cpu()
        counts[batch] = mask[:len(batch)].sum(dim=1).double().cpu()
    return sums.view(-1, N_ENDINGS), counts.view(-1, N_ENDINGS)


def shard(n, rank, world_size):
    """Indices of the items rank evaluates: every item once over all ranks, none twice."""
    return range(rank, n, world_size)


def default_batch_size(device):
    """Items per forward pass: 16 on a GPU; 4 on CPU, where a forward is compute-bound already and
    larger batches measured slower (BENCHMARKS.md)."""
    return 16 if device.startswith("cuda") else 4


def evaluate(model, items, device, dtype="float32", batch_size=None, rank=0, world_size=1, progress=False):
    """{"acc", "acc_norm", "n"} over all items. Each rank scores its share (items rank::world_size);
    the counts are summed over ranks when torch.distributed is initialised and world_size > 1, so
    every rank must call this. model: GPT or anything with model(idx) -> (logits, loss), also
    torch.compile'd; pass the model itself, not a DDP wrapper. It is put in eval mode and its
    train/eval state restored afterwards. batch_size: items per forward pass, 4 rows each
    (default: default_batch_size(device))."""
    mine = [items[i] for i in shard(len(items), rank, world_size)]
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        if mine:
            sums, counts = score_items(model, mine, device, dtype, batch_size or default_batch_size(device),
                                       progress)
            labels = torch.tensor([item["label"] for item in mine])
            correct = int((sums.argmin(dim=1) == labels).sum())
            correct_norm = int(((sums / counts).argmin(dim=1) == labels).sum())
        else:
            correct = correct_norm = 0
    finally:
        if hasattr(model, "train"):
            model.train(was_training)
    totals = torch.tensor([correct, correct_norm, len(mine)], dtype=torch.long, device=device)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    correct, correct_norm, n = totals.tolist()
    return {"acc": correct / n if n else 0.0, "acc_norm": correct_norm / n if n else 0.0, "n": n}


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="HellaSwag accuracy of a GPT-2 model (completion style).")
    p.add_argument("--model", required=True,
                   help="Hugging Face name or directory (gpt2, gpt2-medium, ...), a checkpoint written "
                        "by train_gpt2.py, or a log directory (its latest checkpoint)")
    p.add_argument("--data-file", default=None,
                   help=f"local copy of {HELLASWAG_FILE} (offline use); default: download it once")
    p.add_argument("--cache-dir", default=None,
                   help="where the download is kept (default $HELLASWAG_CACHE or ~/.cache/gpt2-hellaswag)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items (default: all)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="items per forward pass, 4 rows each (default: 16 on a GPU; 4 on CPU, where larger "
                        "batches measured slower, see BENCHMARKS.md)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--dtype", default="auto",
                   help="autocast dtype: auto, bfloat16, float16, float32 (default auto: bf16 on recent "
                        "GPUs, fp32 on CPU); the loss itself is always computed in float32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model first")
    p.add_argument("--json", action="store_true",
                   help="print one JSON line (acc, acc_norm, n) on stdout; the summary goes to stderr")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise common.UserError(f"--limit must be at least 1, got {args.limit}")
    if args.batch_size is not None and args.batch_size < 1:
        raise common.UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    return args


def main(argv=None):
    args = parse_args(argv)
    d = common.setup_distributed(args.device)
    summary = sys.stderr if args.json else sys.stdout  # stdout holds only the JSON line then
    try:
        dtype = common.pick_dtype(args.dtype, d.device)
        items = load_items(args.data_file, args.cache_dir, args.limit)
        model, what = common.load_model(args.model, d.device)
        if args.compile:
            model = torch.compile(model)
        common.print0(f"hellaswag: {len(items)} items, {what}, {d.world_size} process(es) on "
                      f"{common.device_name(d.device)}, {dtype}", file=summary)
        t0 = time.time()
        result = evaluate(model, items, d.device, dtype, args.batch_size, d.rank, d.world_size,
                          progress=d.is_master)
        dt = time.time() - t0
        n = result["n"]
        common.print0(f"acc {result['acc']:.4f} ({round(result['acc'] * n)}/{n})  "
                      f"acc_norm {result['acc_norm']:.4f} ({round(result['acc_norm'] * n)}/{n})  "
                      f"{n / dt:.1f} items/s  (OpenAI GPT-2 124M: acc 0.2859, acc_norm 0.2955)",
                      file=summary)
        if args.json:
            common.print0(json.dumps({**result, "model": args.model}))
    finally:
        common.teardown_distributed()


if __name__ == "__main__":
    common.run_main(main)
