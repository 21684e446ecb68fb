"""How the model is spread over processes: the process group (with or without torchrun), DDP or FSDP2,
activation checkpointing, the collectives the ranks meet in, and what checkpoints hold of them: the full state dicts
of a DDP or FSDP model and its optimizers, and each process's random generators."""

import argparse
import datetime
import functools
import os
import random
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

import common
from common import UserError, torchrun_restart
from device import pick_device

@dataclass(frozen=True)
class Ranks:
    """This process's place in the run, the same with and without torchrun (a world of one)."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    per_node: int = 1  # processes on each node (torchrun's --nproc_per_node): how a resume is launched
    restart: int = 0   # how many times torchrun --max-restarts started the group again (0: the first launch)
    backend: str = None  # the process group's: nccl or gloo (None: no group)
    gpus: int = 0      # GPUs visible to this process (0 off CUDA): more processes than these share them
    stop_grace: tuple = None  # what the launcher leaves a stop before it kills (common.stop_grace); None: no kill

    is_master = property(lambda self: self.rank == 0)  # writes the logs, checkpoints and exports
    multi = property(lambda self: self.world_size > 1)  # collectives are needed
    device_type = property(lambda self: self.device.split(":")[0])  # cuda, mps or cpu
    per_gpu = property(lambda self: -(-self.per_node // self.gpus) if self.gpus else 1)  # processes on each GPU
    shares_gpus = property(lambda self: self.per_gpu > 1)  # --dist-backend gloo, more processes than GPUs


class Sharding(argparse.Action):
    """--sharding and --fsdp (--sharding fsdp), which must agree where both are given (else the last would win)."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        said = getattr(namespace, "_sharding_said", None)  # (an action's own note: the parse drops it)
        if said is not None and said[1] != value:
            parser.error(f"{said[0]} and {option_string}{'' if self.nargs == 0 else ' ' + value} contradict each "
                         "other: give one")
        setattr(namespace, self.dest, value)
        namespace._sharding_said = (option_string if self.nargs == 0 else f"{option_string} {value}", value)


class Flags:
    """This room's flags in the trainer's command line (train_config composes every room's)."""
    ranges = {"dist_timeout": "a positive number"}

    @staticmethod
    def add_flags(a):
        a("--sharding", choices=["none", "fsdp"], default="none", action=Sharding,
          help="none (default): DDP; fsdp: FSDP2 shards parameters, gradients and AdamW state over the GPUs")
        a("--fsdp", dest="sharding", nargs=0, const="fsdp", action=Sharding, help="the same as --sharding fsdp")
        a("--activation-checkpointing", action="store_true",
          help="recompute each block's activations in backward: ~30%% more compute, far less memory")
        a("--dist-backend", choices=["auto", "nccl", "gloo"], default="auto",
          help="the process group's backend under torchrun: auto (default) is NCCL on CUDA, gloo elsewhere; gloo on "
               "CUDA lets several processes share a GPU, slowly: to try a node's paths on the GPUs at hand")
        a("--dist-timeout", type=float, default=15.0, help="minutes a collective waits for the other ranks before "
                                                           "the group fails (default: 15; more if checkpoints take "
                                                           "longer)")


def pick_backend(requested, device):
    """--dist-backend: auto is NCCL on CUDA, gloo elsewhere; NCCL is CUDA's alone."""
    if requested == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if requested == "nccl" and not device.startswith("cuda"):
        raise UserError(f"--dist-backend nccl runs on CUDA GPUs, and this run is on {device}: drop it (gloo is the "
                        "backend there)")
    return requested


def setup_distributed(requested_device="auto", timeout_s=None, backend="auto", group_of_one=False):
    """Join the process group when launched by torchrun (--dist-backend: NCCL on CUDA, gloo on CPU). A collective that
    waits longer than timeout_s fails, so a dead or hung rank ends the group in bounded time. group_of_one: a group
    of this process alone where torchrun starts none (FSDP2 runs in a process group, even of one)."""
    multi = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    # under torchrun each rank takes the GPU of its LOCAL_RANK (below): a GPU index asked for would make every
    # rank open a context on that one GPU first
    device = pick_device(requested_device.partition(":")[0] if multi and requested_device else requested_device)
    backend = pick_backend(backend, device)
    restart, grace = torchrun_restart(), common.stop_grace()  # the launcher's: read once, from its command line
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    timeout = datetime.timedelta(seconds=timeout_s or 1800)
    if not multi:  # plain python, or torchrun with one process
        if group_of_one and not tdist.is_initialized():
            join(backend, tdist.HashStore(), 0, 1, timeout, device)
        return Ranks(device=device, restart=restart, backend=backend if tdist.is_initialized() else None, gpus=gpus,
                     stop_grace=grace)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 0))  # torchrun's --nproc_per_node; 0 without torchrun
    per_node = local_world or world_size
    if device.startswith("cuda"):
        # before the rendezvous: every rank stops at once instead of waiting for the ones that cannot start
        here = max(local_world, local_rank + 1)  # processes on this machine, at least
        if here > gpus and backend == "nccl":  # NCCL refuses two ranks on one GPU; gloo shares them
            raise UserError(f"torchrun starts {here} processes on this machine, one per GPU, "
                            f"but it has {gpus} GPU(s) visible: use --nproc_per_node={gpus} (or, to try a "
                            "node's paths on fewer GPUs, slowly: --dist-backend gloo)")
        device = f"cuda:{local_rank % gpus}"
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        store, rank, world_size = next(tdist.rendezvous("env://", rank, world_size, timeout=timeout))
        join(backend, common.attempt_store(store), rank, world_size, timeout, device)
    return Ranks(rank, local_rank, world_size, device, per_node, restart, backend, gpus, grace)


def join(backend, store, rank, world_size, timeout, device):
    """init_process_group; NCCL bound to this process's GPU at once."""
    extra = {}
    if backend == "nccl":
        index = torch.device(device).index
        extra = dict(device_id=torch.device("cuda", torch.cuda.current_device() if index is None else index))
    tdist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **extra)
    common.mark_joined_process_group(store)


def teardown_distributed():
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
    return smallest(0 if flag else 1, ranks) == 0


def smallest(value, ranks):
    """The smallest of every rank's integer value, on every rank (a collective in a multi-process run)."""
    if not ranks.multi:
        return value
    t = torch.full((1,), value, dtype=torch.int64, device=ranks.device)  # made on the device: no host-to-device copy
    tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
    return int(t.item())


def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(unwrap(model), FSDPModule)


def unwrap(model):
    """The GPT under DDP's .module and torch.compile's ._orig_mod (FSDP2 shards the GPT itself)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


def _set_block_forwards(raw_model, activation_checkpointing, compile_blocks):
    """Replace each Block's forward by an instance attribute rather than wrap the module: wrappers add
    '_checkpoint_wrapped_module.' or '_orig_mod.' to the parameter names, and so to the checkpoints."""
    for block in raw_model.blocks:
        forward = block.forward
        if activation_checkpointing:  # non-reentrant: works with keyword arguments, FSDP2's hooks and compile
            forward = functools.partial(checkpoint, forward, use_reentrant=False)
        if compile_blocks:
            forward = torch.compile(forward)  # compile sees the checkpoint (as torchtitan orders them)
        block.forward = forward
        block._compiled = compile_blocks
        block._checkpointed = activation_checkpointing  # what the micro-batch auto-fit's memory plan assumes


def wrap_model(raw_model, sharding, device, dtype, activation_checkpointing=False, compile=False):
    """The model to train. "none": the (compiled) GPT, DDP-wrapped in a world of several processes. "fsdp": the
    GPT sharded in place (each Block, then the root), whose forward every rank must run, evaluation included."""
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    if sharding == "none":
        _set_block_forwards(raw_model, activation_checkpointing, compile_blocks=False)
        model = torch.compile(raw_model) if compile else raw_model  # compile before DDP
        if world > 1:
            for p in raw_model.parameters():
                p.grad = torch.zeros_like(p)  # DDP makes each gradient a view of its bucket at once (see zero_grad)
            # the GPU this rank runs on: not its local rank where ranks share GPUs (--dist-backend gloo)
            gpu = torch.device(device)
            model = DistributedDataParallel(model, device_ids=[gpu] if gpu.type == "cuda" else None,
                                            gradient_as_bucket_view=True)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(torch.device(device).type, (world,))
    policy = MixedPrecisionPolicy()  # fp32 throughout
    if dtype in ("bfloat16", "float16"):  # 16-bit all-gathers; fp32 reduce-scatter and master weights
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    # compile each block rather than the whole model, as torchtitan does with FSDP2: its hooks run between blocks
    _set_block_forwards(raw_model, activation_checkpointing, compile_blocks=compile)
    blocks = raw_model.blocks
    for i, block in enumerate(blocks):
        # each block a unit of its own; the last stays gathered after forward, as backward starts with it
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    # the root unit holds wte, wpe, ln_f and the tied lm_head: one Parameter in one unit keeps the tie
    fully_shard(raw_model, mesh=mesh, mp_policy=policy)
    return raw_model


def grad_sync(model, enabled):
    """Around a micro-step's forward and backward: under DDP, enabled=False accumulates locally (no_sync). FSDP
    reduce-scatters every micro-step, as torchtitan does: skipping it would hold every full fp32 gradient."""
    if enabled or not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return model.no_sync()


def zero_grad(model):
    """Clear the gradients after a step. Under DDP they are zeroed and stay views of its buckets: set to None,
    they would come back beside the buckets, a second copy until the all-reduce. Elsewhere they are freed."""
    model.zero_grad(set_to_none=not isinstance(model, DistributedDataParallel))


@contextmanager
def uncompiled(raw_model):
    """The blocks' plain forwards for a while: HellaSwag's packed rows and KV-cache sampling would make the
    per-block compile under FSDP (wrap_model) compile again for every new shape until it gave up."""
    saved = {}
    for block in raw_model.blocks:
        if getattr(block, "_compiled", False):
            saved[block] = block.__dict__.pop("forward")  # Block.forward (the class's) shows through
    try:
        yield raw_model
    finally:
        for block, forward in saved.items():
            block.forward = forward


def clip_grad_norm(model, max_norm):
    """Clip the global gradient norm to max_norm (inf: only measure); the norm before clipping as a plain
    tensor, the same on every rank (under FSDP, clip_grad_norm_ returns a replicated DTensor)."""
    norm = torch.nn.utils.clip_grad_norm_(unwrap(model).parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# Checkpoints hold the full state gathered on rank 0, not torch.distributed.checkpoint's per-rank shards: one format
# for DDP and FSDP. That costs rank 0 ~18 GB of CPU memory at 1.5B parameters; larger models would want shards.

def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def _to_cpu(state):
    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), state)


def model_state(model):
    """The full state dict of the GPT, CPU tensors. Under FSDP every rank calls it; rank 0 gets the dict."""
    raw = unwrap(model)
    if not is_fsdp(raw):
        return _to_cpu(raw.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(raw, options=_options(cpu_offload=True))


def load_model_state(model, state):
    raw = unwrap(model)
    if not is_fsdp(raw):
        raw.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(raw, state, options=_options())


def optimizer_state(model, optimizer):
    """The optimizers' full state dict (optim.Optimizers.pack) as state_dict() has it on the unsharded model, CPU
    tensors, so that DDP and FSDP checkpoints are interchangeable. Under FSDP every rank calls it; rank 0 gets it."""
    return optimizer.pack([_optimizer_state(model, opt) for opt in optimizer.optimizers])


def _optimizer_state(model, opt):
    raw = unwrap(model)
    if not is_fsdp(raw):
        return _to_cpu(opt.state_dict())
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    by_name = get_optimizer_state_dict(raw, opt, options=_options(cpu_offload=True))
    if not by_name:
        return {}
    index = {name: i for i, name in enumerate(n for group in by_name["param_groups"] for n in group["params"])}
    groups = [{**group, "params": [index[n] for n in group["params"]]} for group in by_name["param_groups"]]
    return {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def load_optimizer_state(model, optimizer, state):
    """Load optimizer_state's format into the optimizers, sharding it under FSDP; before the first backward (the
    optimizers are the run's: --optimizer is fixed on resume)."""
    for opt, part in zip(optimizer.optimizers, optimizer.unpack(state)):
        _load_optimizer_state(model, opt, part)
        # a CPU tensor stays a view of the memory-mapped file, whose disk space it would hold after the rotation
        for values in opt.state.values():
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    values[key] = value.clone()


def _load_optimizer_state(model, opt, state):
    raw = unwrap(model)
    if not is_fsdp(raw):
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    names = {p: name for name, p in raw.named_parameters()}  # the tied wte/lm_head weight once, as the optimizer
    name_of = dict(enumerate(names[p] for group in opt.param_groups for p in group["params"]))
    by_name = {"state": {name_of[i]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(raw, opt, by_name, options=_options())


class RNG:
    """This process's random generators (Python's, NumPy's, torch's and each CUDA device's) as a stateful part of the
    run: each rank's own in its checkpoints."""

    def state_dict(self):
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state):
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
