"""device.py: the autocast dtype each device gets, peak FLOP/s by GPU name, and waiting for the
right device."""
import pytest
import torch

import common
import device
from device import peak_flops


def test_peak_flops_by_gpu_name():
    assert peak_flops("cpu", "float32") is None and peak_flops("cpu", "bfloat16") is None
    assert peak_flops("Some Future GPU", "bfloat16") is None
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32") is None  # no honest fp32 peak
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA A10G", "bfloat16") == 70e12          # not the A100's entry
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert peak_flops("NVIDIA L40S", "bfloat16") == 362e12
    assert peak_flops("NVIDIA L4", "bfloat16") == 121e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("Tesla T4", "bfloat16") is None
    assert peak_flops("Tesla T4", "float16") == 65e12
    assert peak_flops("Tesla V100-SXM2-16GB", "float16") == 125e12


def test_dtype_and_device_choice(monkeypatch):
    assert device.pick_dtype("auto", "cpu") == "float32"
    with pytest.raises(common.UserError, match="float16"):
        device.pick_dtype("float16", "cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert device.pick_dtype("auto", "cuda") == "float16"  # T4 / V100: fp16 with a gradient scaler
    with pytest.raises(common.UserError, match="Tesla T4 has no bfloat16"):
        device.pick_dtype("bf16", "cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert device.pick_dtype("auto", "cuda:0") == "bfloat16"


def test_synchronize_waits_on_the_device_it_is_given(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("cuda", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append(("mps", None)))
    device.synchronize("cpu")
    assert calls == []  # CPU work is synchronous
    device.synchronize("cuda:1")
    device.synchronize("mps")
    assert calls == [("cuda", "cuda:1"), ("mps", None)]
