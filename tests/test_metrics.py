"""metrics.py: what RunLog writes, read_metrics reads back, over a launch and a resume, and the
lines it cannot use; the writer leaves no trace until it writes, and nothing at all on ranks other
than 0; a disk that fills under it is one line."""

import json
import os

import pytest

import checkpoint
import metrics
from runs import run, tiny


def write_launch(log_dir, start, last, tps=1024, resumed_from=None, end=None):
    """One launch as train_gpt2.py logs it: the record kinds and keys listed in metrics.py."""
    log = metrics.RunLog(str(log_dir), active=True)
    log.record("run", step=start, max_steps=10, tokens_per_step=tps, resumed_from=resumed_from, device="cpu",
               device_name="cpu", dtype="float32", world_size=1, versions={"torch": "x"}, git=None,
               config={"seed": 1})
    log.line(f"run: starting at step {start}")
    for step in range(start, last + 1):
        if step % 4 == 0:
            log.record("val", step=step, val_loss=5.0 - step / 10, tokens=step * tps)
            log.record("hellaswag", step=step, tokens=step * tps, acc=0.25, acc_norm=0.25 + step / 100, n=7)
        log.record("train", step=step, loss=6.0 - step / 10 + start / 100, lr=1e-3, grad_norm=1.0, dt_ms=10.0,
                   tok_per_s=tps / 0.01, mfu=None, tokens=(step + 1) * tps, skipped=False)
        log.record("timing", step=step, data_ms=1.0, copy_ms=0.1, forward_ms=3.0, backward_ms=5.0,
                   optimizer_ms=1.0, eval_ms=0.0)
        log.line(f"step {step} | loss ...")
    log.record("checkpoint", step=last + 1, path=os.path.join(str(log_dir), f"ckpt_{last + 1:06d}.pt"))
    if end:
        log.record("end", step=last + 1, reason=end)
    log.close()


def test_round_trip_with_a_resume(tmp_path, capsys):
    # a launch that ran steps 0-7 and was killed, resumed from its checkpoint at step 4
    write_launch(tmp_path, 0, 7)
    write_launch(tmp_path, 4, 9, resumed_from="ckpt_000004.pt", end="finished")
    m = metrics.read_metrics(tmp_path)
    assert m["path"] == os.path.join(str(tmp_path), metrics.METRICS_FILE)
    assert [r["step"] for r in m["train"]] == list(range(10))
    # steps 4-7 come from the second launch (loss offset by start / 100), the first's are dropped
    assert [r["loss"] for r in m["train"]] == [6.0 - s / 10 + (0.04 if s >= 4 else 0) for s in range(10)]
    assert m["train"][5]["tokens"] == 6 * 1024 and m["train"][5]["skipped"] is False
    assert [r["step"] for r in m["val"]] == [0, 4, 8] == [r["step"] for r in m["hellaswag"]]
    assert m["hellaswag"][2]["acc_norm"] == 0.25 + 8 / 100 and m["val"][1]["val_loss"] == 5.0 - 0.4
    assert [r["step"] for r in m["checkpoint"]] == [10]  # the first launch's step 8 is past the resume
    first, second = m["launches"]
    assert first["run"]["step"] == 0 and first["end"] is None and first["first_train_step"] == 0
    assert second["run"]["resumed_from"] == "ckpt_000004.pt" and second["first_train_step"] == 4
    assert second["end"]["reason"] == "finished" and second["end"]["step"] == 10
    assert second["start"] <= second["last_time"] and first["last_time"] <= second["start"]
    # every record is one line with a kind and a time; log.txt holds the printed lines
    lines = (tmp_path / metrics.METRICS_FILE).read_text().splitlines()
    assert all({"kind", "time"} <= json.loads(line).keys() for line in lines)
    assert sum(json.loads(line)["kind"] == "timing" for line in lines) == 8 + 6  # written, skipped by the reader
    text = (tmp_path / metrics.TEXT_LOG_FILE).read_text()
    assert text.startswith("run: starting at step 0\n") and "step 9 | loss ..." in text
    assert "step 9 | loss ..." in capsys.readouterr().out


def test_a_line_cut_by_a_kill_is_ended_before_the_next_launch_writes(tmp_path, capsys):
    """A kill mid-write leaves log.txt's and metrics.jsonl's last line without its end; the next launch's first
    line starts on a line of its own (it ran into the cut one: 'step     1 | loss 10.7run: resuming ...'), and
    the reader skips the cut record alone."""
    write_launch(tmp_path, 0, 3)
    for name, cut in ((metrics.TEXT_LOG_FILE, "step     4 | loss 10.7"), (metrics.METRICS_FILE, '{"kind": "tr')):
        with open(tmp_path / name, "a") as f:
            f.write(cut)
    write_launch(tmp_path, 2, 5, resumed_from="ckpt_000002.pt")
    text = (tmp_path / metrics.TEXT_LOG_FILE).read_text().splitlines()
    assert text[text.index("step     4 | loss 10.7") + 1] == "run: starting at step 2"
    metrics._warned.clear()
    m = metrics.read_metrics(tmp_path)
    assert [r["step"] for r in m["train"]] == list(range(6)) and len(m["launches"]) == 2
    assert "line 13: not complete JSON: the line ends before its value does (cut short?)" in capsys.readouterr().err


def test_no_trace_before_the_first_write(tmp_path, capsys):
    log = metrics.RunLog(str(tmp_path / "never"), active=True)
    log.close()  # e.g. the run stopped on bad input
    assert not (tmp_path / "never").exists()
    quiet = metrics.RunLog(str(tmp_path / "rank1"), active=False)  # a rank other than 0
    quiet.line("hello")
    quiet.record("train", step=0)
    quiet.close()
    assert not (tmp_path / "rank1").exists() and capsys.readouterr().out == ""


def test_a_launch_refused_by_the_lock_takes_nothing_of_the_holders(tmp_path):
    """Two trainers started at once into the same new directory: the one the lock refuses must not
    take back the directory the other made and holds (nor its lock file); one that holds the lock
    and is refused later takes back what it made, and nothing else."""
    log_dir = str(tmp_path / "new")
    first = metrics.RunLog(log_dir, active=True)
    first.hold()
    second = metrics.RunLog(log_dir, active=True)
    try:
        second.hold()
        raise AssertionError("the lock was taken twice")
    except metrics.UserError:
        pass
    second.close()
    assert os.path.isfile(os.path.join(log_dir, metrics.LOCK_FILE))
    first.line("step 0 | written")  # its directory is still there
    first.close()
    assert open(os.path.join(log_dir, metrics.TEXT_LOG_FILE)).read() == "step 0 | written\n"
    refused = metrics.RunLog(str(tmp_path / "refused"), active=True)
    refused.hold()
    os.makedirs(os.path.join(refused.log_dir, "wandb"))  # what a tracker made before a later check refused
    refused.close()
    assert not os.path.exists(refused.log_dir)
    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("kept")
    refused = metrics.RunLog(str(old), active=True)
    refused.hold()
    refused.close()
    assert sorted(os.listdir(old)) == ["notes.txt"]  # no trainer.lock left behind either



def test_lines_no_reader_can_use_are_skipped_wherever_they_are(tmp_path, capsys):
    """The zeros a power loss leaves between two launches, a step that is not an integer and the
    start of a write cut by a kill: each is skipped, named in one warning, and the records around
    them are read; a file with no record in it is not a run's."""
    write_launch(tmp_path, 0, 7)
    write_launch(tmp_path / "next", 4, 9, end="finished")
    with open(tmp_path / metrics.METRICS_FILE, "a") as f:  # the next launch's records right after the cut, as
        f.write("\0" * 30 + "\n" + json.dumps({"kind": "train", "step": "8", "loss": 1.0}) + "\n" + '{"kind": "tr'
                + (tmp_path / "next" / metrics.METRICS_FILE).read_text())  # writers before the cut was ended wrote them
    lines = (tmp_path / metrics.METRICS_FILE).read_text().splitlines()
    zeros = lines.index("\0" * 30) + 1
    metrics._warned.clear()
    m = metrics.read_metrics(tmp_path)
    assert [r["step"] for r in m["train"]] == list(range(10)) and len(m["launches"]) == 2
    assert m["launches"][1]["end"]["reason"] == "finished" and m["launches"][1]["run"]["step"] == 4
    assert capsys.readouterr().err == (
        f"warning: {m['path']}: skipped what no reader can use: line {zeros}: not JSON (Expecting value); "
        f"line {zeros + 1}: 'step' is '8', not an integer; line {zeros + 2}: a write cut short by a kill, then a "
        "record\n")
    (tmp_path / metrics.METRICS_FILE).write_text("\0" * 30 + "\n")
    try:
        metrics.read_metrics(tmp_path)
        raise AssertionError("a file of zeros was read as a run's records")
    except metrics.UserError as e:
        assert "metrics.jsonl is not JSON records of a run (line 1: not JSON (Expecting value))" in str(e)


def test_a_full_disk_under_the_logs_is_one_line_and_keeps_the_checkpoints(data_dir, tmp_path):
    """A resumed run whose log.txt, then metrics.jsonl, is on a full disk (/dev/full: every write
    fails with ENOSPC): the trainer ends with one line naming the file, exit status 2, and its
    checkpoints are as they were."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    log_dir = tmp_path / "log"
    run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=2))
    kept = {p: open(p, "rb").read() for p in checkpoint.list_checkpoints(str(log_dir))}
    for name in (metrics.TEXT_LOG_FILE, metrics.METRICS_FILE):
        path = log_dir / name
        path.rename(log_dir / "real")
        path.symlink_to("/dev/full")
        p = run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=4, resume=True), check=False)
        path.unlink()
        (log_dir / "real").rename(path)
        assert p.returncode == 2 and p.stderr == (
            f"error: could not write {path} (no space left on its disk); the run's checkpoints are intact (the last: "
            "ckpt_000002.pt): free space under --log-dir, then --resume continues from it\n"), p.stderr
        assert {p: open(p, "rb").read() for p in checkpoint.list_checkpoints(str(log_dir))} == kept
    # a new run, before its first checkpoint: nothing to continue, and the line says so
    new = tmp_path / "new"
    new.mkdir()
    (new / metrics.METRICS_FILE).symlink_to("/dev/full")
    p = run(tiny(data_dir=data_dir, log_dir=new, max_steps=4), check=False)
    assert p.returncode == 2 and p.stderr == (
        f"error: could not write {new / metrics.METRICS_FILE} (no space left on its disk); no checkpoint was written "
        "yet: free space under --log-dir, then --resume starts the run again\n"), p.stderr
