"""
Muon against AdamW on real text, with the trainer itself: validation loss against steps for
AdamW at each learning rate of a small sweep (the best one is the fair baseline) and for
--optimizer muon (its AdamW part at the best AdamW rate, its matrices at each --muon-lrs value,
0.02 being the default; also with --lr-schedule wsd). The headline: the steps Muon needs to reach
the best AdamW run's final validation loss, as a fraction of AdamW's steps (goal <= 0.75).

    python fineweb.py --data-files books.parquet --out-dir data/books --max-tokens 6000000 --val-tokens 250000
    python bench/bench_muon.py --data-dir data/books --out bench_muon

Every run is `python train_gpt2.py` in a fresh process with the same model, data, batch, seed and
schedule; its log directory is kept under --out, so `python plot.py` can draw any of them. Step
times here come from runs made one after another, so a busy machine skews them: bench/ladder.py's
muon rung measures Muon's cost per step in turns, with its spread.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from metrics import read_metrics  # noqa: E402


def train(out, name, args, extra):
    """One run of the trainer; its val records as [(step, val_loss)] and its median step ms."""
    log_dir = os.path.join(out, name)
    if not os.path.exists(os.path.join(log_dir, "metrics.jsonl")):
        cmd = [sys.executable, os.path.join(ROOT, "train_gpt2.py"), "--data-dir", args.data_dir, "--log-dir", log_dir,
               "--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
               "--block-size", str(args.block_size), "--total-batch-size", str(args.batch), "--micro-batch-size",
               str(args.micro_batch), "--max-steps", str(args.steps), "--eval-every", str(args.eval_every),
               "--val-tokens", str(args.val_tokens), "--hellaswag-every", "0", "--sample-every", "0",
               "--checkpoint-every", str(args.steps), "--no-export-hf", "--no-plot", "--device", args.device] + extra
        print(f"== {name}: {' '.join(extra)}", flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    m = read_metrics(log_dir)
    val = [(r["step"], r["val_loss"]) for r in m["val"]]
    ms = sorted(r["dt_ms"] for r in m["train"][1:])
    return {"name": name, "flags": extra, "log_dir": log_dir, "val": val, "final": val[-1][1],
            "step_ms": ms[len(ms) // 2]}


def steps_to_reach(val, target):
    """The first step at which the validation loss reaches target, linear between evaluations;
    None if it never does."""
    for (s0, v0), (s1, v1) in zip(val, val[1:]):
        if v1 <= target:
            return s1 if v0 == v1 else s0 + (v0 - target) / (v0 - v1) * (s1 - s0)
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="shards from fineweb.py")
    p.add_argument("--out", default="bench_muon", help="log directories and results.json (default: bench_muon)")
    p.add_argument("--adamw-lrs", default="1.5e-3,3e-3,6e-3", help="AdamW --max-lr sweep (default: 1.5e-3,3e-3,6e-3)")
    p.add_argument("--muon-lrs", default="0.01,0.02,0.04", help="--muon-lr values (default: 0.01,0.02,0.04)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096, help="tokens per step (default: 4096)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--val-tokens", type=int, default=32768)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    adamw = [train(args.out, f"adamw_lr{lr}", args, ["--max-lr", lr]) for lr in args.adamw_lrs.split(",")]
    best = min(adamw, key=lambda r: r["final"])
    base_lr = best["flags"][1]
    muon = [train(args.out, f"muon_lr{lr}", args, ["--optimizer", "muon", "--muon-lr", lr, "--max-lr", base_lr])
            for lr in args.muon_lrs.split(",")]
    muon.append(train(args.out, "muon_wsd", args, ["--optimizer", "muon", "--max-lr", base_lr,
                                                   "--lr-schedule", "wsd"]))
    target, steps = best["final"], best["val"][-1][0]
    print(f"\nmodel L{args.n_layer} H{args.n_head} d{args.n_embd}, T={args.block_size}, {args.batch} tokens/step, "
          f"{args.steps} steps, validation every {args.eval_every} on {args.val_tokens} tokens, {args.device}")
    print(f"{'run':18s} {'final val':>9s} {'steps to AdamW best':>20s} {'fraction':>9s} {'ms/step':>8s}")
    for r in adamw + muon:
        reach = steps_to_reach(r["val"], target)
        r["steps_to_target"], r["fraction"] = reach, (reach / steps if reach is not None else None)
        frac = f"{r['fraction']:.2f}" if reach is not None else "n/a"
        print(f"{r['name']:18s} {r['final']:9.4f} {'never' if reach is None else f'{reach:.0f}':>20s} "
              f"{frac:>9s} {r['step_ms']:8.0f}" + ("   <- AdamW baseline" if r is best else ""))
    default = next(r for r in muon if r["name"] == "muon_lr0.02")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"config": vars(args), "target": target, "runs": adamw + muon}, f, indent=1)
    print(f"\nheadline: Muon at its defaults reaches the best AdamW's final val loss {target:.4f} in "
          + (f"{default['fraction']:.2f}x the steps (goal <= 0.75)" if default["fraction"] else "no fewer steps"))
    print("plot: python plot.py " + shlex.join([best["log_dir"], default["log_dir"], "--labels", "AdamW", "Muon",
                                                 "--out", os.path.join(args.out, "muon_vs_adamw.png")]))


if __name__ == "__main__":
    main()
