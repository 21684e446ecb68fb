"""
How the model is spread over processes: joining the process group (with or without torchrun),
DDP (every rank holds everything, the default) or FSDP2 (PyTorch's
torch.distributed.fsdp.fully_shard: parameters, gradients and optimizer state sharded over the
ranks), optional activation checkpointing, and the few places where the two differ for the
trainer: gradient sync during accumulation, gradient clipping, full state dicts for checkpoints,
a per-GPU memory plan, and the micro-batch auto-fit.

Imports only torch, the standard library, model.py, device.py and common.py.

Order the trainer follows (FSDP replaces the parameters with sharded DTensors, so anything that
holds parameters is built after it):
    ranks = setup_distributed(...)             # this process's rank, world size and device
    raw_model.to(device)                       # load the checkpoint's model weights here (or later,
                                               #   with load_model_state)
    model = wrap_model(raw_model, ...)         # compiles, checkpoints and wraps/shards
    micro_batch = choose_micro_batch(..., model, ...)  # --micro-batch-size auto: tries the model as it
                                               #   trains, before the optimizer state (it counts that itself)
    optimizer = optim.configure(raw_model, ...)       # after wrap_model: FSDP's sharded parameters
    load_optimizer_state(model, optimizer, ckpt["optimizer"])
    ... with grad_sync(model, last_micro_step): forward, backward
    norm = clip_grad_norm(model, max_norm)
    checkpoint: model_state(model), optimizer_state(model, optimizer) on every rank, saved by rank 0
"""

import datetime
import itertools
import json
import os
from contextlib import contextmanager

import torch
import torch.distributed as tdist
from torch.utils.checkpoint import checkpoint

import common
from common import UserError
from device import autocast, pick_device
from model import PADDED_VOCAB_SIZE, Block
from optim import Optimizers

SHARDINGS = ("none", "fsdp")


# ----------------------------------------------------------------------------------------------
# The process group


class Ranks:
    """This process's place in the run: rank, local rank, world size and device; the same with
    and without torchrun (a world of one)."""

    def __init__(self, rank=0, local_rank=0, world_size=1, device="cpu"):
        self.rank, self.local_rank, self.world_size, self.device = rank, local_rank, world_size, device

    @property
    def is_master(self):
        return self.rank == 0

    @property
    def multi(self):
        """More than one process: collectives are needed."""
        return self.world_size > 1

    @property
    def device_type(self):
        return self.device.split(":")[0]


def torchrun_restart():
    """How many times torchrun --max-restarts has started this group again (0: the first launch)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def setup_distributed(requested_device="auto", timeout_s=None):
    """Join the process group when launched by torchrun (NCCL on CUDA, gloo on CPU); a Ranks. A
    collective that waits longer than timeout_s fails (NCCL's watchdog aborts the process), so a
    dead or hung rank ends the group in bounded time and torchrun --max-restarts can start it again."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks(device=pick_device(requested_device))  # plain python, or torchrun with one process
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ["WORLD_SIZE"])
    device = pick_device(requested_device)
    if device.startswith("cuda"):
        # before the rendezvous, so that every rank stops at once instead of waiting for the ones
        # that cannot start ("invalid device ordinal")
        gpus = torch.cuda.device_count()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))  # torchrun's --nproc_per_node
        if max(per_node, local_rank + 1) > gpus:
            raise UserError(f"torchrun starts {max(per_node, local_rank + 1)} processes on this machine, one per GPU, "
                            f"but it has {gpus} GPU(s) visible: use --nproc_per_node={gpus}")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not tdist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s or 1800)
        # torchrun shares its rendezvous store with the process group, and after a restart
        # (--max-restarts) the failed attempt's keys are still in it: a rank can read a dead peer's
        # address before the new one is written, and fail to connect (pytorch/pytorch#135712).
        # One key prefix per attempt keeps the attempts apart.
        store, rank, world_size = next(tdist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = tdist.PrefixStore(f"attempt_{torchrun_restart()}", store)
        # device_id binds NCCL's communicator to this rank's GPU at once (no guess from the current
        # device at the first collective, and barriers know which GPU to use)
        extra = dict(device_id=torch.device(device)) if backend == "nccl" else {}
        tdist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                 **extra)
        common.mark_joined_process_group()
    return Ranks(rank, local_rank, world_size, device)


def teardown_distributed():
    """Leave the process group, if this process joined one."""
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def gather(obj, ranks):
    """A list with every rank's obj (on every rank). Every rank must call it."""
    if not ranks.multi:
        return [obj]
    out = [None] * ranks.world_size
    tdist.all_gather_object(out, obj)
    return out


def any_rank(flag, ranks):
    """True on every rank when flag is true on any rank (a collective in a multi-process run)."""
    if not ranks.multi:
        return bool(flag)
    t = torch.tensor([float(flag)], device=ranks.device)
    tdist.all_reduce(t)
    return t.item() > 0


# ----------------------------------------------------------------------------------------------
# Wrapping


def is_fsdp(model):
    """Whether the model (or the GPT under its wrappers) is sharded by FSDP2."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(unwrap(model), FSDPModule)


def unwrap(model):
    """The GPT under DDP's .module and torch.compile's ._orig_mod. Under FSDP2 the GPT itself is
    the sharded module (fully_shard works in place), so it is returned as is."""
    from torch.nn.parallel import DistributedDataParallel
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        else:
            return model


def _checkpointed(forward):
    def run(*args, **kwargs):
        # non-reentrant: works with keyword arguments, with FSDP2's hooks and inside torch.compile
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def _set_block_forwards(raw_model, activation_checkpointing, compile_blocks):
    """Replace each Block's forward by an instance attribute rather than wrapping the module:
    checkpoint_wrapper and torch.compile(module) add '_checkpoint_wrapped_module.' / '_orig_mod.' to
    the parameter names, and we want the names, and so the checkpoints, unchanged."""
    for block in raw_model.transformer.h:
        assert isinstance(block, Block)
        forward = block.forward  # the bound Block.forward
        if activation_checkpointing:
            forward = _checkpointed(forward)  # keep each block's input, recompute the rest in backward
        if compile_blocks:
            forward = torch.compile(forward)  # compile sees the checkpoint (as torchtitan orders them)
        block.forward = forward
        block._compiled = compile_blocks
        block._checkpointed = activation_checkpointing  # what the micro-batch auto-fit's memory plan assumes


def mixed_precision_policy(dtype):
    """FSDP2's mixed precision: 16-bit parameters in forward/backward (so the all-gathers move half
    the bytes), fp32 gradient reduce-scatter and fp32 sharded master weights for AdamW."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if dtype in ("bfloat16", "float16"):
        return MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # fp32 throughout


def wrap_model(raw_model, sharding, device_type, local_rank, dtype, activation_checkpointing=False,
               compile=False):
    """The model to train. raw_model: the GPT, already on its device, not compiled.
    sharding "none": the (compiled) model, DDP-wrapped when the world has more than one process;
    raw_model keeps its plain parameters. "fsdp": raw_model itself, sharded in place (each Block,
    then the root). Under FSDP every forward all-gathers parameters, so evaluation and sampling must
    run on every rank through it, never on rank 0 alone; and the optimizer must be built after this.
    dtype: 'float32' | 'bfloat16' | 'float16' (FSDP's parameter dtype in forward/backward)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, not {sharding!r}")
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    if sharding == "none":
        _set_block_forwards(raw_model, activation_checkpointing, compile_blocks=False)
        model = torch.compile(raw_model) if compile else raw_model  # compile before DDP, as the trainer does
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None,
                        gradient_as_bucket_view=True)
        return model

    if not tdist.is_initialized():
        raise ValueError("sharding 'fsdp' needs torch.distributed initialised (torchrun, or a world of 1)")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device_type, (world,))
    policy = mixed_precision_policy(dtype)
    # compile each block rather than the whole model: FSDP2's hooks run between blocks, and this is
    # what torchtitan does with FSDP2 (one graph per block, compiled once and reused for all layers)
    _set_block_forwards(raw_model, activation_checkpointing, compile_blocks=compile)
    blocks = raw_model.transformer.h
    for i, block in enumerate(blocks):
        # each block its own unit: only one or two blocks' full parameters exist at a time. The last
        # block stays gathered after forward, since backward starts with it (as torchtitan does)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    # the root unit holds wte, wpe, ln_f and lm_head: the tied wte/lm_head weight (one Parameter)
    # stays inside one unit, so FSDP sees it once; sharding wte and lm_head apart would break the tie
    fully_shard(raw_model, mesh=mesh, mp_policy=policy)
    return raw_model


@contextmanager
def grad_sync(model, enabled):
    """Around forward and backward of a micro-step. Under DDP, enabled=False accumulates the
    gradients locally without communication (no_sync) and the last micro-step (enabled=True)
    all-reduces their sum. FSDP reduce-scatters at every micro-step, whatever `enabled` says, and
    accumulates into the sharded gradients: skipping the sync there would keep every parameter's
    full fp32 gradient on every GPU between micro-steps (6.2 GB at GPT-2 XL, what the 2 x 24 GB
    recipe cannot spare), for the saving of communication that backward overlaps anyway; torchtitan
    makes the same choice by default."""
    from torch.nn.parallel import DistributedDataParallel
    if enabled or not isinstance(model, DistributedDataParallel):
        yield  # one process, FSDP, or the last micro-step
    else:
        with model.no_sync():
            yield


@contextmanager
def uncompiled(raw_model):
    """The blocks' plain forwards for a while. Under FSDP each block's forward is compiled for
    training (wrap_model); HellaSwag's packed rows and KV-cache sampling would make Dynamo compile
    again for every new shape, cache position and layer until it gave up, so they run eagerly on the
    same sharded weights. A no-op where the blocks were not compiled one by one."""
    saved = {}
    for block in raw_model.transformer.h:
        if getattr(block, "_compiled", False):
            saved[block] = block.__dict__.pop("forward")  # Block.forward (the class's) shows through
    try:
        yield raw_model
    finally:
        for block, forward in saved.items():
            block.forward = forward


def clip_grad_norm(model, max_norm):
    """Clip the global gradient norm to max_norm (inf: only measure); returns the norm before clipping
    as a plain tensor, the same on every rank. Under FSDP the gradients are DTensor shards and
    clip_grad_norm_ returns a replicated DTensor (already all-reduced over the shards)."""
    norm = torch.nn.utils.clip_grad_norm_(unwrap(model).parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


# ----------------------------------------------------------------------------------------------
# Full state dicts
#
# Checkpoints stay one ordinary file with the unsharded model and optimizer, gathered on rank 0,
# rather than torch.distributed.checkpoint's directory of per-rank shards: sample.py, hellaswag.py
# and the Hugging Face export keep one loader (GPT.load_state_dict), and DDP and FSDP runs write the
# same format. The cost is gathering everything on rank 0's CPU when saving: ~6 GB of weights and
# ~12 GB of AdamW moments at 1.5B parameters, fine at that size; much larger models would want
# sharded checkpoints.


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def model_state(model):
    """The full state dict of the GPT (same keys as GPT.state_dict(), CPU tensors). Call on every
    rank under FSDP (it gathers); only rank 0's result is complete, the others get an empty dict."""
    raw = unwrap(model)
    if not is_fsdp(raw):
        return {k: v.detach().cpu() for k, v in raw.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(raw, options=_options(cpu_offload=True))


def load_model_state(model, state, from_rank0=False):
    """Load a full state dict (GPT.state_dict() keys) into the model, sharded or not.
    from_rank0: only rank 0 passes the dict (the others pass {}), which broadcasts it; otherwise
    every rank passes the whole dict (each read the file)."""
    raw = unwrap(model)
    if not is_fsdp(raw):
        raw.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(raw, state, options=_options(broadcast_from_rank0=from_rank0))


def _param_names(raw):
    """Parameter -> its name, in named_parameters order (the tied wte/lm_head weight once, as
    transformer.wte.weight, like the optimizer sees it once)."""
    return {p: name for name, p in raw.named_parameters()}


def optimizer_state(model, optimizer):
    """The optimizer's full state dict in the format optimizer.state_dict() has on the unsharded model
    (parameters numbered in param-group order), CPU tensors; so a DDP checkpoint resumes under FSDP and
    the other way round. Call on every rank under FSDP; rank 0 gets the whole dict, the others {}.
    optim.Optimizers (Muon and AdamW): {"optimizers": [each one's state dict, in order]}."""
    if isinstance(optimizer, Optimizers):
        return {"optimizers": [optimizer_state(model, opt) for opt in optimizer.optimizers]}
    raw = unwrap(model)
    if not is_fsdp(raw):
        return _to_cpu(optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    by_name = get_optimizer_state_dict(raw, optimizer, options=_options(cpu_offload=True))
    if not by_name:
        return {}
    # torch.distributed.checkpoint names the parameters; number them back as optimizer.state_dict() does
    names = [n for group in by_name["param_groups"] for n in group["params"]]
    index = {n: i for i, n in enumerate(names)}
    groups = []
    for group in by_name["param_groups"]:
        groups.append({**group, "params": [index[n] for n in group["params"]]})
    return {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def load_optimizer_state(model, optimizer, state, from_rank0=False):
    """Load a state dict written by optimizer_state (or optimizer.state_dict() of an unsharded model)
    into the optimizer, sharding it under FSDP. Build the optimizer after wrap_model and call this
    before the first backward. from_rank0 as in load_model_state."""
    if isinstance(optimizer, Optimizers):
        states = state.get("optimizers", []) if state else [{}] * len(optimizer.optimizers)
        if len(states) != len(optimizer.optimizers):
            raise ValueError(f"the state holds {len(states)} optimizer(s), this run has {len(optimizer.optimizers)}")
        for opt, s in zip(optimizer.optimizers, states):
            load_optimizer_state(model, opt, s, from_rank0)
        return
    raw = unwrap(model)
    if not is_fsdp(raw):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    by_name = {}
    if state:
        names = _param_names(raw)
        ordered = [names[p] for group in optimizer.param_groups for p in group["params"]]
        saved = [i for group in state["param_groups"] for i in group["params"]]
        if len(saved) != len(ordered):
            raise ValueError(f"optimizer state has {len(saved)} parameters, the optimizer {len(ordered)}")
        name_of = dict(zip(saved, ordered))
        by_name = {
            "state": {name_of[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in state["param_groups"]],
        }
    set_optimizer_state_dict(raw, optimizer, by_name, options=_options(broadcast_from_rank0=from_rank0))


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------
# Micro-batch auto-fit: the largest micro-batch that fits, found by trying, on the model as it
# trains (DDP-wrapped or sharded, activation-checkpointed), with the step's own micro-steps


def largest_fitting(candidates, fits):
    """The largest of the ascending `candidates` for which fits(b) is true, assuming memory grows
    with b (binary search: log2(n) trial steps). None if even the smallest does not fit."""
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return best


def micro_batch_candidates(total_batch_size, block_size, world_size, cap=128):
    """Micro-batch sizes that divide the per-rank share of the batch, ascending (beyond `cap`
    sequences a GPU is long saturated and only memory is spent)."""
    per_rank, rem = divmod(total_batch_size, block_size * world_size)
    if rem or per_rank == 0:
        return []
    return [b for b in range(1, min(per_rank, cap) + 1) if per_rank % b == 0]


# What a failed allocation says: PyTorch's caching allocator raises OutOfMemoryError, but cuBLAS and
# cuDNN report theirs (a handle or workspace they could not get) as plain RuntimeErrors.
ALLOCATION_FAILURES = ("out of memory", "ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED", "NOT_ENOUGH_WORKSPACE")


def is_allocation_failure(e):
    """Whether an exception means the device ran out of memory (then a size does not fit)."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in ALLOCATION_FAILURES))


class CudaMemory:
    """The GPU memory counters the micro-batch auto-fit reads (tests count tensors on the CPU instead)."""

    def __init__(self, device):
        self.device = device

    def capacity(self):
        return torch.cuda.get_device_properties(self.device).total_memory

    def allocated(self):
        return torch.cuda.memory_allocated(self.device)

    def reserve(self, nbytes):
        """Raise where nbytes more are not free now. They are allocated and handed back to the
        device at once: kept in PyTorch's cache they would serve this stream's allocations only,
        and FSDP allocates its collectives' buffers (the gradient shards among them) on streams of
        its own, which would then find the memory taken."""
        torch.cuda.empty_cache()
        block = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)
        del block
        torch.cuda.empty_cache()

    def peak_of(self, run):
        """run(); the most memory allocated while it ran, what was allocated before included."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        return torch.cuda.max_memory_allocated(self.device)


def fsdp_buffer_bytes(raw_model, dtype):
    """What FSDP's collectives hold per GPU beyond the memory plan's figures, at most: for the two
    largest units (wrap_model's: the root with the embeddings, then a block), the all-gather's
    flat output in the 16-bit (or fp32) parameter dtype, which the next unit's all-gather finds
    still held, and in backward the unit's unsharded gradients in that dtype plus their fp32 copy,
    the reduce-scatter's input, which stays until the next unit's reduce-scatter is under way
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, _fsdp_param_group.py)."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in raw_model.transformer.h]
    root = sum(p.numel() for p in raw_model.parameters()) - sum(blocks)
    largest = sorted(blocks + [root], reverse=True)[:2]
    return (_dtype_bytes(dtype) + 4) * sum(largest)


def step_footprint(model, world_size, dtype, block_size, micro_batch):
    """Bytes one GPU holds at the peak of a training step at this micro-batch: the memory plan's
    total (weights, gradients, optimizer state, activations) and, under FSDP, its collectives'
    buffers. model: the model as it trains (wrap_model's)."""
    raw = unwrap(model)
    c = raw.config
    sharding = "fsdp" if is_fsdp(raw) else "none"
    checkpointing = any(getattr(block, "_checkpointed", False) for block in raw.transformer.h)
    plan = memory_plan(raw.num_params(non_embedding=False), world_size, sharding, dtype, micro_batch, block_size,
                       c.n_layer, c.n_embd, checkpointing, c.padded_vocab_size)
    return plan["total"] + (fsdp_buffer_bytes(raw, dtype) if sharding == "fsdp" else 0)


def trial_micro_steps(model, micro_batch, block_size, device, dtype, accumulation, phase):
    """Forward and backward at this micro-batch as the training step runs them (train_gpt2.train_step),
    as far as its memory peak: with accumulation the second micro-step holds the gradients of the
    first and the activations of its own. DDP's micro-steps run without sync there (no_sync), and
    the last one, which all-reduces, holds no more: it copies each gradient into DDP's bucket as it
    is ready and lets it go. So only a step of one micro-step all-reduces here, as it does in
    training, where the gradients are never held beside the buckets. phase[0]: 'forward' or
    'backward', for the message when one fails."""
    raw = unwrap(model)
    syncs = [True] if accumulation == 1 else [False, False]
    for sync in syncs:
        x = torch.randint(0, raw.config.vocab_size, (micro_batch, block_size), device=device)
        with grad_sync(model, sync):
            phase[0] = "forward"
            with autocast(device, dtype):
                _, loss = model(x, x)
            phase[0] = "backward"
            loss.backward()


def _has_collectives(model, accumulation):
    """Whether a trial at this accumulation talks to the other ranks: FSDP's forward and backward
    always do, DDP's backward when it all-reduces."""
    from torch.nn.parallel import DistributedDataParallel
    return is_fsdp(model) or (isinstance(model, DistributedDataParallel) and accumulation == 1)


_auto_fits = itertools.count()  # each auto-fit's votes go under keys of their own


def memory_probe(model, block_size, ranks, dtype, memory, per_rank, margin=0.10):
    """fits(b): the training step at micro-batch b stays under (1 - margin) of the device's memory,
    counting the AdamW state (two fp32 moments per parameter it holds) that the real step adds.
    model: the model as it trains (wrap_model's: DDP-wrapped, sharded, activation-checkpointed);
    per_rank: sequences per rank in an optimizer step (the accumulation at b is per_rank / b);
    memory: a CudaMemory. Every rank answers the same, or all stop.

    An allocation that fails means "does not fit" where the ranks are not talking to each other
    then. Inside FSDP's forward or backward, or DDP's all-reducing backward, it is different: the
    ranks match their collectives by order, and one that stopped half-way leaves the others'
    collectives waiting for it (queued on their GPUs, or, with gloo, blocking), so the group
    cannot be used again. There each rank first makes sure the memory the whole step holds is
    free (step_footprint: the plan's activations, gradient shards, optimizer state and FSDP's
    buffers), and the ranks agree on that before any trial; where a trial still runs out of
    memory, every rank learns it through the process group's store, which no pending collective
    holds up, and stops with the same line (the rank that failed at once, without waiting for
    ranks that may be stuck in a collective; torchrun then ends any that are)."""
    raw = unwrap(model)
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731  (an FSDP shard)
    optimizer_bytes = 2 * 4 * sum(local(p).numel() for p in raw.parameters())
    capacity = memory.capacity()
    fit_id, rounds = next(_auto_fits), itertools.count()

    def agree(outcome, b):
        """outcome: this rank's {"fits", "oom" (the phase), "error", "stranded"}; the answer of all."""
        outcomes = _exchange(outcome, f"microbatch_fit/{fit_id}/{next(rounds)}", ranks, wait=not outcome["stranded"])
        # a failure half-way through the collectives decides; an allocation failure before the errors
        # it caused on other ranks (with gloo, a peer that left breaks the collective under way)
        stranded = sorted((o["oom"] is None, rank) for rank, o in enumerate(outcomes) if o and o["stranded"])
        if stranded:
            rank = stranded[0][1]
            raise _fit_failure(rank, outcomes[rank], b, block_size, per_rank)
        for rank, o in enumerate(outcomes):
            if o["error"]:
                raise RuntimeError(f"the micro-batch probe failed on rank {rank}: {o['error']}")
        return all(o["fits"] for o in outcomes)

    def fits(b):
        accumulation = per_rank // b
        collectives = ranks.multi and _has_collectives(model, accumulation)
        phase = ["reserve"]
        try:
            if collectives:
                need = step_footprint(model, ranks.world_size, dtype, block_size, b) - memory.allocated()
                try:
                    memory.reserve(max(need, 0))
                    outcome = dict(fits=True, oom=None, error=None, stranded=False)
                except Exception as e:  # noqa: BLE001 (every rank must vote, whatever happened)
                    outcome = _failure(e, phase[0], stranded=False)
                if not agree(outcome, b):
                    return False
            try:
                with torch.compiler.set_stance("force_eager"):
                    peak = memory.peak_of(lambda: trial_micro_steps(model, b, block_size, ranks.device, dtype,
                                                                    accumulation, phase))
                outcome = dict(fits=peak + optimizer_bytes <= (1 - margin) * capacity, oom=None, error=None,
                               stranded=False)
            except Exception as e:  # noqa: BLE001
                outcome = _failure(e, phase[0], stranded=collectives)
            return agree(outcome, b)
        finally:
            model.zero_grad(set_to_none=True)
            if is_fsdp(raw):  # a forward that stopped half-way may leave blocks gathered
                for m in raw.modules():
                    if hasattr(m, "reshard"):
                        m.reshard()
    return fits


def _failure(e, phase, stranded):
    """A trial's outcome when it raised e: an allocation failure (in which phase), or another error."""
    oom = is_allocation_failure(e)
    return dict(fits=False, oom=phase if oom else None, error=None if oom else f"{type(e).__name__}: "
                f"{common.first_line(e)}", stranded=stranded)


def _fit_failure(rank, outcome, b, block_size, per_rank):
    """The exception every rank stops with after a trial failed half-way through its collectives."""
    if not outcome["oom"]:
        return RuntimeError(f"the micro-batch probe failed on rank {rank}: {outcome['error']}")
    smaller = [d for d in range(1, b) if per_rank % d == 0]
    todo = (f"pass --micro-batch-size {smaller[-1]} (or smaller) instead of auto" if smaller else
            "use more GPUs, --activation-checkpointing or a smaller --model")
    return UserError(f"the micro-batch auto-fit ran out of GPU memory on rank {rank} in the {outcome['oom']} "
                     f"pass at {b} x {block_size} tokens, although the memory the step needs was free "
                     f"before it; the ranks' collectives are out of step after that, so the fit cannot go on: "
                     f"{todo}")


def _exchange(outcome, key, ranks, wait=True):
    """Every rank's outcome (a dict of plain values) through the process group's store, which
    answers while collectives are pending. wait=False: what has been posted so far, None for the
    ranks that have not posted yet."""
    if not ranks.multi:
        return [outcome]
    store = tdist.distributed_c10d._get_default_store()
    store.set(f"{key}/{ranks.rank}", json.dumps(outcome))
    keys = [f"{key}/{rank}" for rank in range(ranks.world_size)]
    if wait:
        store.wait(keys)
    return [json.loads(store.get(k)) if wait or store.check([k]) else None for k in keys]


def choose_micro_batch(total_batch_size, ranks, model, dtype, block_size, *, memory=None):
    """The micro-batch for --micro-batch-size auto; ranks: the run's Ranks; model: the model as it
    trains (what wrap_model returned: DDP's wrapper, the FSDP-sharded GPT, or the plain or
    compiled GPT in a world of one); memory: the device's counters (CudaMemory on CUDA; elsewhere
    none, and the answer is 8 or fewer)."""
    from torch.nn.parallel import DistributedDataParallel
    if ranks.multi and not (is_fsdp(model) or isinstance(model, DistributedDataParallel)):
        raise ValueError("choose_micro_batch takes the model as it trains (wrap_model's), not the bare GPT")
    cands = micro_batch_candidates(total_batch_size, block_size, ranks.world_size)
    if not cands:
        raise UserError(f"--total-batch-size {total_batch_size} is not divisible by block size x GPUs "
                        f"({block_size} x {ranks.world_size}); use a multiple of {block_size * ranks.world_size}")
    if memory is None and ranks.device_type == "cuda":
        memory = CudaMemory(ranks.device)
    if memory is None:
        return max(b for b in cands if b <= 8)  # the same on every rank
    per_rank = total_batch_size // (block_size * ranks.world_size)
    fits = memory_probe(model, block_size, ranks, dtype, memory, per_rank)
    best = largest_fitting(cands, fits)
    if best is None:
        raise UserError(f"even a micro-batch of 1 x {block_size} tokens does not fit in GPU memory: use "
                        "--sharding fsdp over several GPUs, --activation-checkpointing, or a smaller --model")
    return best


# ----------------------------------------------------------------------------------------------
# Memory plan


def _dtype_bytes(dtype):
    return 2 if dtype in ("bfloat16", "float16") else 4


def block_params(n_embd):
    """Parameters of one GPT-2 block: attention 4h^2 + 4h, MLP 8h^2 + 5h, two LayerNorms 4h."""
    return 12 * n_embd * n_embd + 13 * n_embd


def memory_plan(n_params, world_size, sharding, dtype, micro_batch, block_size, n_layer, n_embd,
                activation_checkpointing=False, vocab_size=PADDED_VOCAB_SIZE, muon_params=0):
    """Estimated bytes each GPU holds at the peak of a training step, as a dict with params, grads,
    optimizer, activations and total. An estimate to choose settings by, not a measurement: it leaves
    out the CUDA context, allocator fragmentation and communication buffers (plan ~10% margin).

    - params: fp32 weights, 1/world of them under FSDP; under FSDP also the unsharded copies in the
      compute dtype of the root (embeddings, ln_f) and two blocks (the current one and the prefetched
      next); under DDP with 16-bit autocast, autocast's cached 16-bit copy of every weight.
    - grads: fp32, 1/world under FSDP (DDP's buckets are the gradients: gradient_as_bucket_view).
    - optimizer: AdamW's two fp32 moments, 1/world under FSDP; Muon keeps one (its momentum) for
      the muon_params it trains.
    - activations, s = block_size, b = micro_batch, h = n_embd: per layer 34*s*b*h bytes for 16-bit
      (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
      s*b*h*(34 + 5*a*s/h) without tensor parallelism; flash attention (SDPA is_causal) stores no
      s x s scores, dropping the 5*a*s/h term; GPT-2 has no dropout masks, which leaves the 34 a little
      generous), twice that in fp32. With activation checkpointing only each block's input is kept,
      4*s*b*h bytes (the residual stream is fp32 under autocast), plus one block's full activations
      recomputed in backward. Plus the logits: s*b*V*(2 for the 16-bit logits + 4 for their fp32 copy
      in cross_entropy + 4 for log-softmax), s*b*V*8 in fp32."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, not {sharding!r}")
    cb = _dtype_bytes(dtype)
    shards = world_size if sharding == "fsdp" else 1
    params = 4 * n_params / shards
    if sharding == "fsdp":
        per_block = block_params(n_embd)
        root = n_params - n_layer * per_block
        params += cb * (root + 2 * per_block)
    elif cb == 2:
        params += cb * n_params
    grads = 4 * n_params / shards
    optimizer = (8 * (n_params - muon_params) + 4 * muon_params) / shards
    sbh = block_size * micro_batch * n_embd
    per_layer = 34 * sbh * cb // 2  # 34 sbh bytes in 16-bit, 68 sbh in fp32
    if activation_checkpointing:
        layers = n_layer * 4 * sbh + per_layer
    else:
        layers = n_layer * per_layer
    logits = block_size * micro_batch * vocab_size * (10 if cb == 2 else 8)
    activations = layers + logits
    total = params + grads + optimizer + activations
    return dict(params=params, grads=grads, optimizer=optimizer, activations=activations, total=total,
                optimizer_name="Muon+AdamW" if muon_params else "AdamW")


def format_memory_plan(plan, capacity=None, per="GPU"):
    """One line: 'per GPU: params 3.1 GiB + grads 3.1 GiB + AdamW 6.2 GiB + activations ~9.0 GiB =
    21.4 GiB of 24.0 GiB'. capacity: the GPU's bytes (torch.cuda.get_device_properties().total_memory).
    Small models are shown in MiB, so that their figures are not all 0.0."""
    unit, scale = ("GiB", 2 ** 30) if max(plan["total"], capacity or 0) >= 2 ** 30 else ("MiB", 2 ** 20)
    size = lambda n: f"{n / scale:.1f} {unit}"  # noqa: E731
    text = (f"per {per}: params {size(plan['params'])} + grads {size(plan['grads'])} "
            f"+ {plan['optimizer_name']} {size(plan['optimizer'])} + activations ~{size(plan['activations'])} "
            f"= {size(plan['total'])}")
    if capacity:
        text += f" of {size(capacity)}"
    return text
