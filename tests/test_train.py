"""train_gpt2.py end to end on a tiny model: learning, DDP and FSDP equivalence, multi-node launch,
Muon, the non-finite stop, bad input, the schedule and the timing breakdown."""
import json
import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
import common
import evaluation
import export
import metrics
import optim
import train_config
from core_bundle import TASKS, write_bundle
import runs
from runs import ENV, FAULT_TRAINER, TRAIN, final_state, records, run, run_process, tiny, torchrun


HS_ITEMS = [{"ctx": f"The cat sees a red ball number {i}.", "endings": ["It runs.", "The dog likes books.", "A.",
                                                                     "My friend paints the sky."], "label": i % 4}
            for i in range(5)]


@pytest.fixture(scope="module")
def logged_run(data_dir, tmp_path_factory):
    """One 30-step run with everything on: validation, HellaSwag (the first 3 of the file's 5 items) and
    CORE (4 items a task) every 15 steps, samples, the export. The tests below read what it left: its
    log directory and what it printed."""
    base = tmp_path_factory.mktemp("logged")
    hs_file = base / "hellaswag_val.jsonl"
    hs_file.write_text("".join(json.dumps(item) + "\n" for item in HS_ITEMS))
    bundle = write_bundle(base / "bundle")
    log_dir = str(base / "log")
    p = run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=30, max_lr="1e-2", export_hf=True, sample_every=15,
                 num_samples=2, sample_tokens=8, hellaswag_every=15, hellaswag_file=str(hs_file), hellaswag_limit=3,
                 core_every=15, core_bundle=bundle, core_limit=4))
    return dict(log_dir=log_dir, stdout=p.stdout.splitlines(), bundle=bundle)


def test_loss_goes_down(logged_run):
    log_dir = logged_run["log_dir"]
    train = records(log_dir, "train")
    assert [r["step"] for r in train] == list(range(30))
    assert abs(train[0]["loss"] - math.log(50257)) < 0.5  # untrained: about uniform over the vocabulary
    assert train[-1]["loss"] < train[0]["loss"] - 3.0
    val = records(log_dir, "val")
    assert [r["step"] for r in val] == [0, 4, 8, 12, 16, 20, 24, 28, 29]
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 3.0


def test_the_run_is_logged_one_greppable_line_per_step(logged_run):
    """Every step's record, the run header and the end record in metrics.jsonl; one line per step
    with the same keys in stdout and log.txt; the samples at their steps."""
    log_dir, stdout = logged_run["log_dir"], logged_run["stdout"]
    for r in records(log_dir, "train"):
        assert r["tokens"] == (r["step"] + 1) * 128 and r["mfu"] is None and r["dt_ms"] > 0
    for kind in ("val", "hellaswag", "core"):  # measured before the step: at the tokens seen by then (the plot's x)
        assert [r["tokens"] for r in records(log_dir, kind)] == [r["step"] * 128 for r in records(log_dir, kind)]
        assert records(log_dir, kind)[-1]["step"] == 29
    header = records(log_dir, "run")[0]
    assert header["grad_accum"] == 2 and header["world_size"] == 1
    assert header["versions"]["torch"] == torch.__version__
    assert records(log_dir, "end")[0]["reason"] == "finished"
    lines = [l for l in stdout if l.startswith("step ") and "| loss" in l]
    assert len(lines) == 30
    for key in ("loss", "lr", "grad_norm", "dt_ms", "tok_per_s", "mfu"):
        assert f"| {key} " in lines[-1]
    assert lines[-1].endswith("| mfu n/a")  # and the header says why
    device_line = [l for l in stdout if l.startswith("device cpu")][0].split(" | ")
    assert device_line[2] == "MFU n/a (no float32 peak known for cpu)" and device_line[4] == "compile off"
    with open(os.path.join(log_dir, "log.txt")) as f:
        assert sum(1 for l in f if l.startswith("step ") and "| loss" in l) == 30
    assert sum(1 for l in stdout if l.startswith("sample ")) == 4  # steps 15 and 29


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_header_counts_the_validation_tokens_of_every_process(data_dir, world):
    """--val-tokens 256 at a 32-token context is 8 sequences, shared by N processes (8 // N each): the header says
    the tokens all of them validate, N times one process's."""
    from types import SimpleNamespace
    import parallel
    val = evaluation.Validation(4, data_dir, 256)
    val.start(SimpleNamespace(ranks=parallel.Ranks(rank=world - 1, world_size=world), micro_batch=2,
                              raw_model=SimpleNamespace(config=SimpleNamespace(block_size=32, vocab_size=50304))))
    assert val.loader.num_sequences > 8 and val.note() == f"val: {8 // world * 32 * world:,} tokens"


def test_hellaswag_in_the_loop_is_the_standalone_figure_on_the_limits_items(logged_run):
    """At steps 0, 15 and the last, announced before each one, over the first --hellaswag-limit
    items; the last equals hellaswag.py's on the final weights."""
    import hellaswag
    log_dir, stdout = logged_run["log_dir"], logged_run["stdout"]
    hs = records(log_dir, "hellaswag")
    assert [(r["step"], r["n"]) for r in hs] == [(0, 3), (15, 3), (29, 3)]
    progress = [i for i, l in enumerate(stdout) if l == "hellaswag: scoring 3 items on 1 rank(s)..."]
    results = [i for i, l in enumerate(stdout) if "| hellaswag acc_norm" in l]
    assert len(progress) == 3 and all(a < b for a, b in zip(progress, results))  # said before each one
    assert all(0 <= r["acc_norm"] <= 1 and r["acc"] * 3 == round(r["acc"] * 3) for r in hs)
    final, _ = checkpoint.load_model(log_dir)
    standalone = hellaswag.scoring.evaluate(final, hellaswag.HellaSwag(HS_ITEMS[:3]))  # on the CPU
    assert hs[-1]["acc_norm"] == standalone["acc_norm"]


def test_core_in_the_loop_is_the_standalone_figure_and_in_the_summary(logged_run):
    """In the log, metrics.jsonl (each task's centred accuracy) and the plot's summary, over
    --core-limit items a task; the last equals core.py's on the final weights."""
    import core
    import plot
    log_dir, stdout = logged_run["log_dir"], logged_run["stdout"]
    cores = records(log_dir, "core")
    assert [r["step"] for r in cores] == [0, 15, 29] and all(len(r["centered"]) == len(TASKS) for r in cores)
    scored = sum(min(4, items) for *_, items in TASKS)
    assert scored < sum(items for *_, items in TASKS)
    assert stdout.count(f"core: scoring {scored} items on 1 rank(s)...") == 3
    assert sum(1 for l in stdout if "| core " in l and f"over {len(TASKS)} tasks" in l) == 3
    final, _ = checkpoint.load_model(log_dir)
    standalone = core.scoring.evaluate(final, core.Core(core.load_tasks(logged_run["bundle"], None, 4)))
    assert cores[-1]["core"] == pytest.approx(standalone["core"], abs=1e-12)
    summary = plot.summarize(log_dir)
    assert summary["core_final"] == cores[-1]["core"] and summary["core_best"] == max(r["core"] for r in cores)
    assert "  CORE        best " in plot.format_summary(summary)


def test_the_export_loads_in_transformers_with_the_checkpoints_logits(logged_run):
    from transformers import GPT2LMHeadModel
    log_dir = logged_run["log_dir"]
    hf = GPT2LMHeadModel.from_pretrained(os.path.join(log_dir, "hf")).eval()
    ours, _ = checkpoint.load_model(log_dir)
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx)[0][..., :50257]).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory):
    """The reference for the multi-process runs below: 4 steps on one process, micro-batch 2 and 2
    accumulation steps, validation every 2 steps."""
    log_dir = str(tmp_path_factory.mktemp("single"))
    run(tiny(data_dir=data_dir, max_steps=4, eval_every=2, log_dir=log_dir))
    return log_dir


def assert_same_training(reference, other):
    """The same global batch, the same math; only the summation order differs."""
    a, b = records(reference, "train"), records(other, "train")
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
    assert len(records(reference, "val")) == len(records(other, "val")) == 3
    for va, vb in zip(records(reference, "val"), records(other, "val")):
        assert vb["val_loss"] == pytest.approx(va["val_loss"], rel=1e-5)


def test_fsdp_matches_one_process_and_evaluates_samples_and_exports_in_step(data_dir, tmp_path, one_process):
    """FSDP2 with activation checkpointing through the command line: the steps and validations of one
    process to float rounding (the in-process checks of parallel.py are test_parallel.py's);
    HellaSwag on 9 items (shares of 5 and 4: two batches of 4 on one rank, one on the other) and
    samples run on both ranks in step, since every forward through the sharded model is a
    collective; the checkpoint is the ordinary full one, and the export is gathered from the shards."""
    fsdp = str(tmp_path / "fsdp")
    hs_file = tmp_path / "hellaswag_val.jsonl"
    hs_file.write_text("".join(json.dumps({"ctx": f"The cat sees item {i}.",
                                           "endings": ["A.", "It runs.", "B c.", "D."], "label": i % 4}) + "\n"
                               for i in range(9)))
    p = torchrun(["--standalone", "--nproc_per_node=2"], tiny(
        data_dir=data_dir, max_steps=4, eval_every=2, log_dir=fsdp, fsdp=True, activation_checkpointing=True,
        hellaswag_every=2, hellaswag_file=str(hs_file), sample_every=2, num_samples=1, sample_tokens=4,
        export_hf=True))
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    assert "memory (fsdp, activation checkpointing): per process: params" in out
    assert [(r["step"], r["n"]) for r in records(fsdp, "hellaswag")] == [(0, 9), (2, 9), (3, 9)]
    assert sum(1 for line in out.splitlines() if line.startswith("sample 0 |")) == 2  # steps 2 and 3, rank 0
    assert_same_training(one_process, fsdp)
    # the FSDP checkpoint is the ordinary full one: it loads as a plain GPT, whole and tied
    model, _ = checkpoint.load_model(fsdp)
    single_model, _ = checkpoint.load_model(one_process)
    assert {k: v.shape for k, v in model.state_dict().items()} == \
        {k: v.shape for k, v in single_model.state_dict().items()}
    assert model.lm_head.weight is model.transformer.wte.weight
    exported, _ = checkpoint.load_model(os.path.join(fsdp, "hf"))  # gathered from the shards at the end
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert torch.equal(exported(idx)[0][..., :50257], model.eval()(idx)[0][..., :50257])


def test_fsdp_in_one_process_shards_nothing_and_trains_as_one_process(data_dir, tmp_path, one_process):
    """--sharding fsdp without torchrun: a process group of one runs FSDP2's paths (the sharded step, the gathered
    checkpoint), the header says it shards nothing, and the steps are one process's."""
    log_dir = str(tmp_path / "fsdp1")
    p = run_process(tiny(data_dir=data_dir, max_steps=4, eval_every=2, log_dir=log_dir, fsdp=True))
    assert "warning: --sharding fsdp with one process shards nothing" in p.stdout
    assert "memory (fsdp): per process" in p.stdout
    assert_same_training(one_process, log_dir)
    model, _ = checkpoint.load_model(log_dir)  # the full checkpoint, whole and tied
    assert model.lm_head.weight is model.transformer.wte.weight


def said_lines(out):
    """The lines a torchrun group's ranks said of an error: 'error: ...', 'rank N: ...' or 'ranks N, M: ...'."""
    return [line for line in out.splitlines() if re.match(r"(error: |ranks? [\d, ]+: )", line)]


def torchrun_output(args, timeout=300):
    p = torchrun(["--standalone", "--nproc_per_node=2"], args)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


STATUS_WRAPPER = """import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun signals the rank's process group: the trainer answers it
code = subprocess.call([sys.executable] + sys.argv[1:])
with open(os.path.join(os.environ["STATUS_DIR"], "status" + os.environ["RANK"]), "w") as f:
    f.write(str(code))
sys.exit(code)
"""


def test_a_sigterm_to_torchrun_stops_the_ranks_cleanly_then_torchrun_fails(data_dir, tmp_path):
    """kill -TERM of torchrun itself (a wrapper's, a spot instance's): it passes the signal to the ranks, which
    finish their step, write its checkpoint, record the end and exit 0; torchrun then exits 1 with its
    SignalException (its own: docs/clusters.md tells a wrapper to read the run's end record instead). The run record
    holds the grace torchrun gives them (--shutdown-timeout, read from its command line)."""
    wrapper = tmp_path / "status.py"
    wrapper.write_text(STATUS_WRAPPER)
    log_dir = tmp_path / "log"
    args = [TRAIN] + tiny(data_dir=data_dir, log_dir=str(log_dir), max_steps=100000, eval_every=0)
    p = torchrun(["--standalone", "--nproc_per_node=2", "--shutdown-timeout", "45"], args, script=str(wrapper),
                 env=dict(ENV, STATUS_DIR=str(tmp_path)), cold=True)
    out = ""
    for line in p.stdout:  # once the ranks train
        out += line
        if line.startswith("step     2 |"):
            p.send_signal(signal.SIGTERM)
            break
    out += p.communicate(timeout=300)[0]
    assert p.returncode == 1 and "SignalException: Process" in out and "got signal: 15" in out, out[-3000:]
    assert (tmp_path / "status0").read_text() == "0" and (tmp_path / "status1").read_text() == "0", out[-3000:]
    end = records(str(log_dir), "end")[-1]
    assert end["reason"] == "signal", end
    last = (log_dir / "log.txt").read_text().splitlines()[-1]
    assert last.startswith(f"stopped by SIGTERM after {end['step'] + 1} steps; continue with: "), last
    assert checkpoint.load_file(checkpoint.list_checkpoints(str(log_dir))[-1])["step"] == end["step"] + 1
    assert records(str(log_dir), "run")[0]["stop_grace_s"] == 45


@pytest.mark.parametrize("argv, env, grace", [
    ([], {}, None),  # a plain python launch: nothing kills it after a SIGTERM
    (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "train_gpt2.py"], {"TORCHELASTIC_RUN_ID": "1"},
     30),
    (["python", "/bin/torchrun", "--shutdown_timeout=90", "train_gpt2.py", "--shutdown-timeout", "5"],
     {"TORCHELASTIC_RUN_ID": "1"}, 90),  # the script's own arguments are not torchrun's
    (["torchrun", "train_gpt2.py", "--shutdown-timeout", "5"], {"TORCHELASTIC_RUN_ID": "1"}, 30),
    (["torchrun", "train_gpt2.py"], {"TORCHELASTIC_RUN_ID": "1", "PET_SHUTDOWN_TIMEOUT": "120"}, 120),
    (["torchrun", "train_gpt2.py"], {"TORCHELASTIC_RUN_ID": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}, 60),
    (["torchrun", "--signals-to-handle", "SIGINT", "train_gpt2.py"], {"TORCHELASTIC_RUN_ID": "1"}, None),
    (["torchrun", "train_gpt2.py"], {"TORCHELASTIC_RUN_ID": "1", "PET_SIGNALS_TO_HANDLE": "SIGINT",
                                     "SLURM_JOB_ID": "7"}, 30),  # train_gpt2.sbatch's torchrun: SLURM's KillWait
])
def test_the_grace_a_launcher_gives_a_stop(argv, env, grace):
    got = common.stop_grace(env, argv)
    assert (got and got[0]) == grace


def test_a_checkpoint_that_may_outlast_the_launchers_grace_is_said():
    """GPT-2 XL's checkpoint (weights and AdamW's moments, ~18.7 GB) under a plain torchrun: the estimate says so
    (naming --shutdown-timeout), 124M's (~1.5 GB) does not; a checkpoint measured at over half the grace does."""
    grace = common.stop_grace({"TORCHELASTIC_RUN_ID": "1"}, ["torchrun", "train_gpt2.py"])
    xl, small = 12 * 1_557_611_200, 12 * 124_475_904
    said = common.stop_grace_warning(xl, grace)
    assert said.startswith("a stop's checkpoint (~18.7 GB, ~75 s at 250 MB/s) may not be written within the 30 s "
                           "torchrun waits after passing a SIGTERM on: give torchrun a longer --shutdown-timeout"), said
    assert common.stop_grace_warning(small, grace) is None and common.stop_grace_warning(xl, None) is None
    assert common.stop_grace_warning(None, grace, seconds=14.0) is None
    assert common.stop_grace_warning(None, grace, seconds=16.0).startswith("this checkpoint took 16 s: a stop")


def test_the_header_and_a_checkpoint_say_when_a_stop_may_outlast_the_grace(data_dir, tmp_path, monkeypatch):
    """Under a torchrun whose grace is shorter than any checkpoint (PET_SHUTDOWN_TIMEOUT, as torchrun reads it): the
    header says the estimate, the first checkpoint its measured time, once."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "grace")
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "0.000001")
    out = run(tiny(data_dir=data_dir, log_dir=str(tmp_path / "log"), max_steps=4, checkpoint_every=2)).stdout
    header = [line for line in out.splitlines() if line.startswith("warning: a stop's checkpoint (~0.0 GB")]
    measured = [line for line in out.splitlines() if line.startswith("warning: this checkpoint took ")]
    assert len(header) == 1 and "within the 1e-06 s torchrun waits" in header[0], out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("checkpoint "))
    written = records(str(tmp_path / "log"), "checkpoint")
    assert [r["step"] for r in written] == [2, 4] and all(0 < r["seconds"] < 60 for r in written)
    assert re.fullmatch(r"checkpoint \S+ckpt_000002\.pt \(0\.\d\d GB in \d+\.\d s\)", lines[first]), lines[first]
    assert len(measured) == 1 and lines[first + 1] == measured[0], out


def test_a_ddp_run_with_samples_due_finishes(data_dir, tmp_path):
    """Rank 0 alone draws the samples under DDP: the ranks meet after each round of them (else rank 1's next
    collective pairs with another of rank 0's, and the run hangs until --dist-timeout), and the run finishes."""
    log_dir = str(tmp_path / "log")
    code, out = torchrun_output(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=4, sample_every=2, num_samples=1,
                                     sample_tokens=4, dist_timeout=2))
    assert code == 0, out[-3000:]
    assert [r["step"] for r in records(log_dir, "sample")] == [2, 3] and records(log_dir, "end")[-1]["reason"] == \
        "finished"


def test_under_torchrun_an_error_every_rank_meets_is_said_once(data_dir, tmp_path):
    """A bad flag (argparse's error, before the process group), flags that contradict each other and a bad
    --init-from (every rank meets them): the group says the error once, without a rank; each rank exits 2 with that
    line as its error record, which torchrun's summary shows as the root cause in place of our traceback."""
    bad_flag = tiny(data_dir=data_dir, log_dir=str(tmp_path / "a")) + ["--max-steps", "ten"]
    bad_batch = tiny(data_dir=data_dir, log_dir=str(tmp_path / "a"), total_batch_size=1000)
    missing = str(tmp_path / "no-such-model")
    bad_model = tiny(data_dir=data_dir, log_dir=str(tmp_path / "b"), init_from=missing, n_layer=None, n_head=None,
                     n_embd=None)
    for args, said in ((bad_flag, "error: argument --max-steps: invalid int value: 'ten' (see --help)"),
                       (bad_batch, "error: --total-batch-size 1000 is not a multiple of --block-size 32"),
                       (bad_model, f"error: model {missing!r} not found: pass a checkpoint file, a log directory, "
                                   "a Hugging Face directory, or a name such as gpt2")):
        code, out = torchrun_output(args)
        assert code != 0 and said_lines(out) == [said], out[-3000:]
        summary = out.split("Failures:")[1]  # torchrun's own: each rank's exit status and error record
        assert summary.count("exitcode  : 2 ") == 2 and summary.count(f"traceback : {said}\n") == 2, out[-3000:]
        assert "common.UserError" not in out and 'File "' + TRAIN not in out, out[-3000:]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def bad_token_said(data, rank, token):
    return (f"rank {rank}: error: token id {token} in the train data of {data} is >= the model's vocab_size 50257: "
            "the shards were made with another tokenizer; re-create them with python fineweb.py")


def test_under_torchrun_errors_two_ranks_meet_differently_are_each_said_with_its_rank(tmp_path):
    """Each rank finds another bad token id in its own rows: each says its own error, once, with its rank."""
    data = runs.write_shards(str(tmp_path / "data"))
    first = os.path.join(data, "tiny_train_000001.npy")
    tokens = np.load(first)
    tokens[10], tokens[74] = 61000, 60000  # rank 0's first rows are tokens 0-64, rank 1's 64-128
    np.save(first, tokens)
    code, out = torchrun_output(tiny(data_dir=data, log_dir=str(tmp_path / "log"), eval_every=0, max_steps=4))
    assert code != 0 and sorted(said_lines(out)) == [bad_token_said(data, 0, 61000), bad_token_said(data, 1, 60000)], \
        out[-3000:]


def test_under_torchrun_an_error_one_rank_meets_is_said_once_with_its_rank(tmp_path):
    """A token id beyond the vocabulary in the part of a shard only rank 1 reads (shards without a manifest are
    checked batch by batch): rank 1 says it once, with its rank, and stays a moment to hear whether others met it;
    rank 0, whose collective broke when rank 1 left, says so in one line rather than a traceback; torchrun names
    rank 1's error as the root cause."""
    data = runs.write_shards(str(tmp_path / "data"))
    first = os.path.join(data, "tiny_train_000001.npy")
    tokens = np.load(first)
    tokens[74] = 60000  # rank 1's first rows are sequences 2 and 3 of 32 tokens: tokens 64-128 (rank 0's end at 64)
    np.save(first, tokens)
    code, out = torchrun_output(tiny(data_dir=data, log_dir=str(tmp_path / "log"), eval_every=0, max_steps=4))
    said = said_lines(out)
    assert code != 0 and len(said) == 2, out[-3000:]
    assert said[0] == bad_token_said(data, 1, 60000)
    assert said[1].startswith("rank 0: stopped, another rank failed (")
    assert "Traceback" not in out.split(" failed (exitcode: ")[0], out[-3000:]  # before torchrun's own summary
    root = out.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 2" in root, out[-3000:]


def hellaswag_items(path, n):
    """n HellaSwag items in the official format."""
    path.write_text("".join(json.dumps({"ctx": f"The cat sees item {i}.", "endings": ["A.", "It runs.", "B c.", "D."],
                                        "label": i % 4}) + "\n" for i in range(n)))
    return str(path)


def test_fsdp_in_bf16_compiled_evaluates_samples_resumes_and_exports(data_dir, tmp_path):
    """FSDP with the 16-bit policy GPUs use (bf16 parameters in forward and backward, fp32 master
    shards), compiled block by block (aot_eager), through every phase of a run: training, validation,
    HellaSwag and samples, a sample right after a training step with no evaluation before it (where
    the sharded weights are fp32 and the forward bf16), a SIGTERM, a resume with --resume alone and
    the export. Evaluation compiles nothing once the first one has run (HellaSwag and samples run
    uncompiled), and the resumed run ends bit-identical to the one that never stopped."""
    base = tiny(data_dir=data_dir, max_steps=6, fsdp=True, dtype="bfloat16", compile=True, eval_every=4,
                hellaswag_every=4, hellaswag_file=hellaswag_items(tmp_path / "hs.jsonl", 5), sample_every=3,
                num_samples=1, sample_tokens=4, checkpoint_every=0, export_hf=True, core_every=4,
                core_bundle=write_bundle(tmp_path / "bundle"), core_limit=3)
    launch = [runs.python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", FAULT_TRAINER]
    env = dict(ENV, COMPILE_BACKEND="aot_eager", COMPILE_LOG=str(tmp_path / "compiles"))

    def trainer(args, **extra):
        p = subprocess.run(launch + args, capture_output=True, text=True, env=dict(env, **extra), timeout=900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout

    whole = str(tmp_path / "whole")
    out = trainer(base + ["--log-dir", whole])
    assert "dtype bfloat16" in out and "compile on" in out
    assert [r["step"] for r in records(whole, "sample")] == [3, 5]
    assert [r["step"] for r in records(whole, "hellaswag")] == [0, 4, 5]
    assert [r["step"] for r in records(whole, "core")] == [0, 4, 5]  # on both ranks, uncompiled, in step
    for rank in (0, 1):
        with open(tmp_path / f"compiles.rank{rank}") as f:
            compiled = [json.loads(line) for line in f]
        assert [c["step"] for c in compiled] == list(range(6))
        assert all(c["graphs"] == 0 for c in compiled[1:]), compiled  # nothing new after the first
    stopped = str(tmp_path / "stopped")
    trainer(base + ["--log-dir", stopped], FAULT="term:0:4")
    assert checkpoint.step_of(checkpoint.list_checkpoints(stopped)[-1]) == 5
    trainer(["--log-dir", stopped, "--resume"])
    assert [r["loss"] for r in records(stopped, "train")] == [r["loss"] for r in records(whole, "train")]
    _, model_a, optim_a = final_state(whole)
    _, model_b, optim_b = final_state(stopped)
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    assert all(torch.equal(optim_a["state"][i]["exp_avg"], optim_b["state"][i]["exp_avg"]) for i in optim_a["state"])
    exported, _ = checkpoint.load_model(os.path.join(stopped, "hf"))
    model, _ = checkpoint.load_model(stopped)
    idx = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert torch.equal(exported(idx)[0][..., :50257], model(idx)[0][..., :50257])


def test_muon_accumulates_and_resumes_exactly(data_dir, tmp_path):
    """--optimizer muon through the trainer: micro-batches of 2 with accumulation equal one batch of
    4; a kill -9 mid-run, resumed with --resume alone, ends bit-identical to the run that never
    stopped (Muon's momentum is in the checkpoint). Two processes equal one: test_parallel.py."""
    base = tiny(data_dir=data_dir, max_steps=6, optimizer="muon", eval_every=0, checkpoint_every=3)
    accum = str(tmp_path / "accum")
    p = run(base + ["--log-dir", accum])  # micro-batch 2, accumulation 2
    assert "Muon 0.02 on the block matrices" in p.stdout and "Muon+AdamW" in p.stdout
    whole = str(tmp_path / "whole")
    run(tiny(data_dir=data_dir, max_steps=6, optimizer="muon", eval_every=0, checkpoint_every=3,
             micro_batch_size=4, log_dir=whole))
    ref = records(accum, "train")
    got = records(whole, "train")  # the same gradients summed in another order; Newton-Schulz runs in bf16,
    # which magnifies that rounding in the update (1e-4 in the norms here)
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
    args = tiny(data_dir=data_dir, max_steps=3, eval_every=0)
    run(args + ["--log-dir", str(tmp_path / "plain")])
    run(args + ["--log-dir", str(tmp_path / "ckpt"), "--activation-checkpointing"])
    assert [r["loss"] for r in records(str(tmp_path / "ckpt"), "train")] == \
        [r["loss"] for r in records(str(tmp_path / "plain"), "train")]


def test_two_node_torchrun_on_loopback_matches_one_process(data_dir, tmp_path, free_port, one_process):
    """Two nodes of one process each (DDP over gloo, rendezvous on loopback): one run of world size
    2 without accumulation, whose steps and validations are one process's to float rounding."""
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=4, eval_every=2)
    nodes = [torchrun(["--nnodes=2", f"--node_rank={r}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                       f"--master_port={free_port}"], args) for r in range(2)]
    outs = [n.communicate(timeout=900)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    header = records(log_dir, "run")[0]
    assert header["world_size"] == 2 and header["grad_accum"] == 1
    assert_same_training(one_process, log_dir)


def test_a_closed_stdout_does_not_end_the_run(data_dir, tmp_path):
    """python train_gpt2.py ... | head -2: the reader closes the pipe after two lines; the run goes
    on to its end and its checkpoint, with every line in log.txt."""
    fcntl = pytest.importorskip("fcntl")
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        pytest.skip("the pipe's size cannot be set on this system")
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=24, timing_breakdown=1)
    read_end, write_end = os.pipe()
    # a pipe of one page, which the run's output outgrows: the trainer writes into it after the
    # reader has gone, however fast or slow either side runs
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen([sys.executable, TRAIN] + args, stdout=write_end, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        head = reader.readline() + reader.readline()
    err = proc.communicate(timeout=900)[1]
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert head.startswith("run: new run")
    assert err.count("stdout was closed") == 1
    assert checkpoint.load_file(checkpoint.list_checkpoints(log_dir)[-1])["step"] == 24
    with open(os.path.join(log_dir, "log.txt")) as f:
        text = f.read()
    assert len(text) > 4096 + len(head)  # more than the pipe held
    steps = [int(l.split("|")[0].split()[1]) for l in text.splitlines() if l.startswith("step ") and "| loss" in l]
    assert steps == list(range(24))


def diverging(data_dir, log_dir, **overrides):
    """A run whose learning rate (1e30) makes the loss non-finite within a few steps."""
    settings = {**dict(max_steps=6, warmup_steps=0, max_lr="1e30", eval_every=0), **overrides}
    return run(tiny(data_dir=data_dir, log_dir=log_dir, **settings), check=False)


def test_nonfinite_loss_stops_and_keeps_last_checkpoint(data_dir, tmp_path):
    log_dir = str(tmp_path / "log")
    p = diverging(data_dir, log_dir, max_steps=12, checkpoint_every=1)
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    assert "non-finite; stopping" in p.stdout and "Traceback" not in p.stderr
    assert (f"The last good checkpoint is {checkpoint.list_checkpoints(log_dir)[-1]}: resume from it with a lower "
            "--max-lr, or pass --on-nonfinite skip") in p.stdout  # AdamW: no --muon-lr
    end = records(log_dir, "end")[-1]
    assert end["reason"] == "nonfinite"
    step, model, _ = final_state(log_dir)
    assert step <= end["step"]
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())


def test_on_nonfinite_skip_carries_on_and_muon_skips_both_optimizers(data_dir, tmp_path):
    """With --on-nonfinite skip the run carries on to the end; under Muon a skipped step updates
    neither optimizer, and the weights stay finite."""
    p = diverging(data_dir, str(tmp_path / "adamw"), on_nonfinite="skip")
    assert p.returncode == 0 and "skipped (non-finite)" in p.stdout
    log_dir = str(tmp_path / "muon")
    p = diverging(data_dir, log_dir, on_nonfinite="skip", optimizer="muon")
    assert p.returncode == 0 and "skipped (non-finite)" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    _, model, _ = final_state(log_dir)
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())


def test_nonfinite_stop_under_muon_before_any_checkpoint_names_both_rates(data_dir, tmp_path):
    """No checkpoint yet: both rates named, and no checkpoint to resume from."""
    log_dir = str(tmp_path / "log")
    p = diverging(data_dir, log_dir, optimizer="muon")
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    assert ("non-finite; stopping. No checkpoint was written yet: start the run again (--resume) with a lower "
            "--max-lr or --muon-lr, or pass --on-nonfinite skip") in p.stdout
    assert "none" not in p.stdout.split("non-finite; stopping")[1] and checkpoint.list_checkpoints(log_dir) == []


def test_the_allocators_error_mid_run_is_one_line_an_end_record_and_keeps_the_checkpoints(data_dir, tmp_path,
                                                                                           monkeypatch):
    """A micro-batch too large for the GPU ran out of memory on an H100 with a 40-line traceback. The allocator's
    error (what PyTorch raises when cudaMalloc fails, raised by the step here) is one line that names the device and
    the micro-batch and what to change, exit status 2, an end record at the last step that ran, the checkpoints
    kept."""
    import train_gpt2
    real_step, calls = train_gpt2.train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB of which 4.32 GiB is free.")
        return real_step(*args, **kwargs)
    monkeypatch.setattr(train_gpt2, "train_step", step)
    log_dir = str(tmp_path / "log")
    p = run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=8, checkpoint_every=2), check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith("error: out of CPU memory at a micro-batch of 2 x 32 tokens (CUDA out of memory. "
                               "Tried to allocate 6.00 GiB") and "--micro-batch-size" in p.stderr
    assert [checkpoint.step_of(c) for c in checkpoint.list_checkpoints(log_dir)] == [2, 4]
    assert records(log_dir, "end") == [dict(records(log_dir, "end")[0], step=3, reason="out_of_memory")]


def test_running_out_of_cpu_memory_is_one_line_naming_the_cpu(data_dir, tmp_path):
    """The CPU's allocator, out of memory (the process's address space capped as `ulimit -v` caps it), says
    "DefaultCPUAllocator: can't allocate memory" in a RuntimeError, which was a 38-line traceback and exit 1: now one
    line naming the CPU and the micro-batch, exit status 2, the end record, the checkpoint kept. A run checkpointed
    at micro-batch 8 resumes with 256 x 32 tokens, whose logits and their masked copy (1.6 GB each in fp32) pass a
    3 GB cap whatever the rest of the process takes."""
    import resource
    log_dir = str(tmp_path / "log")
    shape = dict(data_dir=data_dir, log_dir=log_dir, total_batch_size=256 * 32, eval_every=0)
    run_process(tiny(**shape, micro_batch_size=8, max_steps=1, warmup_steps=0))
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (3 * 10 ** 9, 3 * 10 ** 9))  # noqa: E731
    p = run_process(["--log-dir", log_dir, "--resume", "--micro-batch-size", "256", "--max-steps", "3"], check=False,
                    preexec_fn=cap, cold=True)  # the cap is this process's own
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-3000:]
    assert p.stderr.startswith("error: out of CPU memory at a micro-batch of 256 x 32 tokens ([enforce fail at "
                               "alloc_cpu.cpp") and "--micro-batch-size" in p.stderr and "(auto fits" not in p.stderr
    launches = metrics.read_metrics(log_dir)["launches"]  # the resumed launch ended at the step before its first
    assert [(launch["end"]["step"], launch["end"]["reason"]) for launch in launches] == [(1, "finished"),
                                                                                         (0, "out_of_memory")]
    assert [checkpoint.step_of(c) for c in checkpoint.list_checkpoints(log_dir)] == [1]


def test_float16_stops_on_a_nonfinite_loss(data_dir, tmp_path, monkeypatch, capsys, train_in_process):
    """A T4 has no bf16, so the run trains in fp16 with a gradient scaler, which skips the steps whose
    gradients overflow: those are normal. A loss that is not finite is divergence, and the run stops
    on it as a bf16 or fp32 run does (exit 3, its end record says why) instead of logging skipped
    steps to the end and exporting the stuck weights. fp16 is faked on the CPU: autocast and
    GradScaler both run there."""
    import device
    monkeypatch.setattr(device, "pick_dtype", lambda requested, dev: "float16")
    log_dir = str(tmp_path / "log")
    status = train_in_process(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=12, warmup_steps=0, max_lr="1e30",
                                   eval_every=0, export_hf=True))
    out = capsys.readouterr().out
    assert "dtype float16" in out
    stop = [line for line in out.splitlines() if "non-finite; stopping" in line]
    assert status == 3 and len(stop) == 1, out[-2000:]
    assert not math.isfinite(float(stop[0].split("| loss ")[1].split(" |")[0]))  # the forward loss itself
    assert records(log_dir, "end")[-1]["reason"] == "nonfinite" and not os.path.exists(os.path.join(log_dir, "hf"))
    # every step logged before the stop either trained or was an overflow the scaler skipped
    for line in out.splitlines():
        if line.startswith("step ") and "| loss " in line and "skipped" in line:
            assert line.endswith("skipped (float16 gradient overflow: the loss scale is lowered)"), line


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_only_an_fp16_run_scales_its_loss(dtype, data_dir, tmp_path, monkeypatch, train_in_process):
    """fp16's gradients need a loss scale (small ones flush to zero); bf16 and fp32 have the exponent range and
    none. What the checkpoint holds says which ran: a scale for fp16, nothing for the others. fp16 is faked on the
    CPU as above; bf16 autocast runs there."""
    import device
    if dtype == "float16":
        monkeypatch.setattr(device, "pick_dtype", lambda requested, dev: "float16")
    log_dir = str(tmp_path / "log")
    args = tiny(data_dir=data_dir, log_dir=log_dir, max_steps=2, eval_every=0, dtype=None if dtype == "float16"
                else dtype)
    assert train_in_process(args) == 0
    scaler = checkpoint.load_file(checkpoint.list_checkpoints(log_dir)[-1])["scaler"]
    assert ("scale" in scaler) == (dtype == "float16"), scaler


def infinite_gradient_at(monkeypatch, step, grad_accum=2):
    """A fault: in optimizer step `step` (its first micro-step) the tied embedding's gradient holds an inf while the
    loss stays finite, as an overflow in the backward pass leaves it."""
    import parallel
    real, backwards = parallel.wrap_model, []

    def wrap(raw_model, *args, **kwargs):
        def hook(grad):
            backwards.append(1)
            at = len(backwards) - 1 == step * grad_accum
            return grad.index_fill(0, torch.tensor([0]), float("inf")) if at else grad
        raw_model.transformer.wte.weight.register_hook(hook)
        return real(raw_model, *args, **kwargs)
    monkeypatch.setattr(parallel, "wrap_model", wrap)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_finite_loss_with_an_infinite_gradient(dtype, data_dir, tmp_path, monkeypatch, capsys, train_in_process):
    """fp16: an overflow in the gradients with a finite loss is what the loss scale is for: the step is skipped,
    logged as an overflow, and the run goes on to its end. bf16 and fp32 have no scale to lower: a non-finite
    gradient norm there is divergence, and the run stops with exit status 3 at that step."""
    import device
    if dtype == "float16":
        monkeypatch.setattr(device, "pick_dtype", lambda requested, dev: "float16")
    infinite_gradient_at(monkeypatch, step=2)
    log_dir = str(tmp_path / "log")
    status = train_in_process(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=5, eval_every=0,
                                   dtype=None if dtype == "float16" else dtype))
    out = capsys.readouterr().out
    step2 = next(line for line in out.splitlines() if re.match(r"step +2 \| loss", line))
    assert math.isfinite(float(step2.split("| loss ")[1].split(" |")[0])), step2
    if dtype == "float16":
        assert status == 0 and step2.endswith("skipped (float16 gradient overflow: the loss scale is lowered)")
        assert [r["step"] for r in records(log_dir, "train")] == [0, 1, 2, 3, 4]
        assert records(log_dir, "end")[-1]["reason"] == "finished"
        return
    assert status == 3 and "non-finite; stopping" in step2 and "grad_norm inf" in step2, step2
    assert records(log_dir, "end")[-1] == dict(records(log_dir, "end")[-1], step=2, reason="nonfinite")
    assert [r["step"] for r in records(log_dir, "train")] == [0, 1]


def test_float16_resumes_with_the_loss_scale_of_its_checkpoint(data_dir, tmp_path, monkeypatch, train_in_process):
    """A resumed fp16 run trains on with the gradient scaler's scale and growth count that its
    checkpoint saved, not a fresh scaler's. fp16 is faked on the CPU as above."""
    import device
    import train_gpt2
    monkeypatch.setattr(device, "pick_dtype", lambda requested, dev: "float16")
    log_dir = str(tmp_path / "log")
    assert train_in_process(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=3, eval_every=0)) == 0
    saved = checkpoint.load_file(checkpoint.list_checkpoints(log_dir)[-1])["scaler"]
    assert saved != torch.amp.GradScaler("cpu").state_dict()
    first_step = []
    real = train_gpt2.train_step
    monkeypatch.setattr(train_gpt2, "train_step", lambda parts, *a, **kw: (
        first_step.append(parts.scaler.state_dict()), real(parts, *a, **kw))[1])
    assert train_in_process(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=4, eval_every=0, resume=True)) == 0
    assert first_step[0] == saved


def test_samples_from_an_empty_or_special_prompt_and_a_failure_that_does_not_end_the_run(
        data_dir, tmp_path, monkeypatch, capsys, train_in_process):
    """The trainer's samples start from the prompt as sample.py does: an empty one is <|endoftext|>
    (not shown), which a prompt may also name. And whatever goes wrong while sampling is one line
    in the log, never the end of the run (with the defaults, up to 250 steps since the last
    checkpoint would be lost)."""
    import model
    base = tiny(data_dir=data_dir, max_steps=2, eval_every=0, sample_every=1, num_samples=2, sample_tokens=4)
    for i, prompt in enumerate(["", "<|endoftext|>Once upon a time"]):
        assert train_in_process(base + ["--log-dir", str(tmp_path / f"log{i}"), "--sample-prompt", prompt]) == 0
        with open(tmp_path / f"log{i}" / "metrics.jsonl") as f:
            samples = [r for r in map(json.loads, f) if r["kind"] == "sample"]
        assert [(r["step"], r["index"]) for r in samples] == [(1, 0), (1, 1)]
        assert all(r["text"].startswith(prompt) and len(r["text"]) > len(prompt) for r in samples)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        yield
    monkeypatch.setattr(model.GPT, "generate_stream", broken)
    capsys.readouterr()
    assert train_in_process(base + ["--log-dir", str(tmp_path / "broken")]) == 0
    out = capsys.readouterr().out
    assert ("step 1 | samples failed, training goes on (RuntimeError: CUDA error: an illegal memory access was "
            "encountered)") in out
    assert records(str(tmp_path / "broken"), "end")[-1]["reason"] == "finished"


@pytest.fixture(scope="module")
def bad_input_setup(data_dir, tmp_path_factory, reference_run):
    base = tmp_path_factory.mktemp("bad")
    junk = base / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint")
    notes = base / "notes.txt"  # a text file: its first letter is the unpickler's float opcode
    notes.write_text("For the record, these are notes.\n")
    good = checkpoint.list_checkpoints(reference_run)[-1]
    truncated = base / "ckpt_000009.pt"
    with open(good, "rb") as f:
        truncated.write_bytes(f.read()[:2000])
    malformed = base / "hs_malformed.jsonl"
    malformed.write_text('{"ctx": "A cat", "endings": ["sat.", "ran.", "is.", "a."], "label": 0}\n{oops\n')
    misfit = base / "misfit.pt"  # a config with more positions than its weights
    ckpt = checkpoint.load_file(good)
    ckpt["model_config"]["block_size"] = 64
    checkpoint.save_file(str(misfit), ckpt)
    hf_dir = base / "hf"
    from model import GPT, GPTConfig
    export.write_hf(GPT(GPTConfig(block_size=32, n_layer=1, n_head=1, n_embd=16)), str(hf_dir))
    return dict(base=str(base), junk=str(junk), truncated=str(truncated), hf=str(hf_dir),
                malformed=str(malformed), notes=str(notes), misfit=str(misfit), data=data_dir, ref=reference_run)


BAD = {
    "missing data dir": (["--data-dir", "{base}/nope"], "nope"),
    "empty data dir": (["--data-dir", "{base}"], "fineweb.py"),
    "batch not a multiple of block": (["--total-batch-size", "100"], "multiple"),
    "batch not divisible": (["--total-batch-size", "96"], "not divisible"),
    "block size too large for init-from": (["--init-from", "{hf}", "--block-size", "64"], "block-size"),
    "resume path missing": (["--resume", "{base}/ckpt_000123.pt"], "no such file"),
    "resume not a checkpoint": (["--resume", "{junk}"], "{junk} is not a checkpoint: not a torch zip or pickle file"),
    "resume weights that do not fit the config": (["--resume", "{misfit}", "--max-steps", "12"],
                                                  "{misfit} does not hold the model its config describes: "
                                                  "transformer.wpe.weight has shape (32, 32) there, (64, 32) in "
                                                  "the model"),
    "init from weights that do not fit the config": (["--init-from", "{misfit}"], "transformer.wpe.weight has shape"),
    "resume a text file": (["--resume", "{notes}"], "{notes} is not a checkpoint: not a torch zip or pickle file"),
    "init from a text file": (["--init-from", "{notes}"], "{notes} is not a checkpoint: not a torch zip or pickle"),
    "resume truncated checkpoint": (["--resume", "{truncated}"], "truncated"),
    "unknown device": (["--device", "tpu"], "unknown device"),
    "existing run without --resume": (["--log-dir", "{ref}"], "--resume"),
    "resume with another shape": (["--log-dir", "{ref}", "--resume", "--n-layer", "3"], "--n-layer 2 and this"),
    "resume with another preset": (["--log-dir", "{ref}", "--resume", "--model", "gpt2-medium"], "--model gpt2 and"),
    "resume with another seed": (["--log-dir", "{ref}", "--resume", "--seed", "7"], "--seed 1337 and this"),
    "resume with another batch": (["--log-dir", "{ref}", "--resume", "--total-batch-size", "256"],
                                  "--total-batch-size 128"),
    "resume with a shuffle seed": (["--log-dir", "{ref}", "--resume", "--shuffle-seed", "3"],
                                   "the run was trained without --shuffle-seed and this command asks for "
                                   "--shuffle-seed 3"),
    "resume with another optimizer": (["--log-dir", "{ref}", "--resume", "--optimizer", "muon"],
                                      "--optimizer adamw and this command asks for --optimizer muon"),
    "zero muon lr": (["--optimizer", "muon", "--muon-lr", "0"], "--muon-lr must be a positive number"),
    "muon lr without muon": (["--muon-lr", "0.01"], "--muon-lr is a setting of --optimizer muon"),
    "muon momentum on an adamw resume": (["--log-dir", "{ref}", "--resume", "--muon-momentum", "0.9"],
                                         "this run uses adamw"),
    "shape with init-from": (["--init-from", "{hf}", "--n-embd", "64"], "--n-embd has no effect with --init-from"),
    "muon momentum of 1": (["--optimizer", "muon", "--muon-momentum", "1"], "--muon-momentum must be at least 0"),
    "bad micro-batch": (["--micro-batch-size", "lots"], "micro-batch-size"),
    "hellaswag file missing": (["--hellaswag-every", "1", "--hellaswag-file", "{base}/hs.jsonl"], "hellaswag-file"),
    "hellaswag file malformed": (["--hellaswag-every", "1", "--hellaswag-file", "{malformed}"],
                                 "--hellaswag-file: {malformed} line 2: malformed HellaSwag line, not JSON"),
    "log dir is a file": (["--log-dir", "{junk}"], "is a file"),
    "log dir under a file": (["--log-dir", "{junk}/run1"], "cannot be made"),
    "empty log dir": (["--log-dir", ""], "--log-dir is empty"),
    "resume with a larger block size": (["--log-dir", "{ref}", "--resume", "--block-size", "64"],
                                        "--block-size 32 and"),
    "negative warm-up": (["--warmup-steps", "-1"], "warmup-steps"),
    "nccl on a cpu": (["--dist-backend", "nccl"], "--dist-backend nccl runs on CUDA GPUs"),
    "zero dist timeout": (["--dist-timeout", "0"], "dist-timeout"),
    "beta1 above 1": (["--beta1", "2"], "--beta1 must be at least 0 and below 1"),
    "beta2 not a number": (["--beta2", "nan"], "--beta2 must be"),
    "negative eps": (["--eps", "-1"], "--eps must be a positive number"),
    "zero width": (["--n-embd", "0"], "--n-embd must be at least 1"),
    "zero layers": (["--n-layer", "0"], "--n-layer must be at least 1"),
    "zero context": (["--block-size", "0"], "--block-size must be at least 1"),
    "zero core limit": (["--core-limit", "0"], "--core-limit must be at least 1"),
    "negative grad clip": (["--grad-clip", "-1"], "--grad-clip must be 0 or more"),
    "negative weight decay": (["--weight-decay", "-0.1"], "--weight-decay must be 0 or more"),
    "infinite max lr": (["--max-lr", "inf"], "--max-lr must be a positive number"),
    "warm-up longer than the run": (["--warmup-steps", "5"], "--warmup-steps 5 is more than --max-steps 2"),
    "zero hellaswag limit": (["--hellaswag-limit", "0"], "--hellaswag-limit must be at least 1"),
    # of two bad flags, the same one is refused wherever the rooms declare them: by range, then in --help's order
    "two bad ranges": (["--seed", "-1", "--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    "two bad ranges of two rooms": (["--warmup-steps", "-1", "--val-tokens", "0"], "--val-tokens must be at least 1"),
    # and the checks between flags that were the trainer's own (the model's, the profiler's) before the other rooms'
    "profile steps past a short run with a long warm-up": (["--warmup-steps", "50", "--profile-steps", "20:30"],
                                                           "--profile-steps 20:30 ends after the run's last step"),
    "negative shuffle seed": (["--shuffle-seed", "-1"], "--shuffle-seed must be 0 or more"),
    "unknown flag": (["--learning-rate", "3e-4"], "error: unrecognized arguments: --learning-rate 3e-4 (see --help)"),
    "bad choice": (["--optimizer", "sgd"], "error: argument --optimizer: invalid choice: 'sgd' (choose from 'adamw', "
                                           "'muon') (see --help)"),
    "not a number": (["--max-steps", "ten"], "error: argument --max-steps: invalid int value: 'ten' (see --help)"),
    "negative seed": (["--seed", "-1"], "--seed must be between 0 and 2**32-1"),
    "seed above 32 bits": (["--seed", str(2 ** 32)], "--seed must be between 0 and 2**32-1"),
    "fsdp and sharding none": (["--fsdp", "--sharding", "none"],
                               "error: --fsdp and --sharding none contradict each other: give one (see --help)"),
    "sharding none and fsdp": (["--sharding", "none", "--fsdp"],
                               "error: --sharding none and --fsdp contradict each other: give one (see --help)"),
    "data dir is a corpus file": (["--data-dir", "{notes}"], "data directory {notes} is a file, not a directory of "
                                  "shards: tokenize it with python fineweb.py --data-files {notes} --out-dir NEW_DIR, "
                                  "and train with --data-dir NEW_DIR"),
    "init from a missing path beside a shape flag": (["--init-from", "{base}/nonexistent", "--n-layer", "2"],
                                                     "error: model '{base}/nonexistent' not found: pass a checkpoint"),
    "init from a checkpoint's name that is not here": (["--init-from", "ckpt_000123.pt"],
                                                        "error: model 'ckpt_000123.pt' not found: pass a checkpoint"),
    "init from a relative path that is not here": (["--init-from", "runs/a.pt"],
                                                   "error: model 'runs/a.pt' not found: pass a checkpoint"),
    "init from a .jsonl beside a shape flag": (["--init-from", "{malformed}", "--n-layer", "2"],
                                               "error: {malformed} is not a checkpoint: not a torch zip or pickle"),
    "sample prompt longer than the context": (["--sample-prompt", "word " * 40],
                                              "--sample-prompt: the prompt is 41 tokens, longer than the model's "
                                              "context of 32: shorten it"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_clear_line(case, bad_input_setup, tmp_path):
    """Each case through the trainer's own exit path (common.run_main), in this process (a traceback
    fails the test there): a separate interpreter per case would spend ~2 s each importing torch,
    minutes for the table."""
    extra, expect = BAD[case]
    extra = [a.format(**bad_input_setup) for a in extra]
    expect = expect.format(**bad_input_setup)
    log_dir = str(tmp_path / "fresh")
    shape = {}
    if "--init-from" in extra:  # the architecture comes from there: no shape flags (refused, see BAD)
        shape = dict(n_layer=None, n_head=None, n_embd=None)
    before = run_files(bad_input_setup["ref"])
    p = run(tiny(data_dir=bad_input_setup["data"], log_dir=log_dir, max_steps=2, **shape) + extra, check=False)
    assert p.returncode == 2, p.stdout[-1000:] + p.stderr[-2000:]
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], p.stderr
    assert run_files(bad_input_setup["ref"]) == before  # nothing written over
    assert not os.path.exists(log_dir)  # and nothing left behind


def run_files(log_dir):
    """The shared reference run's files with their times, but what other workers' refused launches on it make and
    remove as they check it (the write test's directory, the trainer's lock): nothing of the run."""
    found = [f for f in os.listdir(log_dir) if not f.startswith(".write-test") and f != metrics.LOCK_FILE]
    return sorted((f, os.stat(os.path.join(log_dir, f)).st_mtime_ns) for f in found)


@pytest.mark.parametrize("flags", [["--sharding", "fsdp", "--fsdp"], ["--fsdp", "--sharding", "fsdp"],
                                   ["--fsdp", "--fsdp"], ["--sharding", "none", "--sharding", "none"]])
def test_flags_that_agree_are_accepted(data_dir, tmp_path, flags):
    """The same setting said twice, by two spellings or one: no contradiction to refuse."""
    args = train_config.parse_args(tiny(data_dir=data_dir, log_dir=str(tmp_path / "log")) + flags)
    assert args.sharding == ("none" if "none" in flags else "fsdp")


def test_what_a_launch_profiles_is_its_own_not_the_runs(data_dir, tmp_path):
    """--memory-snapshot and --profile-steps belong to the launch that names them: a resume that does not name them
    takes neither from the run's stored settings."""
    log_dir = str(tmp_path / "log")
    run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=2) + ["--profile-steps", "0:0"])
    path = checkpoint.list_checkpoints(log_dir)[-1]
    ckpt = checkpoint.load_file(path)
    assert ckpt["config"]["profile_steps"] in ([0, 0], (0, 0)) and ckpt["config"]["memory_snapshot"] is False
    ckpt["config"]["memory_snapshot"] = True  # as a launch on a GPU stores it (refused on this CPU)
    checkpoint.save_file(path, ckpt)
    run(["--log-dir", log_dir, "--resume", "--max-steps", "3"])  # on this CPU --memory-snapshot would be refused
    resumed = checkpoint.load_file(checkpoint.list_checkpoints(log_dir)[-1])["config"]
    assert resumed["memory_snapshot"] is False and resumed["profile_steps"] is None


@pytest.mark.parametrize("every, batch, tokens", [(4, 128, 128), (10, 1024, 2560), (250, 524288, 10485760)])
def test_the_default_val_tokens_are_at_most_a_quarter_of_those_trained_between_validations(data_dir, tmp_path, every,
                                                                                           batch, tokens):
    """--val-tokens left out: a quarter of the tokens trained between validations (validation costs about a tenth of
    the training, its forward only), at most 10,485,760 (20 of GPT-2's 524,288-token steps)."""
    args = tiny(data_dir=data_dir, log_dir=str(tmp_path / "log"), eval_every=every, total_batch_size=batch,
                val_tokens=None)
    assert train_config.resolve(train_config.parse_args(args))[0].val_tokens == tokens


def test_hellaswag_file_is_read_at_start_as_far_as_the_limit(tmp_path):
    """--hellaswag-file is read when the settings are resolved, before the run starts (evaluation.prepare), up
    to --hellaswag-limit: what lies past the items a run scores does not stop it."""
    hs = tmp_path / "hs.jsonl"
    hs.write_text('{"ctx": "A cat", "endings": ["sat.", "ran.", "is.", "a."], "label": 0}\nnot json\n')
    log_dir = str(tmp_path / "log")
    check = lambda argv: evaluation.prepare(train_config.resolve(train_config.parse_args(argv))[0])  # noqa: E731
    check(["--hellaswag-file", str(hs), "--hellaswag-limit", "1", "--log-dir", log_dir])
    with pytest.raises(train_config.UserError, match="line 2: malformed HellaSwag line"):
        check(["--hellaswag-file", str(hs), "--log-dir", log_dir])
    assert not os.path.exists(log_dir)


class FixedBatches:
    """The loader's part that train_step uses, handing out the given (x, y) micro-batches in order."""

    def __init__(self, batches):
        self.batches = iter(batches)

    def next_batch(self, timer=None):
        return next(self.batches)


def test_on_one_process_a_signal_during_the_update_stops_after_that_step(data_dir, tmp_path, monkeypatch,
                                                                        train_in_process):
    """A stop request that arrives during the optimizer's update, after the step's one sync read the flags: with no
    other rank to agree with, it counts for this step, which is the last (not the one after it)."""
    real, updates = torch.optim.AdamW.step, []

    def update(self, *args, **kwargs):
        updates.append(1)
        if len(updates) == 3:  # step 2's
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.AdamW, "step", update)
    log_dir = str(tmp_path / "log")
    assert train_in_process(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=8, eval_every=0)) == 0
    assert [r["step"] for r in records(log_dir, "train")] == [0, 1, 2]
    assert records(log_dir, "end")[-1]["reason"] == "signal"
    assert [checkpoint.step_of(c) for c in checkpoint.list_checkpoints(log_dir)] == [3]


def cosine_lr(step, peak, warmup=2, max_steps=5, floor=0.1):
    """Linear warm-up to peak, then cosine down to floor * peak at max_steps, as GPT-3's appendix B."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * floor + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (max_steps - warmup))) * peak * (1 - floor)


@pytest.mark.parametrize("optimizer,clip", [("adamw", 0.05), ("muon", 0.05), ("adamw", 0.0)])
def test_a_step_clips_the_mean_gradient_then_runs_torchs_optimizers_at_their_scheduled_rates(optimizer, clip,
                                                                                            one_thread):
    """Two optimizer steps of train_step (2 accumulation steps each) against torch's pieces by hand:
    the gradient of the whole batch's mean loss, clip_grad_norm_ (with --grad-clip 0, none: the unclipped
    gradient, of a norm the default clip of 1.0 would cut), then torch.optim.AdamW with weight
    decay on its 2-D weights only and, with Muon, torch.optim.Muon on the blocks' matrices, each at
    the cosine schedule of its own peak. Both sides make the same float32 operations in the same
    order on one thread, so they agree to the last bit on any machine; the tolerance is a margin."""
    import copy
    import optim
    import parallel
    import train_gpt2
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    if not clip:  # sharper logits: gradients the default clip would cut at both steps
        with torch.no_grad():
            model.transformer.wte.weight.mul_(10)
    ref = copy.deepcopy(model)
    peak, muon_peak, decay = 1e-2, 5e-2, 0.1
    muon = muon_peak if optimizer == "muon" else None
    opt = optim.configure(model, optim.Settings(decay, peak, muon_lr=muon))
    params = dict(ref.named_parameters())
    matrices = [p for n, p in params.items() if muon and n.startswith("transformer.h.") and p.dim() == 2]
    rest = [p for p in params.values() if not any(p is m for m in matrices)]
    ref_opts = [torch.optim.AdamW([{"params": [p for p in rest if p.dim() == 2], "weight_decay": decay},
                                   {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                  betas=(0.9, 0.95), eps=1e-8)]
    peaks = [peak]
    if muon:
        ref_opts.append(torch.optim.Muon(matrices, momentum=0.95, nesterov=True, weight_decay=0.0))
        peaks.append(muon_peak)
    schedule = optim.Schedule(warmup_steps=2, max_steps=5, min_lr_ratio=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in (0, 3):  # in the warm-up, then on the cosine
        micro = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(2)]
        opt.set_lrs(schedule, step, peak, muon)
        parts = train_gpt2.StepParts(model, opt, scaler, parallel.Ranks(), "float32", 2, grad_clip=clip)
        loss, norm, _, finite = train_gpt2.train_step(parts, FixedBatches(micro))

        whole_loss = ref(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))[1]
        whole_norm = torch.linalg.vector_norm(torch.stack(
            [g.norm() for g in torch.autograd.grad(whole_loss, list(params.values()))]))
        for x, y in micro:
            (ref(x, y)[1] / 2).backward()
        if clip:
            assert torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) > 2 * clip  # the clip changes the step
        else:  # the norm the default --grad-clip 1.0 would have cut
            assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])) > 1.5
        for o, p in zip(ref_opts, peaks):
            for group in o.param_groups:
                group["lr"] = cosine_lr(step, p)
            o.step()
            o.zero_grad()

        assert finite and loss == pytest.approx(whole_loss.item(), rel=1e-5)
        assert norm == pytest.approx(whole_norm.item(), rel=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p, params[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {n}: {m}")


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_an_fp16_overflow_in_one_optimizers_gradients_skips_every_optimizer(grad_clip, one_thread):
    """fp16 with Muon: an overflow in a gradient AdamW owns (the tied embedding, the usual place) makes the global
    norm inf. Muon's own gradients are finite, so stepping each optimizer on its own found_inf let Muon move along
    its momentum (its gradients clipped to 0) or, without clipping (inf/inf), turned its matrices into NaN, while
    the log said "skipped". No parameter may change, and the scale must come down. (GradScaler and fp16 autocast
    run on the CPU.)"""
    import optim
    import parallel
    import train_gpt2
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    opt = optim.configure(model, optim.Settings(0.1, 1e-2, muon_lr=5e-2), muon_dtype=torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)

    def step():
        micro = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(2)]
        parts = train_gpt2.StepParts(model, opt, scaler, parallel.Ranks(), "float16", 2, grad_clip)
        return train_gpt2.train_step(parts, FixedBatches(micro))
    assert step()[3]  # a normal step: Muon now has momentum
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale = scaler.get_scale()
    wte = model.transformer.wte.weight
    hook = wte.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    _, norm, _, finite = step()
    hook.remove()
    assert not finite and not math.isfinite(norm)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert scaler.get_scale() == scale / 2


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_launch_decays_the_matrices_only(optimizer, data_dir, tmp_path, monkeypatch, train_in_process):
    """The optimizer a real launch builds (not optim.configure called by hand): weight decay --weight-decay on
    the 2-D weights (matmuls and the tied embedding) and none on biases and LayerNorm gains, as GPT-3 and nanoGPT
    do; with Muon the blocks' matrices are Muon's, undecayed, and AdamW keeps the same split for the rest."""
    import train_gpt2
    seen = {}
    real_loop = train_gpt2.loop
    monkeypatch.setattr(train_gpt2, "loop", lambda run: seen.setdefault("run", run) and real_loop(run))
    assert train_in_process(tiny(data_dir=data_dir, log_dir=str(tmp_path / "log"), max_steps=2, eval_every=0,
                                 weight_decay=0.05, optimizer=optimizer)) == 0
    run = seen["run"]
    names = {p: n for n, p in run.raw_model.named_parameters()}
    decay = {}
    for opt in run.optimizer.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                decay[names[p]] = (type(opt).__name__, group["weight_decay"])
    assert sorted(decay) == sorted(names.values())  # every parameter once (the tied weight is one)
    for n, p in run.raw_model.named_parameters():
        muon = optimizer == "muon" and n.startswith("transformer.h.") and p.dim() == 2
        assert decay[n] == (("Muon", 0.0) if muon else ("AdamW", 0.05 if p.dim() >= 2 else 0.0)), n


def test_the_loop_steps_with_each_optimizers_scheduled_rate_and_the_grad_clip(data_dir, tmp_path, monkeypatch,
                                                                            train_in_process):
    """What the loop hands train_step: Muon's group at the schedule of --muon-lr, AdamW's two at that
    of --max-lr, and --grad-clip."""
    import train_gpt2
    seen = []
    real = train_gpt2.train_step

    def step(parts, *rest):
        seen.append(([(type(o).__name__, g["lr"]) for o in parts.optimizer.optimizers for g in o.param_groups],
                     parts.grad_clip))
        return real(parts, *rest)
    monkeypatch.setattr(train_gpt2, "train_step", step)
    assert train_in_process(tiny(data_dir=data_dir, log_dir=str(tmp_path / "log"), max_steps=4, warmup_steps=2,
                                 optimizer="muon", muon_lr=0.05, max_lr=0.01, min_lr_ratio=0.1, grad_clip=0.5,
                                 eval_every=0)) == 0
    assert seen == [([("Muon", pytest.approx(cosine_lr(s, 0.05, max_steps=4)))]
                     + [("AdamW", pytest.approx(cosine_lr(s, 0.01, max_steps=4)))] * 2, 0.5) for s in range(4)]


def test_lr_schedule():
    import train_gpt2
    args = train_config.parse_args([])
    assert args.max_steps == 19073 and args.warmup_steps == 715 and args.total_batch_size == 524288
    schedule = optim.schedule_of(args)
    lrs = [schedule.lr(s, args.max_lr) for s in range(args.max_steps)]
    assert lrs[0] == pytest.approx(6e-4 / 715) and lrs[714] == pytest.approx(6e-4)
    assert max(lrs) == pytest.approx(6e-4)
    assert lrs[-1] == pytest.approx(6e-5, rel=1e-3)  # cosine down to 10%
    assert all(a >= b for a, b in zip(lrs[715:], lrs[716:]))


def test_wsd_schedule_holds_the_peak_then_decays_linearly():
    import train_gpt2
    schedule = optim.Schedule(warmup_steps=10, max_steps=100, min_lr_ratio=0.1, shape="wsd")
    lrs = [schedule.lr(s, 2.0) for s in range(101)]
    assert lrs[:10] == [2.0 * (s + 1) / 10 for s in range(10)]  # the same warm-up as cosine
    assert set(lrs[9:81]) == {2.0}  # stable until the last 20% of the run
    assert lrs[90] == pytest.approx(1.1) and lrs[100] == pytest.approx(0.2)  # linear to min_lr_ratio * peak
    assert all(a > b for a, b in zip(lrs[80:100], lrs[81:101]))


def test_timing_breakdown_reports_phases(data_dir, tmp_path):
    log_dir = str(tmp_path / "log")
    p = run(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=4, timing_breakdown=2))
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
    assert optim.schedule_of(args).lr(5, args.max_lr) == pytest.approx(6e-4)
    assert train_config.parse_args(["--max-steps", "50", "--warmup-steps", "40"]).warmup_steps == 40  # as asked


def test_a_val_split_shorter_than_a_batch_is_validated(data_dir, tmp_path):
    """60 validation tokens hold one 32-token sequence but not a batch of 2: validation fills its short last batch,
    so the run validates that one sequence instead of refusing the split."""
    import shutil
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    val, = data.glob("*_val_*.npy")
    np.save(val, np.load(val)[:60])
    run(tiny(data_dir=str(data), log_dir=str(tmp_path / "log"), max_steps=2, eval_every=1))
    assert [r["step"] for r in records(str(tmp_path / "log"), "val")] == [0, 1]
    assert "val: 32 tokens (the whole split)" in (tmp_path / "log" / "log.txt").read_text()


def test_validation_covers_the_val_split_at_most_once(data_dir, tmp_path):
    import dataloader
    p = run(tiny(val_tokens=10 ** 9, warmup_steps=1, data_dir=data_dir, log_dir=str(tmp_path / "log"), max_steps=1))
    whole = dataloader.TokenLoader(data_dir, "val", 2, 32).num_sequences * 32  # every sequence of the split once
    assert f"val: {whole:,} tokens (the whole split)" in p.stdout
    assert len(records(str(tmp_path / "log"), "val")) == 1


def test_a_padded_validation_batch_compiles_no_graph_of_its_own(data_dir):
    """Validation's last batch, filled up to the micro-batch, has the loader batches' shape and
    strides: a compiled model compiles one graph for training and one for evaluation, however the
    two interleave (Dynamo would compile again for new strides, then mark them dynamic)."""
    import dataloader
    import parallel
    from model import GPT, GPTConfig
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32))
    compiled = torch.compile(model, backend=counting_backend)
    train = dataloader.TokenLoader(data_dir, "train", batch_size=2, seq_len=32)
    val = dataloader.TokenLoader(data_dir, "val", batch_size=2, seq_len=32)
    ranks, no_stop = parallel.Ranks(), lambda: False
    for _ in range(2):
        compiled.train()
        compiled(*train.next_batch())[1].backward()
        loss = evaluation.validation_loss(compiled, val, 3, ranks, "float32", no_stop)  # batches of 2, then 1 + 1
        assert math.isfinite(loss)
    assert len(graphs) == 2
    torch._dynamo.reset()


def test_validation_asks_the_ranks_about_a_stop_every_few_batches(data_dir, monkeypatch):
    """Each question about a stop request is a collective and a host-device sync: a validation of
    ten batches on each of two ranks asks before its first batch and every STOP_CHECK_EVERY batches,
    and a request that came before it still stops it at once."""
    import types
    import torch.distributed as tdist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import dataloader
    import parallel
    from model import GPT, GPTConfig
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        collectives = []
        real = tdist.all_reduce
        monkeypatch.setattr(tdist, "all_reduce", lambda t, *a, **k: collectives.append(t.numel()) or real(t, *a, **k))
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32))
        ranks, stop = parallel.Ranks(rank=0, world_size=2), types.SimpleNamespace(signal=None)
        val = dataloader.TokenLoader(data_dir, "val", batch_size=2, seq_len=32, ranks=ranks)
        loss = evaluation.validation_loss(model, val, 20, ranks, "float32", evaluation.stop_check(stop, ranks))
        assert math.isfinite(loss)
        asks = -(-10 // evaluation.STOP_CHECK_EVERY)
        assert evaluation.STOP_CHECK_EVERY > 1 and len(collectives) == asks + 1  # + the loss's own sum
        stop.signal = "SIGTERM"  # asked before the validation: it runs no batch at all
        batches, next_batch = [], val.next_batch
        monkeypatch.setattr(val, "next_batch", lambda *a, **k: batches.append(1) or next_batch(*a, **k))
        assert evaluation.validation_loss(model, val, 20, ranks, "float32", evaluation.stop_check(stop, ranks)) is None
        assert batches == []
    finally:
        tdist.destroy_process_group()
