"""
HellaSwag (Zellers et al. 2019) in the completion style used for GPT-2: the context followed by each of the
4 endings; acc picks the ending with the lowest summed loss, acc_norm the lowest mean loss per ending token.
OpenAI's GPT-2 124M gets acc 0.2859, acc_norm 0.2955 on the 10,042 validation items (GPT-3 124M: 0.337, from
the GPT-3 paper). Follows build-nanogpt's hellaswag.py, batched (scoring.py).

    python hellaswag.py --model log/ --limit 500                    # latest checkpoint written by train_gpt2.py
    torchrun --nproc_per_node=8 hellaswag.py --model gpt2 --json    # a Hugging Face name or directory

Offline: --data-file path/to/hellaswag_val.jsonl (or a gzip/xz/bz2 copy), or the copy an earlier download cached.
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
N_ENDINGS = 4
CHANCE = 1 / N_ENDINGS
N_ITEMS = 10042  # the validation set the published figures are over; fewer (--limit) is a sample
GPT2_HELLASWAG = 0.2955  # OpenAI's GPT-2 124M, acc_norm on the N_ITEMS (build-nanogpt)
GPT3_HELLASWAG = 0.337   # GPT-3 Small (125M), zero-shot (Brown et al. 2020)
CACHE = ("HELLASWAG_CACHE", "gpt2-hellaswag")  # where the download is kept: $HELLASWAG_CACHE, else ~/.cache/...
COMPRESSED = ((b"\x1f\x8b", "gzip", gzip), (b"\xfd7zXZ\x00", "xz", lzma), (b"BZh", "bz2", bz2))  # first bytes
# An item's checks in order: (field, test of its value, the problem when it fails); an absent field is "no 'field'"
ITEM_CHECKS = (
    ("ctx", lambda v: isinstance(v, str), "'ctx' is not a string"),
    ("endings", lambda v: isinstance(v, list) and all(isinstance(e, str) for e in v),
     "'endings' is not a list of strings"),
    ("endings", lambda v: len(v) == N_ENDINGS, "{n} endings, not 4"),
    ("endings", lambda v: any(e.strip() for e in v), "every ending is empty: nothing to score"),
    ("label", lambda v: type(v) is int and 0 <= v < N_ENDINGS, "label {v!r} is not 0-3"),
)


def parse_item(line, where):
    fix = f"each line must be a JSON object with ctx (a string), endings ({N_ENDINGS} strings) and label (0-3)"
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise common.UserError(f"{where}: malformed HellaSwag line, {common.json_line_problem(line, e)}; {fix}")
    if not isinstance(d, dict):
        raise common.UserError(f"{where}: malformed HellaSwag line (not an object); {fix}")
    if isinstance(d.get("label"), str) and d["label"].isdigit():
        d["label"] = int(d["label"])  # some re-distributions store the label as a string
    for field, ok, problem in ITEM_CHECKS:
        value = d.get(field)
        if field not in d:
            problem = f"no {field!r}"
        elif ok(value):
            continue
        n = len(value) if isinstance(value, list) else None
        raise common.UserError(f"{where}: malformed HellaSwag line ({problem.format(v=value, n=n)}); {fix}")
    return {"ctx": d["ctx"], "endings": d["endings"], "label": d["label"]}


def load_items(data_file=None, cache_dir=None, limit=None, flag="--data-file"):
    """The first `limit` validation items, from data_file (plain or compressed), else from the official file,
    downloaded once into cache_dir; flag: the option an error names for a local copy."""
    path = data_file
    if path is None:
        path = scoring.download(HELLASWAG_URL, os.path.join(scoring.cache_dir(cache_dir, *CACHE), HELLASWAG_FILE),
                                "HellaSwag", f"pass a local copy with {flag} path/to/{HELLASWAG_FILE}")
    if os.path.isdir(path):
        raise common.UserError(f"HellaSwag file {path} is a directory: pass the {HELLASWAG_FILE} file itself")
    if not os.path.isfile(path):
        raise common.UserError(f"HellaSwag file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(6)
    kind, opener = None, open
    for magic, name, module in COMPRESSED:
        if head.startswith(magic):
            kind, opener = name, module.open
    items = []
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
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


def render(item, enc, block_size):
    """An item as (context tokens, [ending tokens] * 4), ending j scored after context + " " + ending j.
    Too long for block_size, the context loses tokens from the front, the same for all endings, and
    an ending keeps its first block_size - 1; an empty context is <|endoftext|>."""
    ctx = enc.encode_ordinary(item["ctx"]) or [EOT_TOKEN]
    # as in GPT-2's evaluation, the space belongs to the ending
    endings = [enc.encode_ordinary(" " + e)[:block_size - 1] for e in item["endings"]]
    cut = max(0, len(ctx) + max(len(e) for e in endings) - block_size)
    return ctx[cut:], endings


class HellaSwag:
    """HellaSwag's pieces of an evaluation (scoring.py): one row per item, marked acc and acc_norm."""
    name = "hellaswag"
    tallies = (1, 2)

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
        return f"acc_norm {result['acc_norm']:.4f} acc {result['acc']:.4f} n {result['n']}", result


def parse_args(argv=None):
    p = common.ArgumentParser(description="HellaSwag accuracy of a GPT-2 model (completion style).")
    p.add_argument("--data-file", help=f"local copy of {HELLASWAG_FILE} (offline use); default: download it once")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items (default: all)")
    return scoring.parse_args(p, argv, "acc, acc_norm, n", CACHE)


def main(argv=None):
    args = parse_args(argv)

    def show(result, seconds):
        n = result["n"]
        return (f"acc {result['acc']:.4f} ({round(result['acc'] * n)}/{n})  "
                f"acc_norm {result['acc_norm']:.4f} ({round(result['acc_norm'] * n)}/{n})  "
                f"{n / seconds:.1f} items/s  (OpenAI GPT-2 124M: acc 0.2859, acc_norm 0.2955)")
    scoring.run_script(args, lambda: HellaSwag(load_items(args.data_file, args.cache_dir, args.limit)),
                       lambda bench: f"{len(bench.items)} items", show)


if __name__ == "__main__":
    common.run_script(main)
