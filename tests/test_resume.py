"""Stopping and resuming train_gpt2.py: kill -9, SIGTERM during a step or an evaluation, a full
disk, a corrupt checkpoint, a restarted torchrun group, the settings a resume restores or refuses,
and one trainer per log directory."""
import errno
import importlib.util
import io
import json
import os
import shlex
import shutil
import signal
import struct
import re
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch

import checkpoint
import metrics
import optim
import common
import evaluation
import train_config
import train_gpt2
import runs
from model import GPT
from runs import ENV, FAULT_TRAINER, TRAIN, final_state, records, run, tiny


def test_a_fine_tune_to_a_shorter_context_trains_and_resumes_without_its_source(data_dir, reference_run, tmp_path):
    """--init-from a run with --block-size below its context: an N-position model trains (the position table cut to
    its first N rows) and is checkpointed as one; interrupted and resumed after the run it started from is deleted,
    it goes on from its own checkpoint to the losses of a fine-tune that never stopped."""
    source = tmp_path / "source"
    shutil.copytree(reference_run, source)
    trained = checkpoint.load_file(checkpoint.list_checkpoints(str(source))[-1])["model"]["transformer.wpe.weight"]
    tune = dict(data_dir=data_dir, init_from=str(source), block_size=16, n_layer=None, n_head=None, n_embd=None,
                checkpoint_every=2)
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    run(tiny(log_dir=whole, max_steps=4, **tune))
    ckpt = checkpoint.load_file(checkpoint.list_checkpoints(whole)[0])
    assert ckpt["model_config"]["block_size"] == 16 and ckpt["model"]["transformer.wpe.weight"].shape == (16, 32)
    assert trained.shape == (32, 32) and checkpoint.load_model(whole)[0].config.block_size == 16
    run(tiny(log_dir=cut, max_steps=2, **tune))
    shutil.rmtree(source)
    run(["--log-dir", cut, "--resume", "--max-steps", "4"])
    assert [r["loss"] for r in records(cut, "train")] == [r["loss"] for r in records(whole, "train")]
    assert final_state(cut)[0] == 4


def test_each_round_of_samples_draws_its_own_stream_and_a_resume_draws_the_same(data_dir, tmp_path):
    """The samples at step s are drawn from a generator seeded with --seed + s, from the model as step s begins (its
    checkpoint): each round a new stream, whatever the launch; a run resumed from step 2's checkpoint records the
    very samples of the run that never stopped."""
    import sample
    import tokenizer
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    settings = dict(data_dir=data_dir, max_steps=6, sample_every=2, num_samples=2, sample_tokens=6, checkpoint_every=2,
                    keep_checkpoints=10)
    run(tiny(log_dir=whole, **settings))
    drawn = samples_of(whole)
    assert sorted(drawn) == [2, 4, 5] and len({tuple(texts) for texts in drawn.values()}) == 3
    prompt = sample.encode_prompt(tokenizer.get_tokenizer(), train_config.build_parser().get_default("sample_prompt"),
                                  32)
    for step in (2, 4):
        model = checkpoint.load_model(checkpoint.checkpoint_path(whole, step))[0]
        generator = torch.Generator().manual_seed(1337 + step)  # the default --seed
        assert sample.training_samples(model, prompt, 2, 6, generator) == drawn[step], step
    run(tiny(log_dir=resumed, resume=checkpoint.checkpoint_path(whole, 2), **settings))
    assert samples_of(resumed) == drawn


def samples_of(log_dir):
    """{step: [its samples' texts]} of a run's records."""
    drawn = {}
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            if r["kind"] == "sample":
                drawn.setdefault(r["step"], []).append(r["text"])
    return drawn


def test_kill9_then_resume_is_bit_identical(data_dir, reference_run, tmp_path):
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=10, checkpoint_every=3)
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


class EMA:
    """An exponential moving average of the weights, updated after every optimizer step: a stateful part of the run
    defined here, which nothing outside this file knows."""

    def __init__(self, model, decay=0.75):
        self.model, self.decay = model, decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self):
        for name, p in self.model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self):
        return {name: t.clone() for name, t in self.shadow.items()}

    def load_state_dict(self, state):
        for name, t in self.shadow.items():
            t.copy_(state[name])


def with_ema(restore):
    """Checkpointer.restore that first registers an EMA of the run's model with the checkpoints and hooks its update
    to the optimizer's step (torch's own post-step hook)."""
    def registering(self, *, model, optimizer, **kwargs):
        import parallel
        ema = EMA(parallel.unwrap(model))
        self.register("ema", ema)
        optimizer.optimizers[0].register_step_post_hook(lambda *_: ema.update())
        return restore(self, model=model, optimizer=optimizer, **kwargs)
    return registering


def train_with_ema(argv):  # the trainer with the EMA, as a process of its own (python -c)
    checkpoint.Checkpointer.restore = with_ema(checkpoint.Checkpointer.restore)
    train_gpt2.main(argv)


def test_a_stateful_part_added_by_a_test_survives_kill9_and_resume_bit_identically(data_dir, tmp_path, monkeypatch):
    """An EMA of the weights registered with the run's checkpoints from this test alone: every checkpoint keeps it,
    and after a kill -9 mid-run the resume brings it back, so that it ends bit for bit where the EMA of a run that
    never stopped ends."""
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    monkeypatch.setattr(checkpoint.Checkpointer, "restore", with_ema(checkpoint.Checkpointer.restore))
    run(tiny(data_dir=data_dir, log_dir=whole, max_steps=10, checkpoint_every=3))
    args = tiny(data_dir=data_dir, log_dir=killed, max_steps=10, checkpoint_every=3)
    env = dict(ENV, PYTHONPATH=os.pathsep.join([runs.ROOT, os.path.dirname(os.path.abspath(__file__))]))
    proc = subprocess.Popen([sys.executable, "-c", "import sys, test_resume; test_resume.train_with_ema(sys.argv[1:])",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:  # kill hard in the middle of step 7, two steps past the last checkpoint
        if line.startswith("step     7 |"):
            proc.kill()
            break
    proc.wait(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    saved = checkpoint.load_file(checkpoint.checkpoint_path(killed, 6))
    assert set(saved["ema"]) == {name for name, _ in GPT.from_shape(saved["model_config"]).named_parameters()}
    run(args + ["--resume"])
    a, b = (checkpoint.load_file(checkpoint.list_checkpoints(d)[-1]) for d in (whole, killed))
    assert a["step"] == b["step"] == 10
    for name in a["ema"]:
        assert torch.equal(a["ema"][name], b["ema"][name]), name
    assert not torch.equal(a["ema"]["transformer.h.0.mlp.c_fc.weight"], a["model"]["transformer.h.0.mlp.c_fc.weight"])
    assert [r["loss"] for r in records(killed, "train")] == [r["loss"] for r in records(whole, "train")]
    monkeypatch.undo()  # a run checkpointed without the part: resumed with it, the part starts afresh, and says so
    plain = str(tmp_path / "plain")
    run(tiny(data_dir=data_dir, log_dir=plain, max_steps=2))
    monkeypatch.setattr(checkpoint.Checkpointer, "restore", with_ema(checkpoint.Checkpointer.restore))
    p = run(["--log-dir", plain, "--resume", "--max-steps", "3"])
    assert f"resume: {checkpoint.checkpoint_path(plain, 2)} holds no ema: it starts afresh" in p.stdout
    assert "ema" in checkpoint.load_file(checkpoint.checkpoint_path(plain, 3))
    import parallel
    checkpoints = checkpoint.Checkpointer(str(tmp_path / "other"), 1, parallel.Ranks(), None)
    for name in ("model", "rng", "step", "config"):  # the checkpoint's own parts and keys are not to be replaced
        with pytest.raises(ValueError, match=f"{name!r} is a checkpoint's own key"):
            checkpoints.register(name, EMA(torch.nn.Linear(2, 2)))


def test_sigterm_during_a_step_stops_after_it_and_resume_alone_continues(data_dir, reference_run, tmp_path,
                                                                         monkeypatch):
    """SIGTERM while step 5 runs: the run ends after step 5, not after the next one (the request is
    read at the step's sync), with a checkpoint of its 6 steps; then the command it prints,
    `--log-dir L --resume` alone (L has a space: quoted for the shell), with none of the run's
    flags, continues it with the run's settings to the reference's losses and weights, bit for bit."""
    import fault_trainer
    log_dir = str(tmp_path / "my run")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=10, checkpoint_every=100)
    monkeypatch.setattr(train_gpt2, "train_step", train_gpt2.train_step)  # put back by undo()
    fault_trainer.inject("term:0:5")
    p = run(args)
    monkeypatch.undo()
    assert "stopped by SIGTERM after 6 steps" in p.stdout
    assert records(log_dir, "end")[-1] == dict(records(log_dir, "end")[-1], step=5, reason="signal")
    assert [r["step"] for r in records(log_dir, "train")] == list(range(6))
    assert final_state(log_dir)[0] == 6
    command = shlex.split(p.stdout.split("continue with: ")[1].splitlines()[0])
    assert command == ["python", "train_gpt2.py", "--log-dir", log_dir, "--resume"]
    p = run(command[2:])
    assert f"resuming {log_dir}/ckpt_000006.pt at step 6 with the run's settings" in p.stdout
    assert "resume: " not in p.stdout  # nothing changed
    assert [r["loss"] for r in records(log_dir, "train")] == [r["loss"] for r in records(reference_run, "train")]
    _, model_a, _ = final_state(reference_run)
    step, model_b, _ = final_state(log_dir)
    assert step == 10 and all(torch.equal(model_a[k], model_b[k]) for k in model_a)


def test_a_refusal_says_where_a_value_it_names_came_from(data_dir, tmp_path, monkeypatch):
    """A run started with --max-steps 50 derived 5 warm-up steps and keeps them; resumed with --max-steps 3, the
    refusal names the warm-up as the run's own (the user never typed it) and a value that would do."""
    log_dir = str(tmp_path / "log")
    evaluate = evaluation.evaluate
    monkeypatch.setattr(evaluation, "evaluate", lambda evs, step, *a: step < 2 and evaluate(evs, step, *a))
    run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=50, warmup_steps=None, eval_every=0))  # stops at 2
    monkeypatch.undo()
    p = run(["--log-dir", log_dir, "--resume", "--max-steps", "3"], check=False)
    assert p.returncode == 2 and p.stderr.strip() == (
        "error: --warmup-steps 5 (the run's) is more than --max-steps 3: the run would end before the learning "
        "rate reaches its peak; pass --warmup-steps 0 (or another of at most 3), or raise --max-steps")
    run(["--log-dir", log_dir, "--resume", "--max-steps", "3", "--warmup-steps", "0"])


def test_resume_applies_the_changes_that_keep_the_math(data_dir, reference_run, tmp_path):
    """Named on the command line of a resume: more steps, another evaluation cadence or timeout are
    applied and printed; the checks between flags see the run's own settings (its --block-size 32, not
    the default, for its own --total-batch-size 128; the flags that would change the math are
    refused: see BAD)."""
    log_dir = str(tmp_path / "log")
    shutil.copytree(reference_run, log_dir)  # a finished 10-step run
    p = run(["--log-dir", log_dir, "--resume", "--warmup-steps", "11"], check=False)
    assert p.returncode == 2 and "--warmup-steps 11 is more than --max-steps 10" in p.stderr, p.stderr
    p = run(["--log-dir", log_dir, "--resume", "--max-steps", "5"], check=False)
    assert p.returncode == 2 and "--max-steps 5 is fewer than the 10 steps" in p.stderr, p.stderr
    before = snapshot(log_dir)
    # finished: nothing to do, nothing written, and nothing to check (a prompt longer than its 32 positions)
    for own in ([], ["--total-batch-size", "128"], ["--sample-prompt", " word" * 40]):
        p = run(["--log-dir", log_dir, "--resume"] + own)
        assert p.stdout.startswith(f"{log_dir}: the run already finished its 10 steps") and snapshot(log_dir) == before
    p = run(["--log-dir", log_dir, "--resume", "--max-steps", "12", "--eval-every", "1", "--dist-timeout", "20"])
    for change in ("--max-steps 10 -> 12", "--eval-every 4 -> 1", "--dist-timeout 15.0 -> 20.0"):
        assert f"resume: {change} (from the command line)" in p.stdout, p.stdout
    assert "cosine to 0.0003 at step 12" in p.stdout
    header = records(log_dir, "run")[-1]
    assert header["config"]["max_steps"] == 12 and header["config"]["block_size"] == 32  # given, and kept
    assert len(header["changes"]) == 3 and "given" not in header["config"]
    assert [r["step"] for r in records(log_dir, "train")] == list(range(12))
    assert [r["step"] for r in records(log_dir, "val")] == [0, 4, 8, 9, 10, 11]  # every step after the resume


def test_resume_with_another_micro_batch_trains_and_validates_on_the_same_data(data_dir, tmp_path):
    """A run moved to a GPU with less (or more) memory: resumed with --micro-batch-size 1, or auto
    (4 on a CPU here), where it ran at 2, it reads the same sequences in the same order (the data
    position is counted in sequences), so its losses and weights match the run that never stopped
    up to the summation order of the accumulation; and it validates on the same 5 sequences
    (--val-tokens 160: two batches and a half at micro-batch 2, five at 1, two at 4), so its
    validation losses match too instead of jumping."""
    base = tiny(data_dir=data_dir, max_steps=6, checkpoint_every=3, eval_every=3, val_tokens=160)
    whole = str(tmp_path / "whole")
    p = run(base + ["--log-dir", whole])
    assert "val: 160 tokens" in p.stdout
    ref, ref_val = records(whole, "train"), records(whole, "val")
    _, want, _ = final_state(whole)
    for micro, accum in (("1", 4), ("auto", 1)):
        log_dir = str(tmp_path / micro)
        os.makedirs(log_dir)
        shutil.copy(os.path.join(whole, "ckpt_000003.pt"), log_dir)
        p = run(["--log-dir", log_dir, "--resume", "--micro-batch-size", micro])
        assert f"resume: --micro-batch-size 2 -> {micro} (from the command line)" in p.stdout, p.stdout
        assert f"x {accum} accumulation step(s)" in p.stdout and "val: 160 tokens" in p.stdout
        got = records(log_dir, "train")
        assert [r["step"] for r in got] == [3, 4, 5]
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref[3:]], rel=1e-5)
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref[3:]], rel=1e-4)
        val = records(log_dir, "val")
        assert [r["step"] for r in val] == [3, 5]
        assert [r["val_loss"] for r in val] == pytest.approx([r["val_loss"] for r in ref_val[1:]], rel=1e-5)
        _, model, _ = final_state(log_dir)
        for k in want:
            torch.testing.assert_close(model[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


def test_a_fitted_micro_batch_is_fitted_again_on_resume():
    """Not named on the command line: a micro-batch the run chose by itself is chosen again (on the
    GPU this launch has), one the user gave is kept."""
    ckpt = {"step": 3, "model_config": dict(n_layer=12, n_head=12, n_embd=768),
            "config": vars(train_config.parse_args([]))}
    for fitted, expected in ((True, "auto"), (False, 16)):
        ckpt["config"].update(micro_batch_size=16, micro_batch_auto=fitted)
        values = dict(vars(train_config.parse_args(["--resume"])))
        train_config.stored_run(values, frozenset({"resume"}), checkpoint.Resume("ckpt", ckpt, []))
        assert values["micro_batch_size"] == expected


def test_resume_turns_the_trackers_off(reference_run, tmp_path, monkeypatch):
    """A run started with --wandb and --tensorboard, resumed where neither package is installed: the
    trackers are refused in one line, and --no-wandb --no-tensorboard resume it without them."""
    log_dir = str(tmp_path / "log")
    shutil.copytree(reference_run, log_dir)  # a finished 10-step run, then given both trackers
    path = checkpoint.list_checkpoints(log_dir)[-1]
    ckpt = checkpoint.load_file(path)
    ckpt["config"].update(wandb="gpt2-tests", wandb_id="abc123", tensorboard=True)
    checkpoint.save_file(path, ckpt)
    for package in ("wandb", "tensorboard"):  # as on a Python where both imports fail
        monkeypatch.setitem(sys.modules, package, None)
    args = ["--log-dir", log_dir, "--resume", "--max-steps", "12"]
    p = run(args, check=False)
    assert p.returncode == 2 and p.stderr.strip() == ("error: --wandb needs the wandb package, which is not "
                                                      "installed: pip install wandb"), p.stderr
    p = run(args + ["--no-wandb"], check=False)
    assert p.returncode == 2 and "--tensorboard needs the tensorboard package" in p.stderr, p.stderr
    p = run(args + ["--no-wandb", "--no-tensorboard"])
    assert "resume: --tensorboard True -> False (from the command line)" in p.stdout
    assert "resume: --wandb gpt2-tests -> None (from the command line)" in p.stdout
    assert not os.path.exists(os.path.join(log_dir, "tb")) and not os.path.exists(os.path.join(log_dir, "wandb"))
    config = checkpoint.load_file(checkpoint.list_checkpoints(log_dir)[-1])["config"]
    assert config["max_steps"] == 12 and not config["tensorboard"] and config["wandb"] is None
    assert [r["step"] for r in records(log_dir, "train")] == list(range(12))


def test_one_trainer_per_log_dir(data_dir, tmp_path):
    """A second trainer on a log directory in use gets one line naming the running one, with or
    without --resume; a kill -9 of the first leaves nothing to clean up."""
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, eval_every=0)
    tracked = ["--tensorboard"] if importlib.util.find_spec("tensorboard") else []
    first = subprocess.Popen([sys.executable, TRAIN] + args + tracked + ["--max-steps", "100000"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        for line in first.stdout:
            if line.startswith("step     1 |"):
                break
        first.send_signal(signal.SIGSTOP)  # holds its lock, writes nothing meanwhile
        while open(f"/proc/{first.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)  # the signal is delivered, and the tracker thread stopped, before the snapshot
        before = snapshot(log_dir)
        for extra in (["--resume"] + tracked, []):
            p = run(args + ["--max-steps", "2"] + extra, check=False)
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1, p.stdout[-2000:] + p.stderr
            assert f"is in use by a trainer that is still running (pid {first.pid} on " in lines[0]
        # a refused launch touched nothing: no TensorBoard file of its own, no checkpoint moved
        assert snapshot(log_dir) == before
    finally:
        first.kill()
        first.wait(timeout=600)
    p = run(args + ["--max-steps", "3", "--resume"])  # no checkpoint yet: --resume starts it afresh
    assert "new run" in p.stdout and records(log_dir, "end")[-1]["reason"] == "finished"
    with open(os.path.join(log_dir, "trainer.lock")) as f:
        assert f.read() == ""  # "pid ... on host" only while a trainer holds it


def snapshot(folder):
    """Every file under folder, with its bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return out


def test_resume_applies_changed_optimizer_settings(data_dir, reference_run, tmp_path):
    """--weight-decay, --beta1/2, --eps and --muon-momentum named on a resume reach the optimizer,
    not only the printed change and the stored config (load_state_dict brings back the old ones)."""
    log_dir = str(tmp_path / "adamw")
    shutil.copytree(reference_run, log_dir)
    run(["--log-dir", log_dir, "--resume", "--max-steps", "11", "--weight-decay", "0.3", "--beta1", "0.8",
         "--beta2", "0.99", "--eps", "1e-6"])
    decay, no_decay = final_state(log_dir)[2]["param_groups"]
    assert (decay["weight_decay"], decay["betas"], decay["eps"]) == (0.3, (0.8, 0.99), 1e-6)
    assert (no_decay["weight_decay"], no_decay["betas"], no_decay["eps"]) == (0.0, (0.8, 0.99), 1e-6)
    muon_dir = str(tmp_path / "muon")
    base = tiny(data_dir=data_dir, log_dir=muon_dir, optimizer="muon", eval_every=0)
    run(base + ["--max-steps", "2"])
    run(["--log-dir", muon_dir, "--resume", "--max-steps", "3", "--muon-momentum", "0.9"])
    muon, _ = final_state(muon_dir)[2]["optimizers"]
    assert muon["param_groups"][0]["momentum"] == 0.9


def test_resume_from_an_older_checkpoint_starts_a_branch_every_reader_follows(data_dir, tmp_path, monkeypatch):
    """Resuming from step 2 of a run that reached 6 starts a new branch: the old branch's later
    checkpoints and its export are moved aside (not deleted, and said so), the rotation keeps the
    new branch, and sample.py's and hellaswag.py's loader and plot.py follow it; the command that
    started the branch, run again, continues it instead of starting it again."""
    import plot
    log_dir = str(tmp_path / "log")
    base = tiny(data_dir=data_dir, log_dir=log_dir, eval_every=0, checkpoint_every=2, keep_checkpoints=2)
    run(base + ["--max-steps", "6", "--keep-checkpoints", "3", "--export-hf"])
    old = {s: checkpoint.load_file(checkpoint.checkpoint_path(log_dir, s))["model"] for s in (4, 6)}
    branch = ["--log-dir", log_dir, "--resume", checkpoint.checkpoint_path(log_dir, 2), "--max-lr", "1e-3"]
    evaluate = evaluation.evaluate
    monkeypatch.setattr(evaluation, "evaluate", lambda evs, step, *a: step < 4 and evaluate(evs, step, *a))
    p = run(branch)  # a stop request at the top of step 4: it stops after step 3
    monkeypatch.undo()
    moved = [line for line in p.stdout.splitlines() if "a new branch from step 2" in line]
    assert len(moved) == 1 and "ckpt_000004.pt, ckpt_000006.pt, hf" in moved[0], p.stdout
    aside = moved[0].split(" to ")[-1]
    assert sorted(os.listdir(aside)) == ["ckpt_000004.pt", "ckpt_000006.pt", "hf"]
    assert torch.equal(checkpoint.load_file(os.path.join(aside, "ckpt_000006.pt"))["model"]["lm_head.weight"],
                       old[6]["lm_head.weight"])
    assert [os.path.basename(c) for c in checkpoint.list_checkpoints(log_dir)] == ["ckpt_000002.pt", "ckpt_000004.pt"]
    new4 = checkpoint.load_file(checkpoint.checkpoint_path(log_dir, 4))
    head = new4["model"]["lm_head.weight"]
    assert new4["config"]["max_lr"] == 1e-3 and not torch.equal(head, old[4]["lm_head.weight"])
    model, what = checkpoint.load_model(log_dir)  # what sample.py and hellaswag.py load
    assert "ckpt_000004.pt" in what and torch.equal(model.state_dict()["lm_head.weight"], head)
    summary = plot.summarize(log_dir)
    assert summary["status"] == "signal" and summary["checkpoint_step"] == 4 and summary["steps"] == 4
    # the branch's own command again (a requeued job, torchrun --max-restarts) continues the branch
    p = run(branch)
    assert f"resuming {log_dir}/ckpt_000004.pt at step 4" in p.stdout and "new branch" not in p.stdout, p.stdout
    schedule = optim.Schedule(warmup_steps=2, max_steps=6, min_lr_ratio=0.1)
    assert [r["lr"] for r in records(log_dir, "train")] == pytest.approx(
        [schedule.lr(s, 3e-3) for s in range(2)] + [schedule.lr(s, 1e-3) for s in range(2, 6)])
    assert records(log_dir, "run")[-1]["config"]["max_lr"] == 1e-3 and os.path.isdir(os.path.join(log_dir, "hf"))
    # the branch set aside, named as --resume into the run: it is the run's own, and the line says so and how to
    # continue it elsewhere (which works)
    old6 = os.path.join(aside, "ckpt_000006.pt")
    p = run(["--log-dir", log_dir, "--resume", old6], check=False)
    assert p.returncode == 2 and p.stderr.strip() == (
        f"error: --resume {old6}: that is a checkpoint of {log_dir}'s own earlier branch, set aside when the run "
        f"was resumed from an older step; --resume alone continues the run, and --log-dir NEW --resume {old6} "
        "continues that branch in a new directory")
    p = run(["--log-dir", str(tmp_path / "old_branch"), "--resume", old6, "--max-steps", "7"])
    assert "resuming" in p.stdout and "at step 6" in p.stdout


@pytest.fixture(scope="module")
def six_steps(data_dir, tmp_path_factory):
    """A finished 6-step run with its checkpoints of steps 2, 4 and 6."""
    log_dir = str(tmp_path_factory.mktemp("six") / "log")
    run(tiny(data_dir=data_dir, log_dir=log_dir, eval_every=0, checkpoint_every=2, max_steps=6, keep_checkpoints=3))
    return log_dir


@pytest.mark.parametrize("refusal", ["other data", "unreachable W&B"])
def test_a_launch_that_fails_changes_nothing(refusal, six_steps, data_dir, tmp_path, monkeypatch, train_in_process):
    """A branch launch (--resume from an older checkpoint of the same directory) that is refused by a
    check, here a loader state saved with other data or an unreachable W&B, leaves the directory
    byte for byte as it was: the later checkpoints are not moved aside, so the next --resume does not
    silently train again from the older step. A refused launch into a new directory leaves none."""
    from runs import write_shards
    log_dir = str(tmp_path / "log")
    shutil.copytree(six_steps, log_dir)
    before = snapshot(log_dir)
    older = checkpoint.checkpoint_path(log_dir, 2)
    if refusal == "other data":
        other = write_shards(str(tmp_path / "other"), n_train_shards=1)
        with pytest.raises(common.UserError, match="loader state was saved with another data"):
            train_in_process(["--log-dir", log_dir, "--resume", older, "--data-dir", other])
        assert snapshot(log_dir) == before
        return
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there: refused at once
    with pytest.raises(common.UserError, match="--wandb: 127.0.0.1 cannot be reached"):
        train_in_process(["--log-dir", log_dir, "--resume", older, "--wandb", "gpt2-tests"])
    assert snapshot(log_dir) == before
    fresh = str(tmp_path / "fresh")
    with pytest.raises(common.UserError, match="--wandb: 127.0.0.1 cannot be reached"):
        train_in_process(tiny(data_dir=data_dir, log_dir=fresh, max_steps=2, wandb="gpt2-tests"))
    assert not os.path.exists(fresh)


def test_another_runs_checkpoint_is_not_resumed_into_a_directory_holding_a_run(data_dir, reference_run, tmp_path,
                                                                              train_in_process):
    """--resume PATH with a checkpoint of another directory continues that run in --log-dir: where
    --log-dir holds a run of its own, the two would mix (the rotation deleting one's checkpoints by
    step number, hf/ overwritten, plot.py and a later --resume following either), so it is refused in
    one line before anything is written; into an empty directory it continues the run."""
    log_dir = str(tmp_path / "log")
    base = tiny(data_dir=data_dir, eval_every=0)
    assert train_in_process(base + ["--log-dir", log_dir, "--max-steps", "2"]) == 0
    before = snapshot(log_dir)
    other = checkpoint.checkpoint_path(reference_run, 9)
    with pytest.raises(common.UserError, match=f"--resume {other}: {log_dir} holds another run; continue {other} "
                                               "in a new --log-dir"):
        train_in_process(["--log-dir", log_dir, "--resume", other])
    assert snapshot(log_dir) == before


def test_the_command_that_continued_another_run_continues_it_again(reference_run, tmp_path, monkeypatch):
    """--resume DIR or --resume PATH (relative here) of another run, run again (a requeued job,
    torchrun --max-restarts), goes on in --log-dir, which continues that run: whatever DIR holds by
    then (a newer checkpoint: the other run trains on), and whether PATH is still there."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(reference_run, "other")
    os.remove("other/ckpt_000010.pt")
    commands = {"from_dir": ["--resume", "other"], "from_file": ["--resume", "other/ckpt_000009.pt"]}
    want = [r["loss"] for r in records(reference_run, "train")[9:]]
    for log_dir, command in commands.items():
        run(["--log-dir", log_dir] + command)
        assert [r["loss"] for r in records(log_dir, "train")] == want
    shutil.copy(checkpoint.checkpoint_path(reference_run, 10), "other")
    os.remove("other/ckpt_000009.pt")
    for log_dir, command in commands.items():
        p = run(["--log-dir", log_dir] + command)
        assert p.stdout.startswith(f"{log_dir}: the run already finished its 10 steps ({log_dir}/ckpt_000010.pt)")


def test_a_stop_before_the_first_step_of_a_moved_run_keeps_a_checkpoint_in_its_directory(
        data_dir, reference_run, tmp_path, monkeypatch):
    """Continued from another directory's checkpoint and stopped before its first step finished (in
    the first validation, say): the checkpoint of its steps is written in --log-dir, which the
    printed command continues, not left in the other directory, where that command finds none."""
    import train_gpt2
    moved = str(tmp_path / "moved")
    monkeypatch.setattr(evaluation, "evaluate", lambda *args: False)  # a stop request there
    p = run(["--log-dir", moved, "--resume", checkpoint.checkpoint_path(reference_run, 9)])
    assert "stopped by a signal on another rank after 9 steps" in p.stdout
    assert [os.path.basename(c) for c in checkpoint.list_checkpoints(moved)] == ["ckpt_000009.pt"]


def test_a_resume_from_another_working_directory_reads_the_runs_own_files(data_dir, tmp_path, monkeypatch):
    """--data-dir and --hellaswag-file given relative are stored absolute, so a resume from another
    working directory reads the same files. One that is gone by then (a copied run, another machine)
    is no reason to refuse the resume: HellaSwag says it is skipped; a file named on the command
    line that does not exist is still refused (the bad-input table)."""
    hs = tmp_path / "hs.jsonl"
    hs.write_text(json.dumps({"ctx": "A cat", "endings": ["sat.", "ran.", "is.", "a."], "label": 0}) + "\n")
    log_dir = str(tmp_path / "log")
    monkeypatch.chdir(tmp_path)
    run(tiny(data_dir=os.path.relpath(data_dir), log_dir=log_dir, max_steps=2, eval_every=0, hellaswag_every=1,
             hellaswag_file="hs.jsonl"))
    config = records(log_dir, "run")[0]["config"]
    assert (config["data_dir"], config["hellaswag_file"]) == (data_dir, str(hs))
    os.mkdir("elsewhere")
    monkeypatch.chdir("elsewhere")
    p = run(["--log-dir", log_dir, "--resume", "--max-steps", "3"])
    assert [r["step"] for r in records(log_dir, "hellaswag")] == [0, 1, 2], p.stdout
    hs.unlink()
    p = run(["--log-dir", log_dir, "--resume", "--max-steps", "4"])
    assert f"hellaswag: skipped for this run (HellaSwag file {hs} does not exist)" in p.stdout, p.stdout
    assert [r["step"] for r in records(log_dir, "train")] == [0, 1, 2, 3]


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
    args = tiny(log_dir=log_dir, max_steps=2)
    p = run(args + ["--data-dir", str(bad)], check=False)
    assert p.returncode == 2 and "token id 60000" in p.stderr, p.stderr
    assert records(log_dir, "run") and not records(log_dir, "train")  # the header is there, no step
    run(args + ["--data-dir", data_dir])
    assert [r["step"] for r in records(log_dir, "train")] == [0, 1]


def test_sigterm_on_one_rank_during_a_step_stops_every_rank_after_it(data_dir, tmp_path):
    """Under DDP a request that reaches one rank while step 5 runs ends every rank after step 5."""
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=8, eval_every=0)
    p = subprocess.run([runs.python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        FAULT_TRAINER] + args, capture_output=True, text=True, env=dict(ENV, FAULT="term:1:5"),
                       timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "stopped by a signal on another rank after 6 steps" in p.stdout
    assert final_state(log_dir)[0] == 6 and [r["step"] for r in records(log_dir, "train")] == list(range(6))
    # what it says to continue with launches as many processes as a resume needs, and so does plot.py
    command = f"torchrun --standalone --nproc_per_node=2 train_gpt2.py --log-dir {log_dir} --resume"
    assert f"continue with: {command}" in p.stdout
    import plot
    assert f"  resume      {command} (continues at step 6" in plot.format_summary(plot.summarize(log_dir))
    assert metrics.resume_command("my log", 16, 8) == ("torchrun --nnodes=2 --node_rank=N --nproc_per_node=8 "
                                                          "--rdzv-endpoint=HOST:PORT train_gpt2.py --log-dir 'my log' "
                                                          "--resume")


def test_sigterm_on_one_rank_during_validation_stops_every_rank_inside_it(data_dir, tmp_path):
    """Under DDP a request that reaches rank 1 alone in the middle of step 4's validation (16 batches a rank, the
    ranks asked every 8) stops both ranks inside it: nothing of that round is recorded, step 4 does not train, the
    checkpoint holds 4 steps."""
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=8, eval_every=4, val_tokens=64 * 32, dist_timeout=2)
    p = subprocess.run([runs.python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        FAULT_TRAINER] + args, capture_output=True, text=True, env=dict(ENV, FAULT="evalterm:1:1"),
                       timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "stopped by a signal on another rank after 4 steps" in p.stdout
    assert [r["step"] for r in records(log_dir, "val")] == [0] and records(log_dir, "end")[-1]["reason"] == "signal"
    assert final_state(log_dir)[0] == 4 and [r["step"] for r in records(log_dir, "train")] == [0, 1, 2, 3]


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_resume_with_another_process_count_is_refused_once(reference_run, tmp_path, ranks):
    """A run of one process resumed by two or three: every rank refuses it alike, and the group says so once, without
    a rank (torchrun used to print the line per rank); nothing is written. The highest rank is held after posting its
    line and before reading the others', as a loaded machine can hold it: no rank leaves (torchrun then ends the
    rest) before it knows the line is not its own to say (rank 1 of three once left as soon as rank 0 had said it)."""
    path = checkpoint.list_checkpoints(reference_run)[-1]
    p = subprocess.run([runs.python(), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                        FAULT_TRAINER, "--log-dir", str(tmp_path / "two"), "--resume", path, "--max-steps", "12"],
                       capture_output=True, text=True, env=dict(ENV, FAULT=f"slowsay:{ranks - 1}:0"), timeout=300)
    said = [line for line in (p.stdout + p.stderr).splitlines() if re.match(r"(error: |ranks? [\d, ]+: )", line)]
    assert p.returncode != 0 and said == [
        f"error: cannot resume {path}: it was trained with 1 process(es) (GPUs), this launch has {ranks}; launch it "
        "with 1 in all (torchrun --nproc_per_node x --nnodes)"], p.stdout[-2000:] + p.stderr[-2000:]
    assert not (tmp_path / "two").exists()


def zero_inside_a_tensor(path, size=2 * 2 ** 20):
    """Zero `size` bytes in the middle of the largest tensor of a checkpoint file, its zip structure
    left whole (as a bad block of a disk or a faulty copy leaves it)."""
    with zipfile.ZipFile(path) as archive:
        entry = max(archive.infolist(), key=lambda e: e.file_size)
    with open(path, "r+b") as f:
        f.seek(entry.header_offset + 26)  # a local file header: 30 bytes, then its name and extra field
        name, extra = struct.unpack("<HH", f.read(4))
        f.seek(entry.header_offset + 30 + name + extra + (entry.file_size - size) // 2)
        f.write(bytes(size))


def maps_naming(folder):
    """The lines of /proc/self/maps (the files this process has mapped) that name a file in folder."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if folder in line]


@pytest.fixture(scope="module")
def damaged_resume(data_dir, reference_run, tmp_path_factory):
    """--resume of the reference run's checkpoints of steps 9 and 10, with 2 MB of a tensor in the
    newest zeroed, keeping one checkpoint: the log directory, the output, and what /proc/self/maps
    named in it after each checkpoint was written (Linux)."""
    log_dir = str(tmp_path_factory.mktemp("damaged"))
    for path in checkpoint.list_checkpoints(reference_run):  # steps 9 and 10
        shutil.copy(path, log_dir)
    zero_inside_a_tensor(checkpoint.checkpoint_path(log_dir, 10))
    mapped, save = [], checkpoint.Checkpointer.save

    def save_and_look(self, step):
        save(self, step)
        if os.path.exists("/proc/self/maps"):
            mapped.append(maps_naming(log_dir))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint.Checkpointer, "save", save_and_look)
        p = run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=10, checkpoint_every=3, keep_checkpoints=1,
                     resume=True))
    return log_dir, p, mapped


def test_resume_skips_a_damaged_newest_checkpoint(damaged_resume, reference_run):
    """A tensor of the newest checkpoint zeroed in place loads as it is (torch.load reads no
    checksum): the zip's CRC catches it, and --resume passes over it in one line, to the one before,
    and continues to the reference's weights."""
    log_dir, p, _ = damaged_resume
    skipped = [line for line in p.stdout.splitlines() if line.startswith("resume: skipped")]
    assert len(skipped) == 1 and "ckpt_000010.pt is not a readable checkpoint" in skipped[0], p.stdout
    assert "fails its CRC check" in skipped[0]
    assert f"resuming {log_dir}/ckpt_000009.pt at step 9" in p.stdout
    _, model_a, _ = final_state(reference_run)
    _, model_b, _ = final_state(log_dir)
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)


def test_a_resumed_run_frees_the_disk_space_of_the_checkpoint_it_resumed_from(damaged_resume):
    """The checkpoint a run resumed from is memory-mapped while it loads; once the rotation deletes
    it, nothing maps it any more, so its space on disk is free again (a deleted file that is still
    mapped keeps its blocks until it is unmapped)."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("reads Linux's /proc/self/maps")
    log_dir, _, mapped = damaged_resume
    assert [os.path.basename(c) for c in checkpoint.list_checkpoints(log_dir)] == ["ckpt_000010.pt"]
    assert mapped == [[]]  # after the one checkpoint it wrote, which deleted step 9's


@pytest.mark.parametrize("damage", ["zeroed", "truncated"])
def test_a_damaged_checkpoint_is_passed_over_in_a_directory_and_refused_by_name(damage, data_dir, reference_run,
                                                                                tmp_path):
    """Every loader of a log directory (--resume, sample.py's, hellaswag.py's and core.py's) passes
    over a damaged newest checkpoint in one line; named itself it is refused in one line; a directory
    where none loads is refused in one line."""
    folder = str(tmp_path / "log")
    os.mkdir(folder)
    for path in checkpoint.list_checkpoints(reference_run):  # steps 9 and 10
        shutil.copy(path, folder)
    bad = checkpoint.checkpoint_path(folder, 10)
    if damage == "zeroed":
        zero_inside_a_tensor(bad)
    else:  # as a full disk or a copy cut short leaves it
        with open(bad, "r+b") as f:
            f.truncate(5000)
    _, what = checkpoint.load_model(folder)
    assert what.startswith(f"checkpoint {folder}/ckpt_000009.pt (skipped 1 newer that do not load: {bad} is not "
                           "a readable checkpoint, truncated or corrupt"), what
    with pytest.raises(common.UserError, match=f"^{bad} is not a readable checkpoint, truncated or corrupt"):
        checkpoint.load_model(bad)
    p = run(["--log-dir", str(tmp_path / "new"), "--resume", bad], check=False)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and f"{bad} is not a readable checkpoint" in lines[0], p.stderr
    for path in checkpoint.list_checkpoints(folder):  # none loads: one line, nothing written
        with open(path, "wb") as f:
            f.write(b"garbage")
    before = snapshot(folder)
    p = run(tiny(data_dir=data_dir, log_dir=folder, max_steps=10, checkpoint_every=3, resume=True), check=False)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "none of the 2 checkpoints" in lines[0], p.stderr
    assert snapshot(folder) == before


def test_sigusr1_is_a_stop_request_as_sigterm_is():
    """train_gpt2.sbatch passes SLURM's warning before the time limit on as SIGUSR1, to processes
    that ignore it until the trainer's loop begins (its torchrun must not die of it): the stop flag
    catches it as it catches SIGTERM (whose stop the tests above follow through a run)."""
    handlers = {sig: signal.getsignal(sig) for sig in common.STOP_SIGNALS}
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGUSR1)  # before the flag: ignored, and this process lives on
        stop = common.StopFlag()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signal == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a later request: the first is the one reported
        assert stop.signal == "SIGUSR1"
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_the_batch_scripts_reader_of_launches_runs_without_slurm(reference_run, tmp_path):
    """train_gpt2.sbatch tells how the trainer's latest launch ended with a few lines of Python of its own (its
    launches function), which read the log through metrics.py: they run here as the script runs them, on a log
    directory with no records yet, on a finished run, and on a log that cannot be read."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "train_gpt2.sbatch")) as f:
        script = f.read()
    reader = script.split("python - \"$@\" <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]

    def launches(*args):
        p = subprocess.run([sys.executable, "-", *args], input=reader, cwd=root, capture_output=True, text=True)
        return p.returncode, p.stdout.strip(), p.stderr.strip()
    assert launches("", "--log-dir", str(tmp_path / "none")) == (0, "0", "")
    assert launches("", "--max-steps", "10", "--log-dir", reference_run) == (0, "1", "")
    assert launches("0", "--log-dir", reference_run) == (0, "1 finished 10", "")
    assert launches("1", "--log-dir", reference_run) == (0, "1 none", "")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / metrics.METRICS_FILE).write_text('{"kind": "run", "step": "zero"}\n')
    code, out, err = launches("", "--log-dir", str(tmp_path / "bad"))
    assert code == 1 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err


def test_sigterm_during_evaluation_stops_within_it(data_dir, reference_run, tmp_path, monkeypatch):
    """A stop request during the evaluation at the top of a step (here SIGTERM once step 0's
    validation is done) ends it before HellaSwag's next batch: no figure is logged for it, the run
    keeps the steps it finished, and a resume continues exactly."""
    hs = tmp_path / "hellaswag_val.jsonl"
    item = {"ctx": "The cat sees a red ball and", "endings": ["it runs.", "the dog likes books.", "a.", "we paint."]}
    hs.write_text("".join(json.dumps(dict(item, label=i % 4)) + "\n" for i in range(16)))
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=10, checkpoint_every=3)
    validation_loss = evaluation.validation_loss

    def then_sigterm(*args):
        loss = validation_loss(*args)
        os.kill(os.getpid(), signal.SIGTERM)
        return loss
    monkeypatch.setattr(evaluation, "validation_loss", then_sigterm)
    p = run(args + ["--hellaswag-every", "5", "--hellaswag-file", str(hs)])
    monkeypatch.undo()
    assert "hellaswag: scoring 16 items" in p.stdout and "stopped by SIGTERM after 0 steps" in p.stdout, p.stdout
    assert records(log_dir, "hellaswag") == [] and records(log_dir, "end")[-1]["reason"] == "signal"
    assert records(log_dir, "val") == []  # the round's validation finished, but the round did not: nothing of it
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(log_dir)] == ["ckpt_000000.pt"]
    run(args + ["--resume"])
    assert [r["loss"] for r in records(log_dir, "train")] == [r["loss"] for r in records(reference_run, "train")]
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:  # step 0's validation recorded once, by the resume
        assert [r["step"] for r in map(json.loads, f) if r["kind"] == "val"] == [0, 4, 8, 9]


def test_sigterm_during_sampling_records_no_cut_sample_and_stops_before_the_step(data_dir, reference_run, tmp_path,
                                                                               monkeypatch):
    """A stop request while step 5's samples are drawn (here at their fourth token) ends the sampling: no sample
    of that round is recorded as if it were whole, step 5 does not train, the run checkpoints before it as after
    a stop during validation, and a resume continues exactly."""
    from model import GPT
    real_stream = GPT.generate_stream

    def stream(self, *args, **kwargs):
        for i, tokens in enumerate(real_stream(self, *args, **kwargs)):
            if i == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            yield tokens
    monkeypatch.setattr(GPT, "generate_stream", stream)
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=10, checkpoint_every=3, sample_every=5, num_samples=1,
                sample_tokens=50)
    p = run(args)
    monkeypatch.undo()
    assert "stopped by SIGTERM after 5 steps" in p.stdout and "sample 0 |" not in p.stdout, p.stdout
    assert records(log_dir, "sample") == [] and [r["step"] for r in records(log_dir, "train")][-1] == 4
    assert [os.path.basename(c) for c in checkpoint.list_checkpoints(log_dir)] == ["ckpt_000003.pt", "ckpt_000005.pt"]
    run(args + ["--resume"])
    assert [r["loss"] for r in records(log_dir, "train")] == [r["loss"] for r in records(reference_run, "train")]
    assert [r["step"] for r in records(log_dir, "sample")] == [5, 9]


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


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(data_dir, tmp_path, monkeypatch, train_in_process):
    """The disk fills while the step-6 checkpoint is written: torch's zip writer turns the OSError
    into its own RuntimeError ("unexpected pos"); the run still ends in one line, with the step-3
    checkpoint whole and no temporary file left (nor the one a kill -9 mid-write left before)."""
    real = checkpoint.atomic_write

    def filling(path, write_fn):
        if "ckpt_000006" not in path:
            return real(path, write_fn)
        return real(path, lambda f: write_fn(DiskFull(f, 4096)))
    monkeypatch.setattr(checkpoint, "atomic_write", filling)
    log_dir = str(tmp_path / "log")
    os.makedirs(log_dir)
    with open(os.path.join(log_dir, ".ckpt_000009.pt.tmp4242"), "wb") as f:
        f.write(b"half a checkpoint")
    with pytest.raises(common.UserError, match=r"ckpt_000006.pt \(no space left on its disk\)") as e:
        train_in_process(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=10, checkpoint_every=3))
    assert "ckpt_000003.pt is intact" in str(e.value) and "\n" not in str(e.value)
    assert sorted(f for f in os.listdir(log_dir) if "ckpt" in f) == ["ckpt_000003.pt"]  # no half file left
    assert checkpoint.load_file(os.path.join(log_dir, "ckpt_000003.pt"))["step"] == 3


@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_full_disk_during_the_hf_export_keeps_the_earlier_export(data_dir, tmp_path, monkeypatch, train_in_process,
                                                                 error):
    """The disk fills while the final model is exported (after config.json, before the weights):
    one line that says so, the earlier export in LOG_DIR/hf untouched, nothing half-written left
    beside it, and the run's last checkpoint whole; with space again, --resume exports it."""
    import safetensors
    import safetensors.torch
    log_dir = str(tmp_path / "log")
    hf = os.path.join(log_dir, "hf")
    args = tiny(data_dir=data_dir, log_dir=log_dir, eval_every=0, export_hf=True)
    assert train_in_process(args + ["--max-steps", "2"]) == 0
    earlier = {name: open(os.path.join(hf, name), "rb").read() for name in os.listdir(hf)}
    assert "model.safetensors" in earlier

    def full_disk(tensors, filename, metadata=None):  # safetensors raises its own type; os.write an OSError
        assert os.path.isfile(os.path.join(os.path.dirname(filename), "config.json"))  # written by then
        if error == "OSError":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(common.UserError, match=r"^could not export the final model to .*hf \(no space left on its "
                                               r"disk\); the checkpoints are intact .*ckpt_000003.pt") as e:
        train_in_process(args + ["--max-steps", "3", "--resume"])
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(log_dir)) == sorted(["ckpt_000002.pt", "ckpt_000003.pt", "hf", "log.txt",
                                                  "metrics.jsonl", "trainer.lock"])  # no partial export beside hf/
    assert {name: open(os.path.join(hf, name), "rb").read() for name in os.listdir(hf)} == earlier
    assert checkpoint.load_file(os.path.join(log_dir, "ckpt_000003.pt"))["step"] == 3
    monkeypatch.undo()
    assert train_in_process(args + ["--max-steps", "3", "--resume"]) == 0
    assert sorted(os.listdir(hf)) == sorted(earlier)
    assert open(os.path.join(hf, "model.safetensors"), "rb").read() != earlier["model.safetensors"]


def test_the_command_to_export_again_exports_a_run_trained_without_the_export(data_dir, tmp_path, monkeypatch,
                                                                              train_in_process):
    """A run trained with --no-export-hf, finished, then --resume --export-hf on a full disk: the command the error
    names exports it once there is space (a plain --resume would take the run's stored --no-export-hf and answer
    that the run already finished)."""
    import shlex
    import safetensors.torch
    log_dir = str(tmp_path / "log")
    assert train_in_process(tiny(data_dir=data_dir, log_dir=log_dir, eval_every=0, max_steps=2)) == 0  # no export

    def full_disk(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full_disk)
        with pytest.raises(common.UserError, match="could not export the final model") as e:
            train_in_process(["--log-dir", log_dir, "--resume", "--export-hf"])
    command = str(e.value).split("then ")[-1].removesuffix(" exports it")
    assert command == f"python train_gpt2.py --log-dir {log_dir} --resume --export-hf"
    assert train_in_process(shlex.split(command)[2:]) == 0
    assert os.path.isfile(os.path.join(log_dir, "hf", "model.safetensors"))


def test_weights_that_do_not_fit_the_config_name_the_first_misfit(reference_run):
    """One line naming the first weight that is missing, has another shape or is not the model's,
    in place of torch's "Error(s) in loading state_dict for GPT:"."""
    path = checkpoint.list_checkpoints(reference_run)[-1]
    ckpt = checkpoint.load_file(path)
    assert checkpoint.model_from_checkpoint(ckpt, path).config.n_embd == 32
    weights = ckpt["model"]
    cases = [({k: v for k, v in weights.items() if k != "transformer.h.1.ln_1.bias"},
              "transformer.h.1.ln_1.bias (32,) is missing"),
             (dict(weights, **{"transformer.h.2.ln_1.bias": weights["transformer.h.1.ln_1.bias"]}),
              "transformer.h.2.ln_1.bias is not a weight of the model its config describes"),
             (dict(weights, **{"transformer.ln_f.weight": torch.ones(31)}),
              "transformer.ln_f.weight has shape (31,) there, (32,) in the model its config describes")]
    for misfit, problem in cases:
        with pytest.raises(common.UserError) as e:
            checkpoint.model_from_checkpoint(dict(ckpt, model=misfit), path)
        assert str(e.value) == (f"{path} does not hold the model its config describes: {problem}; use an earlier "
                                "ckpt_*.pt from the same directory")


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
    args = tiny(data_dir=data_dir, max_steps=8, checkpoint_every=3, eval_every=0, resume=True, sharding=sharding)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    ref = str(tmp_path / "ref")  # the run that never failed: warm (the restart, below, is the process's own)
    p = subprocess.run([runs.python()] + launch[1:] + [TRAIN] + args + ["--log-dir", ref], capture_output=True,
                       text=True, env=ENV, timeout=600)
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
