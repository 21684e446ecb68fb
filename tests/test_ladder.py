"""bench/ladder.py on CPU with a tiny model: rungs are cumulative, rungs with the same math give
the same losses, a failed or hung rung is reported and the ladder goes on, the table comes last.
torch.compile is left out here (minutes on two cores); `python bench/ladder.py` runs it. Every
command bench/device_check.py and the ladder run on a GPU, parsed here by the script it runs. And
--profile-steps, of the trainer and the ladder: a trace of those steps and nothing else."""
import gzip
import json
import math
import os
import shlex
import shutil
import sys
import time

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_core  # noqa: E402
import bench_hellaswag  # noqa: E402
import bench_sample  # noqa: E402
import device_check  # noqa: E402
import fake_cuda  # noqa: E402
import hellaswag  # noqa: E402
import ladder  # noqa: E402
import measure  # noqa: E402
import node_paths  # noqa: E402
import processes  # noqa: E402
import memory  # noqa: E402
import sample  # noqa: E402
import train_config  # noqa: E402
from common import UserError  # noqa: E402
from device_check import Machine  # noqa: E402
import runs  # noqa: E402
from runs import run as run_trainer, tiny  # noqa: E402

# 16 tokens per step: the 50257-wide LM head is most of the cost on CPU
TINY = ["--device", "cpu", "--model", "tiny", "--block-size", "16", "--micro-batch-size", "1",
        "--grad-accum", "1", "--warmup-steps", "1", "--steps", "2", "--repeats", "1"]


@pytest.fixture(autouse=True)
def one_thread_in_rungs(monkeypatch, one_thread):
    """One CPU thread in the rung processes too (conftest's one_thread covers this one): on a
    small, shared machine two threads of tiny ops spend most of their time waiting for each other
    (8x slower under load)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def warm_launches(monkeypatch):
    """The scripts' launches of the trainer and the other scripts started warm (tests/warm.py): real processes
    running the real scripts, without torch's import to pay for in each."""
    python = runs.python()
    monkeypatch.setattr(sys, "executable", python)
    monkeypatch.setattr(device_check, "PY", python)
    monkeypatch.setattr(node_paths, "PY", python)
    monkeypatch.setattr(node_paths, "TORCHRUN", [python] + node_paths.TORCHRUN[1:])


def run(tmp_path, *extra):
    out = tmp_path / "ladder.json"
    rc = ladder.main(TINY + ["--json-out", str(out), *extra])
    with open(out) as f:
        doc = json.load(f)
    return rc, doc, {r["name"]: r for r in doc["rungs"]}


def test_rungs_are_cumulative_and_overrides_apply():
    overrides = [ladder.parse_override(o) for o in ("compile=false", "padded-vocab:attention=cudnn")]
    fp32, bf16, compiled, padded = ladder.plan_rungs(["padded-vocab", "fp32", "compile", "bf16"], "default",
                                                     overrides)
    assert [fp32.name, bf16.name, compiled.name, padded.name] == ["fp32", "bf16", "compile", "padded-vocab"]
    assert fp32.settings == ladder.BASELINE
    assert bf16.settings == dict(ladder.BASELINE, tf32=True, dtype="auto")  # tf32 came in though not run
    assert compiled.settings["compile"] is False  # --override for every rung wins over the rung's change
    assert padded.settings == dict(ladder.BASELINE, tf32=True, dtype="auto", attention="cudnn", padded_vocab=True)
    auto = ladder.plan_rungs(["max-autotune"], "max-autotune")[0].settings
    assert auto["compile"] and auto["compile_mode"] == "max-autotune-no-cudagraphs"


@pytest.mark.parametrize("argv", [
    ["--rungs", "fp32,warp-speed"],
    ["--override", "attention=fastest"],
    ["--override", "nonsense"],
    ["--override", "no-such-rung:tf32=true"],
    ["--steps", "0"],
    ["--n-embd", "65"],
])
def test_bad_arguments_are_one_line_errors(argv):
    with pytest.raises(UserError):
        ladder.parse_args(TINY + argv)


def test_unpadded_model_is_the_padded_model_cut_down():
    cfg = dict(n_layer=1, n_head=2, n_embd=16, block_size=16)
    padded = ladder.build_model(cfg, True, 0, "cpu").eval()
    plain = ladder.build_model(cfg, False, 0, "cpu").eval()
    assert padded.lm_head.weight.shape[0] == 50304 and plain.lm_head.weight.shape[0] == 50257
    assert plain.lm_head.weight is plain.transformer.wte.weight  # still tied
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        a, loss_a = padded(idx, idx)
        b, loss_b = plain(idx, idx)
    assert torch.allclose(a[..., :50257], b, atol=1e-6) and abs(loss_a.item() - loss_b.item()) < 1e-6


def test_shards_are_read_in_order_by_token_loader(tmp_path):
    ladder.write_shards(str(tmp_path), 1000, seed=0)
    tokens = np.load(tmp_path / ladder.SHARD_NAME).astype(np.int64)
    for prefetch in (False, True):
        loader = ladder.TokenLoader(ladder.Data(str(tmp_path), prefetch=prefetch), "train", 2, 8)
        for i in range(3):
            x, y = loader.next_batch()
            assert x.shape == y.shape == (2, 8)
            assert torch.equal(x.flatten(), torch.from_numpy(tokens[16 * i:16 * i + 16]))
            assert torch.equal(y.flatten(), torch.from_numpy(tokens[16 * i + 1:16 * i + 17]))


def test_ladder_in_process_same_math_same_loss_and_failure_reported(tmp_path, capsys):
    rungs = "fp32,tf32,flash,padded-vocab,fused-adamw"
    rc, doc, r = run(tmp_path, "--in-process", "--rungs", rungs, "--override", "dtype=float32",
                     "--override", "compile=false", "--override", "fused-adamw:attention=efficient")
    assert rc == 0
    assert [x["name"] for x in doc["rungs"]] == rungs.split(",")
    ok = [r[n] for n in ("fp32", "tf32", "flash", "padded-vocab")]
    for x in ok:
        assert x["status"] == "ok", x.get("reason")
        assert x["tokens_per_s"] > 0 and len(x["step_ms"]) == 2 and x["median_ms"] > 0
        assert all(math.isfinite(v) for v in x["losses"])
        assert x["mfu"] is None  # no honest peak for a CPU
        assert x["speedup_base"] == pytest.approx(x["tokens_per_s"] / r["fp32"]["tokens_per_s"])
    # fp32 throughout: TF32 is a no-op on CPU, flash and padding change kernels and shapes, not math
    for x in ok[1:]:
        assert max(abs(a - b) for a, b in zip(x["losses"], r["fp32"]["losses"])) <= 1e-4
    assert r["fp32"]["attention_kernel"] == "math" and r["flash"]["attention_kernel"] == "flash (cpu)"
    assert "TF32 n/a on cpu" in r["tf32"]["notes"]
    # CPUs have no memory-efficient SDPA kernel: that rung fails, the ladder reports it and finishes
    failed = r["fused-adamw"]
    assert failed["status"] == "failed" and "scaled_dot_product_attention" in failed["reason"]
    assert doc["env"]["torch"] == torch.__version__ and doc["config"]["steps"] == 2
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-7].startswith("rung") and "tok/s" in lines[-7] and "MFU" in lines[-7]
    assert [line.split()[0] for line in lines[-6:-1]] == rungs.split(",")
    assert "FAILED" in lines[-2] and lines[-1].startswith("1 repeat(s)")


def test_ladder_times_the_trainers_step(tmp_path, monkeypatch):
    """A speed-up the ladder measures must be a speed-up of training, so
    every step it runs is train_gpt2.train_step, with the trainer's learning-rate schedule."""
    calls, real = [], ladder.train_gpt2.train_step

    def counted(parts, *args, **kwargs):
        calls.append(parts.optimizer.optimizers[-1].param_groups[0]["lr"])  # AdamW's
        return real(parts, *args, **kwargs)
    monkeypatch.setattr(ladder.train_gpt2, "train_step", counted)
    rc, _, r = run(tmp_path, "--in-process", "--rungs", "fp32")
    assert rc == 0 and r["fp32"]["status"] == "ok", r["fp32"].get("reason")
    schedule = ladder.optim.schedule_of(ladder.TRAIN)
    assert calls == [schedule.lr(i, ladder.TRAIN.max_lr) for i in range(3)]  # 1 warm-up + 2 timed


def test_ladder_rung_in_its_own_process(tmp_path, warm_launches):
    rc, doc, r = run(tmp_path, "--rungs", "bf16")  # cumulative: + TF32 + bf16 autocast, eager
    x = r["bf16"]
    assert rc == 0 and x["status"] == "ok", (x.get("reason"), x.get("log_tail"))
    assert x["dtype"] == "bfloat16" and x["tokens_per_s"] > 0 and math.isfinite(x["final_loss"])
    assert x["peak_mem_kind"] == "process peak RSS" and x["peak_mem_bytes"] > 0
    assert doc["device_env"]["device"] == "cpu"


def test_hung_rung_is_killed_and_reported(tmp_path, capsys):
    rc, doc, r = run(tmp_path, "--rungs", "fp32", "--rung-timeout", "0.5")
    assert rc == 1  # nothing ran: a failure exit status, but a report all the same
    assert r["fp32"]["status"] == "failed" and "timed out" in r["fp32"]["reason"]
    assert "FAILED" in capsys.readouterr().out.rstrip().splitlines()[-2]


def test_repeats_take_turns_and_speedups_show_their_spread(tmp_path, capsys):
    """--repeats 2: every rung runs twice, the rungs taking turns; a speed-up is the median of the
    pairs measured in the same turn, shown with their range."""
    rc, doc, r = run(tmp_path, "--in-process", "--rungs", "fp32,flash", "--repeats", "2", "--override", "compile=false")
    assert rc == 0
    for x in r.values():
        assert x["status"] == "ok" and len(x["repeats"]) == 2 and len(x["tokens_per_s_all"]) == 2
    pairs = [a / b for a, b in zip(r["flash"]["tokens_per_s_all"], r["fp32"]["tokens_per_s_all"])]
    assert r["flash"]["speedup_prev_pairs"] == pytest.approx(pairs)
    out = capsys.readouterr().out
    assert [line.split("]")[0] for line in out.splitlines() if line.startswith("[")] == \
        ["[1/2: 1/2", "[1/2: 2/2", "[2/2: 1/2", "[2/2: 2/2"]  # in turns
    flash_row = next(line for line in out.splitlines()[-4:] if line.startswith("flash"))
    assert f"{min(pairs):.2f}-{max(pairs):.2f})" in flash_row


def test_a_speedup_whose_pairs_reach_one_is_marked_as_noise():
    """The case that showed noise as effect: 0.15x, 5.00x from one run to the next."""
    def rung(name, tps):
        return dict(name=name, status="ok", tokens_per_s=measure.spread(tps)[0], tokens_per_s_all=tps)
    noisy = [rung("a", [100.0, 100.0, 100.0]), rung("b", [90.0, 130.0, 110.0]), rung("c", [140.0, 150.0, 160.0])]
    ladder.add_speedups(noisy)
    assert noisy[1]["speedup_prev_verdict"] == "~" and noisy[2]["speedup_prev_verdict"] == ""
    assert measure.ratio_text(noisy[1]["speedup_prev_pairs"]) == "1.10x (0.90-1.30)~"
    assert measure.ratio_text([1.5]) == "1.50x?" and measure.verdict([0.5, 0.6]) == ""


def test_muon_rung_times_the_trainers_muon_step(tmp_path):
    """The muon rung trains with --optimizer muon's optimizers: Muon and AdamW both hold state, and the
    block matrices move otherwise than under AdamW. (Not its loss: after two small warm-up updates the
    two rungs' losses can be equal to float32 resolution, on some CPUs bit-equal.)"""
    rc, _, r = run(tmp_path, "--in-process", "--rungs", "fp32,muon", "--override", "compile=false",
                   "--override", "dtype=float32", "--override", "muon:batch_x2=false")
    assert rc == 0 and r["muon"]["status"] == "ok", r["muon"].get("reason")
    assert r["muon"]["settings"]["optimizer"] == "muon" and r["fp32"]["settings"]["optimizer"] == "adamw"
    assert all(math.isfinite(v) for v in r["muon"]["losses"])
    assert r["muon"]["optimizers"] == ["Muon", "AdamW"] and r["fp32"]["optimizers"] == ["AdamW"]
    assert r["muon"]["optimizer_state"] > 0 and r["fp32"]["optimizer_state"] > 0
    muon, adamw = r["muon"]["weight_change"], r["fp32"]["weight_change"]
    assert muon > 0 and adamw > 0 and abs(muon - adamw) > 0.1 * max(muon, adamw), (muon, adamw)


def test_a_cuda_loader_pins_its_batches_only_with_prefetch(tmp_path):
    """The prefetch rung adds the thread and the pinned, asynchronous copy; the rungs before it copy
    from pageable memory. (Pinning itself needs CUDA: here only the unpinned side can run.)"""
    ladder.write_shards(str(tmp_path), 1000, seed=0)
    loader = ladder.TokenLoader(ladder.Data(str(tmp_path), device="cuda", prefetch=False), "train", 2, 8)
    assert not loader._make(0, 2).is_pinned()


@pytest.mark.parametrize("name,index", [("cuda", 1), ("cuda:0", 0), ("cuda:1", 1)])
def test_the_auto_fit_counts_the_memory_this_process_may_take(monkeypatch, name, index):
    """torch.cuda.set_per_process_memory_fraction(0.3), as device_check's probe sets it, leaves this
    process 30% of the card: the micro-batch auto-fit must fit into that, not into the whole card.
    Only the driver is faked: torch's own device-index handling runs, and plain 'cuda' (what --device
    auto gives one GPU) is the current device, here cuda:1 as torchrun's LOCAL_RANK=1 sets it."""
    driver = fake_cuda.install(monkeypatch, [fake_cuda.T4, fake_cuda.H100])
    torch.cuda.set_device(1)
    torch.cuda.set_per_process_memory_fraction(0.3, index)
    gpu = memory.CudaMemory(name)
    assert gpu.capacity() == int(0.3 * driver.gpus[index][2])
    assert gpu.allocated() == 0 and ("memory_stats", index) in driver.calls
    # a trial's peak: the allocator's own counter of this GPU, reset before the trial, its cache handed back
    # before and after (what a trial allocates is the driver's to count here)
    driver.allocated[index], driver.peak[index] = 2 << 30, 9 << 30
    driver.calls.clear()

    def trial():
        driver.peak[index] = max(driver.peak[index], 7 << 30)  # a peak only rises
    assert gpu.peak_of(trial) == 7 << 30
    assert driver.calls == [("empty_cache", None), ("reset_peak", index), ("memory_stats", index),
                            ("empty_cache", None), ("reset_peak", index)]
    # the steps' peak, which the trainer records in each train record: counted from the reset after the last trial
    driver.calls.clear()
    gpu.reset_peak()
    driver.peak[index] = max(driver.peak[index], 5 << 30)
    assert gpu.peak() == 5 << 30 and driver.calls == [("reset_peak", index), ("memory_stats", index)]


def test_each_rung_process_compiles_into_a_cache_of_its_own(tmp_path):
    """Inductor's on-disk cache leaves the SDPA kernel choice out of its key: rungs sharing it measured one graph."""
    caches = [ladder.worker_env(str(tmp_path))["TORCHINDUCTOR_CACHE_DIR"] for _ in range(3)]
    assert len(set(caches)) == 3 and all(os.path.dirname(c) == str(tmp_path) and os.path.isdir(c) for c in caches)


def test_rungs_that_compile_are_skipped_where_compile_cannot_run(tmp_path, monkeypatch, capsys):
    """On a P100 (compute capability 6.0, below Triton's 7.0) every rung from compile on would fail;
    they are skipped with device.compile_blocker's reason instead, and the rest of the ladder runs."""
    blocker = ("the Tesla P100-PCIE-16GB has compute capability 6.0, and Triton, which torch.compile generates "
               "GPU code with, needs 7.0 or newer")
    plan = ladder.plan_rungs(["bf16", "compile", "flash", "fused-adamw"], "default",
                             [ladder.parse_override("flash:compile=false")], blocker)
    assert [bool(r.skipped) for r in plan] == [False, True, False, True]
    assert blocker in plan[1].skipped
    assert not any(r.skipped for r in ladder.plan_rungs(ladder.RUNG_NAMES, "default", [], None))

    monkeypatch.setattr(ladder, "compile_blocker", lambda device: blocker)  # this CPU compiles: say it cannot
    rc, doc, r = run(tmp_path, "--in-process", "--rungs", "fp32,compile")
    assert rc == 0 and r["fp32"]["status"] == "ok"
    assert r["compile"]["status"] == "skipped" and blocker in r["compile"]["reason"]
    assert "speedup_prev" not in r["compile"]
    assert capsys.readouterr().out.rstrip().splitlines()[-2].split()[:2] == ["compile", "SKIPPED"]


# ----------------------------------------------------------------------------------------------
# The commands that reach a GPU: every one parsed here by the parser of the script it runs

PARSERS = {"train_gpt2.py": train_config.parse_args, "hellaswag.py": hellaswag.parse_args,
           "sample.py": sample.parse_args, "bench/bench_hellaswag.py": bench_hellaswag.parse_args,
           "bench/bench_sample.py": bench_sample.parse_args, "bench/bench_core.py": bench_core.parse_args,
           "bench/ladder.py": ladder.parse_args, "bench/node_paths.py": node_paths.parse_args}
MACHINES = {  # the command line of device_check.py there, and the machine as it finds it
    "H100": (["--device", "cuda"], Machine("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1)),
    "H200 with build-nanogpt": (["--device", "cuda", "--peer-src", "/peer/train_gpt2.py"],
                                Machine("cuda", "NVIDIA H200", (9, 0), 1)),
    "T4": (["--device", "cuda"], Machine("cuda", "Tesla T4", (7, 5), 1)),
    "P100": (["--device", "cuda"], Machine("cuda", "Tesla P100-PCIE-16GB", (6, 0), 1)),
    "2 x T4": (["--device", "cuda"], Machine("cuda", "Tesla T4", (7, 5), 2)),
    "CPU": (["--device", "cpu", "--small", "--steps", "12"], Machine("cpu")),
}


def script_and_args(cmd):
    """(the script a command runs, relative to the repository, and its arguments); None for the
    script of `python -c CODE ARGS` (CODE is compiled)."""
    assert cmd[0] == sys.executable, cmd
    if cmd[1] == "-m":  # torchrun: its own parser says which script it starts, with which arguments
        assert cmd[2] == "torch.distributed.run"
        from torch.distributed.run import get_args_parser
        launch = get_args_parser().parse_args(cmd[3:])
        assert launch.nproc_per_node == "2" and launch.standalone
        return launch.training_script, launch.training_script_args
    if cmd[1] == "-c":
        compile(cmd[2], "-c", "exec")
        rest = cmd[3:]  # python -c CODE script.py ARGS, where CODE runs the script with them
        return (rest[0], rest[1:]) if rest and rest[0].endswith(".py") else (None, rest)
    return os.path.relpath(os.path.join(ROOT, cmd[1]), ROOT), cmd[2:]


@pytest.mark.parametrize("machine", MACHINES)
def test_every_device_check_command_parses_for_its_machine(machine, tmp_path):
    argv, found = MACHINES[machine]
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    args = device_check.parse_args(["--data-dir", data, "--out", out] + argv)
    steps = device_check.plan(args, found, out)
    cuda = found.device == "cuda"
    assert ("probe" in steps) == ("fp16" in steps) == cuda
    assert {"two_ranks", "fsdp", "activation_checkpointing"} <= set(steps)  # a node's paths, on one GPU or a CPU
    assert ("peer" in steps) == ("--peer-src" in argv)
    parsed = {}
    for name, step in steps.items():
        script, script_argv = script_and_args(step.cmd)
        if script is not None:
            parsed[name] = args_ = PARSERS[script](script_argv)
            if found.capability and found.capability < (8, 0):  # no bfloat16 before Ampere: the scripts refuse it
                assert getattr(args_, "dtype", None) != "bfloat16", (name, step.cmd)
            if found.capability and found.capability < (7, 0):  # nor torch.compile before Volta
                assert getattr(args_, "compile", None) is not True, (name, step.cmd)
            if script == "train_gpt2.py" and args_.resume in (None, "latest"):  # a resume of a path reads its data_dir
                assert args_.data_dir == data and args_.device == argv[1], (name, step.cmd)
        if step.stop_at:
            assert step.stop_at[0] == f"step {int(step.stop_at[0].split()[1]):5d} |"
            assert int(step.stop_at[0].split()[1]) < args.steps
    assert parsed["train"].log_dir == parsed["resume"].log_dir and parsed["resume"].resume == "latest"
    assert parsed["micro_b"].resume == os.path.join(parsed["micro_a"].log_dir, "ckpt_000006.pt")
    assert parsed["micro_a"].checkpoint_every == 6 and parsed["micro_b"].micro_batch_size == 4
    if cuda:
        assert parsed["probe"].max_steps == 3 and parsed["fp16"].dtype == "float16"
        assert parsed["oom_snapshot"].memory_snapshot and steps["oom_snapshot"].rc == 2
    assert parsed["train"].profile_steps[1] < args.steps
    for name in ("two_ranks", "fsdp", "activation_checkpointing") + (("peer",) if "peer" in steps else ()):
        node = parsed[name]
        assert node.step == name and node.data_dir == data and node.device == argv[1] and node.small == args.small
    if "peer" in steps:
        assert parsed["peer"].peer_src == "/peer/train_gpt2.py" and parsed["peer"].steps == args.peer_steps
    runs = [p.log_dir for name, p in parsed.items() if hasattr(p, "given") and name != "resume"]
    assert len(set(runs)) == len(runs)  # each run its own log directory

def test_the_ladders_worker_command_parses(tmp_path):
    script, argv = script_and_args(ladder.worker_command(str(tmp_path / "fp32.spec.json")))
    assert PARSERS[script](argv).worker == str(tmp_path / "fp32.spec.json")


def test_the_sync_count_counts_syncs_not_the_modes_own_notice():
    """The warnings torch 2.11 gave on an H100 for the first three timed steps, the mode's one-time notice
    first: three syncs, one per step (counting every message that mentions synchronization gave 4/3)."""
    caught = ["Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
              "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)"] + [
              "called a synchronizing CUDA operation (Triggered internally at "
              "/pytorch/c10/cuda/CUDAFunctions.cpp:162.)"] * 3
    assert device_check.syncs_in(caught) == 3


def test_the_quick_device_check_runs_end_to_end_on_a_cpu(data_dir, tmp_path, capsys, warm_launches):
    """--quick --small on the CPU: the steps on the default recipe's run pass (the GPU's own, syncs, the
    out-of-memory snapshot and the probe, are left out; a node's paths are the next test's), the resume's loss at
    the checkpoint's step is the first run's, and --results holds at most 8 files with the table last printed."""
    out, results = tmp_path / "out", tmp_path / "results"
    rc = device_check.main(["--quick", "--small", "--device", "cpu", "--data-dir", data_dir, "--out", str(out),
                            "--results", str(results), "--only", "train,resume,sample,hellaswag,muon"])
    table = capsys.readouterr().out.rstrip().splitlines()[-6:]
    assert rc == 0, table
    assert [line.split()[:2] for line in table] == [["step", "result"], ["train", "ok"], ["resume", "ok"],
                                                    ["sample", "ok"], ["hellaswag", "ok"], ["muon", "ok"]]
    assert "equal to the first run's; micro-batch 8 (first run: micro-batch 8)" in table[2]
    files = sorted(os.listdir(results))
    assert len(files) <= 8 and {"device_check.txt", "device_check.json", "logs.tgz"} <= set(files)
    assert any(f.endswith(".pt.trace.json.gz") for f in files)  # the trace of one warm step
    assert open(results / "device_check.txt").read().splitlines() == table


def node_steps(data_dir, out, steps, capsys, *extra):
    """device_check's table rows of these steps, run tiny on the CPU, by name; and its exit status."""
    rc = device_check.main(["--small", "--device", "cpu", "--data-dir", data_dir, "--out", str(out), "--only",
                            ",".join(steps)] + list(extra))
    lines = capsys.readouterr().out.rstrip().splitlines()[-len(steps):]
    return rc, {line.split()[0]: line for line in lines}


NODE_PATHS = {  # what the device check's node path run for real says when it holds on the CPU
    "two_ranks": ["against one process: losses within", "resumed at step 4: losses within 0.0e+00, step 4 equal"],
}


def test_a_nodes_path_runs_on_a_cpu(data_dir, tmp_path, capsys, warm_launches):
    """The device check's node paths, tiny, on the CPU as on the one GPU, their launches real: two ranks over gloo
    train as one process on the same batches and resume exactly. (The fsdp and activation checkpointing steps judge
    recorded launches below; the trainer's own tests run those paths.)"""
    step = "two_ranks"
    rc, table = node_steps(data_dir, tmp_path / "out", (step,), capsys)
    assert rc == 0 and table[step].split()[1] == "ok", table
    assert [phrase for phrase in NODE_PATHS[step] if phrase not in table[step]] == [], table[step]


PEER = os.path.join(ROOT, ".peer", "train_gpt2.py")  # build-nanogpt's trainer, where it was fetched (never committed)


@pytest.mark.skipif(not os.path.isfile(PEER), reason="build-nanogpt's train_gpt2.py is not at .peer/ (fetch it and "
                                                      "copy the peer script beside it: BENCHMARKS.md)")
def test_the_peer_runs_beside_ours_on_a_cpu(data_dir, tmp_path, capsys, warm_launches):
    rc, table = node_steps(data_dir, tmp_path / "out", ("peer",), capsys, "--peer-src", PEER, "--peer-steps", "8")
    assert rc == 0 and table["peer"].split()[1] == "ok", table
    assert "build-nanogpt" in table["peer"] and "ours/peer" in table["peer"] and "losses within" in table["peer"]


def recorded(source, dest, scale=1.0, from_step=0):
    """A run directory as a launch would have left it, made from a recorded one (a real tiny run): its train losses
    times scale, its records from from_step on (a resume's), its log beside it as the launch's output."""
    shutil.copytree(source, dest)
    records = [json.loads(line) for line in open(os.path.join(source, "metrics.jsonl"))]
    kept = [dict(r, loss=r["loss"] * scale) if r["kind"] == "train" else r for r in records
            if r["kind"] == "run" or r.get("step", 0) >= from_step]
    with open(os.path.join(dest, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return open(os.path.join(source, "log.txt")).read().splitlines()


def test_device_check_fails_a_run_whose_losses_are_off_its_reference(reference_run, tmp_path, capsys, monkeypatch):
    """On recorded launches (a real tiny run, as each step's launch would have left it): micro_a, the eager run's
    recipe, must reach eager's losses; here its losses are half as large again (as a graph compiled for the wrong
    dtype trains differently): the result says 'losses', and the check fails. micro_b, resumed from micro_a's
    checkpoint, matches micro_a and passes. Without its reference the table says so rather than nothing. (The real
    launches: test_the_quick_device_check_runs_end_to_end_on_a_cpu.)"""
    launched = []

    def replay(name, cmd, out_dir, timeout, env, stop_at=None):
        launched.append((name, cmd))
        lines = recorded(reference_run, os.path.join(out_dir, name), scale=1.5 if name != "eager" else 1.0,
                         from_step=6 if name == "micro_b" else 0)
        with open(os.path.join(out_dir, f"{name}.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return {"name": name, "cmd": " ".join(cmd), "rc": 0, "seconds": 1.0, "tail": lines[-15:]}
    monkeypatch.setattr(device_check, "run_step", replay)
    rc = device_check.main(["--small", "--device", "cpu", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out"),
                            "--only", "eager,micro_a,micro_b"])
    table = {line.split()[0]: line for line in capsys.readouterr().out.rstrip().splitlines()[-3:]}
    assert [name for name, _ in launched] == ["eager", "micro_a", "micro_b"]
    assert launched[2][1][launched[2][1].index("--resume") + 1].endswith(os.path.join("micro_a", "ckpt_000006.pt"))
    assert rc == 1
    assert table["eager"].split()[1] == "ok"
    assert table["micro_a"].split()[1] == "losses" and "steps 0-9: losses within 5.0e-01 (relative) of eager's" in \
        table["micro_a"]
    assert table["micro_b"].split()[1] == "ok" and "steps 6-9: losses within 0.0e+00 (relative) of micro_a's" in \
        table["micro_b"]
    alone = tmp_path / "alone"
    device_check.main(["--small", "--device", "cpu", "--data-dir", str(tmp_path), "--out", str(alone), "--only",
                       "micro_a"])
    assert capsys.readouterr().out.rstrip().splitlines()[-1].endswith(f"losses not compared: no eager run in {alone}")


class Launches:
    """node_paths.launch, replayed: each launch leaves the run directory and output it is given (a recorded run, or
    none), with its exit status, and is noted; launches not given run for real."""

    def __init__(self, monkeypatch, runs):
        self.runs, self.names, self.real = runs, [], node_paths.launch
        monkeypatch.setattr(node_paths, "launch", self)

    def __call__(self, name, cmd, out, timeout=None):
        self.names.append(name)
        if name not in self.runs:
            return self.real(name, cmd, out, timeout)
        make, code = self.runs[name]
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        lines = make(os.path.join(out, name))
        with open(node_paths.output(out, name), "w") as f:
            f.write("\n".join(lines) + "\n")
        return code


def node_path(step, tmp_path, capsys):
    """(exit status, the figure line) of node_paths' step, run in this process on the tiny model."""
    args = node_paths.parse_args([step, "--data-dir", str(tmp_path), "--out", str(tmp_path / "out"), "--device",
                                  "cpu", "--small"])
    code = node_paths.STEPS[step](args)
    return code, capsys.readouterr().out.rstrip().splitlines()[-1]


def test_the_fsdp_path_judges_its_launches(reference_run, tmp_path, capsys, monkeypatch):
    """The fsdp step on recorded launches (the group of one, its resume; tests/test_train.py runs them for real):
    an exact resume that exported and warned is ok, as its line says; a resume whose first loss is not the run's,
    a run that did not export and one whose header lacks the one-process warning each fail, named. The probe of
    gloo's collectives runs for real, under torchrun."""
    def fsdp(exported=True, warned=True):
        def make(path):
            lines = recorded(reference_run, path)
            if exported:
                os.makedirs(os.path.join(path, "hf"))
                open(os.path.join(path, "hf", "model.safetensors"), "w").close()
            return (["warning: --sharding fsdp with one process shards nothing"] if warned else []) + lines
        return make, 0

    def resume(scale=1.0):
        return (lambda path: recorded(reference_run, path, scale=scale, from_step=4)), 0
    python = runs.python()
    monkeypatch.setattr(node_paths, "TORCHRUN", [python] + node_paths.TORCHRUN[1:])
    launches = Launches(monkeypatch, dict(fsdp=fsdp(), fsdp_resume=resume()))
    code, line = node_path("fsdp", tmp_path, capsys)
    assert launches.names == ["fsdp", "fsdp_resume", "fsdp_gloo"]
    assert code == 0 and line.startswith("fsdp | exit [0, 0]; world 1, resumed at step 4: losses within 0.0e+00, "
                                         "step 4 equal; exported; gloo on cpu: all_reduce sum float32 ok"), line
    assert "DTensor.full_tensor ok (exit 0)" in line
    launches.runs["fsdp_gloo"] = (lambda path: [], 0)  # the probe's answer is the real one above: not again
    for runs_, said in ((dict(fsdp_resume=resume(scale=1.001)), "step 4's loss is not the first run's"),
                        (dict(fsdp=fsdp(exported=False)), "; no export"),
                        (dict(fsdp=fsdp(warned=False)), "no one-process warning")):
        launches.runs.update(dict(fsdp=fsdp(), fsdp_resume=resume()), **runs_)
        code, line = node_path("fsdp", tmp_path, capsys)
        assert code == 1 and said in line, line


def test_the_activation_checkpointing_path_judges_its_launches(reference_run, tmp_path, capsys, monkeypatch):
    """The activation_checkpointing step on recorded launches: without the train step's run it launches the recipe
    without checkpointing first, then with it at that run's micro-batch, and reports both; with the train step's run
    (OUT/run) it launches only the run with; a launch that left no run fails."""
    launches = Launches(monkeypatch, dict(activation_checkpointing_off=((lambda p: recorded(reference_run, p)), 0),
                                          activation_checkpointing=((lambda p: recorded(reference_run, p)), 0)))
    cmds = []
    monkeypatch.setattr(node_paths, "trainer_flags", lambda *a, **settings: cmds.append(settings) or [])
    code, line = node_path("activation_checkpointing", tmp_path, capsys)
    assert launches.names == ["activation_checkpointing_off", "activation_checkpointing"]
    assert code == 0 and line == ("activation_checkpointing | on: micro-batch 2, " + line.split("micro-batch 2, ")[1]
                                  .split(";")[0] + "; off (activation_checkpointing_off): micro-batch 2, "
                                  + line.split("off (activation_checkpointing_off): micro-batch 2, ")[1]), line
    assert "peak n/a (CUDA only)" in line and "x)" in line
    assert cmds == [{}, dict(activation_checkpointing=True, micro_batch_size=2)]  # they differ in that alone
    recorded(reference_run, str(tmp_path / "out" / "run"))  # the train step's run: no launch without
    launches.names.clear()
    launches.runs["activation_checkpointing"] = ((lambda p: []), 1)
    code, line = node_path("activation_checkpointing", tmp_path, capsys)
    assert launches.names == ["activation_checkpointing"]
    assert code == 1 and line.startswith("activation_checkpointing | on: no run; off (run): micro-batch 2"), line


def test_device_check_refuses_a_step_it_would_not_run(tmp_path):
    with pytest.raises(UserError, match="no step probe"):
        device_check.main(["--data-dir", str(tmp_path), "--out", str(tmp_path / "out"), "--device", "cpu",
                           "--only", "probe"])
    assert not (tmp_path / "out").exists()


def test_an_arm_that_fails_is_one_line_and_the_others_are_tabled(data_dir, tmp_path, capsys, warm_launches):
    """A launch that gives no result (here a flag the trainer refuses) is one line naming its log; the arms that
    finished are in the table; the exit status says one failed."""
    import ab
    rc = ab.main(["--data-dir", data_dir, "--variant", "good=--micro-batch-size 2", "--variant",
                  "bad=--micro-batch-size 3", "--repeats", "1", "--steps", "2", "--skip-steps", "1", "--out",
                  str(tmp_path), "--"] + tiny(eval_every=0))
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    header = next(i for i, line in enumerate(lines) if line.startswith("arm "))
    assert [line.split()[0] for line in lines[header + 1:header + 2]] == ["worktree:good"]  # one row, then the legend
    assert lines[header + 2].startswith("ratios:") and "within" in lines[header + 1]
    failed = [line for line in lines if line.startswith("worktree:bad (repeat 0): no result")]
    assert failed[-1] == (f"worktree:bad (repeat 0): no result, train_gpt2.py exited 2; see "
                          f"{tmp_path / 'worktree.bad-0.log'}")


def test_a_launch_past_its_time_limit_is_stopped_with_what_it_started(tmp_path):
    """ab.launch kills a launch that runs past its limit, the processes it started included (torchrun's workers,
    compile's), and says so instead of raising."""
    import ab
    child = tmp_path / "child.pid"
    # a shell, which starts its child and writes its pid within milliseconds even on a loaded machine (a Python
    # doing the same took 3 s beside the suite's workers: the limit would come first)
    code = f"sleep 600 & echo $! > {shlex.quote(str(child))}; sleep 600"
    t0 = time.monotonic()
    why = ab.launch(["sh", "-c", code], str(tmp_path), dict(os.environ), str(tmp_path / "a.log"), 5)
    assert why == "ran past --timeout 5 s" and time.monotonic() - t0 < 300  # a bound on a hang, not on speed
    pid = int(child.read_text())
    left = [p for p in [processes.read(pid)] if p is not None]  # None: gone already or a zombie (killed with its group)
    assert processes.end(left, grace=120) == [], f"process {pid} outlived its launch"  # 120 s: a bound on a hang


# ----------------------------------------------------------------------------------------------
# --profile-steps A:B


def profiled_steps(trace_path):
    """{ProfilerStep#N: (start, end)} of a Chrome trace, in microseconds, and its operators' events."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")}
    return steps, [e for e in events if e.get("cat") == "cpu_op"]


def test_profile_steps_trace_those_steps_and_no_other(data_dir, tmp_path):
    log_dir = tmp_path / "run"
    run_trainer(tiny(data_dir=data_dir, log_dir=log_dir, max_steps=6, eval_every=0, profile_steps="2:3",
                     checkpoint_every=1, keep_checkpoints=6))
    trace, = (log_dir / "profile").glob("rank0.steps2-3.*.pt.trace.json.gz")
    steps, ops = profiled_steps(trace)
    assert sorted(steps) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert "aten::mm" in {e["name"] for e in ops}
    # every operator ran inside step 2 or 3 (1 us of slack for the trace's rounding)
    outside = [e["name"] for e in ops
               if not any(lo - 1 <= e["ts"] and e["ts"] + e["dur"] <= hi + 1 for lo, hi in steps.values())]
    assert not outside, outside[:5]
    lines = (log_dir / "log.txt").read_text().splitlines()
    table = [i for i, line in enumerate(lines) if line.startswith("profile |")]
    assert len(table) == 1 + ladder.profiling.StepProfiler.TOP and str(trace) in lines[table[0]]
    assert "self CPU time" in lines[table[0]] and any(lines[i].endswith("aten::mm") for i in table)
    step_line = lambda n: next(i for i, line in enumerate(lines) if line.startswith(f"step {n:5d} |"))  # noqa: E731
    assert step_line(3) < table[0] and table[-1] < step_line(4)  # written once step 3 is done

    # a resume profiles only when asked to again: --profile-steps is this launch's, not the run's
    again = tmp_path / "again"
    run_trainer(["--log-dir", str(again), "--resume", str(log_dir / "ckpt_000001.pt")])
    assert (again / "ckpt_000006.pt").exists() and not (again / "profile").exists()
    # a window the resumed run has already passed would profile nothing: one line, nothing written
    late = tmp_path / "late"
    p = run_trainer(["--log-dir", str(late), "--resume", str(log_dir / "ckpt_000004.pt"), "--profile-steps", "2:4"],
                    check=False)
    assert p.returncode == 2 and p.stderr.strip() == (
        f"error: --profile-steps 2:4 starts before step 4, where this launch resumes {log_dir / 'ckpt_000004.pt'}: "
        "profile steps from 4 on") and not late.exists()


def test_cuda_profile_table_ranks_the_gpu_work_once(tmp_path):
    """On CUDA every kernel's time is also held by the CPU operator that launched it and by the annotations spanning
    it (ProfilerStep#N, a compiled graph's call): the table ranks the kernels and copies alone, its shares of their
    sum. The events are torch's own profiler records, as a CUDA profile holds them."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent, FunctionEventAvg

    def averaged(name, us, device_type, annotation=False, kernel=None):
        event = FunctionEvent(id=0, name=name, thread=0, start_us=0, end_us=us, use_device="cuda",
                              device_type=device_type, is_user_annotation=annotation)
        if kernel:
            event.append_kernel(kernel, 0, us)
        return FunctionEventAvg().add(event)

    events = [averaged("ProfilerStep*", 1000, DeviceType.CUDA, annotation=True),  # the whole step, on the GPU
              averaged("## Call CompiledFxGraph ##", 700, DeviceType.CPU, annotation=True, kernel="triton_red"),
              averaged("aten::mm", 300, DeviceType.CPU, kernel="nvjet_gemm"),
              averaged("nvjet_gemm", 300, DeviceType.CUDA), averaged("triton_red", 700, DeviceType.CUDA),
              averaged("Memcpy HtoD (Pinned -> Device)", 5, DeviceType.CUDA)]
    rows, total = ladder.profiling.busiest(events, cuda=True)
    assert [(e.key, t) for e, t in rows] == [("triton_red", 700), ("nvjet_gemm", 300),
                                            ("Memcpy HtoD (Pinned -> Device)", 5)] and total == 1005
    rows, total = ladder.profiling.busiest(events, cuda=False)  # the CPU's table: each event's self CPU time
    assert [e.key for e, _ in rows[:2]] == ["## Call CompiledFxGraph ##", "aten::mm"] and total == 1000

    lines = []  # the table as the trainer writes it
    profiler = ladder.profiling.StepProfiler((2, 3), "cuda", str(tmp_path), "rank0", lines.append)
    profiler.prof = type("Profile", (), {"stop": lambda self: None, "key_averages": lambda self: events,
                                         "export_chrome_trace": lambda self, path: None})()
    profiler.report()
    assert "the GPU's kernels and copies, 0.5 ms/step summed over its streams" in lines[0] and len(lines) == 4
    assert lines[1].split() == ["profile", "|", "0.35", "ms/step", "69.7%", "1", "calls", "triton_red"]


@pytest.mark.parametrize("value, error", [("5:3", "step A comes after step B"), ("-1:3", "not A:B"),
                                          ("1.5:3", "not A:B"), ("3", "not A:B"), ("a:b", "not A:B"),
                                          ("2:6", "ends after the run's last step, 5")])
def test_bad_profile_steps_are_one_line_errors(value, error, tmp_path):
    p = run_trainer(tiny(log_dir=tmp_path / "run", max_steps=6) + [f"--profile-steps={value}"], check=False)
    assert p.returncode == 2 and error in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_memory_snapshot_is_refused_off_cuda(data_dir, tmp_path):
    """A CUDA allocator's history is all it records: on a CPU it would be silently nothing."""
    p = run_trainer(tiny(data_dir=data_dir, log_dir=tmp_path / "run", memory_snapshot=True), check=False)
    assert p.returncode == 2 and "--memory-snapshot" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_ladder_profiles_the_first_repeat_of_each_rung(tmp_path, capsys):
    rc, doc, r = run(tmp_path, "--in-process", "--rungs", "fp32", "--repeats", "2", "--profile-steps", "1:2")
    assert rc == 0 and r["fp32"]["status"] == "ok"
    trace, = (tmp_path / "profile").glob("fp32.steps1-2.*.pt.trace.json.gz")
    steps, ops = profiled_steps(trace)
    assert sorted(steps) == ["ProfilerStep#1", "ProfilerStep#2"] and "aten::mm" in {e["name"] for e in ops}
    first, second = r["fp32"]["repeats"]
    assert str(trace) in first["profile"][0] and not second["profile"]
    assert "steps 1-2 profiled: the profiler's cost is in their times" in r["fp32"]["notes"]
    assert first["profile"][1] in capsys.readouterr().out
    with pytest.raises(UserError, match="a rung runs steps 0 to 2"):
        ladder.parse_args(TINY + ["--profile-steps", "2:3"])


def test_ab_launches_each_revision_in_turn_and_compares_their_losses(data_dir, tmp_path, capsys, warm_launches):
    import ab
    extra = tiny(eval_every=0, device="cpu")
    ab.main(["--data-dir", data_dir, "--revs", "worktree,HEAD", "--repeats", "1", "--steps", "4", "--skip-steps", "1",
             "--out", str(tmp_path), "--"] + extra)
    table = capsys.readouterr().out.splitlines()
    results = json.loads((tmp_path / "ab.json").read_text())["results"]
    for rev in ("worktree", "HEAD"):
        (tok_per_s, mfu, first_step_s, losses, launch_s), = results[rev]
        assert tok_per_s > 0 and mfu is None and sorted(losses) == ["0", "1", "2", "3"]  # (JSON keys)
        row = next(line for line in table if line.startswith(rev))
        assert "within" in row and row.split()[-1].endswith("x?")
    assert (tmp_path / "src" / "HEAD" / "train_gpt2.py").is_file()  # HEAD's files, exported

    # variants: every revision with each set of flags, the first the base; an arm may lead with environment
    # variables, which reach the trainer (its run record holds them); each arm compiles into caches of its own, which
    # its later repeats share
    cdt = "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1"
    rc = ab.main(["--data-dir", data_dir, "--variant", f"b2={cdt} --micro-batch-size 2",
                  "--variant", "b4=--micro-batch-size 4",
                  "--repeats", "2", "--steps", "4", "--skip-steps", "1", "--out", str(tmp_path / "v"), "--"] + extra)
    table = capsys.readouterr().out.splitlines()
    assert rc == 0
    results = json.loads((tmp_path / "v" / "ab.json").read_text())["results"]
    assert sorted(results) == ["worktree:b2", "worktree:b4"]
    header = {(arm, r): json.loads((tmp_path / "v" / "runs" / f"worktree.{arm}-{r}" / "metrics.jsonl").read_text()
                                   .splitlines()[0]) for arm in ("b2", "b4") for r in (0, 1)}
    assert {arm: header[arm, 0]["grad_accum"] for arm in ("b2", "b4")} == {"b2": 2, "b4": 1}  # 128 tokens, 4 rows
    assert any(line.startswith("worktree:b4") and "within" in line for line in table)
    env = {key: h["environment"] for key, h in header.items()}
    assert env["b2", 0]["TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"] == "1"
    assert "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING" not in env["b4", 0]
    caches = {key: (e["TORCHINDUCTOR_CACHE_DIR"], e["TRITON_CACHE_DIR"]) for key, e in env.items()}
    assert caches["b2", 0] == caches["b2", 1] and caches["b4", 0] == caches["b4", 1]
    assert not set(caches["b2", 0]) & set(caches["b4", 0])
    assert all(path.startswith(str(tmp_path / "v" / "cache")) for pair in caches.values() for path in pair)
    # an arm that names a cache of its own keeps it
    assert ab.arm_env("mine", {"TRITON_CACHE_DIR": "/mine"}, str(tmp_path))["TRITON_CACHE_DIR"] == "/mine"
    with pytest.raises(SystemExit, match="--variant: give NAME=FLAGS"):
        ab.main(["--data-dir", data_dir, "--variant", "--micro-batch-size 4", "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match="--revs: git cannot export 'no-such-rev'"):
        ab.main(["--data-dir", data_dir, "--revs", "no-such-rev", "--out", str(tmp_path / "bad")])
