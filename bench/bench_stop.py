"""
How long the checkpoint of a stop takes to write, against the grace a launcher gives it: a SIGTERM to torchrun
reaches the ranks, which finish their step and write a checkpoint, and torchrun kills them --shutdown-timeout
seconds later (30 by default). This writes a checkpoint laid out as the trainer's (a real model's fp32 weights and
AdamW's two moments, through checkpoint.save_file: torch.save, fsync, rename) for each preset, in --dir, and prints
its size, seconds and rate. It needs the preset's checkpoint in host memory (GPT-2 XL: ~19 GB) and on disk.

    python bench/bench_stop.py                           # gpt2, in the system's temporary directory
    python bench/bench_stop.py --models gpt2 gpt2-xl --dir /path/on/the/run/disk
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from checkpoint import save_file  # noqa: E402
from model import GPT, config_of  # noqa: E402


def write_one(preset, folder, repeats):
    model = GPT(config_of(preset, 1024))
    weights = model.state_dict()
    moments = {name: {"exp_avg": t.detach().clone(), "exp_avg_sq": t.detach().clone()}
               for name, t in model.named_parameters()}
    ckpt = {"step": 1, "model": weights, "optimizer": moments}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # the tied head is stored once
                for t in list(weights.values()) + [t for m in moments.values() for t in m.values()]}
    size = sum(storages.values())
    path = os.path.join(folder, f"ckpt_{preset}.pt")
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        save_file(path, ckpt)
        seconds.append(time.perf_counter() - t0)
        os.remove(path)
    return size, min(seconds), max(seconds)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt2"], help="presets (gpt2, gpt2-medium, gpt2-large, gpt2-xl)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written (then removed)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--grace", type=float, default=30.0, help="torchrun's --shutdown-timeout, seconds")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for preset in args.models:
        size, best, worst = write_one(preset, args.dir, args.repeats)
        rows.append((preset, size, best, worst))
        print(f"{preset}: {size / 1e9:.2f} GB in {best:.1f}-{worst:.1f} s", flush=True)
    print(f"\n| model | checkpoint | write (fastest-slowest of {args.repeats}) | rate | "
          f"share of a {args.grace:g} s grace |")
    print("|---|---|---|---|---|")
    for preset, size, best, worst in rows:
        print(f"| {preset} | {size / 1e9:.2f} GB | {best:.1f}-{worst:.1f} s | {size / 1e6 / worst:.0f} MB/s | "
              f"{100 * worst / args.grace:.0f}% |")


if __name__ == "__main__":
    main()
