"""
The trainer itself at several git revisions or with several sets of flags (the arms), launched in turns on one
machine: which trains faster. Each launch is `train_gpt2.py` from that revision's files, a short run of the given
recipe; its figure is the median tokens/s (and MFU) the trainer logged over its steady steps (from --skip-steps on,
profiled steps left out), beside how far its step losses are from the first arm's (a speed-up must train the same
model).

    python bench/ab.py --data-dir DIR --revs HEAD~1,HEAD --repeats 2 -- --micro-batch-size 64
    python bench/ab.py --data-dir DIR --variant mb64='--micro-batch-size 64' --variant mb128='--micro-batch-size 128'

    python bench/ab.py --data-dir DIR --variant base='' --variant cdt='TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1'
    python bench/ab.py --data-dir DIR --steps 6 --skip-steps 2 -- --device cpu --model gpt2 --n-layer 2 \
        --n-embd 128 --n-head 2 --block-size 128 --total-batch-size 4096   # a try-out on a CPU

A revision is anything `git archive` takes (a commit, a branch, HEAD~1), or `worktree` for the files as they are;
a variant is a set of trainer flags, led by any environment variables it sets (NAME=VALUE words), and every
revision runs with every variant (flags after -- go to all). Each arm compiles into caches of its own
(OUT/cache/<arm>: Inductor's and Triton's), which its later repeats find warm. Launches take turns (arm A, arm B,
arm A, arm B, ...), and ratios to the first arm are taken turn by turn (bench/measure.py). A launch that fails or
runs past --timeout is one line naming its log, and the other launches go on. The table comes last; every
launch's output goes to OUT/<arm>-<repeat>.log. The defaults are the 124M recipe's, a GPU's work: on a CPU, pass a
small model, as above.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from device_check import run_logged, same_losses  # noqa: E402
from measure import LEGEND, paired_ratios, ratio_text, value_text  # noqa: E402
from common import UserError  # noqa: E402
from metrics import read_metrics  # noqa: E402

QUIET = ["--eval-every", "0", "--hellaswag-every", "0", "--sample-every", "0", "--no-export-hf", "--no-plot"]


def sources(rev, out):
    """The directory holding rev's files: the checkout itself for `worktree`, else an export under out."""
    if rev == "worktree":
        return ROOT
    dest = os.path.join(out, "src", file_name(rev))
    if not os.path.isdir(dest):
        os.makedirs(dest)
        archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True)
        if archive.returncode:
            raise SystemExit(f"--revs: git cannot export {rev!r} ({archive.stderr.decode().strip()}); give a commit, "
                             "a branch or worktree")
        tar_path = dest + ".tar"
        with open(tar_path, "wb") as f:
            f.write(archive.stdout)
        with tarfile.open(tar_path) as tar:
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        os.remove(tar_path)
    return dest


def file_name(label):
    """A revision or an arm as a file name: HEAD~1 -> HEAD-1, worktree:mb64 -> worktree.mb64."""
    return label.replace(":", ".").replace("/", "_").replace("~", "-").replace("^", "-")


def steady(log_dir, skip, profiled):
    """(median tokens/s, median MFU or None, seconds of step 0, {step: loss}) of a launch's train records."""
    train = read_metrics(log_dir)["train"]
    kept = [r for r in train if r["step"] >= skip and r["step"] not in profiled]
    if not kept:
        raise UserError(f"{log_dir}: no train steps from step {skip} on; raise --steps")
    mfus = [r["mfu"] for r in kept if r.get("mfu") is not None]
    first = next((r["dt_ms"] / 1e3 for r in train if r["step"] == 0), None)
    return (statistics.median(r["tok_per_s"] for r in kept), statistics.median(mfus) if mfus else None, first,
            {r["step"]: r["loss"] for r in train})


def profiled_steps(extra):
    """The steps --profile-steps A:B names among the extra flags (their times hold the profiler's cost)."""
    if "--profile-steps" not in extra:
        return set()
    first, last = map(int, extra[extra.index("--profile-steps") + 1].split(":"))
    return set(range(first, last + 1))


ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # NAME=VALUE: a variable an arm sets


def arm_settings(text):
    """(environment variables, trainer flags) of a variant's FLAGS, whose leading NAME=VALUE words set variables."""
    words, env = shlex.split(text), {}
    while words and ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def arm_env(label, env, out):
    """The environment of an arm's launches: its variables, and compile caches of its own (Inductor's, where
    AOTAutograd's live too, and Triton's) unless it names them, so that no arm finds another's graphs."""
    cache = os.path.join(os.path.abspath(out), "cache", file_name(label))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(cache, "triton"), **env}


def launch(cmd, files, env, log_path, timeout):
    """Run one launch, its output into log_path; None, or why it gave no result (a failure, the time limit)."""
    code = run_logged(cmd, log_path, files, env, timeout)  # past the limit, torchrun's and compile's workers go too
    if code == "timeout":
        return f"ran past --timeout {timeout} s"
    return f"train_gpt2.py exited {code}" if code else None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="shards from fineweb.py")
    p.add_argument("--revs", default="worktree",
                   help="comma-separated git revisions (or worktree, the default); the first is the base")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="environment variables and trainer flags of one arm at every revision, such as "
                        "mb128='--micro-batch-size 128' or cdt='TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1'; "
                        "repeatable, the first is the base")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per launch (default 12)")
    p.add_argument("--skip-steps", type=int, default=3, help="steps left out at the start: compile, warm-up")
    p.add_argument("--timeout", type=int, default=300, help="seconds per launch (default 300)")
    p.add_argument("--out", default="/tmp/ab")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    variants = [v.partition("=") for v in args.variant]
    if any(not name or not sep for name, sep, _ in variants):
        raise SystemExit("--variant: give NAME=FLAGS, such as mb128='--micro-batch-size 128'")
    variants = [(name, *arm_settings(flags)) for name, _, flags in variants] or [("", {}, [])]
    os.makedirs(args.out, exist_ok=True)
    # the arms: every revision with every variant, as (label, files, environment, flags)
    arms = []
    for rev in args.revs.split(","):
        for name, env, flags in variants:
            label = f"{rev}:{name}" if name else rev
            arms.append((label, sources(rev, args.out), arm_env(label, env, args.out), flags))
    # per arm and repeat: (tok/s, mfu, step-0 s, {step: loss}, launch s), or None where the launch gave no result
    results = {label: [] for label, *_ in arms}
    failures = []
    for r in range(args.repeats):
        for label, files, env, flags in arms:
            name = f"{file_name(label)}-{r}"
            log_dir = os.path.join(args.out, "runs", name)
            cmd = [sys.executable, "train_gpt2.py", "--data-dir", os.path.abspath(args.data_dir), "--log-dir", log_dir,
                   "--max-steps", str(args.steps)] + QUIET + extra + flags
            print(f"== {label} (repeat {r}): {shlex.join(cmd)}", flush=True)
            t0 = time.time()
            log_path = os.path.join(args.out, f"{name}.log")
            why = launch(cmd, files, env, log_path, args.timeout)
            figures = None
            if why is None:
                try:
                    figures = steady(log_dir, args.skip_steps, profiled_steps(extra + flags)) + (time.time() - t0,)
                except UserError as e:  # no metrics, or no steady step
                    why = str(e)
            if why is not None:
                failures.append(f"{label} (repeat {r}): no result, {why}; see {log_path}")
                print(failures[-1], flush=True)
            results[label].append(figures)
    print_table(arms, results, args)
    for line in failures:
        print(line)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump({"arms": [label for label, *_ in arms], "extra": extra, "results": results,
                   "env": {label: {k: v for k, v in env.items() if os.environ.get(k) != v}  # what each arm set
                           for label, _, env, _ in arms}},
                  f, indent=1)
    return 1 if failures else 0


def print_table(arms, results, args):
    """The arms that gave a result, each against the base arm: speed by pairs of repeats taken in the same turn."""
    base_label = arms[0][0]
    base = results[base_label]
    first_run = {label: os.path.join(args.out, "runs", f"{file_name(label)}-{next(i for i, r in enumerate(rows) if r)}")
                 for label, rows in results.items() if any(rows)}  # the first repeat with a result
    print(f"\narm{'':17s} tok/s (median of steps {args.skip_steps}+){'':6s} MFU      step 0 s   launch s   "
          f"losses vs {base_label}   speed vs {base_label}")
    for label, rows in results.items():
        done = [row for row in rows if row]
        if not done:
            continue
        toks = [t for t, *_ in done]
        mfus = [m for _, m, *_ in done if m is not None]
        mfu = value_text([100 * m for m in mfus], "{:.1f}%") if mfus else "n/a"
        gap = same_losses(first_run[base_label], first_run[label])[1] if base_label in first_run else None
        losses = f"within {gap:.1e}" if gap is not None else "no common steps"
        pairs = [(row[0], b[0]) for row, b in zip(rows, base) if row and b]
        speed = ratio_text(paired_ratios(*zip(*pairs))) if pairs else f"no {base_label} result"
        print(f"{label:20s} {value_text(toks):32s} {mfu:8s} {value_text([s for _, _, s, _, _ in done], '{:.1f}'):10s} "
              f"{value_text([w for *_, w in done], '{:.0f}'):10s} {losses:20s} {speed}")
    print(LEGEND)


if __name__ == "__main__":
    sys.exit(main())
