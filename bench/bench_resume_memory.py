"""
Host memory of a resume: N processes (the ranks of one node) load the same checkpoint at once,
as checkpoint.load_file does (memory-mapped) and as a plain torch.load does, and each reports
its proportional set size (Pss: shared pages count once, split between the processes that map
them) once every tensor has been read. The checkpoint is the size of GPT-2 124M's with AdamW
state (weights + two moments, 12 bytes per parameter) unless --params says otherwise. Linux only.

    python bench/bench_resume_memory.py                  # 2 processes, 124M parameters
    python bench/bench_resume_memory.py --procs 8 --params 350e6
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from checkpoint import load_file, save_file  # noqa: E402


def pss_gb():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1e6  # kB -> GB
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def load_one(path, how, ready_dir, procs):
    t0 = time.perf_counter()
    if how == "mmap":
        ckpt = load_file(path)
    else:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    total = sum(float(t.sum()) for part in ("model", "optimizer") for t in ckpt[part].values())  # read it all
    seconds = time.perf_counter() - t0
    open(os.path.join(ready_dir, str(os.getpid())), "w").close()
    while len(os.listdir(ready_dir)) < procs:  # measure while every process holds its copy
        time.sleep(0.05)
    print(f"{pss_gb():.2f} {seconds:.2f} {total:.1f}", flush=True)
    time.sleep(0.5)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2, help="processes loading at once (default: 2)")
    p.add_argument("--params", type=float, default=124e6, help="parameters (default: 124e6)")
    p.add_argument("--child", nargs=3, metavar=("PATH", "HOW", "READY_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return load_one(*args.child, args.procs)
    n = int(args.params)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt_000001.pt")
        save_file(path, {"step": 1, "model": {"w": torch.randn(n)},
                                      "optimizer": {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}})
        size = os.path.getsize(path) / 1e9
        print(f"checkpoint {size:.2f} GB, {args.procs} processes loading it at once")
        print("| load | Pss per process (GB) | all processes (GB) | seconds to load and read |")
        print("|---|---|---|---|")
        for how in ("plain", "mmap"):
            ready = tempfile.mkdtemp(dir=tmp)
            procs = [subprocess.Popen([sys.executable, __file__, "--procs", str(args.procs), "--child", path, how,
                                       ready], stdout=subprocess.PIPE, text=True) for _ in range(args.procs)]
            rows = [[float(v) for v in proc.communicate()[0].split()[:2]] for proc in procs]
            pss = [r[0] for r in rows]
            label = "torch.load" if how == "plain" else "checkpoint.load_file (mmap)"
            print(f"| {label} | {max(pss):.2f} | {sum(pss):.2f} | {max(r[1] for r in rows):.2f} |")


if __name__ == "__main__":
    main()
