"""
What a reader follows to understand one training step: the project's functions in the order a tiny
run first calls them, from `loop` (one step with a validation at its top) or from `main` (set-up
too), with the files entered and how often the path comes back to a file it had left.

    python bench/step_path.py                 # from loop: the functions, then a one-line summary
    python bench/step_path.py --from main
    python bench/step_path.py --from main --evaluations default   # HellaSwag, samples and the plot on too

A function is counted once, where it is first called (a reader reads it once); generator
expressions and lambdas belong to their function. Torch and the standard library are not the
project's and are left out. The figures go into BENCHMARKS.md ("Reading one step").
"""

import argparse
import inspect
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import fineweb  # noqa: E402
import train_gpt2  # noqa: E402
from train_config import command_line  # noqa: E402

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, micro_batch_size=2, total_batch_size=128, max_steps=2,
            warmup_steps=1, max_lr=3e-3, eval_every=1, val_tokens=128, checkpoint_every=0, hellaswag_every=0,
            sample_every=0, plot=False, export_hf=False, device="cpu")

SKIPPED = ("<genexpr>", "<lambda>", "<listcomp>", "<dictcomp>", "<setcomp>")


def trace(start, data_dir, log_dir, evaluations):
    """[(file, function, first line, lines)] in the order of first calls, from `start` (a function
    name of train_gpt2.py, or main) to the second optimizer step; evaluations: settings over TINY's."""
    order, seen = [], set()
    state = {"on": start == "main", "steps": 0}

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or code.co_filename.startswith("<"):
            return
        path = os.path.abspath(code.co_filename)
        if not path.startswith(ROOT + os.sep) or os.sep + "tests" + os.sep in path or os.sep + "bench" + os.sep in path:
            return
        if code.co_name == "train_step":
            state["steps"] += 1
            if state["steps"] == 2:  # one step followed: stop here
                state["on"] = False
                state["steps"] = float("inf")
        if code.co_name == start and state["steps"] == 0:
            state["on"] = True
        if not state["on"] or code.co_name in SKIPPED or (path, code.co_firstlineno) in seen:
            return
        seen.add((path, code.co_firstlineno))
        try:
            lines = len(inspect.getsourcelines(code)[0])
        except OSError:
            lines = 0
        order.append((os.path.relpath(path, ROOT), code.co_qualname, code.co_firstlineno, lines))

    argv = command_line(dict(TINY, data_dir=data_dir, log_dir=log_dir, **evaluations))
    sys.setprofile(profile)
    try:
        train_gpt2.main(argv)
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    return order


def summary(order):
    """Files entered (in order), and returns to a file already left."""
    files, left, returns, previous = [], set(), 0, None
    for path, *_ in order:
        if path == previous:
            continue
        if previous is not None:
            left.add(previous)
        returns += path in left
        if path not in files:
            files.append(path)
        previous = path
    return dict(functions=len(order), lines=sum(o[3] for o in order), files=len(files), returns=returns,
                file_list=files)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--from", dest="start", default="loop", help="loop (default) or main")
    p.add_argument("--evaluations", choices=["validation", "default"], default="validation",
                   help="validation alone (default), or the defaults' evaluations: HellaSwag (synthetic items), "
                        "samples and the plot beside it")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = os.path.join(tmp, "data")
        with open(os.devnull, "w") as quiet:
            stdout, sys.stdout = sys.stdout, quiet  # the preparation's and the run's own lines
            try:  # Shakespeare's plays, the README's try-out text
                fineweb.main(["--data-files", os.path.join(ROOT, "data", "shakespeare.txt"), "--out-dir", data_dir,
                              "--workers", "1"])
                evaluations = {}
                if args.evaluations == "default":
                    from device_check import write_items
                    items = os.path.join(tmp, "hellaswag.jsonl")
                    write_items(items, 8)
                    evaluations = dict(hellaswag_every=1, hellaswag_file=items, sample_every=1, num_samples=1,
                                       sample_tokens=4, plot=True)
                order = trace(args.start, data_dir, os.path.join(tmp, "log"), evaluations)
            finally:
                sys.stdout = stdout
    for path, name, line, lines in order:
        print(f"{path}:{line} {name} ({lines} lines)")
    print(json.dumps(dict(start=args.start, evaluations=args.evaluations, **summary(order))))


if __name__ == "__main__":
    main()
