"""train_gpt2.py end to end on a tiny model: learning, DDP equivalence, multi-node launch,
kill -9 / SIGTERM and resume, bad input, export."""
import errno
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
import common
import tokenizer
import train_config

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


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("data")))


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


@pytest.fixture(scope="module")
def reference_run(data_dir, tmp_path_factory):
    """An uninterrupted 10-step run that the resume tests must reproduce bit for bit."""
    log_dir = str(tmp_path_factory.mktemp("ref"))
    run(TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "10", "--checkpoint-every", "3"])
    return log_dir


def test_loss_goes_down_and_run_is_logged(data_dir, tmp_path):
    log_dir = str(tmp_path / "log")
    hs_file = tmp_path / "hellaswag_val.jsonl"
    items = [{"ctx": f"The cat sees a red ball number {i}.", "endings": ["It runs.", "The dog likes books.",
                                                                        "A.", "My friend paints the sky."],
              "label": i % 4} for i in range(5)]
    hs_file.write_text("".join(json.dumps(item) + "\n" for item in items))
    p = run(TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "30", "--max-lr", "1e-2",
                    "--export-hf", "--sample-every", "15", "--num-samples", "2", "--sample-tokens", "8",
                    "--hellaswag-every", "15", "--hellaswag-file", str(hs_file)])
    train = records(log_dir, "train")
    assert [r["step"] for r in train] == list(range(30))
    assert abs(train[0]["loss"] - math.log(50257)) < 0.5  # untrained: about uniform over the vocabulary
    assert train[-1]["loss"] < train[0]["loss"] - 3.0
    val = records(log_dir, "val")
    assert [r["step"] for r in val] == [0, 4, 8, 12, 16, 20, 24, 28, 29]
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 3.0
    for r in train:
        assert r["tokens"] == (r["step"] + 1) * 128 and r["mfu"] is None and r["dt_ms"] > 0
    header = records(log_dir, "run")[0]
    assert header["grad_accum"] == 2 and header["world_size"] == 1
    assert header["versions"]["torch"] == torch.__version__
    assert records(log_dir, "end")[0]["reason"] == "finished"
    # one greppable line per step, the same keys in stdout and log.txt
    lines = [l for l in p.stdout.splitlines() if l.startswith("step ") and "| loss" in l]
    assert len(lines) == 30
    for key in ("loss", "lr", "grad_norm", "dt_ms", "tok_per_s", "mfu"):
        assert f"| {key} " in lines[-1]
    with open(os.path.join(log_dir, "log.txt")) as f:
        assert sum(1 for l in f if l.startswith("step ") and "| loss" in l) == 30
    assert sum(1 for l in p.stdout.splitlines() if l.startswith("sample ")) == 4  # steps 15 and 29
    hs = records(log_dir, "hellaswag")
    assert [r["step"] for r in hs] == [0, 15, 29] and all(r["n"] == 5 for r in hs)
    assert all(0 <= r["acc_norm"] <= 1 and r["acc"] * 5 == round(r["acc"] * 5) for r in hs)
    # the trainer's figure is the standalone script's on the final weights
    import hellaswag
    final, _ = checkpoint.load_model(log_dir)
    assert hs[-1]["acc_norm"] == hellaswag.evaluate(final, items, "cpu")["acc_norm"]
    # the final export loads in transformers with the same logits as the checkpoint
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(os.path.join(log_dir, "hf")).eval()
    ours, _ = checkpoint.load_model(log_dir)
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx)[0][..., :50257]).abs().max().item() < 1e-4


def test_kill9_then_resume_is_bit_identical(data_dir, reference_run, tmp_path):
    log_dir = str(tmp_path / "log")
    args = TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "10", "--checkpoint-every", "3"]
    proc = subprocess.Popen([sys.executable, TRAIN] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV)
    for line in proc.stdout:  # kill hard in the middle of step 7, two steps past the last checkpoint
        if line.startswith("step     7 |"):
            proc.kill()
            break
    proc.wait(timeout=600)  # bounds a hang only: a busy machine may take minutes
    assert proc.returncode == -signal.SIGKILL
    assert records(log_dir, "end") == []
    run(args + ["--resume"])
    ref, got = records(reference_run, "train"), records(log_dir, "train")
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]  # bit for bit, replayed steps included
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in ref]
    step_a, model_a, _ = final_state(reference_run)
    step_b, model_b, _ = final_state(log_dir)
    assert step_a == step_b == 10
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    assert len(checkpoint.list_checkpoints(log_dir)) == 2  # --keep-checkpoints 2


def test_sigterm_during_a_step_stops_after_it_and_resume_alone_continues(data_dir, reference_run, tmp_path):
    """SIGTERM while step 5 runs: the run ends after step 5, not after the next one (the request is
    read at the step's sync), with a checkpoint of its 6 steps; then `--log-dir L --resume` alone,
    with none of the run's flags, continues it with the run's settings to the reference's losses
    and weights, bit for bit."""
    log_dir = str(tmp_path / "log")
    args = TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "10", "--checkpoint-every", "100"]
    p = subprocess.run([sys.executable, FAULT_TRAINER] + args, capture_output=True, text=True,
                       env=dict(ENV, FAULT="term:0:5"), timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "stopped by SIGTERM after 6 steps" in p.stdout and "Traceback" not in p.stderr
    assert records(log_dir, "end")[-1] == dict(records(log_dir, "end")[-1], step=5, reason="signal")
    assert [r["step"] for r in records(log_dir, "train")] == list(range(6))
    assert final_state(log_dir)[0] == 6
    p = run(["--log-dir", log_dir, "--resume"])
    assert f"resuming {log_dir}/ckpt_000006.pt at step 6 with the run's settings" in p.stdout
    assert "resume: " not in p.stdout  # nothing changed
    assert [r["loss"] for r in records(log_dir, "train")] == [r["loss"] for r in records(reference_run, "train")]
    _, model_a, _ = final_state(reference_run)
    step, model_b, _ = final_state(log_dir)
    assert step == 10 and all(torch.equal(model_a[k], model_b[k]) for k in model_a)


def test_resume_applies_the_changes_that_keep_the_math(data_dir, reference_run, tmp_path):
    """Named on the command line of a resume: more steps, another evaluation cadence or timeout are
    applied and printed; the checks between flags see the run's own settings (the flags that would
    change the math are refused: see BAD)."""
    log_dir = str(tmp_path / "log")
    shutil.copytree(reference_run, log_dir)  # a finished 10-step run
    p = run(["--log-dir", log_dir, "--resume", "--warmup-steps", "11"], check=False)
    assert p.returncode == 2 and "--warmup-steps 11 is more than --max-steps 10" in p.stderr, p.stderr
    p = run(["--log-dir", log_dir, "--resume", "--max-steps", "5"], check=False)
    assert p.returncode == 2 and "--max-steps 5 is fewer than the 10 steps" in p.stderr, p.stderr
    p = run(["--log-dir", log_dir, "--resume", "--max-steps", "12", "--eval-every", "1", "--dist-timeout", "20"])
    for change in ("--max-steps 10 -> 12", "--eval-every 4 -> 1", "--dist-timeout 15.0 -> 20.0"):
        assert f"resume: {change} (from the command line)" in p.stdout, p.stdout
    assert "cosine to 0.0003 at step 12" in p.stdout
    header = records(log_dir, "run")[-1]
    assert header["config"]["max_steps"] == 12 and header["config"]["block_size"] == 32  # given, and kept
    assert len(header["changes"]) == 3 and "given" not in header["config"]
    assert [r["step"] for r in records(log_dir, "train")] == list(range(12))
    assert [r["step"] for r in records(log_dir, "val")] == [0, 4, 8, 9, 10, 11]  # every step after the resume


def test_one_trainer_per_log_dir(data_dir, tmp_path):
    """A second trainer on a log directory in use gets one line naming the running one, with or
    without --resume; a kill -9 of the first leaves nothing to clean up."""
    log_dir = str(tmp_path / "log")
    args = TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--eval-every", "0"]
    first = subprocess.Popen([sys.executable, TRAIN] + args + ["--max-steps", "100000"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        for line in first.stdout:
            if line.startswith("step     1 |"):
                break
        for extra in (["--resume"], []):
            p = run(args + ["--max-steps", "2"] + extra, check=False)
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1, p.stdout[-2000:] + p.stderr
            assert f"is in use by a trainer that is still running (pid {first.pid} on " in lines[0]
    finally:
        first.kill()
        first.wait(timeout=600)
    p = run(args + ["--max-steps", "3", "--resume"])  # no checkpoint yet: --resume starts it afresh
    assert "new run" in p.stdout and records(log_dir, "end")[-1]["reason"] == "finished"


def test_a_run_that_failed_before_its_first_step_does_not_block_the_retry(data_dir, tmp_path):
    """Shards with a token id beyond the vocabulary fail at the first batch, after the run header
    was written: the retry with good data starts the run without --resume."""
    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    train_shard = sorted(bad.glob("*_train_*.npy"))[0]
    tokens = np.load(train_shard)
    tokens[:50] = 60000
    np.save(train_shard, tokens)
    log_dir = str(tmp_path / "log")
    args = TINY + ["--log-dir", log_dir, "--max-steps", "2"]
    p = run(args + ["--data-dir", str(bad)], check=False)
    assert p.returncode == 2 and "token id 60000" in p.stderr, p.stderr
    assert records(log_dir, "run") and not records(log_dir, "train")  # the header is there, no step
    run(args + ["--data-dir", data_dir])
    assert [r["step"] for r in records(log_dir, "train")] == [0, 1]


def torchrun(extra, args, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run"] + extra + [TRAIN] + args
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, **kw)


def test_ddp_two_processes_match_one_process_with_accumulation(data_dir, tmp_path):
    common_args = TINY + ["--data-dir", data_dir, "--max-steps", "4", "--eval-every", "2"]
    single = str(tmp_path / "single")
    run(common_args + ["--log-dir", single])  # micro-batch 2, accumulation 2
    ddp = str(tmp_path / "ddp")
    p = torchrun(["--standalone", "--nproc_per_node=2"], common_args + ["--log-dir", ddp])
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    assert records(ddp, "run")[0]["world_size"] == 2
    assert records(ddp, "run")[0]["grad_accum"] == 1
    a, b = records(single, "train"), records(ddp, "train")
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):  # same global batch, same math; only the summation order differs
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
    for va, vb in zip(records(single, "val"), records(ddp, "val")):
        assert vb["val_loss"] == pytest.approx(va["val_loss"], rel=1e-5)
    # FSDP2 with activation checkpointing: the same steps again, to the same tolerance; HellaSwag on
    # 9 items (shares of 5 and 4: two batches of 4 on one rank, one on the other) and samples run on
    # both ranks in step, since every forward through the sharded model is a collective
    fsdp = str(tmp_path / "fsdp")
    hs_file = tmp_path / "hellaswag_val.jsonl"
    hs_file.write_text("".join(json.dumps({"ctx": f"The cat sees item {i}.", "endings": ["A.", "It runs.", "B c.", "D."],
                                           "label": i % 4}) + "\n" for i in range(9)))
    p = torchrun(["--standalone", "--nproc_per_node=2"], common_args + [
        "--log-dir", fsdp, "--fsdp", "--activation-checkpointing", "--hellaswag-every", "2", "--hellaswag-file",
        str(hs_file), "--sample-every", "2", "--num-samples", "1", "--sample-tokens", "4", "--export-hf"])
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    assert "memory (fsdp, activation checkpointing): per process: params" in out
    assert [(r["step"], r["n"]) for r in records(fsdp, "hellaswag")] == [(0, 9), (2, 9), (3, 9)]
    assert sum(1 for line in out.splitlines() if line.startswith("sample 0 |")) == 2  # steps 2 and 3, rank 0
    c = records(fsdp, "train")
    assert len(c) == 4
    for ra, rc in zip(a, c):
        assert rc["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rc["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
    for va, vc in zip(records(single, "val"), records(fsdp, "val")):
        assert vc["val_loss"] == pytest.approx(va["val_loss"], rel=1e-5)
    # the FSDP checkpoint is the ordinary full one: it loads as a plain GPT, whole and tied
    model, _ = checkpoint.load_model(fsdp)
    single_model, _ = checkpoint.load_model(single)
    assert {k: v.shape for k, v in model.state_dict().items()} == \
        {k: v.shape for k, v in single_model.state_dict().items()}
    assert model.lm_head.weight is model.transformer.wte.weight
    exported, _ = checkpoint.load_model(os.path.join(fsdp, "hf"))  # gathered from the shards at the end
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert torch.equal(exported(idx)[0][..., :50257], model.eval()(idx)[0][..., :50257])


def test_sigterm_on_one_rank_during_a_step_stops_every_rank_after_it(data_dir, tmp_path):
    """Under DDP a request that reaches one rank while step 5 runs ends every rank after step 5."""
    log_dir = str(tmp_path / "log")
    args = TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "8", "--eval-every", "0"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        FAULT_TRAINER] + args, capture_output=True, text=True, env=dict(ENV, FAULT="term:1:5"),
                       timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "stopped by a signal on another rank after 6 steps" in p.stdout
    assert final_state(log_dir)[0] == 6 and [r["step"] for r in records(log_dir, "train")] == list(range(6))


def test_muon_accumulates_trains_on_two_processes_and_resumes_exactly(data_dir, tmp_path):
    """--optimizer muon through the trainer: micro-batches of 2 with accumulation equal one batch of
    4; two processes equal one; a kill -9 mid-run, resumed with --resume alone, ends bit-identical
    to the run that never stopped (Muon's momentum is in the checkpoint)."""
    base = TINY + ["--data-dir", data_dir, "--max-steps", "6", "--optimizer", "muon", "--eval-every", "0",
                   "--checkpoint-every", "3"]
    accum = str(tmp_path / "accum")
    p = run(base + ["--log-dir", accum])  # micro-batch 2, accumulation 2
    assert "Muon 0.02 on the block matrices" in p.stdout and "Muon+AdamW" in p.stdout
    whole = str(tmp_path / "whole")
    run([a if a != "2" or base[i - 1] != "--micro-batch-size" else "4" for i, a in enumerate(base)]
        + ["--log-dir", whole])
    ddp = str(tmp_path / "ddp")
    p = torchrun(["--standalone", "--nproc_per_node=2"], base + ["--log-dir", ddp])
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    ref = records(accum, "train")
    for other in (whole, ddp):  # the same gradients summed in another order; Newton-Schulz runs in bf16,
        got = records(other, "train")  # which magnifies that rounding in the update (1e-4 in the norms here)
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-3)
    killed = str(tmp_path / "killed")
    p = subprocess.run([sys.executable, FAULT_TRAINER] + base + ["--log-dir", killed], capture_output=True,
                       text=True, env=dict(ENV, FAULT="kill:0:4"), timeout=900)
    assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-2000:]
    run(["--log-dir", killed, "--resume"])
    assert [r["loss"] for r in records(killed, "train")] == [r["loss"] for r in ref]
    _, model_a, optim_a = final_state(accum)
    _, model_b, optim_b = final_state(killed)
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    muon_a, muon_b = optim_a["optimizers"][0]["state"], optim_b["optimizers"][0]["state"]
    assert len(muon_a) == 8 and all(torch.equal(muon_a[i]["momentum_buffer"], muon_b[i]["momentum_buffer"])
                                    for i in muon_a)


def test_activation_checkpointing_gives_the_same_losses(data_dir, tmp_path):
    args = TINY + ["--data-dir", data_dir, "--max-steps", "3", "--eval-every", "0"]
    run(args + ["--log-dir", str(tmp_path / "plain")])
    run(args + ["--log-dir", str(tmp_path / "ckpt"), "--activation-checkpointing"])
    assert [r["loss"] for r in records(str(tmp_path / "ckpt"), "train")] == \
        [r["loss"] for r in records(str(tmp_path / "plain"), "train")]


def test_two_node_torchrun_on_loopback(data_dir, tmp_path, free_port):
    log_dir = str(tmp_path / "log")
    port = free_port
    args = TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "3"]
    nodes = [torchrun(["--nnodes=2", f"--node_rank={r}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                       f"--master_port={port}"], args) for r in range(2)]
    outs = [n.communicate(timeout=900)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert records(log_dir, "run")[0]["world_size"] == 2
    assert len(records(log_dir, "train")) == 3


def test_nonfinite_loss_stops_and_keeps_last_checkpoint(data_dir, tmp_path):
    log_dir = str(tmp_path / "log")
    p = run(TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "12", "--checkpoint-every", "1",
                    "--warmup-steps", "0", "--max-lr", "1e30", "--eval-every", "0"], check=False)
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    assert "non-finite; stopping" in p.stdout and "Traceback" not in p.stderr
    end = records(log_dir, "end")[-1]
    assert end["reason"] == "nonfinite"
    step, model, _ = final_state(log_dir)
    assert step <= end["step"]
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())
    # with --on-nonfinite skip the run carries on to the end
    log2 = str(tmp_path / "log2")
    p = run(TINY + ["--data-dir", data_dir, "--log-dir", log2, "--max-steps", "6", "--warmup-steps", "0",
                    "--max-lr", "1e30", "--eval-every", "0", "--on-nonfinite", "skip"], check=False)
    assert p.returncode == 0 and "skipped (non-finite)" in p.stdout
    # the same with Muon: a skipped step updates neither optimizer, and the weights stay finite
    log3 = str(tmp_path / "log3")
    p = run(TINY + ["--data-dir", data_dir, "--log-dir", log3, "--max-steps", "6", "--warmup-steps", "0",
                    "--max-lr", "1e30", "--eval-every", "0", "--on-nonfinite", "skip", "--optimizer", "muon"],
            check=False)
    assert p.returncode == 0 and "skipped (non-finite)" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    _, model, _ = final_state(log3)
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())


@pytest.fixture(scope="module")
def bad_input_setup(data_dir, tmp_path_factory, reference_run):
    base = tmp_path_factory.mktemp("bad")
    junk = base / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint")
    good = checkpoint.latest_checkpoint(reference_run)
    truncated = base / "ckpt_000009.pt"
    with open(good, "rb") as f:
        truncated.write_bytes(f.read()[:2000])
    hf_dir = base / "hf"
    from model import GPT, GPTConfig
    GPT(GPTConfig(block_size=32, n_layer=1, n_head=1, n_embd=16)).export_hf(str(hf_dir))
    return dict(base=str(base), junk=str(junk), truncated=str(truncated), hf=str(hf_dir),
                data=data_dir, ref=reference_run)


BAD = {
    "missing data dir": (["--data-dir", "{base}/nope"], "nope"),
    "empty data dir": (["--data-dir", "{base}"], "fineweb.py"),
    "batch not a multiple of block": (["--total-batch-size", "100"], "multiple"),
    "batch not divisible": (["--total-batch-size", "96"], "not divisible"),
    "block size too large for init-from": (["--init-from", "{hf}", "--block-size", "64"], "block-size"),
    "resume path missing": (["--resume", "{base}/ckpt_000123.pt"], "no such file"),
    "resume not a checkpoint": (["--resume", "{junk}"], "not a"),
    "resume truncated checkpoint": (["--resume", "{truncated}"], "truncated"),
    "unknown device": (["--device", "tpu"], "unknown device"),
    "existing run without --resume": (["--log-dir", "{ref}"], "--resume"),
    "resume with another shape": (["--log-dir", "{ref}", "--resume", "--n-layer", "3"], "--n-layer 2 and this"),
    "resume with another preset": (["--log-dir", "{ref}", "--resume", "--model", "gpt2-medium"], "--model gpt2 and"),
    "resume with another seed": (["--log-dir", "{ref}", "--resume", "--seed", "7"], "--seed 1337 and this"),
    "resume with another batch": (["--log-dir", "{ref}", "--resume", "--total-batch-size", "256"],
                                  "--total-batch-size 128"),
    "resume with a shuffle seed": (["--log-dir", "{ref}", "--resume", "--shuffle-seed", "3"], "--shuffle-seed None"),
    "resume with another optimizer": (["--log-dir", "{ref}", "--resume", "--optimizer", "muon"],
                                      "--optimizer adamw and this command asks for muon"),
    "zero muon lr": (["--optimizer", "muon", "--muon-lr", "0"], "--muon-lr must be a positive number"),
    "muon momentum of 1": (["--optimizer", "muon", "--muon-momentum", "1"], "--muon-momentum must be at least 0"),
    "resume with another micro-batch": (["--log-dir", "{ref}", "--resume", "--micro-batch-size", "1"],
                                        "micro-batch-size"),
    "bad micro-batch": (["--micro-batch-size", "lots"], "micro-batch-size"),
    "hellaswag file missing": (["--hellaswag-every", "1", "--hellaswag-file", "{base}/hs.jsonl"], "hellaswag-file"),
    "log dir is a file": (["--log-dir", "{junk}"], "is a file"),
    "log dir under a file": (["--log-dir", "{junk}/run1"], "cannot be made"),
    "resume with a larger block size": (["--log-dir", "{ref}", "--resume", "--block-size", "64"], "--block-size 32 and"),
    "negative warm-up": (["--warmup-steps", "-1"], "warmup-steps"),
    "fsdp without torchrun": (["--fsdp"], "torchrun"),
    "zero dist timeout": (["--dist-timeout", "0"], "dist-timeout"),
    "beta1 above 1": (["--beta1", "2"], "--beta1 must be at least 0 and below 1"),
    "beta2 not a number": (["--beta2", "nan"], "--beta2 must be"),
    "negative eps": (["--eps", "-1"], "--eps must be a positive number"),
    "zero width": (["--n-embd", "0"], "--n-embd must be at least 1"),
    "zero layers": (["--n-layer", "0"], "--n-layer must be at least 1"),
    "negative grad clip": (["--grad-clip", "-1"], "--grad-clip must be 0 or more"),
    "negative weight decay": (["--weight-decay", "-0.1"], "--weight-decay must be 0 or more"),
    "infinite max lr": (["--max-lr", "inf"], "--max-lr must be a positive number"),
    "warm-up longer than the run": (["--warmup-steps", "5"], "--warmup-steps 5 is more than --max-steps 2"),
    "zero hellaswag limit": (["--hellaswag-limit", "0"], "--hellaswag-limit must be at least 1"),
    "negative shuffle seed": (["--shuffle-seed", "-1"], "--shuffle-seed must be 0 or more"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_clear_line(case, bad_input_setup, tmp_path):
    extra, expect = BAD[case]
    extra = [a.format(**bad_input_setup) for a in extra]
    log_dir = str(tmp_path / "fresh")
    args = TINY + ["--data-dir", bad_input_setup["data"], "--log-dir", log_dir, "--max-steps", "2"] + extra
    before = sorted(os.listdir(bad_input_setup["ref"]))
    p = run(args, check=False)
    assert p.returncode == 2, p.stdout[-1000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], p.stderr
    assert sorted(os.listdir(bad_input_setup["ref"])) == before  # nothing written over
    assert not os.path.exists(log_dir)  # and nothing left behind


def test_lr_schedule():
    import train_gpt2
    args = train_config.parse_args([])
    assert args.max_steps == 19073 and args.warmup_steps == 715 and args.total_batch_size == 524288
    schedule = train_gpt2.schedule_of(args)
    lrs = [schedule.lr(s, args.max_lr) for s in range(args.max_steps)]
    assert lrs[0] == pytest.approx(6e-4 / 715) and lrs[714] == pytest.approx(6e-4)
    assert max(lrs) == pytest.approx(6e-4)
    assert lrs[-1] == pytest.approx(6e-5, rel=1e-3)  # cosine down to 10%
    assert all(a >= b for a, b in zip(lrs[715:], lrs[716:]))


def test_wsd_schedule_holds_the_peak_then_decays_linearly():
    import train_gpt2
    schedule = train_gpt2.Schedule(warmup_steps=10, max_steps=100, min_lr_ratio=0.1, shape="wsd")
    lrs = [schedule.lr(s, 2.0) for s in range(101)]
    assert lrs[:10] == [2.0 * (s + 1) / 10 for s in range(10)]  # the same warm-up as cosine
    assert set(lrs[9:81]) == {2.0}  # stable until the last 20% of the run
    assert lrs[90] == pytest.approx(1.1) and lrs[100] == pytest.approx(0.2)  # linear to min_lr_ratio * peak
    assert all(a > b for a, b in zip(lrs[80:100], lrs[81:101]))


def test_timing_breakdown_reports_phases(data_dir, tmp_path):
    log_dir = str(tmp_path / "log")
    p = run(TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "4", "--timing-breakdown", "2"])
    lines = [l for l in p.stdout.splitlines() if l.startswith("timing |")]
    assert len(lines) == 2
    for phase in ("data_ms", "copy_ms", "forward_ms", "backward_ms", "optimizer_ms", "eval_ms"):
        assert phase in lines[0]
    t = records(log_dir, "timing")
    assert len(t) == 2 and all(t[0][k] >= 0 for k in ("data_ms", "forward_ms", "backward_ms"))
    assert t[0]["forward_ms"] > 0 and t[0]["eval_ms"] > 0  # step 0 ran a validation


def test_short_run_leaves_warmup():
    import train_gpt2
    args = train_config.parse_args(["--max-steps", "50"])
    assert args.warmup_steps == 5  # 10% of the run, not 715 steps the run never reaches
    assert train_gpt2.schedule_of(args).lr(5, args.max_lr) == pytest.approx(6e-4)
    assert train_config.parse_args(["--max-steps", "50", "--warmup-steps", "40"]).warmup_steps == 40  # as asked


def test_validation_covers_the_val_split_at_most_once(data_dir, tmp_path):
    import dataloader
    args = [a if a != "128" else "1000000000" for a in TINY]  # --val-tokens 1e9 (and the batch stays 128)
    args[args.index("--total-batch-size") + 1] = "128"
    args[args.index("--warmup-steps") + 1] = "1"  # no longer than the one step
    p = run(args + ["--data-dir", data_dir, "--log-dir", str(tmp_path / "log"), "--max-steps", "1"])
    whole = dataloader.TokenLoader(data_dir, "val", 2, 32).batches_per_epoch * 2 * 32
    assert f"val: {whole:,} tokens (the whole split)" in p.stdout
    assert len(records(str(tmp_path / "log"), "val")) == 1


def test_resume_skips_a_corrupt_newest_checkpoint(data_dir, reference_run, tmp_path):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    older, newest = checkpoint.list_checkpoints(reference_run)  # steps 9 and 10
    for path in (older, newest):
        shutil.copy(path, log_dir)
    cut = log_dir / os.path.basename(newest)
    cut.write_bytes(cut.read_bytes()[:5000])  # as a full disk or a copy cut short would leave it
    args = TINY + ["--data-dir", data_dir, "--log-dir", str(log_dir), "--max-steps", "10", "--checkpoint-every", "3",
                   "--resume"]
    p = run(args)
    skipped = [l for l in p.stdout.splitlines() if l.startswith("resume: skipped")]
    assert len(skipped) == 1 and cut.name in skipped[0] and "truncated or corrupt" in skipped[0]
    assert f"resuming {log_dir / os.path.basename(older)} at step 9" in p.stdout
    _, model_a, _ = final_state(reference_run)
    _, model_b, _ = final_state(str(log_dir))
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    for path in checkpoint.list_checkpoints(str(log_dir)):  # none loads: one line, nothing written
        with open(path, "wb") as f:
            f.write(b"garbage")
    p = run(args, check=False)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "none of the 2 checkpoints" in lines[0], p.stderr


def test_sigterm_during_evaluation_stops_within_it(data_dir, reference_run, tmp_path):
    """A stop request in the middle of a long HellaSwag pass ends it at the next batch: no figure
    is logged for it, the run keeps the steps it finished, and a resume continues exactly."""
    hs = tmp_path / "hellaswag_val.jsonl"
    item = {"ctx": "The cat sees a red ball and", "endings": ["it runs.", "the dog likes books.", "a.", "we paint."]}
    hs.write_text("".join(json.dumps(dict(item, label=i % 4)) + "\n" for i in range(20000)))  # minutes to score
    log_dir = str(tmp_path / "log")
    args = TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "10", "--checkpoint-every", "3"]
    proc = subprocess.Popen([sys.executable, TRAIN] + args + ["--hellaswag-every", "5", "--hellaswag-file", str(hs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step 0 | val_loss"):  # HellaSwag comes next
            proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=600)
    text = "".join(out)
    assert proc.returncode == 0 and "stopped by SIGTERM after 0 steps" in text, text[-2000:]
    assert records(log_dir, "hellaswag") == [] and records(log_dir, "end")[-1]["reason"] == "signal"
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(log_dir)] == ["ckpt_000000.pt"]
    run(args + ["--resume"])
    assert [r["loss"] for r in records(log_dir, "train")] == [r["loss"] for r in records(reference_run, "train")]


class DiskFull(io.RawIOBase):
    """A file that takes `room` bytes and then fails as a full disk does (ENOSPC)."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def writable(self):
        return True

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(data_dir, tmp_path, monkeypatch):
    """The disk fills while the step-6 checkpoint is written: torch's zip writer turns the OSError
    into its own RuntimeError ("unexpected pos"); the run still ends in one line, with the step-3
    checkpoint whole and no temporary file left."""
    import train_gpt2
    real = checkpoint.atomic_write

    def filling(path, write_fn):
        if "ckpt_000006" not in path:
            return real(path, write_fn)
        return real(path, lambda f: write_fn(DiskFull(f, 4096)))
    monkeypatch.setattr(checkpoint, "atomic_write", filling)
    # the trainer installs its own signal handlers: pytest's come back afterwards
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    log_dir = str(tmp_path / "log")
    args = train_config.parse_args(TINY + ["--data-dir", data_dir, "--log-dir", log_dir, "--max-steps", "10",
                                         "--checkpoint-every", "3"])
    try:
        with pytest.raises(common.UserError, match=r"ckpt_000006.pt \(no space left on its disk\)") as e:
            train_gpt2.train(args)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert "ckpt_000003.pt is intact" in str(e.value) and "\n" not in str(e.value)
    assert sorted(f for f in os.listdir(log_dir) if "ckpt" in f) == ["ckpt_000003.pt"]  # no half file left
    assert checkpoint.load_file(os.path.join(log_dir, "ckpt_000003.pt"))["step"] == 3


def test_checkpoints_load_memory_mapped_and_without_mmap_when_it_fails(tmp_path, monkeypatch):
    """The ranks of a node resuming together share the file's pages (torch.load(mmap=True)); where
    mmap fails the file is read the plain way, with the same result."""
    path = str(tmp_path / "ckpt_000001.pt")
    weights = torch.arange(4096, dtype=torch.float32)
    checkpoint.save_file(path, {"step": 1, "model": {"w": weights}})
    ckpt = checkpoint.load_file(path)
    assert torch.equal(ckpt["model"]["w"], weights)
    if os.path.exists("/proc/self/maps"):  # Linux: the file is mapped, not copied
        with open("/proc/self/maps") as f:
            assert path in f.read()
    real_load = torch.load

    def no_mmap(*args, mmap=None, **kw):
        if mmap:
            raise RuntimeError("mmap is not supported on this file system")
        return real_load(*args, **kw)
    monkeypatch.setattr(torch, "load", no_mmap)
    assert torch.equal(checkpoint.load_file(path)["model"]["w"], weights)


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_torchrun_restart_after_a_killed_rank_resumes_by_itself(data_dir, tmp_path, sharding):
    """torchrun --max-restarts with --resume: rank 1 dies with SIGKILL mid-run, the group is started
    again, resumes from the last checkpoint, and ends with the per-step losses and the weights of a
    run that never failed, under DDP and under FSDP."""
    args = TINY + ["--data-dir", data_dir, "--max-steps", "8", "--checkpoint-every", "3", "--eval-every", "0",
                   "--resume", "--sharding", sharding]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    ref = str(tmp_path / "ref")
    p = subprocess.run(launch + [TRAIN] + args + ["--log-dir", ref], capture_output=True, text=True, env=ENV,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    log_dir = str(tmp_path / "log")
    env = dict(ENV, FAULT="kill:1:5")  # rank 1 kills itself at step 5, two steps past a checkpoint
    p = subprocess.run(launch + ["--max-restarts=1", FAULT_TRAINER] + args + ["--log-dir", log_dir],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [h["restart"] for h in records(log_dir, "run")] == [0, 1]
    assert "torchrun restart 1" in p.stdout and "resuming" in p.stdout
    assert [r["loss"] for r in records(log_dir, "train")] == [r["loss"] for r in records(ref, "train")]
    _, model_a, optim_a = final_state(ref)
    _, model_b, optim_b = final_state(log_dir)
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)  # bit for bit on CPU
    assert all(torch.equal(optim_a["state"][i]["exp_avg_sq"], optim_b["state"][i]["exp_avg_sq"])
               for i in optim_a["state"])
