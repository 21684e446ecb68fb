"""The tiny GPT and data of the parallel and memory tests, the trainer's own step run on them, and the memory counters
the micro-batch auto-fit reads (memory.CudaMemory) as CPU stand-ins: one that counts as CUDA's allocator counts, one
of a device that allocates nothing."""
import os
import random
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

import optim
import parallel
import train_gpt2
from dataloader import Data, TokenLoader
from model import GPT, GPTConfig

CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=100, padded_vocab_size=128)
BATCH = 4     # sequences per optimizer step, over all ranks
STEPS = 4
RESUME_AT = 2


def tiny_gpt(seed=0):
    """In float64: DDP, FSDP and accumulation sum the same gradients in different orders, and in
    float32 Adam's normalisation turns that rounding into visible differences on near-zero
    gradients; float64 leaves only the logic under test."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**CONFIG)).double()


def some_tokens():
    """BATCH random sequences, for the tests that run one forward pass by hand."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"]), generator=g)


def write_shard(data_dir):
    """Random tokens for STEPS optimizer steps, in fineweb's shard format."""
    tokens = np.random.default_rng(1234).integers(0, CONFIG["vocab_size"], BATCH * STEPS * CONFIG["block_size"] + 1)
    np.save(os.path.join(data_dir, "rand_train_000001.npy"), tokens.astype(np.uint16))
    return data_dir


def loader(data_dir, rank, world):
    """One sequence per micro-batch; window k goes to rank k % world, so a step covers the same
    BATCH sequences whatever the world size and accumulation."""
    return TokenLoader(Data(data_dir, CONFIG["vocab_size"]), "train", 1, CONFIG["block_size"],
                       parallel.Ranks(rank=rank, world_size=world))


def train(model, optimizer, data, steps, ranks):
    """`steps` optimizer steps of train_gpt2.train_step (clip 1.0); each step's mean loss and
    gradient norm (before clipping) as floats."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    accum = BATCH // ranks.world_size
    losses, norms = [], []
    for _ in range(steps):
        parts = train_gpt2.StepParts(model, optimizer, scaler, ranks, "float32", accum, 1.0)
        loss, norm, _, finite = train_gpt2.train_step(parts, data)
        assert finite
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def run(raw, sharding, data_dir, ranks, steps=STEPS, checkpointing=False, compile=False, muon=None):
    """muon: the dtype of Muon's Newton-Schulz iteration (None: AdamW alone)."""
    model = parallel.wrap_model(raw, sharding, "cpu", "float32", checkpointing, compile)
    assert parallel.is_fsdp(model) == (sharding == "fsdp")
    optimizer = optim.configure(raw, optim.Settings(0.1, 1e-3, muon_lr=0.02 if muon else None), device_type="cpu",
                                muon_dtype=muon)
    data = loader(data_dir, ranks.rank, ranks.world_size)
    losses, norms = train(model, optimizer, data, steps, ranks)
    return model, optimizer, data, losses, norms


class FakeMemory:
    """A device of `capacity` bytes on which nothing is allocated: its trials' peaks are 0."""

    def __init__(self, capacity=2 ** 40):
        self.limit = capacity

    def capacity(self):
        return self.limit

    def allocated(self):
        return 0

    def peak_of(self, run):
        run()
        return 0


def _plain(t):
    """The plain tensors under t (a DTensor: its local shard)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [p for n in names if isinstance(getattr(t, n), torch.Tensor) for p in _plain(getattr(t, n))]
    return [t]


def _storages(tree):
    """{data pointer: storage} of the tensors in a pytree."""
    found = {}
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            for t in _plain(leaf):
                storage = t.untyped_storage()
                if storage.data_ptr():
                    found[storage.data_ptr()] = storage
    return found


class CountedMemory(TorchDispatchMode):
    """The auto-fit's memory counters (memory.CudaMemory) on the CPU, counted as CUDA's allocator
    counts them: every storage an operation allocates while counting, until it is freed; what
    existed before (the model's weights) as allocated already. An allocation past `capacity`
    raises torch.OutOfMemoryError, as on a GPU. The peaks it saw are kept for the tests to read."""

    def __init__(self, model, capacity=2 ** 40):
        super().__init__()
        self.base = sum(s.nbytes() for s in _storages(list(parallel.unwrap(model).parameters())).values())
        self.limit = capacity
        self.live, self.current, self.high = {}, 0, 0
        self.peaks, self.before = [], []

    def capacity(self):
        return self.limit

    def allocated(self):
        return self.base + self.current

    def peak_of(self, run):
        self.before.append(self.allocated())
        self.high = self.current
        with self:
            run()
        self.peaks.append(self.base + self.high)
        return self.peaks[-1]

    def _free(self, key):
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))  # views and in-place results allocate nothing
        for key, storage in _storages(out).items():
            if key not in inputs and key not in self.live:
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                weakref.finalize(storage, self._free, key)
        self.high = max(self.high, self.current)
        if self.allocated() > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory in {func}")
        return out


def grad_storages(model):
    """How many parameters have a gradient, and the storages (data pointers) those gradients are in."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return len(grads), {g.untyped_storage().data_ptr() for g in grads}


class Watched:
    """A loader that notes grad_storages(model) as each micro-step asks for its batch."""

    def __init__(self, loader, model):
        self.loader, self.model, self.seen = loader, model, []

    def next_batch(self, *args, **kwargs):
        self.seen.append(grad_storages(self.model))
        return self.loader.next_batch(*args, **kwargs)


def failing_forward(raw, failure, idx, targets=None, **kw):
    """GPT.forward, except that a micro-batch of 4 or more raises `failure`."""
    if idx.size(0) >= 4:
        raise failure
    return GPT.forward(raw, idx, targets, **kw)


def out_of_memory_in_backward(raw, idx, targets=None, **kw):
    """GPT.forward, whose backward runs out of memory from a micro-batch of 4 on."""
    logits, loss = GPT.forward(raw, idx, targets, **kw)
    if idx.size(0) >= 4:
        def fail(grad):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss.register_hook(fail)
    return logits, loss


def outcome(scenario, *args, **kwargs):
    """scenario(*args, **kwargs), or the exception it raised, as 'Type: message'."""
    try:
        return scenario(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (the test reads it; the other scenarios go on)
        return f"{type(e).__name__}: {e}"


def draws():
    """A draw from each generator a run may use: Python's, numpy's and torch's."""
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def trial_step(ranks):
    """The trainer's micro-step as its auto-fit calls it: micro_step(model, x, y, sync)."""
    return train_gpt2.trial_step(train_gpt2.StepParts(None, None, torch.amp.GradScaler("cpu", enabled=False), ranks,
                                                      "float32"))


