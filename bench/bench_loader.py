"""
TokenLoader throughput on one CPU core, shards in the page cache (goal: >= 50M tokens/s).

    python bench/bench_loader.py

Writes `--shards` shards of `--shard-tokens` random GPT-2 token ids (uint16) to a scratch
directory, reads them once so they sit in the page cache, pins this process to one core, and
times next_batch() for GPT-2-sized batches, sequential and shuffled, with and without the
background prefetch thread. On a CPU device next_batch returns the int64 (B, T) tensors, so the
time covers the memory-mapped read, the uint16 -> int64 copy and the vocabulary check. Last, the
time a training loop waits per batch when a (simulated) 20 ms step runs between batches: what
prefetching is for.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dataloader import Data, TokenLoader  # noqa: E402


def make_shards(d, n_shards, shard_tokens):
    rng = np.random.default_rng(0)
    for i in range(n_shards + 1):
        split = "val" if i == 0 else "train"
        n = shard_tokens // 10 if i == 0 else shard_tokens
        np.save(os.path.join(d, f"bench_{split}_{i:06d}.npy"), rng.integers(0, 50257, n, dtype=np.uint16))
    for f in os.listdir(d):  # into the page cache
        with open(os.path.join(d, f), "rb") as fh:
            while fh.read(1 << 24):
                pass


def rate(loader, seconds):
    loader.next_batch()  # first touch of the layout, thread start
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        loader.next_batch()
        n += 1
    return n * loader.tokens_per_batch / (time.perf_counter() - t0)


def stall(loader, step_seconds, steps=100):
    """Mean time the caller waits in next_batch() when each batch is followed by step_seconds of
    other work that releases the GIL (time.sleep standing in for a GPU step)."""
    loader.next_batch()
    waited = 0.0
    for _ in range(steps):
        time.sleep(step_seconds)
        t0 = time.perf_counter()
        loader.next_batch()
        waited += time.perf_counter() - t0
    return waited / steps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--shard-tokens", type=int, default=50_000_000)
    p.add_argument("--seconds", type=float, default=3.0, help="per configuration")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, threads included
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench_loader_")
    try:
        make_shards(tmp, args.shards, args.shard_tokens)
        print(f"{args.shards} shards x {args.shard_tokens:,} tokens, one core, torch {torch.__version__}, "
              f"numpy {np.__version__}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        for B, T in [(16, 1024), (64, 1024)]:
            for seed in (None, 1337):
                for prefetch in (False, True):
                    ld = TokenLoader(Data(tmp, shuffle_seed=seed, prefetch=prefetch), "train", B, T)
                    r = rate(ld, args.seconds)
                    order = "shuffled" if seed is not None else "sequential"
                    print(f"B={B:3d} T={T} {order:10s} prefetch={'on ' if prefetch else 'off'}: "
                          f"{r / 1e6:7.1f}M tokens/s")
        for prefetch in (False, True):
            ld = TokenLoader(Data(tmp, shuffle_seed=1337, prefetch=prefetch), "train", 64, 1024)
            print(f"B= 64 T=1024 shuffled   prefetch={'on ' if prefetch else 'off'}, 20 ms step between batches: "
                  f"the caller waits {stall(ld, 0.02) * 1e6:6.0f} us per batch")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
