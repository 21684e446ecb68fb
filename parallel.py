"""
How the model is spread over processes: joining the process group (with or without torchrun),
DDP (every rank holds everything, the default) or FSDP2 (PyTorch's
torch.distributed.fsdp.fully_shard: parameters, gradients and optimizer state sharded over the
ranks), optional activation checkpointing, and the few places where the two differ for the
trainer: gradient sync during accumulation, gradient clipping and full state dicts for
checkpoints. What a step holds in memory, and the micro-batch auto-fit, are memory.py's.

Imports only torch, the standard library, model.py, optim.py, device.py and common.py.

Order the trainer follows (FSDP replaces the parameters with sharded DTensors, so anything that
holds parameters is built after it):
    ranks = setup_distributed(...)             # this process's rank, world size and device
    raw_model.to(device)                       # load the checkpoint's model weights here (or later,
                                               #   with load_model_state)
    model = wrap_model(raw_model, ...)         # compiles, checkpoints and wraps/shards
    micro_batch = memory.choose_micro_batch(..., model, ...)  # --micro-batch-size auto: tries the model as
                                               #   it trains, before the optimizer state (it counts that itself)
    optimizer = optim.configure(raw_model, ...)       # after wrap_model: FSDP's sharded parameters
    load_optimizer_state(model, optimizer, ckpt["optimizer"])
    ... with grad_sync(model, last_micro_step): forward, backward
    norm = clip_grad_norm(model, max_norm)
    checkpoint: model_state(model), optimizer_state(model, optimizer) on every rank, saved by rank 0
"""

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
from torch.utils.checkpoint import checkpoint

import common
from common import UserError
from device import pick_device
from model import Block
from optim import Optimizers

SHARDINGS = ("none", "fsdp")


# ----------------------------------------------------------------------------------------------
# The process group


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank, local rank, world size and device; the same with
    and without torchrun (a world of one). The rest follows from those."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    is_master: bool = field(init=False)   # rank 0: writes the logs, checkpoints and exports
    multi: bool = field(init=False)       # more than one process: collectives are needed
    device_type: str = field(init=False)  # cuda, mps or cpu

    def __post_init__(self):
        object.__setattr__(self, "is_master", self.rank == 0)
        object.__setattr__(self, "multi", self.world_size > 1)
        object.__setattr__(self, "device_type", self.device.split(":")[0])


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
    t = torch.full((1,), float(flag), device=ranks.device)  # made on the device: no host-to-device copy
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
            for p in raw_model.parameters():
                p.grad = torch.zeros_like(p)  # DDP makes each gradient a view of its bucket at once (see zero_grad)
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


def zero_grad(model):
    """Clear the gradients after a step. Under DDP they are zeroed and stay views of its buckets
    (gradient_as_bucket_view), where the micro-steps under no_sync then accumulate; set to None,
    they would come back as fresh tensors beside the buckets, a second copy of the gradients until
    the last micro-step's all-reduce copies them in (4 bytes a parameter: 6.2 GB at GPT-2 XL).
    Elsewhere they are freed."""
    from torch.nn.parallel import DistributedDataParallel
    model.zero_grad(set_to_none=not isinstance(model, DistributedDataParallel))


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
