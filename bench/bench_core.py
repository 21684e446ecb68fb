"""
CORE scoring speed: scoring.evaluate (all options of an item in one packed row, many items per
forward pass) against one item per forward pass with each option its own padded row, as
nanochat's core_eval.py runs it, on the same model (default GPT-2 124M, random weights: speed does
not depend on them), device and synthetic tasks shaped like the bundle's: multiple choice 10-shot
with "\\nAnswer: " (ARC, PIQA), schema 0-shot (Winograd), language modelling 10-shot (BigBench).
In float32 both give the same answers.

    python bench/bench_core.py                     # CPU, 8 items per task type
    python bench/bench_core.py --device cuda --dtype bfloat16 --items 500
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import core  # noqa: E402
import measure  # noqa: E402
import scoring  # noqa: E402
from bench_hellaswag import WORDS, parsed_with_model_args, scored_model, timed  # noqa: E402
from bench_sample import add_device_args  # noqa: E402
from device import autocast  # noqa: E402
from tokenizer import EOT_TOKEN, get_tokenizer  # noqa: E402


def synthetic_tasks(n, seed=0):
    """Three tasks of n items each, one per type, with the bundle's fields and prompt shapes."""
    rng = random.Random(seed)
    words = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    mc = [{"query": f"Question: {words(8, 25)}?", "choices": [words(1, 6) for _ in range(4)], "gold": rng.randrange(4)}
          for _ in range(n)]
    schema = [{"context_options": [words(10, 20) + " " + w for w in ("he", "she")], "continuation": words(3, 8) + ".",
               "gold": rng.randrange(2)} for _ in range(n)]
    lm = [{"context": words(5, 15) + " =", "continuation": words(1, 3)} for _ in range(n)]
    return [core.Task("mc_10shot", "multiple_choice", "", 10, "\nAnswer: ", 0.25, mc),
            core.Task("schema_0shot", "schema", "", 0, " ", 0.5, schema),
            core.Task("lm_10shot", "language_modeling", "", 10, " ", 0.0, lm)]


@torch.no_grad()
def one_item_per_forward(model, tasks, device, dtype):
    """nanochat's loop: an item's options as rows padded to the longest, one forward per item;
    the same prompts, spans and judging as core.py."""
    enc = get_tokenizer()
    block = model.config.block_size
    result = {}
    for task in tasks:
        right = 0
        for i, item in enumerate(task.items):
            seqs = [[EOT_TOKEN] + enc.encode_ordinary(p) for p in
                    core.prompts(task, item, core.fewshot(task.items, i, task.shots))]
            options = [(s[max(0, len(s) - block):], max(1, start - max(0, len(s) - block)))
                       for s, start in core.spans(task, seqs)]
            T = max(len(s) for s, _ in options)
            tokens = torch.zeros(len(options), T, dtype=torch.long)
            for r, (s, _) in enumerate(options):
                tokens[r, :len(s)] = torch.tensor(s)
            tokens = tokens.to(device)
            with autocast(device, dtype):
                logits, _ = model(tokens)
            losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                     reduction="none").view(len(options), -1)
            greedy = logits[:, :-1].argmax(-1) == tokens[:, 1:]
            sums = torch.stack([losses[r, start - 1:len(s) - 1].sum() for r, (s, start) in enumerate(options)])
            counts = torch.tensor([len(s) - start for s, start in options], dtype=sums.dtype, device=sums.device)
            exact = torch.stack([greedy[r, start - 1:len(s) - 1].all() for r, (s, start) in enumerate(options)])
            right += core.judge(task, item, sums.cpu().double(), counts.cpu().double(), exact.cpu())
        acc = right / len(task.items)
        result[task.label] = {"acc": acc, "centered": core.centered(acc, task.baseline), "n": len(task.items)}
    return {"core": sum(r["centered"] for r in result.values()) / len(result), "tasks": result}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--items", type=int, default=8, help="items per task type (default 8: ~2 minutes on 2 CPU cores)")
    p.add_argument("--batch-sizes", default="1,4,16", help="items per forward for evaluate (default 1,4,16)")
    p.add_argument("--rounds", type=int, default=2,
                   help="the methods take turns this many times, so a passing load hits all alike (default 2)")
    return parsed_with_model_args(p, argv)


def main():
    args = parse_args()
    device, dtype, model, header = scored_model(args)
    tasks = synthetic_tasks(args.items)
    n = sum(len(t.items) for t in tasks)
    share = scoring.share_of(core.Core(tasks), model.config.block_size)  # rendered once, as the trainer does
    lengths = [len(prefix) + sum(len(o) + len(c) for o, c in options) for prefix, options in share.rows]
    print(f"{header}, {n} items in {len(tasks)} tasks, packed rows of {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f})")
    methods = {"one item per forward (nanochat's loop)": lambda: one_item_per_forward(model, tasks, device, dtype)}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        methods[f"scoring.evaluate, batch {bs} items"] = (
            lambda bs=bs: scoring.evaluate(model, core.Core(tasks), scoring.Scoring(device, dtype, bs), share=share))
    seconds = {name: [] for name in methods}
    results = {}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            dt, results[name] = timed(fn, device)
            seconds[name].append(dt)
    base = next(iter(seconds.values()))
    for name, t in seconds.items():
        ratio = measure.ratio_text(measure.paired_ratios(base, t)) if t is not base else "1.00x"
        print(f"{name:40s} {n * len(t) / sum(t):7.3f} items/s  ({sum(t):6.1f} s)  {ratio}")
    print(f"speed ratios over the first method, one pair per round; {measure.LEGEND}")
    answers = {name: {k: r["acc"] for k, r in res["tasks"].items()} for name, res in results.items()}
    if dtype == "float32":
        assert len({tuple(a.values()) for a in answers.values()}) == 1, answers  # the same answers
    print("accuracies: " + ", ".join(f"{k} {v:.3f}" for k, v in next(iter(answers.values())).items()))


if __name__ == "__main__":
    main()
