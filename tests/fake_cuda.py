"""A CUDA driver for machines without one. install() answers the torch._C calls that reach the driver for the
GPUs described; torch.cuda's own Python layer above them (lazy initialisation, device-index handling, the
device count, memory statistics, seeding) runs as it does on a GPU, so a test sees what torch would say."""
import types

import torch
import torch._dynamo  # before the driver is faked: what it imports from a CUDA build's torch._C, a CPU build lacks

H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 80 * 2 ** 30)
T4 = ("Tesla T4", (7, 5), 15 * 2 ** 30)
# what a CUDA 13 build of PyTorch was compiled for (torch.cuda.get_arch_list())
ARCH_FLAGS = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_120"


class Driver:
    """The state a driver keeps: the current device, each GPU's memory fraction and allocator counters."""

    def __init__(self, gpus):
        self.gpus = list(gpus)
        self.current = 0
        self.fraction = [1.0] * len(self.gpus)
        self.allocated = [0] * len(self.gpus)
        self.peak = [0] * len(self.gpus)
        self.calls = []  # (name, device index) of each driver call that names a device

    def _index(self, name, device):
        if not 0 <= device < len(self.gpus):
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.calls.append((name, device))
        return device

    def properties(self, device):
        name, (major, minor), total = self.gpus[self._index("properties", device)]
        return types.SimpleNamespace(name=name, major=major, minor=minor, total_memory=total,
                                     multi_processor_count=132, gcnArchName="")

    def set_device(self, device):
        self.current = self._index("set_device", device)

    def get_fraction(self, device):
        return self.fraction[self._index("get_fraction", device)]

    def set_fraction(self, fraction, device):
        self.fraction[self._index("set_fraction", device)] = fraction

    def memory_stats(self, device):
        i = self._index("memory_stats", device)
        return {"allocated_bytes.all.current": self.allocated[i], "allocated_bytes.all.peak": self.peak[i]}

    def reset_peak(self, device):
        i = self._index("reset_peak", device)
        self.peak[i] = self.allocated[i]

    def exchange_device(self, device):
        """torch.cuda.device(d)'s switch: the current device becomes d; the one before is returned."""
        before, self.current = self.current, (self._index("exchange_device", device) if device >= 0 else self.current)
        return before

    def synchronize(self):
        self.calls.append(("synchronize", self.current))

    def record_memory_history(self, enabled, *args):
        self.calls.append(("memory_history", enabled, args[2]))  # what is recorded, and how many entries at most


def install(monkeypatch, gpus=(H100,), arch_flags=ARCH_FLAGS, cuda_version="13.0"):
    """Make this process see the GPUs [(name, (major, minor), total bytes), ...] through a build of PyTorch for
    arch_flags (torch.cuda.get_arch_list()); returns the Driver."""
    driver = Driver(gpus)
    C = torch._C
    for name, value in {
        "_cuda_getDeviceCount": lambda: len(driver.gpus), "_cuda_init": lambda: None,
        "_cuda_getDevice": lambda: driver.current, "_cuda_setDevice": driver.set_device,
        "_cuda_getMemoryFraction": driver.get_fraction, "_cuda_setMemoryFraction": driver.set_fraction,
        "_cuda_memoryStats": driver.memory_stats, "_cuda_resetPeakMemoryStats": driver.reset_peak,
        "_cuda_emptyCache": lambda: driver.calls.append(("empty_cache", None)),
        "_cuda_getArchFlags": lambda: arch_flags,
        "_cuda_getCompiledVersion": lambda: 13000, "_cuda_synchronize": driver.synchronize,
        "_cuda_record_memory_history": driver.record_memory_history,
    }.items():
        monkeypatch.setattr(C, name, value, raising=False)
    cuda = torch.cuda
    # a CPU build's Python stand-ins for the driver's device switch
    monkeypatch.setattr(cuda, "_exchange_device", driver.exchange_device)
    monkeypatch.setattr(cuda, "_maybe_exchange_device", driver.exchange_device)
    monkeypatch.setattr(cuda, "_cudart", types.SimpleNamespace(), raising=False)
    monkeypatch.setattr(cuda, "_get_device_properties", driver.properties, raising=False)
    # a fresh process: nothing initialised, no device count cached, no calls queued for initialisation
    monkeypatch.setattr(cuda, "_initialized", False)
    monkeypatch.setattr(cuda, "_cached_device_count", None)
    monkeypatch.setattr(cuda, "_queued_calls", [])
    monkeypatch.setattr(cuda, "_lazy_seed_tracker", type(cuda._lazy_seed_tracker)())
    # each GPU's default random generator: a CPU generator keeps its state
    monkeypatch.setattr(cuda, "default_generators", tuple(torch.Generator() for _ in driver.gpus))
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    return driver
