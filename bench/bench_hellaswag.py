"""
HellaSwag scoring speed: scoring.evaluate (many items per forward pass) against a loop that
scores one item (its 4 rows) per forward pass, as build-nanogpt's hellaswag.py does, on the same
model (default GPT-2 124M, random weights: speed does not depend on them), device and synthetic
items whose lengths resemble HellaSwag's (context 25-70 words, endings 8-30 words). In float32
all methods must give the same answers; in bf16/fp16 a difference is reported (rounding differs
between shapes and can flip a near-tie).

    python bench/bench_hellaswag.py                     # CPU, 40 items
    python bench/bench_hellaswag.py --device cuda --dtype bfloat16 --items 2000
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import measure  # noqa: E402

from device import autocast, device_name, synchronize  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402
import hellaswag  # noqa: E402
import scoring  # noqa: E402
from bench_sample import add_device_args, setup  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

WORDS = ("the a man woman he she they is are was holding playing running into on with and then his her "
         "ball water kitchen table slowly camera shows person begins to continues while people around "
         "stands next field rope bike hair dog car paper knife bowl onto down up back after before").split()


def synthetic_items(n, seed=0):
    rng = random.Random(seed)
    words = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    return [{"ctx": words(25, 70).capitalize() + ".", "endings": [words(8, 30) + "." for _ in range(4)],
             "label": rng.randrange(4)} for _ in range(n)]


@torch.no_grad()
def one_item_per_forward(model, items, device, dtype):
    """build-nanogpt's loop: each item's 4 rows padded to their longest, one forward per item."""
    enc = get_tokenizer()
    correct = correct_norm = 0
    for item in items:
        ctx = enc.encode_ordinary(item["ctx"])
        rows = [ctx + enc.encode_ordinary(" " + e) for e in item["endings"]]
        T = max(len(r) for r in rows)
        tokens = torch.zeros(4, T, dtype=torch.long)
        mask = torch.zeros(4, T, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
            mask[i, len(ctx):len(r)] = 1
        tokens, mask = tokens.to(device), mask.to(device)
        with autocast(device, dtype):
            logits, _ = model(tokens)
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
        losses = losses.view(4, -1) * mask[:, 1:]
        sums = losses.sum(dim=1)
        correct += int(sums.argmin()) == item["label"]
        correct_norm += int((sums / mask[:, 1:].sum(dim=1)).argmin()) == item["label"]
    return {"acc": correct / len(items), "acc_norm": correct_norm / len(items), "n": len(items)}


def parsed_with_model_args(p, argv):
    """argv parsed by p with the model's shape added (bench_core.py shares these)."""
    p.add_argument("--n-layer", type=int, default=12, help="model shape (default: GPT-2 124M, 12/12/768)")
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    return p.parse_args(argv)


def scored_model(args):
    """(device, dtype, a GPT of the flags' shape with random weights (speed does not depend on them) in eval mode,
    the first words of the benchmark's header line) (bench_core.py shares it)."""
    device, dtype = setup(args)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)).to(device).eval()
    return device, dtype, model, (f"torch {torch.__version__}, {device_name(device)}, {torch.get_num_threads()} "
                                  f"threads, {dtype}; GPT {model.num_params() / 1e6:.0f}M "
                                  f"({args.n_layer}/{args.n_head}/{args.n_embd})")


def timed(fn, device):
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--items", type=int, default=40, help="synthetic items (default 40: ~3 minutes on 2 CPU cores)")
    p.add_argument("--batch-sizes", default="1,4,16",
                   help="items per forward for evaluate, comma-separated (default 1,4,16)")
    p.add_argument("--rounds", type=int, default=4,
                   help="the items are split into this many parts and the methods take turns on each, so a "
                        "load that comes and goes on the machine hits all of them alike (default 4)")
    return parsed_with_model_args(p, argv)


def main():
    args = parse_args()
    device, dtype, model, header = scored_model(args)
    items = synthetic_items(args.items)
    enc = get_tokenizer()
    rows = [len(enc.encode_ordinary(it["ctx"] + " " + e)) for it in items for e in it["endings"]]
    print(f"{header}, {len(items)} items, rows of {min(rows)}-{max(rows)} tokens (mean {sum(rows) / len(rows):.0f})")
    methods = {"one item per forward (build-nanogpt loop)":
               lambda part: one_item_per_forward(model, part, device, dtype)}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        methods[f"scoring.evaluate, batch {bs} items"] = (
            lambda part, bs=bs: scoring.evaluate(model, hellaswag.HellaSwag(part), scoring.Scoring(device, dtype, bs)))
    for fn in methods.values():
        fn(items[:2])  # warm-up
    seconds = {name: [] for name in methods}  # per round: the methods scored the same items in turn
    correct = {name: [0, 0] for name in methods}
    per = -(-len(items) // args.rounds)
    for part in (items[i:i + per] for i in range(0, len(items), per)):
        for name, fn in methods.items():
            dt, res = timed(lambda: fn(part), device)
            seconds[name].append(dt)
            correct[name][0] += round(res["acc"] * res["n"])
            correct[name][1] += round(res["acc_norm"] * res["n"])
    base = next(iter(seconds.values()))
    for name, t in seconds.items():
        ratio = measure.ratio_text(measure.paired_ratios(base, t)) if t is not base else "1.00x"
        print(f"{name:44s} {len(items) / sum(t):7.3f} items/s  ({sum(t):6.1f} s)  {ratio}")
    print(f"speed ratios over the first method, one pair per round; {measure.LEGEND}")
    same = all(c == next(iter(correct.values())) for c in correct.values())
    if dtype == "float32":
        assert same, correct  # the same answers: packing and batching change no score beyond rounding
    elif not same:  # bf16/fp16 rounding differs between shapes and can flip a near-tie
        print(f"note: correct answers (acc, acc_norm) differ across methods in {dtype}: {correct}")


if __name__ == "__main__":
    main()
