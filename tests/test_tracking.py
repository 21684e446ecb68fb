"""--wandb and --tensorboard: the trainer's records, read back with each library's own format and
reader (W&B offline, no account), at the same steps as metrics.jsonl; a resume continues the same
W&B run and the same TensorBoard directory without a step twice."""
import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import checkpoint
import metrics
import trackers
import runs
from runs import ENV, FAULT_TRAINER, TRAIN, records, run, tiny, write_shards

TRACKED = dict(ENV, WANDB_MODE="offline", WANDB_SILENT="true")


def wandb_records(path):
    """The records of an offline W&B run file (run-ID.wandb: W&B's record log, 32 KiB blocks of chunks with a 7-byte
    header, each record a wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, parts, payloads = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record; 2, 3, 4: first, middle and last parts of one
            payloads.append(chunk)
        elif kind in (2, 3, 4):
            parts = chunk if kind == 2 else parts + chunk
            if kind == 4:
                payloads.append(parts)
    for payload in payloads:
        rec = pb.Record()
        rec.ParseFromString(payload)
        yield rec


def wandb_history(path):
    """The history rows of an offline W&B run file, its run id and its configuration."""
    rows, run_id, config = [], None, {}
    for rec in wandb_records(path):
        which = rec.WhichOneof("record_type")
        if which == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif which == "run":
            run_id = rec.run.run_id
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif which == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    return run_id, rows, config


def wandb_runs(log_dir):
    """(run id, history rows, config) of each offline W&B run under LOG_DIR/wandb, oldest first."""
    return [wandb_history(p) for p in sorted(glob.glob(os.path.join(log_dir, "wandb", "offline-run-*", "run-*.wandb")))]


def tensorboard_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(log_dir, "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)], events.Tags()["tensors"]


def test_wandb_and_tensorboard_hold_the_records_across_a_kill_and_two_resumes(tmp_path):
    """Each tracker that is installed is checked on its own (TensorBoard's part does not wait for W&B's)."""
    installed = [name for name in ("wandb", "tensorboard") if importlib.util.find_spec(name)]
    if not installed:
        pytest.skip("pip install wandb tensorboard (README's test command installs them)")
    data_dir = write_shards(str(tmp_path / "data"))
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=6, checkpoint_every=3, eval_every=2, sample_every=3,
                num_samples=1, sample_tokens=4, wandb="gpt2-tests" if "wandb" in installed else None,
                tensorboard="tensorboard" in installed)
    # killed as step 4 begins: steps 0-3 logged, the checkpoint holds 3 steps
    p = subprocess.run([sys.executable, FAULT_TRAINER] + args, capture_output=True, text=True,
                       env=dict(TRACKED, FAULT="kill:0:4"), timeout=900)
    assert p.returncode == -9, p.stdout[-2000:] + p.stderr[-2000:]
    for max_steps in ([], ["--max-steps", "8"]):  # --resume alone (replays step 3), then two more steps
        p = subprocess.run([runs.python(), TRAIN, "--log-dir", log_dir, "--resume"] + max_steps, capture_output=True,
                           text=True, env=TRACKED, timeout=900)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    train = {r["step"]: r for r in records(log_dir, "train")}
    assert sorted(train) == list(range(8))

    # TensorBoard: every step once, the values of metrics.jsonl (the replayed step 3 replaces the killed launch's)
    if "tensorboard" in installed:
        check_tensorboard(log_dir, train)
    if "wandb" in installed:
        check_wandb(log_dir, train)


def check_tensorboard(log_dir, train):
    scalars, texts = tensorboard_scalars(log_dir, "train/loss")
    assert [s for s, _ in scalars] == list(range(8))
    assert [v for _, v in scalars] == pytest.approx([train[s]["loss"] for s in range(8)], rel=1e-6)
    val, _ = tensorboard_scalars(log_dir, "val/val_loss")
    assert [s for s, _ in val] == [r["step"] for r in records(log_dir, "val")]
    assert {"run/text_summary", "sample/0/text_summary", "checkpoint/path/text_summary"} <= set(texts)



def check_wandb(log_dir, train):
    # W&B: one run (its id stored in the checkpoints), continued by each launch; the launch that
    # was killed lost what W&B's service had not written yet, so its file may hold nothing, and the
    # next launch sends those steps again from metrics.jsonl
    runs = wandb_runs(log_dir)
    stored = checkpoint.load_file(checkpoint.list_checkpoints(log_dir)[-1])["config"]["wandb_id"]
    dirs = sorted(glob.glob(os.path.join(log_dir, "wandb", "offline-run-*")))
    assert len(runs) == 3 and all(d.endswith("-" + stored) for d in dirs)  # the directory names the run id
    assert [run_id for run_id, _, _ in runs[1:]] == [stored, stored]
    (_, first, _), (_, second, config), (_, third, _) = runs
    logged = [row["_step"] for row in second + third if "train/loss" in row]
    assert logged == list(range(8))  # the killed launch's steps replayed, then each launch's own, none twice
    for row in second + third:
        if "train/loss" in row:
            logged = train[row["_step"]]
            assert row["train/loss"] == logged["loss"] and row["train/tokens"] == logged["tokens"]
    assert config["run"]["config"]["max_steps"] == 6 and config["run"]["step"] == 3
    samples = [row for row in second if "sample/0" in row]  # every 3 steps, and at the last step
    assert [row["_step"] for row in samples] == [3, 5]
    assert samples[0]["sample/0"].startswith("Hello, I'm a language model,")
    assert [row["_step"] for row in second if "val/val_loss" in row] == [0, 2, 4, 5]
    assert all(row["_step"] <= 3 for row in first)  # whatever of steps 0-3 reached the killed launch's file


def test_tensorboard_alone_writes_its_events_to_log_dir_tb(data_dir, tmp_path):
    pytest.importorskip("tensorboard")
    log_dir = str(tmp_path / "log")
    run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=2, tensorboard=True))
    assert [step for step, _ in tensorboard_scalars(log_dir, "train/loss")[0]] == [0, 1]
    assert not os.path.exists(os.path.join(log_dir, "wandb"))


def test_the_wandb_runs_name_is_the_log_directorys_own(data_dir, tmp_path):
    """Without --wandb-run, the W&B run is named as the log directory is, however the command line spells it: a
    relative path with a trailing slash, or the working directory itself (.)."""
    pytest.importorskip("wandb")
    here = tmp_path / "exp0"
    here.mkdir()
    for log_dir, name, where in ((".", "exp0", here), ("runs/exp1/", "exp1", here / "runs" / "exp1")):
        p = subprocess.run([runs.python(), TRAIN] + tiny(data_dir=data_dir, log_dir=log_dir, max_steps=2,
                                                          eval_every=0, wandb="gpt2-tests"),
                           capture_output=True, text=True, env=TRACKED, cwd=here, timeout=900)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        (path,) = glob.glob(str(where / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert {rec.run.display_name for rec in wandb_records(path) if rec.WhichOneof("record_type") == "run"} == \
            {name}, log_dir


@pytest.fixture
def no_tracker_packages(monkeypatch):
    """Which steps go to W&B is Trackers' own logic: it needs neither package, so both are blocked."""
    for name in ("wandb", "tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)


class FakeWandbRun:
    """The part of a wandb Run that Trackers uses: .step (the last step it holds), .log, .finish."""

    def __init__(self, step):
        self.step, self.logged, self.finished = step, [], False

    def log(self, values, step):
        self.logged.append((step, sorted(values)))
        self.step = max(self.step, step)

    def finish(self):
        self.finished = True


def test_a_step_the_wandb_run_holds_already_is_not_sent_again(tmp_path, no_tracker_packages):
    """Online, W&B continues a run at the server's last step: the replayed steps before it are not
    sent (W&B would refuse them with a warning each); from it on, every record is."""
    sender = trackers.Trackers(str(tmp_path))
    fake = sender.wandb = FakeWandbRun(step=7)
    for step in range(5, 10):  # in the trainer's order: evaluation at the top of a step, then the step
        sender.send("val", {"step": step, "val_loss": 2.0})
        sender.send("train", {"step": step, "loss": 1.0 / step})
    sender.close()
    assert fake.logged == [(s, [f"{k}/{f}"]) for s in (7, 8, 9) for k, f in (("val", "val_loss"), ("train", "loss"))]
    assert fake.finished


def test_a_resumed_launch_replays_what_the_wandb_run_never_received(tmp_path, no_tracker_packages):
    """Online, the W&B run holds steps up to its .step: a launch resuming at step 4 of a run whose
    W&B history ends at step 2 sends steps 2 and 3 from metrics.jsonl (evaluation before the step's
    training, as the trainer logs them), then its own."""
    log = metrics.RunLog(str(tmp_path), True)
    for step in range(6):
        if step % 2 == 0:
            log.record("val", step=step, val_loss=3.0, tokens=step * 64)
        log.record("train", step=step, loss=1.0 / (step + 1), tokens=(step + 1) * 64, tok_per_s=1e3, dt_ms=64.0)
    log.close()
    sender = trackers.Trackers(str(tmp_path))
    fake = sender.wandb = FakeWandbRun(step=2)
    sender.replay(str(tmp_path), start_step=4)
    sender.send("train", {"step": 4, "loss": 0.1})
    sender.close()
    train_fields = ["train/dt_ms", "train/loss", "train/tok_per_s", "train/tokens"]
    assert fake.logged == [(2, ["val/tokens", "val/val_loss"]), (2, train_fields), (3, train_fields),
                           (4, ["train/loss"])]


@pytest.mark.parametrize("reason, end_step", [("finished", 4), ("signal", 3)])
def test_a_resume_replays_to_wandb_what_came_after_the_last_launch_that_ended(tmp_path, monkeypatch, reason, end_step,
                                                                             no_tracker_packages):
    """Offline the W&B run holds no step it can name (.step 0). A launch that ended (finished at its
    max_steps 4, or stopped after step 3) finished its W&B run; the next one was killed after step 6
    with a checkpoint at 6: the launch resuming there replays steps 4 and 5, then sends its own."""
    train = [{"kind": "train", "step": s, "loss": 1.0, "tokens": 64, "tok_per_s": 1e3, "dt_ms": 1.0} for s in range(7)]
    lines = ([{"kind": "run", "step": 0}] + train[:4] + [{"kind": "end", "step": end_step, "reason": reason}]
             + [{"kind": "run", "step": 4}, {"kind": "val", "step": 4, "val_loss": 3.0, "tokens": 256}] + train[4:])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    fake = FakeWandbRun(step=0)
    monkeypatch.setattr(trackers, "start_wandb", lambda *a: fake)
    sender = trackers.Trackers(str(tmp_path), "project", "name", "abcd1234", start_step=6)
    sender.send("train", {"step": 6, "loss": 0.5})
    sender.close()
    train_fields = ["train/dt_ms", "train/loss", "train/tok_per_s", "train/tokens"]
    assert fake.logged == [(4, ["val/tokens", "val/val_loss"]), (4, train_fields), (5, train_fields),
                           (6, ["train/loss"])]


def test_a_missing_package_is_one_line(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "tensorboard" else None)
    with pytest.raises(trackers.UserError, match=r"^--wandb needs the wandb package, which is not installed: "
                                                r"pip install wandb$"):
        trackers.check_installed(argparse.Namespace(wandb="project", tensorboard=True))
    trackers.check_installed(argparse.Namespace(wandb=None, tensorboard=True))


def test_a_finished_run_says_so_where_its_tracker_is_not_installed(reference_run, tmp_path, monkeypatch, capsys,
                                                                    train_in_process):
    """A finished run resumed with --wandb on a machine without wandb has nothing to do, and says so (exit 0): the
    trackers' packages are checked only where the run has steps to go."""
    import shutil
    log_dir = str(tmp_path / "log")
    shutil.copytree(reference_run, log_dir)  # a finished 10-step run
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert train_in_process(["--log-dir", log_dir, "--resume", "--wandb", "project"]) == 0
    assert capsys.readouterr().out.startswith(f"{log_dir}: the run already finished its 10 steps")
    with pytest.raises(trackers.UserError, match="^--wandb needs the wandb package"):  # where it has steps to go
        train_in_process(["--log-dir", log_dir, "--resume", "--wandb", "project", "--max-steps", "11"])


def test_a_registered_evaluation_is_logged_checked_replayed_summarised_and_plotted(data_dir, tmp_path, monkeypatch,
                                                                                  capsys, train_in_process):
    """An evaluation defined here, registered with one line, in a launch and a resume: its own flag is the trainer's
    (in --help, its range checked in one line, kept by the run for its resume); its records are logged with their
    kind described in the run record; metrics.py checks them (one without its number is skipped with a warning); the
    resume after a kill (no end record) replays them to W&B in the trainer's order; the summary and the plot show
    them, against a published figure of its own, none of train_config.py, metrics.py, trackers.py or plot.py
    told of them."""
    import evaluation
    import plot

    class Toy(evaluation.Evaluation):
        kind, field, label = "toy", "score", "Toy"
        ranges = {"toy_every": "0 or more"}
        references, against = ((0.65, "a published toy score, 0.65", "black"),), "published: 0.65"

        @staticmethod
        def add_flags(add):
            add("--toy-every", type=int, default=0, help="the toy score every N steps; 0 = off (default: 0)")

        @classmethod
        def prepare(cls, cfg):
            return cls(cfg.toy_every) if cfg.toy_every else None

        def run(self, step, stop):
            self.record(step, f"toy {step / 10:.1f}", score=step / 10)
            return True
    monkeypatch.setattr(evaluation, "REGISTRY", list(evaluation.REGISTRY))  # the registration undone after the test
    evaluation.register(Toy)

    log_dir = str(tmp_path / "log")
    assert "the toy score every N steps" in run(["--help"]).stdout
    refused = run(tiny(data_dir=data_dir, log_dir=log_dir, toy_every=-1), check=False)
    assert (refused.returncode, refused.stderr) == (2, "error: --toy-every must be 0 or more (got -1)\n")
    assert train_in_process(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=6, checkpoint_every=3,
                                 eval_every=0, toy_every=2)) == 0
    assert [r["score"] for r in records(log_dir, "toy")] == [0.0, 0.2, 0.4, 0.5]  # every 2 steps and the last
    described = records(log_dir, "run")[0]["evaluations"]["toy"]
    assert {k: described[k] for k in ("field", "best", "label", "panel", "references", "against")} == dict(
        field="score", best="max", label="Toy", panel="toy", against="published: 0.65",
        references=[[0.65, "a published toy score, 0.65", "black"]])
    path = os.path.join(log_dir, metrics.METRICS_FILE)
    lines = open(path).read().splitlines()
    ended = [i for i, line in enumerate(lines) if json.loads(line)["kind"] == "end"]
    bad = json.dumps({"kind": "toy", "step": 1, "tokens": 128})
    with open(path, "w") as f:  # killed after its last step (no end record), and a toy record without its number
        f.write("\n".join(line for i, line in enumerate(lines) if i not in ended) + "\n" + bad + "\n")
    metrics._warned.clear()
    capsys.readouterr()
    assert [r["step"] for r in metrics.read_metrics(log_dir)["toy"]] == [0, 2, 4, 5]
    assert f"line {len(lines) - len(ended) + 1}: a 'toy' record without 'score'" in capsys.readouterr().err

    fake = FakeWandbRun(step=0)  # offline: the W&B run holds no step it can name
    monkeypatch.setattr(trackers, "check_installed", lambda cfg: None)  # (W&B's own, replaced below)
    monkeypatch.setattr(trackers, "start_wandb", lambda *a: fake)
    assert train_in_process(["--log-dir", log_dir, "--resume", "--max-steps", "8", "--wandb", "project"]) == 0
    replayed = [(step, fields) for step, fields in fake.logged if step < 6]
    assert [step for step, fields in replayed if "toy/score" in fields] == [0, 2, 4, 5]
    train_fields = [f"train/{k}" for k in ("dt_ms", "grad_norm", "loss", "lr", "skipped", "tok_per_s", "tokens")]
    assert replayed[:3] == [(0, ["toy/score", "toy/tokens"]), (0, train_fields), (1, train_fields)]  # toy, then train
    assert [step for step, fields in fake.logged if "toy/score" in fields] == [0, 2, 4, 5, 6, 7]

    summary = plot.format_summary(plot.summarize(log_dir))
    assert "  Toy         best 0.7000 at step 7, final 0.7000 at step 7 (published: 0.65)" in summary
    panel = next(ax for ax in plot.build_figure([log_dir]).axes if ax.get_title().startswith("Toy"))
    assert (panel.get_title(), panel.get_ylabel()) == ("Toy (score, higher is better)", "score")
    assert [list(line.get_ydata()) for line in panel.lines] == [[0.0, 0.2, 0.4, 0.5, 0.6, 0.7], [0.65, 0.65]]
    assert panel.lines[1].get_label() == "a published toy score, 0.65"
