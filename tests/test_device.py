"""device.py: the autocast dtype each device gets, peak FLOP/s by GPU name, and waiting for the
right device."""
import ctypes
import dataclasses
import os
import sys

import pytest
import torch

import common
import device
import fake_cuda
from device import peak_flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# what torch.cuda.get_device_name() returns on real machines, and each one's dense peak (bf16, fp16)
REAL_GPUS = [
    ("NVIDIA H100 80GB HBM3", 989e12, 989e12), ("NVIDIA H100 PCIe", 756e12, 756e12),
    ("NVIDIA H100 NVL", 835e12, 835e12), ("NVIDIA H200", 989e12, 989e12), ("NVIDIA H200 NVL", 835e12, 835e12),
    ("NVIDIA GH200 480GB", 989e12, 989e12), ("NVIDIA A100-SXM4-80GB", 312e12, 312e12),
    ("NVIDIA A100-SXM4-40GB", 312e12, 312e12), ("NVIDIA A100 80GB PCIe", 312e12, 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12, 312e12), ("NVIDIA A10G", 70e12, 70e12), ("NVIDIA A10", 125e12, 125e12),
    ("NVIDIA L4", 121e12, 121e12), ("NVIDIA L40", 181e12, 181e12), ("NVIDIA L40S", 362e12, 362e12),
    ("NVIDIA GeForce RTX 4090", 165e12, 165e12), ("NVIDIA GeForce RTX 3090", 71e12, 71e12),
    ("NVIDIA RTX A6000", 155e12, 155e12), ("Tesla V100-SXM2-16GB", None, 125e12),
    ("Tesla V100-SXM2-32GB", None, 125e12), ("Tesla V100-PCIE-16GB", None, 112e12),
    ("Tesla V100S-PCIE-32GB", None, 130e12), ("Tesla T4", None, 65e12),
    # fp32 rates: fp16 matmuls accumulate in fp32
    ("Tesla P100-PCIE-16GB", None, 9.3e12), ("Tesla P100-SXM2-16GB", None, 10.6e12),
    # no row of their own, and no other GPU's row either (an A1000 is not an A100, an L4000 not an L4)
    ("NVIDIA RTX A1000", None, None), ("NVIDIA RTX A2000 12GB", None, None),
    ("NVIDIA RTX 4000 Ada Generation", None, None),
    ("Quadro RTX 6000", None, None), ("NVIDIA GeForce GTX 1080 Ti", None, None),
]


@pytest.mark.parametrize("name,bf16,fp16", REAL_GPUS)
def test_peak_flops_by_whole_gpu_name(name, bf16, fp16):
    assert peak_flops(name, "bfloat16") == bf16 and peak_flops(name, "float16") == fp16
    assert peak_flops(name, "float32") is None  # no honest fp32 peak


def test_peak_flops_of_no_gpu():
    assert peak_flops("cpu", "float32") is None and peak_flops("cpu", "bfloat16") is None
    assert peak_flops("Some Future GPU", "bfloat16") is None


def fake_gpus(monkeypatch, gpus, arch_list=None):
    """CUDA as a machine with these GPUs shows it, [(name, (major, minor))] by index, through a driver faked below
    torch.cuda (tests/fake_cuda.py) of a PyTorch built for arch_list (default: kernels for every one of them)."""
    arch_list = arch_list or sorted({f"sm_{major}{minor}" for _, (major, minor) in gpus})
    return fake_cuda.install(monkeypatch, [(name, cap, 16 * 2 ** 30) for name, cap in gpus], " ".join(arch_list))


def test_dtype_and_device_choice(monkeypatch):
    assert device.pick_dtype("auto", "cpu") == "float32"
    with pytest.raises(common.UserError, match="float16"):
        device.pick_dtype("float16", "cpu")
    driver = fake_gpus(monkeypatch, [("Tesla T4", (7, 5)), ("NVIDIA A100-SXM4-80GB", (8, 0))])
    assert device.pick_dtype("auto", "cuda") == "float16"  # T4 / V100: fp16 with a gradient scaler
    with pytest.raises(common.UserError, match="Tesla T4 has no bfloat16"):
        device.pick_dtype("bf16", "cuda:0")
    # a mixed machine: cuda:1 is asked about itself, and made the current device
    assert device.pick_device("cuda:1") == "cuda:1" and driver.current == 1
    assert device.pick_dtype("auto", "cuda:1") == "bfloat16"
    assert device.muon_dtype("cuda:0") == torch.float16 and device.muon_dtype("cuda:1") == torch.bfloat16
    with pytest.raises(common.UserError, match="cuda:0 to cuda:1"):
        device.pick_device("cuda:2")


@pytest.mark.parametrize("gpu,triton,default,explicit", [
    (("Tesla P100-PCIE-16GB", (6, 0)), True, False, "--compile: the Tesla P100-PCIE-16GB has compute capability 6.0"),
    (("Tesla V100-SXM2-16GB", (7, 0)), True, True, None),  # the oldest GPU Triton runs on
    (("Tesla T4", (7, 5)), True, True, None),
    (("NVIDIA H100 80GB HBM3", (9, 0)), True, True, None),
    # Windows wheels, or Linux without the triton package: inductor would raise TritonMissing
    (("Tesla T4", (7, 5)), False, False, "--compile: Triton, which torch.compile generates GPU code with, is not "
                                         "installed"),
])
def test_compile_by_default_only_where_triton_runs(monkeypatch, gpu, triton, default, explicit):
    from torch.utils import _triton
    fake_gpus(monkeypatch, [gpu])
    monkeypatch.setattr(_triton, "has_triton", lambda: triton)  # the triton package, not the driver: stood in for
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        choice = device.choose("cuda", "auto", None, False)
        assert choice.compile is default
        device.configure_backends(choice, False)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        if explicit:
            with pytest.raises(common.UserError, match=explicit):
                device.choose("cuda", "auto", True, True)  # --compile typed
            # a run started with --compile on another GPU, resumed here without the flag: compile is off
            resumed = device.choose("cuda", "auto", True, False)
            assert resumed.compile is False
            # and no advice to turn on what cannot run
            assert not any("compile" in w for w in resumed.warnings(False, 2 ** 16))
        else:
            assert device.compile_blocker("cuda") is None
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def test_a_micro_batch_of_8192_tokens_or_more_is_not_called_small(monkeypatch):
    """The warning names micro-batches under 8,192 tokens (the GPU idles between their kernels): 8 x 1024 is not."""
    fake_gpus(monkeypatch, [("NVIDIA H100 80GB HBM3", (9, 0))])
    choice = device.choose("cuda", "auto", False, False)
    small = [w for w in choice.warnings(False, 8191) if "micro-batch of 8191 tokens" in w]
    assert len(small) == 1 and not [w for w in choice.warnings(False, 8192) if "micro-batch" in w]


# torch.cuda.get_arch_list() of PyTorch's builds (PyTorch's RELEASE.md support matrix)
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU128_2_8 = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


@pytest.mark.parametrize("gpu,build,stops", [
    (("Tesla P100-PCIE-16GB", (6, 0)), CU128_2_8, True),   # Kaggle's P100 after pip's default torch
    (("Tesla P100-PCIE-16GB", (6, 0)), CU126, False),
    (("Tesla V100-SXM2-16GB", (7, 0)), CU130, True),
    (("Tesla V100-SXM2-16GB", (7, 0)), CU128_2_8, False),
    (("Tesla T4", (7, 5)), CU130, False),
    (("NVIDIA L4", (8, 9)), CU126, False),                  # sm_86's machine code runs on 8.9
    (("NVIDIA GeForce RTX 5090", (12, 0)), CU126, True),    # Blackwell needs CUDA 12.8 or newer
    (("NVIDIA B200", (10, 0)), CU126, True),                # the data-centre Blackwell too: the cu130 wheels
    (("NVIDIA RTX PRO 6000 Blackwell", (12, 1)), CU130, False),  # sm_120's code, and its PTX
    (("Tesla K80", (3, 7)), CU126, True),                   # no wheels at all
])
def test_a_gpu_without_kernels_in_this_pytorch_stops_with_the_wheels_to_install(monkeypatch, gpu, build, stops):
    fake_gpus(monkeypatch, [gpu], build)
    if not stops:
        assert device.pick_device("auto") == "cuda" and device.pick_device("cuda:0") == "cuda:0"
        return
    index = "cu126" if gpu[1] < (10, 0) else "cu130"
    what = f"the {gpu[0]} (compute capability {gpu[1][0]}.{gpu[1][1]})"
    for requested in ("auto", "cuda", "cuda:0"):
        with pytest.raises(common.UserError) as e:
            device.pick_device(requested)
        if gpu[1] < (5, 0):
            assert str(e.value) == f"no PyTorch 2.9 or newer has kernels for {what}: use another GPU or --device cpu"
            continue
        assert str(e.value) == (f"PyTorch {torch.__version__} has no kernels for {what}: it was built for "
                                f"{' '.join(build)}. Install a build that has: pip uninstall -y torch && pip install "
                                f"'torch>=2.9' --index-url https://download.pytorch.org/whl/{index}")


def test_auto_refuses_the_cpu_when_nvidia_smi_lists_a_gpu_pytorch_cannot_use(monkeypatch, fake_nvidia_smi,
                                                                            data_dir, tmp_path):
    """nvidia-smi lists a GPU, CUDA is unavailable (a CPU build here; elsewhere a driver older than
    the build's CUDA): --device auto stops with the wheels that fit the GPU, rather than train for
    days on the CPU; --device cpu still trains there."""
    from runs import run, tiny
    fake_gpus(monkeypatch, [])  # a driver that finds no GPU
    monkeypatch.setattr(torch.version, "cuda", None)  # and a CPU-only build
    assert device.pick_device("auto") == "cpu"  # no nvidia-smi: the CPU is all there is
    fake_nvidia_smi([("Tesla P100-PCIE-16GB", "6.0"), ("Tesla P100-PCIE-16GB", "6.0")])
    assert device.listed_gpu() == ("Tesla P100-PCIE-16GB", (6, 0))
    p = run(tiny(data_dir=data_dir, log_dir=str(tmp_path / "auto"), device="auto", max_steps=2), check=False)
    assert p.returncode == 2 and p.stderr.strip() == (
        f"error: nvidia-smi lists a GPU, the Tesla P100-PCIE-16GB, but PyTorch {torch.__version__} cannot use it "
        "(a CPU-only build): install a build that can: pip uninstall -y torch && pip install 'torch>=2.9' "
        "--index-url https://download.pytorch.org/whl/cu126; or pass --device cpu to run on the CPU")
    assert not (tmp_path / "auto").exists()
    run(tiny(data_dir=data_dir, log_dir=str(tmp_path / "cpu"), device="cpu", max_steps=2))


def test_nccl_group_is_bound_to_the_ranks_gpu(monkeypatch):
    import torch.distributed as tdist
    import parallel
    fake_gpus(monkeypatch, [("NVIDIA H100 80GB HBM3", (9, 0))] * 2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(common, "_joined_process_group", False)  # put back after the test
    # NCCL is not in a CPU build, nor a rank 0 to meet: the group's forming is stood in for, to read what is asked
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "rendezvous", lambda *a, **k: iter([(tdist.HashStore(), 1, 2)]))
    calls = []
    monkeypatch.setattr(tdist, "init_process_group", lambda **kw: calls.append(kw))
    ranks = parallel.setup_distributed("auto")
    assert ranks.device == "cuda:1" and calls[0]["backend"] == "nccl"
    assert calls[0]["device_id"] == torch.device("cuda:1")


def test_a_group_of_one_under_nccl_is_bound_to_the_current_gpu(monkeypatch):
    """--fsdp in plain python: a process group of this process alone, NCCL bound to the GPU that plain 'cuda' is (the
    current one, here cuda:1), not to cuda:0."""
    import torch.distributed as tdist
    import parallel
    fake_gpus(monkeypatch, [("NVIDIA H100 80GB HBM3", (9, 0))] * 2)
    torch.cuda.set_device(1)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(common, "_joined_process_group", False)  # put back after the test
    calls = []  # NCCL is not in a CPU build: the group's forming is stood in for, to read what is asked
    monkeypatch.setattr(tdist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(tdist, "init_process_group", lambda **kw: calls.append(kw))
    ranks = parallel.setup_distributed("auto", group_of_one=True)
    assert ranks.device == "cuda" and ranks.backend == "nccl" and ranks.gpus == 2 and not ranks.multi
    assert [(c["backend"], c["rank"], c["world_size"], c["device_id"]) for c in calls] == [
        ("nccl", 0, 1, torch.device("cuda:1"))]


def test_more_processes_than_gpus_is_one_line_before_the_rendezvous(monkeypatch):
    import parallel
    fake_gpus(monkeypatch, [("Tesla T4", (7, 5))])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(common, "_joined_process_group", False)
    monkeypatch.setattr(torch.distributed, "rendezvous", lambda *a, **k: pytest.fail("rendezvous reached"))
    for rank in (0, 1):  # every rank stops, not only the one without a GPU
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        with pytest.raises(common.UserError, match=r"^torchrun starts 2 processes on this machine, one per GPU, but "
                                                   r"it has 1 GPU\(s\) visible: use --nproc_per_node=1 \(or, to "
                                                   r"try a node's paths on fewer GPUs, slowly: --dist-backend gloo\)$"):
            parallel.setup_distributed("auto")


def test_a_launcher_without_local_world_size_is_counted_by_its_local_rank(monkeypatch):
    """A launcher that sets no LOCAL_WORLD_SIZE (not torchrun): LOCAL_RANK 1 on a machine of one GPU means two
    processes there at least, one too many, refused before the rendezvous."""
    import parallel
    fake_gpus(monkeypatch, [("Tesla T4", (7, 5))])
    for k, v in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(common, "_joined_process_group", False)
    monkeypatch.setattr(torch.distributed, "rendezvous", lambda *a, **k: pytest.fail("rendezvous reached"))
    with pytest.raises(common.UserError, match=r"^torchrun starts 2 processes on this machine, one per GPU, but it has "
                                               r"1 GPU\(s\) visible"):
        parallel.setup_distributed("auto")


def test_synchronize_waits_on_the_device_it_is_given(monkeypatch):
    driver = fake_gpus(monkeypatch, [("NVIDIA H100 80GB HBM3", (9, 0))] * 2)
    calls = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))  # no MPS driver to fake here
    device.synchronize("cpu")
    assert driver.calls == calls == []  # CPU work is synchronous
    device.synchronize("cuda:1")
    device.synchronize("mps")
    assert ("synchronize", 1) in driver.calls and driver.current == 0 and calls == ["mps"]


def imported_in_a_child(script, version):
    """(exit status, stderr) of a process forked from this one that imports `script` afresh (the project's modules
    dropped) with torch saying it is `version`, as `python -c "import torch; torch.__version__ = ...; import
    script"` would, less the interpreter's start-up."""
    import importlib
    import traceback
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.dup2(w, 2)
            sys.stderr = open(2, "w", closefd=False)
            for name, module in list(sys.modules.items()):
                if os.path.dirname(getattr(module, "__file__", None) or "") == ROOT:
                    del sys.modules[name]
            torch.__version__ = version
            importlib.import_module(script)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    import select
    import signal
    import time
    err, deadline = b"", time.monotonic() + 300
    with open(r, "rb", buffering=0) as f:
        while True:
            if not select.select([f], [], [], max(0.0, deadline - time.monotonic()))[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"importing {script} in a forked process took over 300 s: {err.decode()}")
            chunk = f.read(65536)
            if not chunk:
                break
            err += chunk
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err.decode()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the imports run in forked processes")
def test_too_old_pytorch_is_one_line_naming_the_upgrade(fake_nvidia_smi):
    assert device.torch_too_old("2.9.1+cu128") is None and device.torch_too_old("2.13.0") is None
    assert device.torch_too_old("10.0") is None
    for script in ("train_gpt2", "sample", "hellaswag"):
        code, err = imported_in_a_child(script, "2.8.0")
        assert code == 2 and err.strip().splitlines() == [
            "error: PyTorch 2.8.0 is older than 2.9, the oldest these scripts run on (they use torch.optim.Muon); "
            "upgrade it: pip install -U 'torch>=2.9'"], err
    code, err = imported_in_a_child("train_gpt2", torch.__version__)  # this one is new enough
    assert code == 0 and "older than" not in err, err
    # with a GPU that pip's default builds have no kernels for, from the wheels that have them
    fake_nvidia_smi([("Tesla P100-PCIE-16GB", "6.0")])
    code, err = imported_in_a_child("train_gpt2", "2.6.0+cu124")
    assert code == 2 and err.strip().splitlines() == [
        "error: PyTorch 2.6.0+cu124 is older than 2.9, the oldest these scripts run on (they use torch.optim.Muon); "
        "upgrade it: pip install -U 'torch>=2.9' --index-url https://download.pytorch.org/whl/cu126"], err


MMAPPED = """
import ctypes, torch, device
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t)
                for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
def mmapped_by(make):
    before = libc.mallinfo2().hblkhd
    kept = make()
    return libc.mallinfo2().hblkhd - before
print(mmapped_by(lambda: torch.empty(2**24)))
device.configure_backends(device.choose("cpu"), False)
print(mmapped_by(lambda: torch.empty(2**24)))
"""


@pytest.mark.skipif(not (sys.platform == "linux" and hasattr(ctypes.CDLL(None), "mallinfo2")),
                    reason="needs glibc 2.33+ (mallinfo2)")
def test_cpu_training_keeps_freed_memory_in_the_process():
    """A 64 MB tensor is mmap'd by glibc, and faulted in afresh every micro-step, until the CPU trainer's set-up."""
    import subprocess
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    p = subprocess.run([sys.executable, "-c", MMAPPED], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    before, after = map(int, p.stdout.split())
    assert before >= 2**26, "glibc did not mmap a 64 MB block here: nothing to check"
    assert after == 0


@pytest.mark.parametrize("version, dtype, compile, tagged", [
    ("2.11.0+cu130", "bfloat16", True, True),  # the caches' keys, which leave out autocast's dtype: given it
    ("2.12.1", "float16", True, True),
    ("2.13.0", "bfloat16", True, False),  # keyed on the dtype since
    ("2.11.0+cu130", "float32", True, False),  # no autocast: its own key
    ("2.11.0+cu130", "bfloat16", False, False),  # nothing compiled
])
def test_compiled_graphs_of_one_dtype_are_never_served_to_another(monkeypatch, version, dtype, compile, tagged):
    from torch._functorch import config as functorch_config
    from torch.compiler import config
    monkeypatch.setattr(torch, "__version__", version)
    choice = dataclasses.replace(device.choose("cpu", "bfloat16", compile), dtype=dtype)  # (CPU autocast: bf16)
    with config.patch(cache_key_tag="mine"), functorch_config.patch(enable_autograd_cache=True):  # set back after
        device.configure_backends(choice, False)
        assert config.cache_key_tag == (f"mine autocast-{dtype}" if tagged else "mine")  # the user's tag kept
        if tagged:  # another launch's choice in this process: its dtype instead
            device.configure_backends(dataclasses.replace(choice, dtype="float16"), False)
            assert config.cache_key_tag == "mine autocast-float16"
        assert functorch_config.enable_autograd_cache  # a relaunch in the same dtype still finds its graphs


CACHE_BY_DTYPE = """
import dataclasses, torch, device
from torch._dynamo.utils import counters
x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)
for dtype in ("float16", "bfloat16", "bfloat16"):  # three launches, the on-disk caches shared
    torch._dynamo.reset()
    counters.clear()
    device.configure_backends(dataclasses.replace(device.choose("cpu", "bfloat16", True), dtype=dtype), False)
    with torch.autocast("cpu", dtype=getattr(torch, dtype)):
        y = torch.compile(lambda x, w: x @ w)(x, w)
    y.float().sum().backward()
    print(y.dtype, "hit" if counters["aot_autograd"]["autograd_cache_hit"] else "miss")
"""


def test_a_bfloat16_compile_after_a_float16_one_computes_in_bfloat16(tmp_path):
    """On this machine's PyTorch, through the trainer's set-up: a float16 graph in the on-disk caches is not what a
    bfloat16 launch runs (before 2.13 it was, unless the dtype is in the caches' keys), and a second bfloat16 launch
    finds the first one's graph."""
    import subprocess
    import warm
    env = dict(warm.environment(), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # read at each use: warm
    out = subprocess.run([warm.python(), "-c", CACHE_BY_DTYPE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["torch.float16", "miss", "torch.bfloat16", "miss", "torch.bfloat16", "hit"]
