"""Running train_gpt2.py in the tests: a tiny configuration, shards of learnable text for it, and
reading back what a run wrote (its metrics and its last checkpoint); and any script with its
stdout closed."""
import json
import os
import random
import subprocess
import sys

import numpy as np

import checkpoint
import tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train_gpt2.py")
FAULT_TRAINER = os.path.join(ROOT, "tests", "fault_trainer.py")  # the trainer with one fault injected
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--micro-batch-size", "2", "--total-batch-size", "128", "--warmup-steps", "2", "--max-lr", "3e-3",
        "--eval-every", "4", "--val-tokens", "128", "--hellaswag-every", "0", "--sample-every", "0",
        "--no-plot", "--no-export-hf", "--device", "cpu"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


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


def run(args, check=True, **kw):
    p = subprocess.run([sys.executable, TRAIN] + args, capture_output=True, text=True, env=ENV,
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
    ckpt = checkpoint.load_file(checkpoint.latest_checkpoint(log_dir))
    return ckpt["step"], ckpt["model"], ckpt["optimizer"]


def torchrun(extra, args, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run"] + extra + [TRAIN] + args
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, **kw)


def stdout_closed(script, args):
    """Run script (a path) as `python script args | head` runs once head has exited: its stdout a
    pipe whose reader is gone. Returns its exit status and stderr."""
    proc = subprocess.Popen([sys.executable, script] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=600), err
