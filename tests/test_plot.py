"""plot.py: summaries checked against numbers computed here from metrics files written here,
valid PNGs, one-line errors, and the summary without matplotlib."""

import errno
import json
import math
import os
import random
import statistics
import struct
import subprocess
import sys

import pytest

import common
import core
import descriptions
import evaluation
import metrics
import plot
import runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPS = 8192  # tokens per step
CUT_LINE = '{"kind": "train", "step": 40, "loss": 5.1'  # a write cut by a kill


def launch(first, last, t0, seed, max_steps=50, val_every=10, hellaswag=True, mfu=True,
           checkpoints=(), resumed_from=None, end=None, core=0):
    """Records of one launch of the trainer running steps first..last (inclusive); core: how many
    tasks its CORE records average (0: no CORE)."""
    rng = random.Random(seed)
    t = t0
    recs = [{"kind": "run", "step": first, "time": t, "max_steps": max_steps, "tokens_per_step": TPS,
             "resumed_from": resumed_from, "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
             "dtype": "bfloat16", "world_size": 1, "config": {"seed": seed}}]
    for step in range(first, last + 2):
        if val_every and (step % val_every == 0 or step == max_steps) and step <= max_steps:
            t += 0.5
            recs.append({"kind": "val", "step": step, "val_loss": 4 + 6 * math.exp(-step / 15) + rng.random() / 10,
                         "tokens": step * TPS, "time": t})
            if hellaswag:
                recs.append({"kind": "hellaswag", "step": step, "acc": 0.25 + step / 1000, "n": 10042,
                             "acc_norm": 0.25 + step / 800 + rng.random() / 100, "tokens": step * TPS, "time": t})
            if core:
                recs.append({"kind": "core", "step": step, "core": 0.02 + step / 400 + rng.random() / 100,
                             "centered": {f"task{k}": 0.1 - k / 400 for k in range(core)}, "tokens": step * TPS,
                             "time": t})
        if step in checkpoints:
            recs.append({"kind": "checkpoint", "step": step, "path": f"ckpt_{step:06d}.pt", "time": t})
        if step > last:
            break
        tok_per_s = 900.0 if step == first else 40000 + rng.uniform(-3000, 3000)  # compile warm-up
        dt = TPS / tok_per_s
        t += dt
        recs.append({"kind": "train", "step": step, "loss": 4 + 7 * math.exp(-step / 12) + rng.uniform(-0.3, 0.3),
                     "lr": 6e-4, "grad_norm": 1.0, "dt_ms": 1000 * dt, "tok_per_s": tok_per_s,
                     "mfu": tok_per_s / 1e5 if mfu else None, "tokens": (step + 1) * TPS, "time": t})
    if end:
        recs.append({"kind": "end", "step": last + 1, "reason": end, "time": t + 0.1})
    return recs


def write_log(log_dir, records, tail="", checkpoints=()):
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)
    for step in checkpoints:
        open(os.path.join(log_dir, f"ckpt_{step:06d}.pt"), "wb").close()
    return str(log_dir)


def of(records, kind):
    return [r for r in records if r["kind"] == kind]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """Three runs, and what summarize() must say about each, computed from the records."""
    root = tmp_path_factory.mktemp("logs")
    # a run that finished
    full = launch(0, 49, 1000.0, seed=1, checkpoints=(25, 50), end="finished")
    # killed at step 29 (no end record), resumed from step 20, killed again mid-write after step 39
    first = launch(0, 29, 1000.0, seed=2, checkpoints=(20,))
    second = launch(20, 39, 5000.0, seed=3, checkpoints=(30,), resumed_from="ckpt_000020.pt")
    # a CPU run: no evaluation at all, MFU unknown
    cpu = launch(0, 29, 1000.0, seed=4, max_steps=30, val_every=0, mfu=False, end="finished")
    dirs = {"full": write_log(root / "full", full, checkpoints=(25, 50)),
            "resumed": write_log(root / "resumed run", first + second, tail=CUT_LINE, checkpoints=(20, 30)),
            "cpu": write_log(root / "cpu", cpu)}
    # the records that stand, as the test knows them: the resumed launch replaces steps 20 on
    train = {"full": of(full, "train"),
             "resumed": of(first, "train")[:20] + of(second, "train"),
             "cpu": of(cpu, "train")}
    val = {"full": of(full, "val"), "resumed": of(first, "val")[:2] + of(second, "val"), "cpu": []}
    hs = {"full": of(full, "hellaswag"), "resumed": of(first, "hellaswag")[:2] + of(second, "hellaswag"), "cpu": []}
    launches = {"full": [full], "resumed": [first, second], "cpu": [cpu]}
    expected = {}
    for name in dirs:
        t = train[name]
        firsts = {of(recs, "train")[0]["step"] for recs in launches[name]}
        steady = [r for r in t if r["step"] >= len(t) // 10 and r["step"] not in firsts]
        mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
        expected[name] = {
            "launches": len(launches[name]), "steps": len(t), "tokens": len(t) * TPS,
            "wall_time_s": sum(recs[-1]["time"] - recs[0]["time"] for recs in launches[name]),
            "tok_per_s_mean": len(t) * TPS / sum(r["dt_ms"] / 1000 for r in t),
            "tok_per_s_steady": statistics.median(r["tok_per_s"] for r in steady),
            "mfu": statistics.median(mfus) if mfus else None,
            "val_best": min((r["val_loss"] for r in val[name]), default=None),
            "val_final": val[name][-1]["val_loss"] if val[name] else None,
            "hellaswag_best": max((r["acc_norm"] for r in hs[name]), default=None),
            "hellaswag_final_step": hs[name][-1]["step"] if hs[name] else None,
        }
    expected["full"].update(status="finished", stop_step=50, checkpoint_step=50,
                            checkpoint=os.path.join(dirs["full"], "ckpt_000050.pt"))
    expected["resumed"].update(status="stopped", stop_step=39, checkpoint_step=30,
                               checkpoint=os.path.join(dirs["resumed"], "ckpt_000030.pt"))
    expected["cpu"].update(status="finished", stop_step=30, checkpoint=None)
    return dirs, expected


@pytest.mark.parametrize("name", ["full", "resumed", "cpu"])
def test_summary_numbers_match_the_file(logs, name):
    dirs, expected = logs
    s = plot.summarize(dirs[name])
    for key, want in expected[name].items():
        assert s[key] == (pytest.approx(want) if isinstance(want, float) else want), key
    text = plot.format_summary(s)
    assert f"{expected[name]['steps']:,} / " in text
    if name == "resumed":
        assert f"--log-dir '{dirs[name]}' --resume" in text and "ckpt_000030.pt" in text  # quoted: a space
    if name == "cpu":
        assert "MFU         n/a" in text and "HellaSwag" not in text  # it evaluated nothing: no line for it


def test_the_summary_names_the_newest_checkpoint_file_as_resume_does(tmp_path):
    """A checkpoint written just before a kill (or before a full disk stopped its record) is on disk with no record
    of it: --resume continues from it, so the summary names it."""
    log_dir = write_log(tmp_path / "log", launch(0, 49, 1000.0, seed=5, checkpoints=(25,)), checkpoints=(25, 50))
    s = plot.summarize(log_dir)
    assert (s["checkpoint"], s["checkpoint_step"]) == (os.path.join(log_dir, "ckpt_000050.pt"), 50)


def test_plot_and_metrics_ask_the_checkpoint_room_for_its_files_without_torch():
    """The checkpoints' names and their listing are checkpoint.py's alone; plot.py and metrics.py ask it, and none of
    the three imports torch on import (a fresh interpreter: here torch is loaded already)."""
    for name in ("plot.py", "metrics.py"):
        assert "ckpt_" not in open(os.path.join(ROOT, name)).read(), name
    probe = "import sys, plot, metrics, checkpoint; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout.strip()) == (0, "False"), p.stderr


def test_cut_last_line_warns_once(logs, capsys):
    dirs, _ = logs
    metrics._warned.clear()
    plot.summarize(dirs["resumed"])
    plot.summarize(dirs["resumed"])
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "cut short" in err


def test_resume_that_dies_early_drops_the_abandoned_branch(tmp_path):
    # the first launch reached step 29; the resumed one (from 20) died after step 24: steps 25-29 of
    # the first launch are a branch nobody continues, so the run stands at 25 steps
    first = launch(0, 29, 1000.0, seed=5, checkpoints=(20,))
    second = launch(20, 24, 5000.0, seed=6)
    # and the cut write of the first launch shares its line with the second's run record
    text = "".join(json.dumps(r) + "\n" for r in first) + CUT_LINE + "".join(json.dumps(r) + "\n" for r in second)
    (tmp_path / "metrics.jsonl").write_text(text)
    m = metrics.read_metrics(tmp_path)
    assert [r["step"] for r in m["train"]] == list(range(25))
    assert m["train"][-1] == of(second, "train")[-1] and len(m["launches"]) == 2
    assert [r["step"] for r in m["checkpoint"]] == [20]
    assert plot.summarize(tmp_path)["tokens"] == 25 * TPS
    # resumed from 20 and gone before its first step: the first launch's step 20 is the abandoned branch's too
    gone = launch(20, 19, 5000.0, seed=6)
    assert not of(gone, "train")
    write_log(tmp_path / "gone", first + gone)
    m = metrics.read_metrics(tmp_path / "gone")
    assert [r["step"] for r in m["train"]] == list(range(20)) and plot.summarize(tmp_path / "gone")["tokens"] == \
        20 * TPS


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_plot_of_one_run_and_an_overlay(logs, tmp_path):
    pytest.importorskip("matplotlib")
    dirs, _ = logs
    out = os.path.join(dirs["full"], "plot.png")
    plot.main([dirs["full"]])  # the default output: LOG_DIR/plot.png
    width, height = png_size(out)
    assert width > 400 and height > 300 and os.path.getsize(out) > 20_000
    out = str(tmp_path / "runs.png")
    assert plot.write_plot([dirs["full"], dirs["resumed"], dirs["cpu"]], out, labels=["base", "resumed", "cpu"])
    width, height = png_size(out)
    assert width > 400 and height > 300


def legend_problems(fig):
    """What each legend of a drawn figure covers: plotted points, a panel, a title, an axis
    label or tick label (all in display coordinates), or the figure's edge."""
    renderer = fig.canvas.get_renderer()
    problems = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        if not fig.bbox.contains(box.x0, box.y0) or not fig.bbox.contains(box.x1, box.y1):
            problems.append(f"{ax.get_title()!r}: legend cut off by the figure's edge")
        for other in fig.axes:
            if box.overlaps(other.bbox):
                problems.append(f"{ax.get_title()!r}: legend over the panel {other.get_title()!r}")
            texts = [other.title, other.xaxis.label, other.yaxis.label]
            texts += other.get_xticklabels() + other.get_yticklabels()
            for t in texts:
                if t.get_visible() and t.get_text() and box.overlaps(t.get_window_extent(renderer)):
                    problems.append(f"{ax.get_title()!r}: legend over the text {t.get_text()!r}")
            for line in other.lines:
                xy = other.transData.transform(line.get_xydata())
                # the points and 20 more along each segment: a legend can cover a line between points
                points = [a + (b - a) * k / 20 for a, b in zip(xy[:-1], xy[1:]) for k in range(20)] + list(xy[-1:])
                if any(other.bbox.contains(x, y) and box.contains(x, y) for x, y in points):
                    problems.append(f"{ax.get_title()!r}: legend over points of {line.get_label()!r}")
    return problems


def test_legends_hide_nothing(logs, tmp_path):
    """A short run's loss starts in the top left corner and a long run's ends bottom right: no
    corner inside a panel is free for every run, so each legend must sit where no data is."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    dirs, _ = logs
    short = write_log(tmp_path / "short", launch(0, 9, 0.0, seed=9, max_steps=10, val_every=5, end="finished"))
    scored = write_log(tmp_path / "core", launch(0, 49, 0.0, seed=5, core=22, end="finished"))
    for runs in ([short], [dirs["full"], dirs["resumed"], dirs["cpu"], short], [scored, short]):
        fig = plot.build_figure(runs)
        FigureCanvasAgg(fig).draw()  # constrained layout places everything at draw time
        assert sum(ax.get_legend() is not None for ax in fig.axes) == 4 + (scored in runs)  # work for the check
        assert legend_problems(fig) == []


@pytest.fixture(scope="module", autouse=True)
def missing_dir_cli(tmp_path_factory):
    """The real command line on a directory that does not exist, started with the module's first test so that it
    runs beside the rest."""
    proc = subprocess.Popen([runs.python(), os.path.join(ROOT, "plot.py"),
                             str(tmp_path_factory.mktemp("cli") / "no_such_dir")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    proc.kill()  # a no-op once it has finished


def test_missing_log_dir_is_one_line(missing_dir_cli):
    out, err = missing_dir_cli.communicate(timeout=600)
    assert missing_dir_cli.returncode == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "no_such_dir is not a directory" in err


def test_closed_stdout_ends_quietly(logs, tmp_path):
    """python plot.py LOG | head, head gone: exit status 1, no traceback."""
    from runs import stdout_closed
    dirs, _ = logs
    code, err = stdout_closed(os.path.join(ROOT, "plot.py"), [dirs["full"], "--out", str(tmp_path / "plot.png")])
    assert code == 1 and "Traceback" not in err and "Error" not in err, err


def test_without_matplotlib_the_summary_still_prints(logs, monkeypatch, capsys):
    dirs, _ = logs
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)  # any import of it raises ImportError
    assert plot.write_plot(dirs["full"], os.path.join(dirs["full"], "never.png")) is False
    plot.main([dirs["full"], "--out", os.path.join(dirs["full"], "never.png")])
    out = capsys.readouterr().out
    assert "val loss    best" in out and "status      finished at step 50" in out
    assert out.strip().splitlines()[-1] == "matplotlib is not installed: pip install matplotlib to get plots"
    assert not os.path.exists(os.path.join(dirs["full"], "never.png"))


@pytest.mark.parametrize("case,needle", [
    ("no_metrics", "has no metrics.jsonl"),
    ("empty", "has no records"),
    ("only_unknown_kinds", "has no records"),
    ("garbage", "metrics.jsonl is not JSON records of a run (line 1: not JSON (Expecting value))"),
    ("not_an_object", 'is not JSON records of a run (line 1: not a record (a JSON object with a "kind"))'),
    ("missing_field", "is not JSON records of a run (line 1: a 'val' record without 'tokens')"),
    ("labels", "--labels has 1 name(s) for 2"),
])
def test_errors_in_process(tmp_path, capsys, case, needle):
    lines = {"empty": "\n", "only_unknown_kinds": '{"kind": "from_a_newer_trainer", "step": 0}\n',
             "garbage": "this is not json\nnor is this\n",
             "not_an_object": "[1, 2]\n",
             "missing_field": json.dumps({"kind": "val", "step": 0, "val_loss": 3.0}) + "\n"}
    tmp_path.joinpath("run").mkdir()
    if case in lines:
        tmp_path.joinpath("run", "metrics.jsonl").write_text(lines[case])
    argv = [str(tmp_path / "run")] + ([str(tmp_path), "--labels", "a"] if case == "labels" else [])
    with pytest.raises(SystemExit) as e:
        common.run_main(lambda: plot.main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err


def test_command_line_errors_are_one_line(capsys):
    """argparse's own errors too: the flag and where to look, no usage block."""
    for argv, needle in (([], "error: the following arguments are required: LOG_DIR (see --help)"),
                         (["log", "--smooth", "lots"],
                          "error: argument --smooth: invalid int value: 'lots' (see --help)")):
        with pytest.raises(SystemExit) as e:
            common.run_main(lambda: plot.main(argv))
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == needle + "\n"


def test_out_that_cannot_be_written_is_one_line(logs, tmp_path, capsys, monkeypatch):
    """--out naming a directory, or a location the process cannot write (read-only, full)."""
    dirs, _ = logs
    read_only = OSError(errno.EROFS, "Read-only file system")
    for out, error in ((str(tmp_path), None), (str(tmp_path / "runs.png"), read_only)):
        if error is not None:
            def refuse(path, write_fn):
                raise error
            monkeypatch.setattr(plot.common, "atomic_write", refuse)
        with pytest.raises(SystemExit) as e:
            common.run_main(lambda: plot.main([dirs["full"], "--out", out]))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert (f"cannot write {out}: it is a directory" if error is None else "(Read-only file system)") in err[0]


def test_core_is_drawn_against_gpt2_and_summarised(tmp_path):
    """A run that scored CORE: its best and final in the summary (and no CORE line for a run that
    did not), its curve on a panel of its own with GPT-2 124M's and 1.5B's values."""
    pytest.importorskip("matplotlib")
    recs = launch(0, 49, 0.0, seed=5, core=22, end="finished")
    cores = of(recs, "core")
    s = plot.summarize(write_log(tmp_path / "core", recs))
    best = max(cores, key=lambda r: r["core"])
    assert (s["core_best"], s["core_best_step"], s["core_final"]) == (best["core"], best["step"], cores[-1]["core"])
    assert f"  CORE        best {best['core']:.4f} at step {best['step']}" in plot.format_summary(s)
    assert "CORE" not in plot.format_summary(plot.summarize(write_log(tmp_path / "none", launch(0, 9, 0.0, seed=1))))
    fig = plot.build_figure([str(tmp_path / "core")])
    right = [ax for ax in fig.axes if any("CORE" in line.get_label() for line in ax.lines)]
    assert len(right) == 1
    values = {round(line.get_ydata()[0], 4) for line in right[0].lines if "GPT-2" in line.get_label()}
    assert values == {core.GPT2_CORE["124M"], core.GPT2_CORE["1.5B"]} == {0.1139, 0.2565}


def test_a_resumed_run_keeps_every_launchs_evaluations(tmp_path):
    """A run that scored CORE in its first launch and was resumed without it: its records, its summary and its plot
    still hold the first launch's CORE (each launch's run record describes the evaluations of that launch)."""
    pytest.importorskip("matplotlib")
    first = launch(0, 19, 0.0, seed=5, core=22, checkpoints=(20,), end="signal")
    second = launch(20, 49, 100.0, seed=6, resumed_from="ckpt_000020.pt", end="finished")
    first[0]["evaluations"] = {k: descriptions.EVALUATIONS[k] for k in ("val", "hellaswag", "core")}
    second[0]["evaluations"] = {k: descriptions.EVALUATIONS[k] for k in ("val", "hellaswag")}
    log_dir = write_log(tmp_path / "run", first + second)
    read = metrics.read_metrics(log_dir)
    assert list(read["evaluations"]) == ["val", "hellaswag", "core"]
    assert [r["step"] for r in read["core"]] == [0, 10, 20]
    assert plot.summarize(log_dir)["core_best_step"] in (0, 10, 20)
    fig = plot.build_figure([log_dir])
    assert any("CORE" in line.get_label() for ax in fig.axes for line in ax.lines)


def test_a_run_stopped_before_its_first_step(logs):
    dirs, _ = logs
    s = dict(plot.summarize(dirs["full"]), status="signal", stop_step=-1)  # the trainer's end record: step -1
    text = plot.format_summary(s)
    assert "stopped by a signal before its first step" in text and "step -1" not in text


def test_a_core_over_other_tasks_is_not_set_against_gpt2(tmp_path):
    """A custom bundle's 5 tasks: the summary and the panel say so, and draw no GPT-2 reference;
    beside a run over the 22, the references are there for that one."""
    pytest.importorskip("matplotlib")
    five = write_log(tmp_path / "five", launch(0, 19, 0.0, seed=5, core=5, end="finished"))
    text = plot.format_summary(plot.summarize(five))
    assert "over 5 tasks: not comparable with GPT-2's, over 22" in text and "GPT-2 124M: 0.1139" not in text
    ax = next(ax for ax in plot.build_figure([five]).axes if ax.get_title().startswith("CORE"))
    assert ax.get_title() == "CORE (centred accuracy: 0 = chance)" and "22" not in ax.get_title()
    label = f"{os.path.basename(tmp_path)}/five"  # below no directory of here: the path's last two parts
    assert [line.get_label() for line in ax.lines] == [f"{label} (over 5 tasks: not comparable with GPT-2's)"]
    full = write_log(tmp_path / "full", launch(0, 19, 0.0, seed=6, core=22, end="finished"))
    ax = next(ax for ax in plot.build_figure([five, full]).axes if ax.get_title().startswith("CORE"))
    assert sum("GPT-2" in line.get_label() and "1.5B" in line.get_label() for line in ax.lines) == 1


def test_launches_that_trained_nothing_are_no_resumes(tmp_path):
    """The legend lists each step a launch resumed from and trained on, once: two launches that
    resumed from step 12 are one entry, and a launch that only exported (after the run finished)
    is none. A run killed before its first step says so, not "step None"."""
    pytest.importorskip("matplotlib")
    first = launch(0, 13, 0.0, seed=1, checkpoints=(12,))
    again = launch(12, 14, 100.0, seed=2, resumed_from="ckpt_000012.pt")
    last = launch(12, 19, 200.0, seed=3, max_steps=20, resumed_from="ckpt_000012.pt", end="finished")
    export = [{"kind": "run", "step": 20, "time": 300.0 + k, "max_steps": 20, "tokens_per_step": TPS,
               "resumed_from": "ckpt_000020.pt"} for k in range(2)]
    log = write_log(tmp_path / "log", first + again + last + export)
    ax = next(ax for ax in plot.build_figure([log]).axes if ax.get_title().startswith("Loss"))
    resumed = [t for t in ax.get_legend_handles_labels()[1] if "resumed" in t]
    assert resumed == [f"{os.path.basename(tmp_path)}/log: resumed at step 12"]
    killed = write_log(tmp_path / "killed", launch(0, -1, 0.0, seed=4))
    text = plot.format_summary(plot.summarize(killed))
    assert "status      stopped before its first step (no end record" in text and "None" not in text


def test_a_record_of_the_wrong_type_is_one_line_naming_it(tmp_path, capsys):
    """A loss written as text in the middle of a run: plot.py says which line of which file in one
    warning and summarises and draws the other steps."""
    recs = launch(0, 9, 0.0, seed=7, end="finished")
    bad = recs.index(of(recs, "train")[6])
    recs[bad] = dict(recs[bad], loss="nan-ish")
    log = write_log(tmp_path / "log", recs)
    common.run_main(lambda: plot.main([log, "--out", str(tmp_path / "plot.png")]))
    err = capsys.readouterr().err
    assert err == (f"warning: {os.path.join(log, 'metrics.jsonl')}: skipped what no reader can use: line {bad + 1}: "
                   "'loss' is 'nan-ish', not a number\n")
    assert [r["step"] for r in metrics.read_metrics(log)["train"]] == [0, 1, 2, 3, 4, 5, 7, 8, 9]


def test_a_cpu_try_out_is_drawn_for_what_it_measured(tmp_path, monkeypatch):
    """A short CPU run in tryout/log, HellaSwag on a sample of 16 items: the title and legend name tryout/log as
    given; no MFU panel (never measured); the loss axis fits the run's 4-11, with GPT-2's 3.29 named at its bottom
    edge; the sample's points hollow beside the chance line, and the summary says it is a sample, not GPT-2's set.
    Without HellaSwag there is no HellaSwag panel."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    recs = launch(0, 29, 0.0, seed=8, max_steps=30, mfu=False, end="finished")
    for r in of(recs, "hellaswag"):
        r["n"] = 16
    write_log(tmp_path / "tryout" / "log", recs)
    fig = plot.build_figure(["tryout/log/"])
    assert fig.get_suptitle() == "GPT-2 training: tryout/log"
    panels = {ax.get_title().split(" (")[0]: ax for ax in fig.axes}
    assert sorted(panels) == ["HellaSwag", "Loss", "Throughput"], sorted(panels)
    loss = panels["Loss"]
    assert loss.get_ylim()[0] > evaluation.GPT2_VAL_LOSS and "tryout/log train" in loss.get_legend_handles_labels()[1]
    assert not [line for line in loss.lines if list(line.get_ydata()) == [evaluation.GPT2_VAL_LOSS] * 2]
    assert [t.get_text() for t in loss.texts] == ["below the axis: " + evaluation.Validation.references[0][1]]
    hs = panels["HellaSwag"]
    run_line = next(line for line in hs.lines if line.get_label().startswith("tryout/log"))
    assert run_line.get_label() == "tryout/log (a sample of 16 items)" and run_line.get_markerfacecolor() == "none"
    assert [line.get_ydata()[0] for line in hs.lines if "chance" in line.get_label()] == [0.25]
    assert "hollow: a sample of 16 items, +/-0.21 at 95%" in hs.get_title()
    text = plot.format_summary(plot.summarize("tryout/log"))
    assert ("(a sample of 16 items: chance 0.25, +/-0.21 at 95%; the baselines are over all 10,042)" in text
            and "GPT-2 124M: 0.2955" not in text), text
    write_log(tmp_path / "whole", launch(0, 29, 0.0, seed=8, max_steps=30, end="finished"))  # all 10,042 items
    assert "(GPT-2 124M: 0.2955, GPT-3 124M: 0.337)" in plot.format_summary(plot.summarize("whole"))
    hs = next(ax for ax in plot.build_figure(["whole"]).axes if ax.get_title().startswith("HellaSwag"))
    assert hs.get_title() == "HellaSwag (acc_norm, 0-shot)" and hs.lines[0].get_markerfacecolor() != "none"
    write_log(tmp_path / "plain", launch(0, 29, 0.0, seed=8, max_steps=30, val_every=0, end="finished"))
    summary = plot.format_summary(plot.summarize("plain"))  # lists only the evaluations the run ran
    assert [line.split()[0] for line in summary.splitlines()[1:]] == ["device", "steps", "wall", "tokens/s", "MFU",
                                                                      "status"], summary
    titles = [ax.get_title().split(" (")[0] for ax in plot.build_figure(["plain"]).axes]
    assert sorted(titles) == ["Loss", "Model FLOPs utilisation", "Throughput"], titles


def test_runs_written_before_descriptions_said_how_to_draw_are_drawn_as_the_built_ins_describe_themselves(tmp_path):
    """descriptions.EVALUATIONS, how plot.py draws the built-in evaluations of a run whose record predates their
    descriptions (or predates the keys that say how they are shown), is what evaluation.py's classes describe today;
    an evaluation of such a run that is not built in gets a title and y label of its field. Every run's loss is set
    against GPT-2's validation loss, whether it validated or not; a description damaged by hand is drawn plainly
    where only how it is shown is damaged, and left out where its records cannot be read by it."""
    pytest.importorskip("matplotlib")
    for cls in (evaluation.Validation, evaluation.HellaSwag, evaluation.Core):
        assert cls.describe() == descriptions.EVALUATIONS[cls.kind]
    older = {"hellaswag": dict(field="acc_norm", best="max", label="HellaSwag", panel="hellaswag"),
             "toy": dict(field="score", best="min", label="Toy", panel="toy")}
    found = descriptions.described([{"kind": "run", "evaluations": older}])
    assert list(found) == ["val", "hellaswag", "toy"] and found["val"] == descriptions.EVALUATIONS["val"]
    assert found["hellaswag"] == descriptions.EVALUATIONS["hellaswag"]
    assert found["toy"] == dict(descriptions.SHOWN, **older["toy"], references=[],
                                title="Toy (score, lower is better)", ylabel="score")
    assert descriptions.described([{"kind": "run"}]) == descriptions.EVALUATIONS
    damaged = {"core": dict(descriptions.EVALUATIONS["core"], references=[[0.1]]), "toy": {"field": 3}}
    read = descriptions.described([{"kind": "run", "evaluations": damaged}])
    assert read["core"] == descriptions.description("core", "max", "CORE", "core") and "toy" not in read
    recs = [r for r in launch(0, 19, 0.0, seed=5, core=5, end="finished") if r["kind"] != "val"]  # --eval-every 0
    recs[0]["evaluations"] = damaged
    fig = plot.build_figure([write_log(tmp_path / "log", recs)])
    loss = next(ax for ax in fig.axes if ax.get_title().startswith("Loss"))
    assert [t.get_text() for t in loss.texts] == ["below the axis: " + evaluation.Validation.references[0][1]]
    assert loss.get_title() == "Loss (train: per step; val loss: dashed)"
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("CORE"))
    assert panel.get_title() == "CORE (core, higher is better)" and len(panel.lines) == 1


def test_plot_py_names_no_evaluation():
    """What plot.py draws of an evaluation (its panel, title, published figures, a sample, other tasks) comes from
    the run record's description alone: no evaluation's name is in its code (its docstrings give examples)."""
    import ast
    with open(os.path.join(ROOT, "plot.py")) as f:
        tree = ast.parse(f.read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node)}
    words = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and id(n) not in docstrings] + [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)] + [
             n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    named = [w for w in words if any(kind in w.lower() for kind in ("hellaswag", "core", "acc_norm", "centered"))]
    assert named == [], named
