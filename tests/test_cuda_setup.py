"""The trainer's set-up on a GPU, for every way a user names one, with only the driver faked (tests/fake_cuda.py):
torch's own Python layer (device-index handling, the memory fraction, GradScaler's checks, the allocator's history)
runs as on a GPU. The default command once crashed here on one GPU ('cuda' has no index) behind a test that had
replaced the torch function it called. A CPU build of PyTorch has no CUDA device guard, so no tensor can be made on
a 'cuda' device, not even a fake one: the path is followed up to the model's move to the GPU."""
import traceback
import warnings

import pytest
import torch
import torch.distributed as tdist

import common
import device
import fake_cuda
import parallel
import profiling
from runs import run, tiny

A100 = ("NVIDIA A100-SXM4-40GB", (8, 0), 40 * 2 ** 30)
T4 = ("Tesla T4", (7, 5), 15 * 2 ** 30)
V100 = ("Tesla V100-SXM2-16GB", (7, 0), 16 * 2 ** 30)
TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}

# how the user names the GPU -> (--device, torchrun's environment, the machine, the device it runs on, its index)
NAMINGS = {
    "auto": ("auto", {}, [fake_cuda.H100, A100], "cuda", 0),
    "cuda": ("cuda", {}, [fake_cuda.H100, A100], "cuda", 0),
    "cuda:0": ("cuda:0", {}, [fake_cuda.H100, A100], "cuda:0", 0),
    "cuda:1": ("cuda:1", {}, [fake_cuda.H100, A100], "cuda:1", 1),
    "torchrun LOCAL_RANK=1": ("auto", TORCHRUN, [fake_cuda.H100, A100], "cuda:1", 1),
    "torchrun LOCAL_RANK=1, --device cuda:0": ("cuda:0", TORCHRUN, [fake_cuda.H100, A100], "cuda:1", 1),
    "T4, fp16": ("auto", {}, [T4], "cuda", 0),
}
PEAKS = {fake_cuda.H100[0]: 989e12, A100[0]: 312e12, T4[0]: 65e12}


@pytest.fixture
def fake_group():
    """torchrun's process group, of the fake backend (collectives recorded, not run), formed before set-up
    as torchrun's rendezvous forms the real one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    tdist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    tdist.destroy_process_group()


@pytest.mark.parametrize("naming", NAMINGS)
def test_the_set_up_on_a_gpu_for_every_way_of_naming_it(naming, monkeypatch, tmp_path, request):
    requested, env, gpus, expected, index = NAMINGS[naming]
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    driver = fake_cuda.install(monkeypatch, gpus)
    if env:
        request.getfixturevalue("fake_group")
    torch.cuda.set_per_process_memory_fraction(0.5, index)  # what this process may take of its GPU
    name, capability, total = gpus[index]

    ranks = parallel.setup_distributed(requested)
    assert ranks.device == expected and torch.cuda.current_device() == index == driver.current
    # no other GPU was made current on the way (each would hold a CUDA context of this process)
    assert {i for call, i in driver.calls if call == "set_device"} <= {index}
    choice = device.choose(ranks.device, "auto", None, False)
    fp16 = capability < (8, 0)
    assert choice.name == name and choice.dtype == ("float16" if fp16 else "bfloat16")
    assert choice.muon_dtype == (torch.float16 if fp16 else torch.bfloat16)
    assert choice.peak_flops == PEAKS[name] and f"{PEAKS[name] / 1e12:g} TFLOP/s" in choice.mfu_basis
    assert choice.capacity == total // 2  # the auto-fit's and the header's capacity, of this GPU
    assert choice.compile == (choice.compile_blocker is None)  # on, unless Triton is missing (as on this CPU)
    assert choice.warnings(False, 64 * 1024) == []

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        device.configure_backends(choice, False)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32

    # --memory-snapshot: the allocator records its history, its last 100,000 events
    profiling.StepProfiler(None, ranks.device, str(tmp_path), f"rank{ranks.rank}", print, memory_snapshot=True)
    assert ("memory_history", "all", 100_000) in driver.calls
    # fp16's gradient scaler, which GradScaler turns off (with a warning) where it finds no CUDA
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = torch.amp.GradScaler(ranks.device_type, enabled=choice.dtype == "float16")
    assert scaler.is_enabled() == fp16 and [str(w.message) for w in caught] == []


@pytest.mark.parametrize("gpu, dtype", [(fake_cuda.H100, "bfloat16"), (A100, "bfloat16"), (T4, "float16"),
                                        (V100, "float16")])
def test_the_default_command_reaches_the_models_move_to_the_gpu(monkeypatch, data_dir, tmp_path, gpu, dtype):
    """`python train_gpt2.py` on one GPU: everything before the model's move to the GPU runs (the device, its
    choice and switches, the evaluations' set-up), and the build's own refusal comes from the move (a CPU build:
    no CUDA linked; a CUDA build on a machine without a GPU: the real driver's absence). With no --dtype and no
    --compile, where Triton runs: bf16 on Ampere and later, fp16 on a T4 or V100, and compile on."""
    from torch.utils import _triton
    fake_cuda.install(monkeypatch, [gpu], "sm_70 sm_75 sm_80 sm_90")  # a build with kernels for each (cu126)
    monkeypatch.setattr(_triton, "has_triton", lambda: True)  # the triton package, not the driver: stood in for
    monkeypatch.setattr(common, "_joined_process_group", False)
    chosen, choose = [], device.choose
    monkeypatch.setattr(device, "choose", lambda *a, **k: chosen.append(choose(*a, **k)) or chosen[-1])  # a spy
    with pytest.raises(RuntimeError, match="not linked with support for cuda devices|CUDA driver") as e:
        run(tiny(data_dir=data_dir, log_dir=str(tmp_path / "log"), device="auto", sample_every=5))
    frames = traceback.extract_tb(e.value.__traceback__)
    assert any(f.name == "setup" and "raw_model.to(ranks.device)" in f.line for f in frames), frames
    assert [(c.dtype, c.compile) for c in chosen] == [(dtype, True)]
    assert not (tmp_path / "log").exists()  # nothing written before the run could start


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_two_processes_on_one_gpu_share_it_over_gloo_and_nccl_refuses(backend, monkeypatch):
    """torchrun --nproc_per_node=2 on a machine with one GPU: NCCL cannot put two ranks on one device, so the launch
    is refused before the rendezvous, naming the way out; over gloo (--dist-backend gloo) rank 1 takes cuda:0, the
    GPU there is, not cuda:1, which is not."""
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    driver = fake_cuda.install(monkeypatch, [fake_cuda.H100])
    if backend == "auto":
        with pytest.raises(common.UserError, match="one per GPU, but it has 1 GPU.*--dist-backend gloo"):
            parallel.setup_distributed("auto", backend=backend)
        assert not tdist.is_initialized()
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    tdist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)  # as torchrun's rendezvous forms it
    try:
        ranks = parallel.setup_distributed("auto", backend=backend)
    finally:
        tdist.destroy_process_group()
    assert ranks.device == "cuda:0" and driver.current == 0 and ranks.local_rank == 1
    assert {i for call, i in driver.calls if call == "set_device"} == {0}
    assert ranks.shares_gpus and ranks.backend == "gloo" and ranks.gpus == 1


def test_fsdp_over_gloo_on_cuda_is_refused_before_the_model_is_built(monkeypatch, data_dir, tmp_path, fake_group):
    """gloo has no CUDA path for the gathers of a DTensor's whole (FSDP2's full checkpoints, the export, Muon):
    --fsdp with --dist-backend gloo on GPUs stops with one line before anything is built or written."""
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    fake_cuda.install(monkeypatch, [fake_cuda.H100])
    monkeypatch.setattr(common, "_joined_process_group", False)
    p = run(tiny(data_dir=data_dir, log_dir=str(tmp_path / "log"), device="auto", fsdp=True, dist_backend="gloo"),
            check=False)
    # (the fake group has no torchrun store to compare the ranks' errors through: rank 1 says it with its rank)
    assert p.returncode == 2 and p.stderr.startswith("rank 1: error: --sharding fsdp over gloo on CUDA") \
        and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "log").exists()


@pytest.mark.parametrize("rank, world, per_node", [(9, 16, 8), (5, 8, 4)])
def test_a_process_on_a_second_node_takes_its_local_gpu_and_resumes_with_the_nodes_processes(monkeypatch, fake_group,
                                                                                             rank, world, per_node):
    """torchrun --nnodes=2 --nproc_per_node=8 (or 4, on nodes of 8 GPUs): global rank 9 (or 5) is local rank 1 of the
    second node. It takes cuda:1 (its rank names no GPU of the node, or another rank's), and the command that resumes
    the run starts as many processes on each node."""
    import train_gpt2
    from types import SimpleNamespace
    for k, v in {"RANK": str(rank), "LOCAL_RANK": "1", "WORLD_SIZE": str(world),
                 "LOCAL_WORLD_SIZE": str(per_node)}.items():
        monkeypatch.setenv(k, v)
    driver = fake_cuda.install(monkeypatch, [fake_cuda.H100] * 8)
    ranks = parallel.setup_distributed("auto")
    assert ranks.device == "cuda:1" and driver.current == 1 and (ranks.rank, ranks.per_node) == (rank, per_node)
    assert not ranks.shares_gpus
    run = SimpleNamespace(cfg=SimpleNamespace(log_dir="log"), ranks=ranks)
    assert train_gpt2.Run.resume_command(run) == (f"torchrun --nnodes=2 --node_rank=N --nproc_per_node={per_node} "
                                                  "--rdzv-endpoint=HOST:PORT train_gpt2.py --log-dir log --resume")


def test_three_processes_on_two_gpus_share_them_over_gloo(monkeypatch):
    """torchrun --nproc_per_node=3 --dist-backend gloo on two GPUs: local rank 2 takes cuda:0 beside rank 0, and each
    process counts as sharing (the header's warning; the auto-fit plans for half a GPU, tests/test_memory.py)."""
    for k, v in {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(k, v)
    driver = fake_cuda.install(monkeypatch, [fake_cuda.H100] * 2)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    tdist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    try:
        ranks = parallel.setup_distributed("auto", backend="gloo")
    finally:
        tdist.destroy_process_group()
    assert ranks.device == "cuda:0" and driver.current == 0 and ranks.per_gpu == 2 and ranks.shares_gpus


def test_a_trials_peak_is_not_left_for_the_training_steps(monkeypatch):
    """The auto-fit measures its trials with CudaMemory.peak_of; the train records' peak_mem (CudaMemory.peak) then
    counts from the end of the last trial: what the steps allocate, not the trial's 30 GiB."""
    driver = fake_cuda.install(monkeypatch, [fake_cuda.H100])
    torch.cuda.init()  # as the model's move to the GPU has done (torch reports no statistics before)
    gpu = device.CudaMemory("cuda:0")
    driver.allocated[0] = driver.peak[0] = 2 * 2 ** 30  # the model

    def trial():
        driver.peak[0] = 30 * 2 ** 30  # the trial's activations, freed as it ends

    assert gpu.peak_of(trial) == 30 * 2 ** 30 and gpu.peak() == 2 * 2 ** 30


def test_a_checkpoints_random_state_holds_each_gpus_generator(monkeypatch):
    """parallel.RNG keeps every GPU's generator beside the host's and puts them back; a resume on a machine with
    another number of GPUs leaves the GPUs' generators as they are (the host's still come back)."""
    fake_cuda.install(monkeypatch, [fake_cuda.H100, A100])
    torch.cuda.manual_seed_all(7)
    with torch.cuda.device(1):
        torch.cuda.manual_seed(3)  # the second GPU's generator apart from the first's
    saved = parallel.RNG().state_dict()
    assert len(saved["cuda"]) == 2 and not torch.equal(saved["cuda"][0], saved["cuda"][1])
    host = torch.rand(3)
    torch.cuda.manual_seed_all(8)
    parallel.RNG().load_state_dict(saved)
    assert [torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), saved["cuda"])] == [True, True]
    assert torch.equal(torch.rand(3), host)

    fake_cuda.install(monkeypatch, [fake_cuda.H100])  # one GPU now
    torch.cuda.manual_seed_all(9)
    mine = torch.cuda.get_rng_state_all()
    parallel.RNG().load_state_dict(saved)
    assert torch.equal(torch.cuda.get_rng_state_all()[0], mine[0]) and torch.equal(torch.rand(3), host)
