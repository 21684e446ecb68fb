"""
Run the real scripts on one machine, end to end, and print one table: the check for the paths
that CI never runs (CUDA autocast in bf16 and fp16, torch.compile, fused AdamW, flash attention,
pinned prefetch, the memory probe, compiled evaluation, SIGTERM and resume on a GPU).

    python bench/device_check.py --data-dir DIR                      # GPT-2 124M on a GPU
    python bench/device_check.py --data-dir DIR --device cpu --small  # the same steps, tiny, on CPU

DIR holds shards from fineweb.py (a few million tokens are enough: the loader wraps around).
Steps, each a subprocess with its own time limit; a failure is reported and the rest go on:
  train      train_gpt2.py with the defaults of the 124M recipe (batch, compile, dtype, auto
             micro-batch), validation, HellaSwag, samples and --timing-breakdown; stopped with
             SIGTERM part-way
  resume     --resume to the end: steps continue from the checkpoint the signal wrote
  fp16       a short run with --dtype float16 (the T4/V100 path, with the gradient scaler)
  eager      a short run with --no-compile, for the compile speed-up
  muon       a short run with --optimizer muon (compiled, Newton-Schulz on the GPU)
  hellaswag  hellaswag.py --compile on the run's checkpoint
  sample     sample.py on the run's checkpoint
  bench_hellaswag, bench_sample, bench_core   the benchmarks of BENCHMARKS.md on this device
  compile_gate   whether torch.compile can run here (Triton needs compute capability 7.0+), and
                 what the trainer's header says about it
  probe      the micro-batch auto-fit with this process allowed 30% of the GPU's memory: sizes that
             fit on the whole card fail here, and the probe must take a smaller one and train
  micro_a, micro_b   a run with the fitted micro-batch, then a copy of its middle checkpoint
             resumed with --micro-batch-size 4 (a GPU with less memory): same data, same losses
  fsdp_bf16  FSDP over 2 GPUs in bf16, compiled, sampling right after a training step (skipped
             on a machine with fewer than 2 GPUs)
HellaSwag uses synthetic items written next to the results (the machine may be offline).
Every step's command, exit status, time and output tail go to --out as JSON and text files.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plot  # noqa: E402
from common import UserError  # noqa: E402

PY = sys.executable


def run_step(name, cmd, out_dir, timeout, env, stop_at=None):
    """Run cmd, its output teed to out_dir/name.log. stop_at: (line prefix, signal) sent once a
    line starting with the prefix is printed. Returns {name, cmd, rc, seconds, tail}."""
    t0 = time.time()
    log_path = os.path.join(out_dir, f"{name}.log")
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            deadline = t0 + timeout
            for line in proc.stdout:
                log.write(line)
                log.flush()
                lines.append(line.rstrip("\n"))
                if stop_at and line.startswith(stop_at[0]):
                    proc.send_signal(stop_at[1])
                    stop_at = None
                if time.time() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            rc = proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    return {"name": name, "cmd": " ".join(cmd), "rc": rc, "seconds": round(time.time() - t0, 1),
            "tail": lines[-15:]}


def speed(log_dir):
    """Steady-state tok/s and MFU of a run, as plot.py summarises them ('' if it logged none)."""
    try:
        s = plot.summarize(log_dir)
    except UserError:
        return ""
    if s["tok_per_s_steady"] is None:
        return ""
    return f"{s['tok_per_s_steady']:,.0f} tok/s" + (f", MFU {s['mfu']:.1%}" if s["mfu"] is not None else "")


def last_timing(log_path):
    """The last --timing-breakdown line in a step's log, as 'data 0.4 copy 0.1 ... (ms)', or ''."""
    if not os.path.isfile(log_path):
        return ""
    with open(log_path) as f:
        lines = [line for line in f if line.startswith("timing |")]
    if not lines:
        return ""
    return " ".join(f"{k} {float(v):.0f}" for k, v in re.findall(r"(\w+)_ms ([\d.]+)", lines[-1])) + " (ms)"


def same_losses(log_a, log_b):
    """How far run b's losses are from run a's at the steps both logged, or ''."""
    try:
        a, b = ({r["step"]: r["loss"] for r in plot.read_metrics(d)["train"]} for d in (log_a, log_b))
    except UserError:
        return ""
    both = sorted(set(a) & set(b))
    if not both:
        return ""
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in both)
    return f"steps {both[0]}-{both[-1]}: losses within {worst:.1e} (relative) of the fitted run"


def write_items(path, n):
    from bench_hellaswag import synthetic_items
    with open(path, "w") as f:
        for item in synthetic_items(n):
            f.write(json.dumps(item) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="token shards from fineweb.py")
    p.add_argument("--out", default="device_check", help="results folder (default: device_check)")
    p.add_argument("--device", default="cuda", help="cuda (default), cpu, ...")
    p.add_argument("--small", action="store_true", help="a tiny model and batch: to try the script on CPU")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the train/resume run (default 40)")
    p.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    p.add_argument("--step-timeout", type=int, default=240, help="seconds per step (default 240)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    items = os.path.join(out, "hellaswag_synthetic.jsonl")
    write_items(items, 500)

    bench_dtype = ["--dtype", "bfloat16" if args.device.startswith("cuda") else "float32"]
    if args.small:
        shape = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64",
                 "--total-batch-size", "2048"]
        bench_hs = ["--items", "40", "--n-layer", "2", "--n-head", "2", "--n-embd", "64"]
        bench_gen = ["--new-tokens", "16", "--repeats", "1"]
    else:
        shape, bench_hs, bench_gen = [], ["--items", "2000"], []
    log_dir = os.path.join(out, "run")
    every = max(2, args.steps // 2)
    train = ([PY, "train_gpt2.py", "--data-dir", args.data_dir, "--log-dir", log_dir, "--device", args.device,
              "--max-steps", str(args.steps), "--warmup-steps", "10", "--eval-every", str(every),
              "--val-tokens", "1048576" if not args.small else "4096", "--hellaswag-every", str(every),
              "--hellaswag-file", items, "--hellaswag-limit", "200", "--sample-every", str(every),
              "--checkpoint-every", str(every), "--timing-breakdown", "10"] + shape)
    short = ["--data-dir", args.data_dir, "--device", args.device, "--max-steps", "12", "--warmup-steps", "2",
             "--eval-every", "0", "--hellaswag-every", "0", "--sample-every", "0", "--no-export-hf",
             "--no-plot"] + shape
    stop_step = (3 * args.steps) // 4
    steps = {
        "train": (train, (f"step {stop_step:5d} |", signal.SIGTERM)),
        "resume": (train + ["--resume"], None),
        "fp16": ([PY, "train_gpt2.py", "--log-dir", os.path.join(out, "fp16"), "--dtype", "float16"] + short, None),
        "eager": ([PY, "train_gpt2.py", "--log-dir", os.path.join(out, "eager"), "--no-compile"] + short, None),
        "muon": ([PY, "train_gpt2.py", "--log-dir", os.path.join(out, "muon"), "--optimizer", "muon"] + short, None),
        "hellaswag": ([PY, "hellaswag.py", "--model", log_dir, "--data-file", items, "--device", args.device,
                       "--compile", "--json"], None),
        "sample": ([PY, "sample.py", "--model", log_dir, "--device", args.device, "--num-samples", "2",
                    "--max-new-tokens", "64", "--seed", "1"], None),
        "bench_hellaswag": ([PY, "bench/bench_hellaswag.py", "--device", args.device, "--batch-sizes", "1,16,64"]
                            + bench_dtype + bench_hs, None),
        "bench_sample": ([PY, "bench/bench_sample.py", "--device", args.device] + bench_dtype + bench_gen, None),
        "bench_core": ([PY, "bench/bench_core.py", "--device", args.device, "--batch-sizes", "1,16,64"] + bench_dtype
                       + (["--items", "4", "--n-layer", "2", "--n-head", "2", "--n-embd", "64"] if args.small
                          else ["--items", "200"]), None),
    }
    # the GPU-readiness checks: compile gating, the probe under memory pressure, a resume with a
    # smaller micro-batch, FSDP in bf16
    gate = ("import sys, torch, device; d = sys.argv[1]; "
            "print('capability', torch.cuda.get_device_capability(d) if d.startswith('cuda') else '-', "
            "'| compile', 'off: ' + device.compile_blocker(d) if device.compile_blocker(d) else 'allowed')")
    steps["compile_gate"] = ([PY, "-c", gate, args.device], None)
    probe = ("import runpy, sys, torch; torch.cuda.set_per_process_memory_fraction(0.3); "
             "sys.argv = ['train_gpt2.py'] + sys.argv[1:]; runpy.run_path('train_gpt2.py', run_name='__main__')")
    if args.device.startswith("cuda"):
        steps["probe"] = ([PY, "-c", probe, "--log-dir", os.path.join(out, "probe"), "--max-steps", "3"]
                          + short[2:], None)
    micro_a, micro_b = os.path.join(out, "micro_a"), os.path.join(out, "micro_b")
    micro = short + ["--checkpoint-every", "6"]
    steps["micro_a"] = ([PY, "train_gpt2.py", "--log-dir", micro_a] + micro, None)
    steps["micro_b"] = (["sh", "-c", f"mkdir -p {micro_b} && cp {micro_a}/ckpt_000006.pt {micro_b}/ && "
                         f"{PY} train_gpt2.py --log-dir {micro_b} --resume --micro-batch-size 4"], None)
    fsdp = ([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt2.py", "--fsdp",
             "--log-dir", os.path.join(out, "fsdp_bf16"), "--sample-every", "3", "--num-samples", "2"]
            + [a for a in short if a not in ("--sample-every", "0")] + ["--max-steps", "6"])
    gpus = __import__("torch").cuda.device_count() if args.device.startswith("cuda") else 0
    if gpus >= 2:
        steps["fsdp_bf16"] = (fsdp, None)
    else:
        print(f"fsdp_bf16: skipped, {gpus} GPU(s) here (NCCL needs one GPU per rank)", flush=True)
    if not args.device.startswith("cuda"):
        del steps["fp16"]  # float16 autocast is a CUDA path; the trainer refuses it elsewhere
    only = set(args.only.split(",")) if args.only else set(steps)
    results = []
    for name, (cmd, stop_at) in steps.items():
        if name not in only:
            continue
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        r = run_step(name, cmd, out, args.step_timeout, env, stop_at)
        results.append(r)
        print("\n".join(r["tail"][-5:]), flush=True)
        with open(os.path.join(out, "device_check.json"), "w") as f:
            json.dump(results, f, indent=1)

    # ---- the table: what ran, and the one figure that matters for each step
    figures = {"train": last_timing(os.path.join(out, "train.log")), "resume": speed(log_dir),
               "fp16": speed(os.path.join(out, "fp16")), "eager": speed(os.path.join(out, "eager")),
               "muon": speed(os.path.join(out, "muon"))}
    for r in results:
        if r["name"] == "hellaswag":
            figures["hellaswag"] = next((l.split("  ")[2] for l in r["tail"] if "items/s" in l and
                                         len(l.split("  ")) > 2), "")
        if r["name"].startswith("bench_"):  # the speed ratios the benchmark printed last
            figures[r["name"]] = " / ".join(m for l in r["tail"] for m in re.findall(r"(\d+\.\d+x)", l))
    figures["micro_b"] = same_losses(micro_a, micro_b)
    for r in results:
        if r["name"] in ("compile_gate", "probe"):
            figures[r["name"]] = next((l for l in r["tail"] if l.startswith(("capability", "batch "))), "")
    print(f"\n{'step':16s} {'result':8s} {'seconds':>8s}  figure")
    for r in results:
        ok = "ok" if r["rc"] == 0 else f"rc {r['rc']}"
        print(f"{r['name']:16s} {ok:8s} {r['seconds']:8.1f}  {figures.get(r['name'], '')}")
    sys.exit(0 if all(r["rc"] == 0 for r in results) else 1)


if __name__ == "__main__":
    main()
