"""parallel.py: FSDP2 and DDP on two CPU processes (gloo) against one process, activation
checkpointing against none, an exact resume from full state dicts, and the memory plan's arithmetic.
Every scenario trains with the trainer's own step (train_gpt2.train_step) on its own loader."""
import datetime
import functools
import os
import random
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

import checkpoint
import memory
import metrics
import optim
import parallel
import runs
import train_gpt2
from dataloader import TokenLoader
from metrics import RunLog
from profiling import PhaseTimer
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
    return TokenLoader(data_dir, "train", 1, CONFIG["block_size"], rank, world, vocab_size=CONFIG["vocab_size"])


def train(model, optimizer, data, steps, ranks):
    """`steps` optimizer steps of train_gpt2.train_step (clip 1.0); each step's mean loss and
    gradient norm (before clipping) as floats."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    accum = BATCH // ranks.world_size
    losses, norms = [], []
    for _ in range(steps):
        loss, norm, _, finite = train_gpt2.train_step(model, optimizer, scaler, data, accum, ranks, "float32", 1.0)
        assert finite
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def run(raw, sharding, data_dir, ranks, steps=STEPS, checkpointing=False, compile=False, muon=None):
    """muon: the dtype of Muon's Newton-Schulz iteration (None: AdamW alone)."""
    model = parallel.wrap_model(raw, sharding, "cpu", "float32", checkpointing, compile)
    assert parallel.is_fsdp(model) == (sharding == "fsdp")
    optimizer = optim.configure(raw, 0.1, 1e-3, device_type="cpu", muon_lr=0.02 if muon else None,
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
    return functools.partial(train_gpt2.micro_step, ranks=ranks, dtype="float32",
                             scaler=torch.amp.GradScaler("cpu", enabled=False), grad_accum=1,
                             timer=PhaseTimer("cpu"))


def ddp_probe_against_the_step(ranks, data_dir):
    """The peaks of the real training step (train_gpt2.train_step, through DDP) and of the auto-fit's
    trials at micro-batches 1, 2 and 4 of 4 sequences per rank (accumulation 4, 2, 1); and the
    micro-batch it chooses where the step's own peaks say 1 fits and 2 does not. The step's
    optimizer keeps no state, so its peak is the micro-steps' (the fit adds AdamW's moments)."""
    T, per_rank = CONFIG["block_size"], 4
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**CONFIG))  # fp32, the bytes the plan's arithmetic assumes
    model = parallel.wrap_model(raw, "none", "cpu", "float32")
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step = {}
    for b in (1, 2, 4):
        data = TokenLoader(data_dir, "train", b, T, ranks.rank, ranks.world_size, vocab_size=CONFIG["vocab_size"])
        one_step = functools.partial(train_gpt2.train_step, model, optimizer, scaler, data, per_rank // b, ranks,
                                     "float32")
        for _ in range(2):  # DDP rebuilds its buckets after its first step
            one_step()
        step[b] = CountedMemory(model).peak_of(one_step)
    counter = CountedMemory(model)
    for b in (1, 2, 4):
        memory.trial_peak(model, trial_step(ranks), b, per_rank // b, T, "cpu", counter)
    moments = 8 * sum(p.numel() for p in raw.parameters())
    room = (step[1] + step[2]) / 2 + moments  # room for the step at 1, not at 2
    chosen = memory.choose_micro_batch(per_rank * T * ranks.world_size, ranks, model, "float32", T, trial_step(ranks),
                                       memory=CountedMemory(model, capacity=room / 0.9))
    return dict(step=[step[b] for b in (1, 2, 4)], probe=counter.peaks, chosen=chosen)


def fsdp_plan_against_the_trial(ranks, checkpointing):
    """What the FSDP memory plan (step_footprint) says a rank holds at micro-batches 1, 2 and 4, and what the
    trial there allocates on top of the weights."""
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**CONFIG))
    model = parallel.wrap_model(raw, "fsdp", "cpu", "float32", activation_checkpointing=checkpointing)
    counter = CountedMemory(model)
    for b in (1, 2, 4):
        memory.trial_peak(model, trial_step(ranks), b, 4 // b, CONFIG["block_size"], "cpu", counter)
    return dict(plan=[memory.step_footprint(model, ranks.world_size, "float32", CONFIG["block_size"], b)
                      for b in (1, 2, 4)], allocated=[p - a for p, a in zip(counter.peaks, counter.before)])


def worker(rank, world, tmp):
    """Every two-process scenario in one spawn (starting processes is the slow part)."""
    torch.set_num_threads(1)
    # a scenario that leaves one rank waiting fails in minutes instead of hanging the suite
    tdist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                             timeout=datetime.timedelta(minutes=5))
    ranks = parallel.Ranks(rank, rank, world, "cpu")
    data_dir = f"{tmp}/data"
    out = {}
    try:
        for name, sharding, ckpt in (("ddp", "none", False), ("fsdp", "fsdp", False),
                                     ("fsdp_ac", "fsdp", True), ("ddp_ac", "none", True)):
            model, _, _, losses, norms = run(tiny_gpt(), sharding, data_dir, ranks, checkpointing=ckpt)
            out[name] = dict(losses=losses, norms=norms, state=checkpoint.model_state(model))
        # Muon under DDP, and under FSDP, where each matrix is sharded and gathered for its Newton-Schulz
        # iteration (in bf16, and in fp16 as on GPUs without bf16); the optimizer state has the unsharded format
        for name, sharding, dtype in (("ddp_muon", "none", torch.bfloat16), ("fsdp_muon", "fsdp", torch.bfloat16),
                                      ("fsdp_muon_fp16", "fsdp", torch.float16),
                                      ("fsdp_muon_fp32", "fsdp", torch.float32)):
            model, opt, _, losses, norms = run(tiny_gpt(), sharding, data_dir, ranks, muon=dtype)
            out[name] = dict(losses=losses, norms=norms, state=checkpoint.model_state(model),
                             optimizer=checkpoint.optimizer_state(model, opt))

        # DDP with accumulation: where the gradients are between its micro-steps
        raw = tiny_gpt()
        model = parallel.wrap_model(raw, "none", "cpu", "float32")
        opt = optim.configure(raw, 0.1, 1e-3, device_type="cpu")
        watched = Watched(loader(data_dir, rank, world), raw)
        out["ddp_grad_storages"] = []
        for _ in range(3):  # DDP rebuilds its buckets in the second step
            watched.seen = []
            train(model, opt, watched, 1, ranks)
            out["ddp_grad_storages"].append((watched.seen, grad_storages(raw)))

        # an interrupted FSDP run, saved after RESUME_AT steps as the trainer saves it (rank 0 writes
        # the full state) and restored as the trainer restores it (every rank reads the file) into a
        # fresh, differently initialised model
        model, opt, data, losses, _ = run(tiny_gpt(), "fsdp", data_dir, ranks, steps=RESUME_AT)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        saver = checkpoint.Checkpointer(f"{tmp}/ckpt", 1, ranks, RunLog(f"{tmp}/ckpt", rank == 0))
        saver.attach(model=model, optimizer=opt, scaler=scaler, train_loader=data, config={}, fsdp=True)
        torch.rand(rank + 1), np.random.rand(rank + 1), random.random()  # each rank's generators elsewhere
        saver.save(RESUME_AT)
        out["draws_after_save"] = draws()
        out["holds_after_save"] = saver.holds(RESUME_AT)
        out["optimizer_at_resume"] = checkpoint.optimizer_state(model, opt)
        tdist.barrier()
        saved = checkpoint.load_file(metrics.checkpoint_path(f"{tmp}/ckpt", RESUME_AT))
        raw = tiny_gpt(seed=1)
        model = parallel.wrap_model(raw, "fsdp", "cpu", "float32")
        opt = optim.configure(raw, 0.1, 1e-3, device_type="cpu")
        data = loader(data_dir, rank, world)
        restorer = checkpoint.Checkpointer(f"{tmp}/ckpt", 1, ranks, RunLog(f"{tmp}/ckpt", False),
                                           checkpoint.Resume("ckpt", saved, []))
        torch.manual_seed(999), np.random.seed(999), random.seed(999)
        assert restorer.attach(model=model, optimizer=opt, scaler=scaler, train_loader=data, config={},
                               fsdp=True) == RESUME_AT
        out["draws_after_restore"] = draws()
        more, _ = train(model, opt, data, STEPS - RESUME_AT, ranks)
        out["resumed"] = dict(losses=losses + more, state=checkpoint.model_state(model))

        # per-block torch.compile under FSDP, with the aot_eager backend: the same graphs as
        # inductor's up to code generation, without a C++ compile on a small CPU
        real_compile = torch.compile
        torch.compile = functools.partial(real_compile, backend="aot_eager")
        try:
            model, _, _, losses, _ = run(tiny_gpt(), "fsdp", data_dir, ranks, steps=2, checkpointing=True,
                                         compile=True)
        finally:
            torch.compile = real_compile
        out["fsdp_ac_compile"] = dict(losses=losses, keys=list(checkpoint.model_state(model)))

        # fp16 loss scaling: an inf in one rank's shard of the gradients must skip the step on every rank
        raw = tiny_gpt()
        model = parallel.wrap_model(raw, "fsdp", "cpu", "float32")
        opt = optim.configure(raw, 0.1, 1e-3, device_type="cpu")
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        x, _ = loader(data_dir, 0, 1).next_batch()
        scaler.scale(model(x, x)[1]).backward()
        if rank == 1:
            raw.transformer.h[0].mlp.c_fc.weight.grad.to_local().view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        out["found_inf"] = sum(v.item() for v in scaler._found_inf_per_device(opt).values())

        # what a rank holds between micro-steps: its shard of each gradient, reduce-scattered at once,
        # never the full fp32 gradient kept until the last micro-step
        raw = tiny_gpt()
        model = parallel.wrap_model(raw, "fsdp", "cpu", "float32")
        with parallel.grad_sync(model, False):  # a micro-step that is not the last
            model(x, x)[1].backward()
        out["between_micro_steps"] = [(p.to_local().numel(), p.numel(), None if p.grad is None else
                                       p.grad.to_local().numel()) for p in raw.parameters()]

        # the micro-batch auto-fit where rank 1 cannot hold a micro-batch of 4: under DDP its trial there fails
        # (a cuBLAS failure in the forward), under FSDP its memory plan says so (a smaller GPU)
        T = CONFIG["block_size"]
        out["probe"] = {}
        for name in ("ddp", "fsdp"):
            raw = tiny_gpt()
            model = parallel.wrap_model(raw, name if name == "fsdp" else "none", "cpu", "float32")
            capacity = 2 ** 40
            if rank == 1 and name == "fsdp":
                capacity = (memory.step_footprint(model, world, "float32", T, 2) + 1) / 0.9
            elif rank == 1:
                failure = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")
                raw.forward = functools.partial(failing_forward, raw, failure)
            out["probe"][name] = outcome(memory.choose_micro_batch, 16 * T * world, ranks, model, "float32", T,
                                         trial_step(ranks), memory=FakeMemory(capacity))

        out["ddp_probe"] = outcome(ddp_probe_against_the_step, ranks, data_dir)
        out["fsdp_plan"] = {ac: outcome(fsdp_plan_against_the_trial, ranks, ac) for ac in (False, True)}
    finally:
        tdist.destroy_process_group()
    torch.save(out, f"{tmp}/out{rank}.pt")
    os._exit(0)  # skip the interpreter's shutdown, where gloo's threads can abort the process (common.exit_process)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    os.makedirs(tmp / "data")
    write_shard(str(tmp / "data"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(2, str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"out{r}.pt", weights_only=False) for r in range(2)], tmp


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, plain model, the same 4 sequences as 4 micro-steps of 1."""
    data_dir = write_shard(str(tmp_path_factory.mktemp("data")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    raw = tiny_gpt()
    one = parallel.Ranks()
    _, _, _, losses, norms = run(raw, "none", data_dir, one)
    half = tiny_gpt()
    _, opt, _, _, _ = run(half, "none", data_dir, one, steps=RESUME_AT)
    muon = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        m = tiny_gpt()
        _, muon_opt, _, muon_losses, muon_norms = run(m, "none", data_dir, one, muon=dtype)
        muon[dtype] = dict(losses=muon_losses, norms=muon_norms, state=m.state_dict(), optimizer=muon_opt.state_dict())
    torch.set_num_threads(threads)
    return dict(losses=losses, norms=norms, state=raw.state_dict(), optimizer_at_resume=opt.state_dict(), muon=muon)


def assert_states_close(a, b, rtol=1e-5, atol=1e-6):
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp_ac", "ddp_ac"])
def test_two_processes_match_one_process(two_ranks, one_process, name):
    (r0, r1), _ = two_ranks
    got = r0[name]
    assert got["losses"] == r1[name]["losses"]  # the reduced loss is the same on every rank
    assert got["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
    assert got["norms"] == pytest.approx(one_process["norms"], rel=1e-5)
    assert_states_close(got["state"], one_process["state"])
    if name.startswith("fsdp"):
        assert r1[name]["state"] == {}  # the full state dict is gathered on rank 0 only


# 16-bit Newton-Schulz rounds its input to 8 or 11 bits: where FSDP's gradients differ from one process's in the last
# bit (torch 2.9's FSDP sums in another order; 2.13's match to the bit), a rounding can flip and spread through the
# iteration: after 4 steps, states within 1e-3 (bf16) and 1e-4 (fp16) on 2.9. float32 shows the logic to 5e-8.
SIXTEEN_BIT = {torch.bfloat16: 2e-3, torch.float16: 3e-4}


@pytest.mark.parametrize("name, dtype", [("ddp_muon", torch.bfloat16), ("fsdp_muon_fp32", torch.float32),
                                         ("fsdp_muon", torch.bfloat16), ("fsdp_muon_fp16", torch.float16)])
def test_muon_on_two_processes_matches_one_process(two_ranks, one_process, name, dtype):
    """--optimizer muon under DDP and under FSDP trains as one process does (under FSDP each
    matrix's update is gathered and orthogonalised whole, in fp32, bf16 or fp16), and its checkpointed
    state (Muon's momentum, AdamW's moments) has the one-process format."""
    (r0, r1), _ = two_ranks
    got, ref = r0[name], one_process["muon"][dtype]
    atol = SIXTEEN_BIT.get(dtype) if name.startswith("fsdp") else None
    assert got["losses"] == r1[name]["losses"]
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5 if atol is None else 1e-3)
    assert_states_close(got["state"], ref["state"], atol=atol or 1e-6)
    for mine, theirs in zip(got["optimizer"]["optimizers"], ref["optimizer"]["optimizers"]):
        assert mine["param_groups"] == theirs["param_groups"] and list(mine["state"]) == list(theirs["state"])
        for i, s in theirs["state"].items():
            assert list(mine["state"][i]) == list(s)
            for key in s:
                torch.testing.assert_close(mine["state"][i][key], s[key], rtol=1e-5, atol=atol or 1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_muon_under_fsdp_gathers_each_matrix_once(dtype):
    """Muon's step on FSDP's shards over 3 ranks (uneven: 32 rows are 11, 11 and 10), counted on a
    fake process group (collectives are recorded, not run): one all-gather per matrix and no other
    collective, where Newton-Schulz on the shards themselves would redistribute at every product."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        raw = GPT(GPTConfig(**CONFIG))
        parallel.wrap_model(raw, "fsdp", "cpu", "float32")
        muon, _ = optim.configure(raw, 0.1, 1e-3, muon_lr=0.02, muon_dtype=dtype).optimizers
        matrices = [p for group in muon.param_groups for p in group["params"]]
        for p in matrices:
            p.grad = DTensor.from_local(torch.randn(p.to_local().shape), p.device_mesh, p.placements, shape=p.shape,
                                        stride=p.stride())
        with CommDebugMode() as comm:
            muon.step()
        counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items() if n}
        assert counts == {"all_gather_into_tensor": len(matrices)} and len(matrices) == 4 * CONFIG["n_layer"]
    finally:
        tdist.destroy_process_group()


def test_ddp_accumulates_in_its_buckets(two_ranks):
    """Under DDP the micro-steps accumulate into its buckets (gradient_as_bucket_view) from the first
    step on: between micro-steps every gradient is in the storages that hold the gradients after
    the step, fewer than the parameters (one per bucket), never in fresh tensors beside them (a
    second copy of the gradients, which the memory plan does not count)."""
    n = len(list(tiny_gpt().parameters()))
    for r in two_ranks[0]:
        for seen, (count, after) in r["ddp_grad_storages"]:
            assert count == n and len(after) < n
            for held in seen[1:]:  # the first is taken before the step's first backward
                assert held == (n, after), (seen, after)


def test_activation_checkpointing_gives_the_same_training(two_ranks):
    (r0, _), _ = two_ranks
    assert r0["fsdp_ac"]["losses"] == pytest.approx(r0["fsdp"]["losses"], rel=1e-6)
    assert_states_close(r0["fsdp_ac"]["state"], r0["fsdp"]["state"], rtol=1e-6, atol=1e-7)
    assert r0["ddp_ac"]["losses"] == r0["ddp"]["losses"]  # recomputation, not approximation


def test_fsdp_holds_only_gradient_shards_between_micro_steps(two_ranks):
    """Under gradient accumulation each rank holds 1/world of the gradients, as the memory plan
    counts them (at GPT-2 XL the full ones would be 6.2 GB more per GPU)."""
    for r in two_ranks[0]:
        held = r["between_micro_steps"]
        assert all(grad == shard for shard, _, grad in held), held
        assert sum(shard for shard, _, _ in held) <= sum(full for _, full, _ in held) // 2 + 128


def test_micro_batch_auto_fit_agrees_when_one_rank_has_less_memory(two_ranks):
    """Rank 1 cannot hold a micro-batch of 4: under DDP its trial there fails (a cuBLAS failure inside the
    forward) and it tries smaller sizes by itself, without collectives; under FSDP its memory plan says so.
    Both ranks take 2, the largest size that fits everywhere, by one all-reduce."""
    (r0, r1), _ = two_ranks
    assert r0["probe"]["ddp"] == r1["probe"]["ddp"] == 2
    assert r0["probe"]["fsdp"] == r1["probe"]["fsdp"] == 2


def test_ddp_auto_fit_measures_the_step_as_it_trains(two_ranks):
    """Through DDP's wrapper, with the trainer's own micro-step: the trials' peaks are the real step's (to
    the bytes of its target tensor); the bare GPT's single forward and backward missed the
    gradients that accumulation holds between micro-steps, and counted a copy of them where DDP's
    buckets take them at once. So where the step's own peaks leave room for 1 and not 2, 1 it is."""
    for r in two_ranks[0]:
        got = r["ddp_probe"]
        assert isinstance(got, dict), got
        for probe, step in zip(got["probe"], got["step"]):
            assert abs(probe - step) <= 0.001 * step, (got["probe"], got["step"])
        assert got["chosen"] == 1


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp_memory_plan_covers_what_the_trial_allocates(two_ranks, checkpointing):
    """Under FSDP a rank tries one micro-batch only (a second trial would be a collective the others do not
    join), so the plan that picks it must hold at least what the trial allocates on top of the weights
    (activations, gradient shards, the collectives' buffers)."""
    for r in two_ranks[0]:
        got = r["fsdp_plan"][checkpointing]
        assert isinstance(got, dict), got
        assert len(got["plan"]) == len(got["allocated"]) == 3
        assert all(plan >= allocated for plan, allocated in zip(got["plan"], got["allocated"])), got


@pytest.mark.parametrize("room, trials", [(1.7e6, [4]), (2.0e6, [8, 4])])
def test_one_process_auto_fit_takes_the_planned_size_or_what_its_trial_allows(room, trials):
    """One GPU, 16 sequences of 32 tokens per step. The plan picks the largest size it fits under 90% of the
    memory; one trial of the trainer's micro-step checks it. At 1.7 MB the plan says 4 and the trial agrees; at
    2.0 MB the plan says 8, the trial's peak with AdamW's moments is over (at this toy scale the plan is 13% low),
    and the size its growth per sequence allows, 4, is tried and taken. Peaks as CUDA's allocator counts them."""
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**CONFIG))
    ranks = parallel.Ranks()
    counter = CountedMemory(raw, capacity=room / 0.9)
    T = CONFIG["block_size"]
    assert memory.choose_micro_batch(16 * T, ranks, raw, "float32", T, trial_step(ranks), memory=counter) == 4
    moments = 8 * sum(p.numel() for p in raw.parameters())
    assert len(counter.peaks) == len(trials) and counter.peaks[-1] + moments <= room
    assert all(memory.step_footprint(raw, 1, "float32", T, b) <= room for b in trials)  # the plan's choice first
    assert memory.step_footprint(raw, 1, "float32", T, trials[0] * 2) > room
    if len(trials) > 1:
        assert counter.peaks[0] + moments > room


def test_the_auto_fits_growth_per_sequence_leaves_out_the_gradients_and_leaves_none_behind():
    """Many parameters and short sequences (1.7 MB of gradients, far more than a sequence's activations), 64
    sequences a step, room for 19 parameter-sizes of bytes: the plan's first size is over in its trial, and the growth
    per sequence that picks the next one leaves out the gradients the trial made, which do not grow with the
    micro-batch (counted in, they would pick 2 where 4 fits: its trial's peak and AdamW's moments are under the room).
    The trials leave no gradient behind: the first real step starts from none."""
    config = dict(n_layer=2, n_head=2, n_embd=128, block_size=8, vocab_size=100, padded_vocab_size=128)
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**config))
    params = sum(p.numel() for p in raw.parameters())
    room, T, ranks = 19 * params, config["block_size"], parallel.Ranks()
    counter = CountedMemory(raw, capacity=room / 0.9)
    assert memory.choose_micro_batch(64 * T, ranks, raw, "float32", T, trial_step(ranks), memory=counter) == 4
    assert len(counter.peaks) == 2 and counter.peaks[0] + 8 * params > room >= counter.peaks[1] + 8 * params
    assert all(p.grad is None for p in raw.parameters())


def test_the_fsdp_plan_holds_its_two_largest_units_gathered():
    """Under FSDP a step holds, beyond the plan, the two largest units gathered at once (the all-gather's output and
    the unsharded gradients with their fp32 copy): here the two blocks, 12 x 32^2 + 13 x 32 = 12,704 parameters
    each, larger than the root (wte 128 x 32, wpe 32 x 32, ln_f 2 x 32: 5,184), at 2 + 4 bytes in bf16."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)  # a group of one, as --fsdp alone
    try:
        torch.manual_seed(0)
        raw = GPT(GPTConfig(**CONFIG))
        model = parallel.wrap_model(raw, "fsdp", "cpu", "float32")
        T, b = CONFIG["block_size"], 4
        plan = memory.memory_plan(12_704 * 2 + 5_184, 1, "fsdp", "bfloat16", b, T, 2, 32, vocab_size=128)
        assert memory.step_footprint(model, 1, "bfloat16", T, b) == plan["total"] + (2 + 4) * 2 * 12_704
    finally:
        tdist.destroy_process_group()


def test_processes_that_share_a_gpu_fit_into_their_share_of_it():
    """Two processes on one GPU (--dist-backend gloo) each fit their micro-batch into half of it: what one process
    chooses on a card of half the memory, not what it chooses on the whole card."""
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**CONFIG))
    T, room = CONFIG["block_size"], 2.0e6
    alone, shared = parallel.Ranks(), parallel.Ranks(per_node=2, gpus=1)
    assert shared.per_gpu == 2 and shared.shares_gpus and not alone.shares_gpus

    def chosen(ranks, capacity):
        return memory.choose_micro_batch(16 * T, ranks, raw, "float32", T, trial_step(ranks),
                                         memory=CountedMemory(raw, capacity=capacity))
    half, whole = chosen(alone, room / 2 / 0.9), chosen(alone, room / 0.9)
    assert half < whole and chosen(shared, room / 0.9) == half


def stranded_worker(rank, world, tmp):
    """Rank 1 runs out of memory in the backward pass of the FSDP trial; the group's timeout is short, as
    rank 0 is left waiting until torchrun ends it."""
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=20))
    ranks = parallel.Ranks(rank, rank, world, "cpu")
    raw = tiny_gpt()
    model = parallel.wrap_model(raw, "fsdp", "cpu", "float32")
    if rank == 1:
        raw.forward = functools.partial(out_of_memory_in_backward, raw)
    T = CONFIG["block_size"]
    result = outcome(memory.choose_micro_batch, 4 * T * world, ranks, model, "float32", T, trial_step(ranks),
                     memory=FakeMemory())
    torch.save(result, f"{tmp}/stranded{rank}.pt")
    os._exit(0)


def test_out_of_memory_in_an_fsdp_trial_is_one_line_on_its_rank(tmp_path):
    """Rank 1 runs out of memory in the backward pass of the trial at 4, which its plan allowed: its
    collectives and rank 0's no longer match, so the fit cannot go on. Rank 1 stops with one line naming
    the rank and a size to pass instead; under torchrun its exit ends rank 0, which waits on a collective
    (here the group's timeout ends it)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(stranded_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"stranded{r}.pt", weights_only=False) for r in range(2))
    assert r1 == ("UserError: the micro-batch auto-fit ran out of GPU memory on rank 1 at 4 x 32 tokens under "
                  "FSDP: pass a --micro-batch-size below 4")
    assert r0 != 4 and not isinstance(r0, int), r0


def test_each_rank_gets_its_own_random_state_back(two_ranks):
    """Nothing in training draws from the global generators today, so no loss shows whether they come back; a
    future dropout or unseeded sampling would. Each rank's state, saved with the checkpoint, is restored on that
    rank: the draws after the restore are the draws after the save, and the ranks' differ."""
    r0, r1 = two_ranks[0]
    assert r0["draws_after_restore"] == r0["draws_after_save"]
    assert r1["draws_after_restore"] == r1["draws_after_save"]
    assert r0["draws_after_save"] != r1["draws_after_save"]


def test_every_rank_knows_the_checkpoint_was_written(two_ranks):
    """Rank 0 writes the file; a stop right after a scheduled checkpoint asks each rank whether the step is saved,
    and a rank that answered no would call save()'s collectives alone and wait for the others forever."""
    r0, r1 = two_ranks[0]
    assert r0["holds_after_save"] is True and r1["holds_after_save"] is True


def test_fsdp_checkpoint_is_a_plain_gpt_state_dict(two_ranks):
    """Activation checkpointing and sharding leave the names alone: sample.py's GPT.load_state_dict
    reads the checkpoint, weight tying included."""
    (r0, _), _ = two_ranks
    state = r0["fsdp_ac"]["state"]
    assert list(state) == list(tiny_gpt().state_dict())
    assert all(v.device.type == "cpu" and not hasattr(v, "to_local") for v in state.values())
    fresh = tiny_gpt(seed=1)
    fresh.load_state_dict(state)  # strict
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert r0["fsdp_ac_compile"]["keys"] == list(state)


def test_fsdp_resume_from_full_state_dicts_is_exact(two_ranks):
    (r0, _), _ = two_ranks
    assert r0["resumed"]["losses"] == r0["fsdp"]["losses"]
    for k, v in r0["fsdp"]["state"].items():
        assert torch.equal(r0["resumed"]["state"][k], v), k


def test_fsdp_optimizer_state_has_the_unsharded_format(two_ranks, one_process):
    """optimizer_state numbers parameters as optimizer.state_dict() does on one process, so DDP and
    FSDP checkpoints are interchangeable."""
    (r0, _), _ = two_ranks
    got, ref = r0["optimizer_at_resume"], one_process["optimizer_at_resume"]
    assert got["param_groups"] == ref["param_groups"]
    assert list(got["state"]) == list(ref["state"])
    for i, s in ref["state"].items():
        assert list(got["state"][i]) == list(s)
        for key in s:
            torch.testing.assert_close(got["state"][i][key], s[key], rtol=1e-4, atol=1e-7)


def test_fsdp_per_block_compile_matches_eager(two_ranks):
    (r0, _), _ = two_ranks
    assert r0["fsdp_ac_compile"]["losses"] == pytest.approx(r0["fsdp"]["losses"][:2], rel=1e-6)


def test_fsdp_grad_scaler_skips_on_every_rank_when_one_shard_overflows(two_ranks):
    (r0, r1), _ = two_ranks
    assert r0["found_inf"] > 0 and r1["found_inf"] > 0


def test_grad_sync_and_clip_on_one_process():
    raw = tiny_gpt()
    model = parallel.wrap_model(raw, "none", "cpu", "float32", activation_checkpointing=True)
    assert model is raw  # no DDP in a world of one
    x = some_tokens()
    with parallel.grad_sync(model, False):
        model(x, x)[1].backward()
    norm = parallel.clip_grad_norm(model, float("inf"))
    assert type(norm) is torch.Tensor and norm.item() > 0


def saved_for_backward_bytes(model, x):
    """Bytes autograd keeps between forward and backward (what checkpointing is for)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, x)
    loss.backward()
    return sum(saved)


def test_activation_checkpointing_keeps_less_for_backward():
    x = some_tokens()
    plain = saved_for_backward_bytes(tiny_gpt(), x)
    raw = tiny_gpt()
    names = list(raw.state_dict())
    parallel.wrap_model(raw, "none", "cpu", "float32", activation_checkpointing=True)
    assert list(raw.state_dict()) == names
    checkpointed = saved_for_backward_bytes(raw, x)
    assert checkpointed < 0.5 * plain  # 0.26 here: the logits stay, the blocks do not


# ----------------------------------------------------------------------------------------------
# Memory plan: hand-computed numbers

GIB = 2 ** 30


def test_gpt2_xl_parameter_count():
    # wte 50304*1600 + wpe 1024*1600 + 48 blocks * (12*1600^2 + 13*1600) + ln_f 2*1600
    n = 50304 * 1600 + 1024 * 1600 + 48 * (12 * 1600 ** 2 + 13 * 1600) + 2 * 1600
    assert n == 1_557_686_400
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=48, n_head=25, n_embd=1600))
    assert sum(p.numel() for p in model.parameters()) == n


def test_memory_plan_ddp_gpt2_xl_fp32_does_not_shard():
    n = 1_557_686_400
    plan = memory.memory_plan(n, 8, "none", "float32", micro_batch=1, block_size=1024, n_layer=48,
                                n_embd=1600)
    assert plan["params"] == 4 * n and plan["grads"] == 4 * n and plan["optimizer"] == 8 * n
    sbh = 1024 * 1600
    assert plan["activations"] == 48 * 68 * sbh + 1024 * 50304 * 8
    assert plan["total"] == 16 * n + plan["activations"]
    assert round(16 * n / 1e9, 1) == 24.9  # the ~25 GB that does not fit a 24 GB card before any activation


def test_memory_plan_fsdp_gpt2_xl_bf16_with_checkpointing():
    n, world, b, s, h, L = 1_557_686_400, 8, 8, 1024, 1600, 48
    plan = memory.memory_plan(n, world, "fsdp", "bfloat16", micro_batch=b, block_size=s, n_layer=L,
                                n_embd=h, activation_checkpointing=True)
    block = 12 * h * h + 13 * h
    root = n - L * block  # wte, wpe, ln_f: 82,127,600
    assert root == 50304 * 1600 + 1024 * 1600 + 3200
    assert plan["params"] == 4 * n / 8 + 2 * (root + 2 * block)
    assert plan["grads"] == 4 * n / 8
    assert plan["optimizer"] == 8 * n / 8
    sbh = s * b * h
    assert plan["activations"] == L * 4 * sbh + 34 * sbh + s * b * 50304 * 10
    # by hand, GiB: params 0.7254 shard + 0.2675 gathered (root + 2 blocks in bf16), grads 0.7254,
    # AdamW 1.4507; activations 2.3438 block inputs + 0.4150 one block + 3.8379 logits
    assert plan["params"] / GIB == pytest.approx(0.9928, abs=1e-4)
    assert plan["activations"] / GIB == pytest.approx(6.5967, abs=1e-4)
    assert plan["total"] / GIB == pytest.approx(9.7656, abs=1e-4)
    line = memory.format_memory_plan(plan, capacity=24 * GIB)
    assert line == ("per GPU: params 1.0 GiB + grads 0.7 GiB + AdamW 1.5 GiB + activations ~6.6 GiB "
                    "= 9.8 GiB of 24.0 GiB")


def test_the_memory_line_shows_each_part_of_a_small_model_beside_a_gpu():
    """A 3.3M-parameter model on an 80 GiB GPU: every part in a unit that shows it, none 0.0 GiB.
    By hand: params 3.3M x (4 fp32 + 2 bf16) B = 18.9 MiB, grads 3.3M x 4 = 12.6 MiB, AdamW 3.3M x 8 = 25.2 MiB;
    activations 2 layers x 34 x 64 x 8 x 64 B + the logits 64 x 8 x 50,304 x 10 B = 247.7 MiB = 0.2 GiB."""
    plan = memory.memory_plan(3_300_000, 1, "none", "bfloat16", micro_batch=8, block_size=64, n_layer=2, n_embd=64)
    assert memory.format_memory_plan(plan, capacity=80 * GIB) == (
        "per GPU: params 18.9 MiB + grads 12.6 MiB + AdamW 25.2 MiB + activations ~0.2 GiB = 0.3 GiB of 80.0 GiB")
    assert memory.size(512) == "0.5 KiB"


def test_memory_plan_activations_without_checkpointing_and_ddp_autocast_copy():
    plan = memory.memory_plan(1000, 2, "none", "bfloat16", micro_batch=2, block_size=8, n_layer=3,
                                n_embd=4, vocab_size=16)
    assert plan["params"] == 4 * 1000 + 2 * 1000  # fp32 weights + autocast's bf16 copies
    assert plan["activations"] == 3 * 34 * (8 * 2 * 4) + 8 * 2 * 16 * 10


def test_whole_model_compile_with_checkpointing_matches_eager(monkeypatch):
    """sharding 'none' compiles the whole model (before DDP), checkpointed blocks inside it."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    x = some_tokens()
    _, want = tiny_gpt()(x, x)
    raw = tiny_gpt()
    model = parallel.wrap_model(raw, "none", "cpu", "float32", activation_checkpointing=True, compile=True)
    assert parallel.unwrap(model) is raw and list(raw.state_dict()) == list(tiny_gpt().state_dict())
    _, loss = model(x, x)
    loss.backward()
    torch.testing.assert_close(loss, want)
    assert raw.transformer.h[0].attn.c_attn.weight.grad is not None


@pytest.mark.parametrize("saved_fp16", [False, True])
def test_restore_across_a_change_of_dtype(tmp_path, saved_fp16):
    """A resume may change --dtype (a bf16 run continued on a T4, where auto picks fp16): the
    gradient scaler of the one precision restores from the checkpoint of the other."""
    data_dir = write_shard(str(tmp_path))
    one = parallel.Ranks()

    def checkpointer(fp16, resume=None):
        model, opt, data, _, _ = run(tiny_gpt(), "none", data_dir, one, steps=1)
        scaler = torch.amp.GradScaler("cpu", enabled=fp16, init_scale=2.0 ** 10)
        made = checkpoint.Checkpointer(str(tmp_path / "log"), 1, one, RunLog(str(tmp_path / "log"), False), resume)
        return made, made.attach(model=model, optimizer=opt, scaler=scaler, train_loader=data, config={}, fsdp=False)
    checkpointer(saved_fp16)[0].save(1)
    path = metrics.checkpoint_path(str(tmp_path / "log"), 1)
    restorer, step = checkpointer(not saved_fp16, checkpoint.Resume(path, checkpoint.load_file(path), []))
    assert step == 1
    assert restorer.scaler.is_enabled() != saved_fp16
    if not saved_fp16:
        assert restorer.scaler.get_scale() == 2.0 ** 10  # a fresh scale


def test_compiled_training_with_muon_matches_eager(tmp_path, monkeypatch):
    """torch.compile (aot_eager: inductor's graphs without a C++ build) with --optimizer muon."""
    data_dir = write_shard(str(tmp_path))
    one = parallel.Ranks()
    _, _, _, eager, _ = run(tiny_gpt(), "none", data_dir, one, steps=2, muon=torch.bfloat16)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    _, _, _, compiled, _ = run(tiny_gpt(), "none", data_dir, one, steps=2, compile=True, muon=torch.bfloat16)
    assert compiled == pytest.approx(eager, rel=1e-6)


EXIT_SCRIPT = """
import atexit, sys
sys.path.insert(0, {root!r})
import common
import parallel

def main():
    ranks = parallel.setup_distributed("cpu")
    assert parallel.gather(ranks.rank, ranks) == [0, 1]  # both are in the group (rank 0 hosts its store)
    atexit.register(print, "interpreter shutdown ran", flush=True)
    print(f"rank {{ranks.rank}} done", end="")  # not flushed: a pipe's buffer holds it until exit
    parallel.teardown_distributed()
    if ranks.rank == 1 and {fail!r}:
        raise common.UserError("rank 1 cannot go on")

common.run_main(main)
"""


@pytest.mark.parametrize("fail", [False, True])
def test_a_process_that_joined_a_group_exits_with_its_status_and_its_output(tmp_path, fail, free_port):
    """run_main in a process that joined a process group: its exit status (0, or 2 for a user
    error, with the one line), buffered output flushed, and no interpreter shutdown (where gloo's
    threads can abort a finished process, see common.exit_process)."""
    import subprocess
    import sys
    script = tmp_path / "ranks.py"
    script.write_text(EXIT_SCRIPT.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         fail=fail))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port),
                                                  GLOO_SOCKET_IFNAME="lo"))
             for r in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 2 if fail else 0], outs
    for rank, (out, err) in enumerate(outs):
        # gloo itself prints a connection line on stdout in some PyTorch versions (2.9)
        ours = "\n".join(line for line in out.split("\n") if not line.startswith("[Gloo]"))
        assert ours == f"rank {rank} done", (out, err)
    # no torchrun agent to compare errors through, and the group gone: the rank says it, with its rank
    assert outs[1][1].strip().splitlines()[-1:] == (["rank 1: error: rank 1 cannot go on"] if fail else []), outs[1][1]


def test_an_error_on_one_rank_ends_the_group_without_waiting_for_the_timeout(tmp_path):
    """Rank 1 raises in a step where destroying the process group would wait until --dist-timeout
    (10 minutes), as NCCL's finalize can: it leaves without, with its error in the output, and
    torchrun ends the group in seconds (bounded here by a generous 2 minutes from step 1's line on).
    Its summary names rank 1's error as the root cause (the error file of torch's @record), not rank 0's
    broken collective, which waits for torchrun to see rank 1 first."""
    args = runs.tiny(data_dir=runs.write_shards(str(tmp_path / "data")), log_dir=str(tmp_path / "log"),
                     max_steps=10, dist_timeout=10)
    p = runs.torchrun(["--standalone", "--nproc_per_node=2"], args, script=runs.FAULT_TRAINER,
                      env=dict(runs.ENV, FAULT="raise:1:2"))
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith("step     1 |"):  # rank 1 raises as step 2 begins
            break
    # the rest through the same reader (communicate() would read past what it has buffered already)
    rest = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
    rest.start()
    rest.join(timeout=120)
    waited = rest.is_alive()
    if waited:
        p.terminate()  # torchrun stops its workers
        rest.join()
    p.wait()
    text = "".join(out)
    assert "\nRuntimeError: fault injected\n" in text and not waited and p.returncode != 0, text[-3000:]
    root = text.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root and "RuntimeError: fault injected" in root, text[-3000:]
