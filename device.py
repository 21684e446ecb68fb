"""Devices and precision: the device and autocast dtype to run on, waiting for the device, its peak FLOP/s."""

import argparse
import contextlib
import ctypes
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from common import UserError

MIN_TORCH = (2, 9)  # torch.optim.Muon; the test suite passes on 2.9.1 (README)
TORCH_FLOOR = ".".join(map(str, MIN_TORCH))
TRITON_MIN_CAPABILITY = (7, 0)  # Triton, which torch.compile's inductor writes GPU kernels in, needs Volta+

# The wheels for GPUs that pip's default PyTorch has no kernels for (PyTorch's RELEASE.md support matrix):
# the CUDA 12.6 builds carry sm_50 to sm_90 (the P100 and V100 included); Blackwell needs CUDA 12.8 or newer.
LEGACY_WHEELS = "https://download.pytorch.org/whl/cu126"
BLACKWELL_WHEELS = "https://download.pytorch.org/whl/cu130"


class Flags:
    """This room's flags in the trainer's command line (train_config composes every room's)."""

    @staticmethod
    def add_flags(a):
        a("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps")
        a("--dtype", default="auto", help="auto (bf16 on Ampere+, fp16 on T4/V100, fp32 on CPU), bfloat16, float16 "
                                          "or float32")
        a("--compile", action=argparse.BooleanOptionalAction, default=None,
          help="torch.compile the model (default: on for CUDA, off elsewhere)")


def wheel_index(capability):
    """The wheel index with kernels for a GPU of this compute capability, or None where no PyTorch we run on has."""
    if capability < (5, 0):
        return None
    return LEGACY_WHEELS if capability < (10, 0) else BLACKWELL_WHEELS


def reinstall(capability):
    return f"pip uninstall -y torch && pip install 'torch>={TORCH_FLOOR}' --index-url {wheel_index(capability)}"


def listed_gpu():
    """(name, compute capability) of the first GPU nvidia-smi lists, or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        name, capability = out.splitlines()[0].rsplit(",", 1)
        return name.strip(), tuple(int(n) for n in capability.split("."))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):  # no nvidia-smi, no GPU, an old driver
        return None


def major_minor(version):
    """(2, 11) of a PyTorch version string such as '2.11.0+cu130'."""
    return tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())


def torch_too_old(version):
    """The line to stop on where PyTorch `version` is older than MIN_TORCH, else None."""
    if major_minor(version) >= MIN_TORCH:
        return None
    gpu = listed_gpu()
    index = wheel_index(gpu[1]) if gpu else None
    return (f"error: PyTorch {version} is older than {TORCH_FLOOR}, the oldest these scripts run on (they use "
            f"torch.optim.Muon); upgrade it: pip install -U 'torch>={TORCH_FLOOR}'"
            + (f" --index-url {index}" if index else ""))


if too_old := torch_too_old(torch.__version__):  # before model.py fails on the missing torch.optim.Muon
    print(too_old, file=sys.stderr)
    raise SystemExit(2)


def has_kernels(capability, arch_list):
    """Whether a build for arch_list (torch.cuda.get_arch_list()) runs on a GPU of this capability: machine code
    for sm_XY runs on X.Y and the later GPUs of major X, PTX (compute_XY) on X.Y and every later GPU."""
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        number = number.rstrip("af")  # sm_90a, sm_100f: the same machine code, narrower or wider
        if number.isdigit() and divmod(int(number), 10) <= capability:
            if kind == "compute" or int(number) // 10 == capability[0]:
                return True
    return False


def check_kernels(device):
    """Stop with one line where this PyTorch has no kernels for the GPU(s) device names ('cuda': all visible)."""
    arch_list = torch.cuda.get_arch_list()
    if torch.version.cuda is None or not arch_list:  # ROCm, or a build that does not say
        return
    index = torch.device(device).index
    for i in range(torch.cuda.device_count()) if index is None else [index]:
        with warnings.catch_warnings():  # PyTorch's own, several lines, as CUDA starts: ours is one
            warnings.simplefilter("ignore")
            capability = tuple(torch.cuda.get_device_capability(i))
        if has_kernels(capability, arch_list):
            continue
        gpu = f"the {torch.cuda.get_device_name(i)} (compute capability {capability[0]}.{capability[1]})"
        if wheel_index(capability) is None:
            raise UserError(f"no PyTorch {TORCH_FLOOR} or newer has kernels for {gpu}: use another GPU or --device cpu")
        raise UserError(f"PyTorch {torch.__version__} has no kernels for {gpu}: it was built for "
                        f"{' '.join(arch_list)}. Install a build that has: {reinstall(capability)}")


def pick_device(requested="auto"):
    """'auto' prefers CUDA, then Apple MPS, then the CPU, which it refuses where nvidia-smi lists a GPU this
    PyTorch cannot use. A CUDA device is checked against the kernels this PyTorch was built with."""
    if requested in (None, "auto") and not torch.cuda.is_available():
        if torch.backends.mps.is_available():
            return "mps"
        gpu = listed_gpu()
        if gpu is None:
            return "cpu"
        name, capability = gpu
        why = ("a CPU-only build" if torch.version.cuda is None else
               f"its CUDA {torch.version.cuda} needs a newer driver, or CUDA_VISIBLE_DEVICES hides the GPU")
        fix = f"install a build that can: {reinstall(capability)}" if wheel_index(capability) else "use another GPU"
        raise UserError(f"nvidia-smi lists a GPU, the {name}, but PyTorch {torch.__version__} cannot use it "
                        f"({why}): {fix}; or pass --device cpu to run on the CPU")
    if requested in (None, "auto"):
        requested = "cuda"
    kind, _, index = requested.partition(":")
    if kind not in ("cpu", "cuda", "mps"):
        raise UserError(f"unknown device {requested!r}: use auto, cpu, cuda, cuda:N or mps")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps but Apple MPS is not available here; use --device cpu")
    if kind != "cuda":
        return kind
    if not torch.cuda.is_available():
        raise UserError(f"--device {requested} but PyTorch sees no CUDA GPU "
                        f"(torch {torch.__version__}); use --device cpu or install a CUDA build of PyTorch")
    if index:
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise UserError(f"--device {requested}: the GPUs visible are cuda:0 to "
                            f"cuda:{torch.cuda.device_count() - 1}")
        # what asks for the current device (cuBLAS handles, CUDA events) must get this one, not cuda:0
        torch.cuda.set_device(requested)
    check_kernels(requested)
    return requested


def bf16_supported(device):
    """Whether the device computes in bfloat16 natively (emulation on old GPUs does not count)."""
    if not device.startswith("cuda") or torch.version.hip:  # the CPU, MPS and every GPU ROCm runs on have it
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)  # this one: is_bf16_supported() asks the current one


def compile_blocker(device):
    """Why torch.compile cannot run on this device, as a phrase, or None where it can."""
    if not device.startswith("cuda"):
        return None
    triton = "Triton, which torch.compile generates GPU code with,"
    major, minor = torch.cuda.get_device_capability(device)
    if not torch.version.hip and (major, minor) < TRITON_MIN_CAPABILITY:
        return (f"the {torch.cuda.get_device_name(device)} has compute capability {major}.{minor}, and {triton} needs "
                f"{'.'.join(map(str, TRITON_MIN_CAPABILITY))} or newer")
    from torch.utils import _triton  # inductor's own question (Windows wheels, Linux without the triton package)
    if not _triton.has_triton():
        return f"{triton} is not installed with this PyTorch (pip install triton on Linux; Windows wheels lack it)"
    return None


def muon_dtype(device):
    """What Muon's Newton-Schulz iteration runs in: bfloat16 (torch.optim.Muon's) where the device has it, else fp16."""
    return torch.bfloat16 if bf16_supported(device) else torch.float16


def pick_dtype(requested, device):
    """'auto': bf16 on GPUs that have it (Ampere+), fp16 on older GPUs (T4, V100), fp32 on CPU."""
    if requested in (None, "auto"):
        if device.startswith("cuda"):
            return "bfloat16" if bf16_supported(device) else "float16"
        return "float32"
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
    dtype = aliases.get(requested, requested)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise UserError(f"unknown dtype {requested!r}: use auto, bfloat16, float16 or float32")
    if dtype == "bfloat16" and not bf16_supported(device):
        raise UserError(f"{device_name(device)} has no bfloat16 support: use --dtype float16 (or auto)")
    if dtype == "float16" and device == "cpu":
        raise UserError("float16 autocast is not supported on CPU: use --dtype bfloat16 or float32")
    return dtype


@dataclass(frozen=True)
class Choice:
    """What this device allows, decided once by choose(): the trainer, sample.py and the scoring scripts read it,
    and the run header prints it."""
    device: str                     # cpu, mps, cuda or cuda:N
    name: str                       # the GPU's name (what peak_flops looks up), or the device
    dtype: str                      # the autocast dtype: float32, bfloat16 or float16
    compile: bool                   # torch.compile on
    compile_blocker: Optional[str]  # why torch.compile cannot run here; None where it can
    muon_dtype: torch.dtype         # what Muon's Newton-Schulz iteration runs in
    peak_flops: Optional[float]     # dense peak FLOP/s in dtype, what MFU divides by; None where unknown
    capacity: Optional[int]         # bytes this process may allocate on the GPU; None off CUDA

    @property
    def mfu_basis(self):
        """What the run header says the step lines' MFU divides by."""
        if self.peak_flops is None:
            return f"MFU n/a (no {self.dtype} peak known for {self.name})"
        return f"MFU of {self.peak_flops / 1e12:g} TFLOP/s ({self.dtype} dense peak)"

    def warnings(self, deterministic, micro_batch_tokens):
        """The settings that make training slow on this device, each as one line of advice."""
        warn = []
        if self.device == "cpu" and torch.cuda.is_available():
            warn.append("training on the CPU although a CUDA GPU is present: drop --device cpu")
        if deterministic:
            warn.append("--deterministic is on: slower kernels; use it for reproducibility studies only")
        if self.device.startswith("cuda"):
            if self.dtype == "float32" and bf16_supported(self.device):
                warn.append("float32 on a GPU with bfloat16: several times slower; use --dtype auto")
            if not self.compile and self.compile_blocker is None:
                warn.append("torch.compile is off on CUDA: expect slower steps (compile gave 1.27x on an H200); drop "
                            "--no-compile")
            if micro_batch_tokens < 8192:
                warn.append(f"a micro-batch of {micro_batch_tokens} tokens is small enough for the GPU to idle; "
                            "raise --micro-batch-size (or use auto)")
        return warn


def choose(device, dtype="auto", compile=None, compile_typed=False, memory_snapshot=False):
    """The Choice for a device pick_device gave: the dtype from --dtype, compile from --compile (None: on where
    CUDA can compile); compile_typed: --compile was typed (not a resumed run's), so a blocker refuses it. Refuses
    --memory-snapshot off CUDA."""
    dtype = pick_dtype(dtype, device)
    cuda = device.startswith("cuda")
    if memory_snapshot and not cuda:
        raise UserError(f"--memory-snapshot records what CUDA's allocator holds, and this run is on {device}: drop it")
    blocker = compile_blocker(device)
    if compile and blocker and compile_typed:
        raise UserError(f"--compile: {blocker}; leave it out (compile is off by default there)")
    name = device_name(device)
    return Choice(device=device, name=name, dtype=dtype, compile=bool((cuda if compile is None else compile)
                                                                         and blocker is None),
                    compile_blocker=blocker, muon_dtype=muon_dtype(device), peak_flops=peak_flops(name, dtype),
                    capacity=CudaMemory(device).capacity() if cuda else None)


def configure_backends(choice, deterministic):
    """The trainer's switches for the device decided: TF32 for fp32 matmuls on CUDA, glibc keeping freed memory
    on a Linux CPU, compiled graphs kept apart by dtype, and --deterministic's."""
    if choice.device == "cpu" and sys.platform == "linux" and hasattr(libc := ctypes.CDLL(None), "mallopt"):
        libc.mallopt(-4, 0)  # M_MMAP_MAX 0: no block mmap'd (logits over 32 MB were faulted in anew each micro-step)
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: freed memory kept; 2.4x a small model's step (BENCHMARKS.md)
    if choice.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for any fp32 matmul left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    keep_compiled_graphs_apart(choice)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


# Before 2.13, PyTorch's on-disk cache of compiled training graphs (AOTAutograd's) was keyed on whether autocast
# was on, not on its dtype (fixed by pytorch/pytorch#181564): a bfloat16 launch after a float16 one on the same
# machine ran the float16 graph, without a gradient scaler (seen on an H200 with torch 2.11: loss 8.69 after 12
# steps where eager bfloat16 reached 6.84).
AUTOCAST_DTYPE_KEYED = (2, 13)


def keep_compiled_graphs_apart(choice):
    """Where compiled 16-bit graphs could be served to a launch in the other dtype, add the dtype to the key of every
    compile cache (torch.compiler.config.cache_key_tag, PyTorch's own way to part caches; a tag the user set through
    TORCH_COMPILE_CACHE_KEY_TAG is kept in front), so a launch in the same dtype still finds its graphs."""
    if choice.compile and choice.dtype != "float32" and major_minor(torch.__version__) < AUTOCAST_DTYPE_KEYED:
        from torch.compiler import config
        mine = f"autocast-{choice.dtype}"
        config.cache_key_tag = " ".join([t for t in config.cache_key_tag.split() if not t.startswith("autocast-")]
                                        + [mine])


class CudaMemory:
    """A GPU's memory counters, which the micro-batch auto-fit reads (tests pass counters of their own)."""

    def __init__(self, device):
        # 'cuda' is the current GPU; torch's memory-fraction query refuses a device without its index
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def capacity(self):  # the card's bytes, under torch.cuda.set_per_process_memory_fraction's limit
        return int(torch.cuda.get_device_properties(self.device).total_memory
                   * torch.cuda.get_per_process_memory_fraction(self.device))

    def allocated(self):
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self):  # the peak counts from here on
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self):  # the most memory allocated since reset_peak
        return torch.cuda.max_memory_allocated(self.device)

    def peak_of(self, run):  # run(); the most memory allocated while it ran, what was allocated before included
        torch.cuda.empty_cache()
        self.reset_peak()
        run()
        peak = self.peak()
        torch.cuda.empty_cache()  # blocks cached for this stream would not serve FSDP's collectives on theirs
        self.reset_peak()  # a trial's peak is not the training steps' (their records' peak_mem)
        return peak


def autocast(device, dtype):
    """Mixed-precision context for forward passes; a no-op for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, dtype))


def device_name(device):
    """The GPU's name (what peak_flops looks up), or the device ('cpu', 'mps')."""
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else device


def synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elif device == "mps":
        torch.mps.synchronize()


# Dense tensor-core peak FLOP/s from the vendors' datasheets, (bf16, fp16), None without bf16. A row matches a GPU
# whose name holds all its words, as whole words ("RTX A1000" is not an A100); more specific rows come first.
PEAK_FLOPS = [
    (("H100", "PCIE"), 756e12, 756e12),
    (("H100", "NVL"), 835e12, 835e12),
    (("H100",), 989e12, 989e12),   # SXM ("NVIDIA H100 80GB HBM3")
    (("H200", "NVL"), 835e12, 835e12),
    (("H200",), 989e12, 989e12),
    (("GH200",), 989e12, 989e12),
    (("A100",), 312e12, 312e12),
    (("A10G",), 70e12, 70e12),     # AWS's variant of the A10, lower clocks
    (("A10",), 125e12, 125e12),
    (("L40S",), 362e12, 362e12),
    (("L40",), 181e12, 181e12),
    (("L4",), 121e12, 121e12),
    (("RTX", "4090"), 165e12, 165e12),  # fp32 accumulate, which PyTorch uses
    (("RTX", "3090"), 71e12, 71e12),    # fp32 accumulate
    (("RTX", "A6000"), 155e12, 155e12),
    (("V100S",), None, 130e12),
    (("V100", "PCIE"), None, 112e12),
    (("V100",), None, 125e12),     # SXM2
    (("T4",), None, 65e12),
    # no tensor cores: PyTorch's fp16 matmuls accumulate in fp32 (CUBLAS_COMPUTE_32F), at the P100's fp32 rate
    (("P100", "PCIE"), None, 9.3e12),
    (("P100",), None, 10.6e12),    # SXM2
]


def peak_flops(device_name, dtype):
    """Dense peak FLOP/s of the GPU so named in 'bfloat16' or 'float16'; None for fp32, CPUs and unknown GPUs."""
    if not device_name or dtype not in ("bfloat16", "float16"):
        return None
    words = set(re.split(r"[\s\-_/]+", device_name.upper()))  # "Tesla V100-PCIE-16GB": TESLA, V100, PCIE, 16GB
    for model, bf16, fp16 in PEAK_FLOPS:
        if words.issuperset(model):
            return bf16 if dtype == "bfloat16" else fp16
    return None
