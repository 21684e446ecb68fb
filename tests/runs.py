"""Running train_gpt2.py in the tests: a tiny configuration (tiny(), with overrides), shards of
learnable text for it, the trainer in this process (run(), the default: no interpreter and torch
import to pay for) or in one of its own (run_process(), where a process must die, be signalled or
run beside others: started warm, tests/warm.py, unless the process's start is the point), and reading
back what a run wrote (its metrics and its last checkpoint); and any script with its stdout closed."""
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import checkpoint  # noqa: E402
import common  # noqa: E402
import tokenizer  # noqa: E402
import warm  # noqa: E402
from train_config import command_line  # noqa: E402  (the trainer's own settings-to-flags rule)
TRAIN = os.path.join(ROOT, "train_gpt2.py")
FAULT_TRAINER = os.path.join(ROOT, "tests", "fault_trainer.py")  # the trainer with one fault injected
TINY_SETTINGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, micro_batch_size=2, total_batch_size=128,
                     warmup_steps=2, max_lr=3e-3, eval_every=4, val_tokens=128, hellaswag_every=0, sample_every=0,
                     plot=False, export_hf=False, device="cpu")


def tiny(**overrides):
    """The tiny run's command line with overrides, by setting name: max_steps=10, log_dir=path; True is
    a bare flag (fsdp=True, resume=True), False the --no- form of an on/off flag (export_hf=False), None
    leaves the flag out (the default, or the architecture of --init-from)."""
    return command_line({**TINY_SETTINGS, **overrides})


TINY = tiny()
ENV = warm.environment()  # unbuffered, one OpenMP thread: tiny models gain nothing from more


def make_text(n_docs, seed):
    """Repetitive, learnable English-like documents."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my friend", "the teacher", "our team", "the river"]
    verbs = ["sees", "likes", "follows", "builds", "paints", "finds"]
    objects = ["a red ball", "the old house", "many books", "the blue sky", "a small boat"]
    docs = []
    for _ in range(n_docs):
        sentences = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
                     for _ in range(rng.randint(3, 12))]
        docs.append(" ".join(s.capitalize() for s in sentences))
    return docs


def write_shards(data_dir, n_train_shards=2, docs_per_shard=120):
    enc = tokenizer.get_tokenizer()
    os.makedirs(data_dir, exist_ok=True)
    for i in range(n_train_shards + 1):
        toks = []
        for doc in make_text(docs_per_shard if i else 40, seed=i):
            toks.append(enc.eot_token)
            toks.extend(enc.encode_ordinary(doc))
        split = "val" if i == 0 else "train"
        np.save(os.path.join(data_dir, f"tiny_{split}_{i:06d}.npy"), np.array(toks, dtype=np.uint16))
    return data_dir


@contextlib.contextmanager
def in_this_process():
    """Around a trainer run in this process: one thread, as ENV gives a subprocess (tiny models gain
    nothing from more), and the signal handlers the trainer installs put back after."""
    handlers = {sig: signal.getsignal(sig) for sig in common.STOP_SIGNALS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def train(args):
    """train_gpt2.train on the command line args, in this process: its exit status, or the UserError
    of a bad input raised."""
    import train_gpt2
    with in_this_process():
        return train_gpt2.train(args)


def run(args, check=True):
    """train_gpt2.py with args, in this process, through the script's own exit path (a bad input is
    exit status 2 and one line on stderr). Returns a CompletedProcess: returncode, stdout, stderr."""
    import train_gpt2
    out, err = io.StringIO(), io.StringIO()
    try:
        with in_this_process(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            common.run_main(lambda: train_gpt2.main(args))
        code = 0
    except SystemExit as e:
        code = e.code or 0
    p = subprocess.CompletedProcess(["train_gpt2.py"] + args, code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"exit {code}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def run_process(args, check=True, script=TRAIN, cold=False, **kw):
    """train_gpt2.py (or script, such as FAULT_TRAINER) with args in a process of its own, started warm (cold: by the
    interpreter itself)."""
    p = subprocess.run([python(cold), script] + args, capture_output=True, text=True, env=kw.pop("env", ENV),
                       timeout=900, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def records(log_dir, kind):
    """The metrics of one kind, the later record winning for a repeated step."""
    by_step = {}
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["kind"] == kind:
                by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def final_state(log_dir):
    ckpt = checkpoint.load_file(checkpoint.list_checkpoints(log_dir)[-1])
    return ckpt["step"], ckpt["model"], ckpt["optimizer"]


def python(cold=False):
    """The interpreter to start a script's process with: warm (tests/warm.py) unless cold."""
    return sys.executable if cold else warm.python()


def torchrun(extra, args, script=TRAIN, env=ENV, cold=False, **kw):
    """torchrun with its options `extra`, running script with args; it and its ranks started warm unless cold."""
    cmd = [python(cold), "-m", "torch.distributed.run"] + extra + [script] + args
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kw)


def stdout_closed(script, args):
    """Run script (a path) as `python script args | head` runs once head has exited: its stdout a
    pipe whose reader is gone. Returns its exit status and stderr."""
    proc = subprocess.Popen([sys.executable, script] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=600), err
