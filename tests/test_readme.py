"""README's five-minute try-out, as a newcomer types it: its commands parse with the scripts' own
parsers, the text it trains on ships with the repository, and its first two commands prepare that
text and train on it (for two steps here, not a hundred)."""
import os
import shlex

import fineweb
import plot
import sample
import train_config
from runs import ROOT, records, run, tiny


def tryout():
    """The commands of README's "Five minutes on a CPU" block, each as (script, args)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Five minutes on a CPU", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert all(c[0] == "python" for c in commands)
    return [(c[1], c[2:]) for c in commands]


def test_the_readmes_tryout_parses_prepares_and_trains(tmp_path, monkeypatch):
    commands = tryout()
    assert [script for script, _ in commands] == ["fineweb.py", "train_gpt2.py", "sample.py", "plot.py"]
    (_, prepare), (_, train), (_, sampled), (_, plotted) = commands
    text = prepare[prepare.index("--data-files") + 1]
    assert os.path.getsize(os.path.join(ROOT, text)) > 1_000_000
    monkeypatch.chdir(ROOT)  # the paths are the repository's
    fineweb.parse_args(prepare)
    train_config.parse_args(train)
    sample.parse_args(sampled)
    plot.parse_args(plotted)
    data = str(tmp_path / "data")
    fineweb.main(prepare + ["--out-dir", data])
    log_dir = str(tmp_path / "log")
    run(train + ["--data-dir", data, "--log-dir", log_dir, "--max-steps", "2", "--eval-every", "1"])
    val = records(log_dir, "val")
    assert [r["step"] for r in val] == [0, 1] and val[1]["val_loss"] < val[0]["val_loss"]


def test_the_smallest_evaluation_of_the_training_guide_runs_as_printed(data_dir, tmp_path, monkeypatch):
    """docs/training.md's smallest complete evaluation, run as printed: registered, its own flag given to the
    trainer, it records its number at its steps and the last."""
    import evaluation
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        code = f.read().split("The smallest complete one:\n\n```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(evaluation, "REGISTRY", list(evaluation.REGISTRY))  # the registration undone after the test
    exec(compile(code, "docs/training.md", "exec"), {})
    log_dir = str(tmp_path / "log")
    run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=4, wnorm_every=2))
    norms = records(log_dir, "wnorm")
    assert [r["step"] for r in norms] == [0, 2, 3] and all(r["norm"] > 1 for r in norms)


def test_every_top_level_file_reads_in_one_sitting():
    """The flat shape stays readable: no top-level Python file over 450 lines, and no line of the project's Python
    (the scripts, tests/, bench/) over 120 characters."""
    import glob
    long_files, long_lines = {}, []
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "tests", "*.py"))
                       + glob.glob(os.path.join(ROOT, "bench", "*.py"))):
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        if os.path.dirname(path) == ROOT and len(lines) > 450:
            long_files[os.path.basename(path)] = len(lines)
        long_lines += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(lines, 1) if len(line) > 120]
    assert long_files == {} and long_lines == []
