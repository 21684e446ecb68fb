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

An evaluation is scoring.evaluate's (the steps HellaSwag and CORE share) over HellaSwag's own
pieces, the class HellaSwag: an item as one row, and its marks from its endings' scores. The
trainer runs it through training_hook(); evaluate() scores a list of items in one call.
Offline: --data-file path/to/hellaswag_val.jsonl, or the copy cached by an earlier download.
"""

import bz2
import gzip
import json
import lzma
import os

import common
import scoring
from tokenizer import EOT_TOKEN, get_tokenizer

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_VAL_ITEMS = 10042
N_ENDINGS = 4
READ_TIMEOUT = 30  # seconds of silence from the server before a download is given up

# ----------------------------------------------------------------------------------------------
# Data


def default_cache_dir():
    """Where the downloaded file is kept: $HELLASWAG_CACHE or ~/.cache/gpt2-hellaswag."""
    return os.environ.get("HELLASWAG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gpt2-hellaswag")


def download(cache_dir=None, flag="--data-file"):
    """Path of the cached validation file, fetched once (scoring.download): once cached, no network
    is asked. flag: the option an error names for a local copy."""
    path = os.path.join(cache_dir or default_cache_dir(), HELLASWAG_FILE)
    return scoring.download(HELLASWAG_URL, path, "HellaSwag", f"pass a local copy with {flag} path/to/{HELLASWAG_FILE}",
                            write_response, READ_TIMEOUT)


def write_response(response, tmp):
    """The file as downloaded, into the directory tmp (scoring.download puts it in place)."""
    path = os.path.join(tmp, HELLASWAG_FILE)
    with open(path, "wb") as f:
        f.write(response.read())
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
    elif not any(e.strip() for e in endings):
        problem = "every ending is empty: nothing to score"
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


class HellaSwag:
    """HellaSwag's pieces of an evaluation (scoring.evaluate): an item is one row, its context
    once and its endings side by side; it is right by acc when the ending with the lowest summed
    loss is the label, by acc_norm when the one with the lowest mean loss per token is."""
    name = "hellaswag"
    tallies = (1, 2)  # one tally for all items; marks: acc, acc_norm

    def __init__(self, items):
        self.items = items

    def rows(self, item, block_size):
        ctx, endings = render(item, get_tokenizer(), block_size)
        return [(ctx, [([], e) for e in endings])]

    def marks(self, item, sums, counts, exact):
        return 0, (int(sums.argmin()) == item["label"], int((sums / counts).argmin()) == item["label"])

    def result(self, tally):
        (correct, correct_norm, n), = tally
        return {"acc": correct / n if n else 0.0, "acc_norm": correct_norm / n if n else 0.0, "n": n}

    def report(self, result):
        """The trainer's log line and record."""
        return f"acc_norm {result['acc_norm']:.4f} acc {result['acc']:.4f} n {result['n']}", result


def evaluate(model, items, device, dtype="float32", batch_size=None, rank=0, world_size=1, progress=False,
             should_stop=None, lockstep=False):
    """{"acc", "acc_norm", "n"} over all items, or None if should_stop said so (a stop request must
    not wait for 10,042 items). Every rank must call it: each scores its share, and the counts are
    summed over ranks (scoring.evaluate, which says what model, batch_size, should_stop and lockstep
    may be)."""
    return scoring.evaluate(model, HellaSwag(items), device, dtype, batch_size, rank, world_size, progress,
                            should_stop, lockstep)


# ----------------------------------------------------------------------------------------------
# During training


def training_hook(data_file, limit, ranks, log, lockstep):
    """HellaSwag inside train_gpt2.py (scoring.TrainingHook): data_file, limit: the trainer's
    --hellaswag-file and --hellaswag-limit; ranks: its parallel.Ranks; lockstep: every rank makes
    the same number of forward passes (FSDP)."""
    return scoring.TrainingHook(HellaSwag.name,
                                lambda: HellaSwag(load_items(data_file, limit=limit, flag="--hellaswag-file")),
                                ranks, log, lockstep)


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

    def show(result, seconds):
        n = result["n"]
        return (f"acc {result['acc']:.4f} ({round(result['acc'] * n)}/{n})  "
                f"acc_norm {result['acc_norm']:.4f} ({round(result['acc_norm'] * n)}/{n})  "
                f"{n / seconds:.1f} items/s  (OpenAI GPT-2 124M: acc 0.2859, acc_norm 0.2955)")
    scoring.run_script(args, lambda: HellaSwag(load_items(args.data_file, args.cache_dir, args.limit)),
                       lambda bench: f"{len(bench.items)} items", show)


if __name__ == "__main__":
    common.run_main(main)
