"""What a training step holds in memory on each GPU (the plan the run header prints), and --micro-batch-size auto:
the largest micro-batch the plan fits, checked by one trial of the trainer's own micro-step."""

from dataclasses import dataclass

import torch

from common import UserError
from device import CudaMemory
from optim import local_part
from parallel import is_fsdp, smallest, unwrap, zero_grad

# PyTorch's CUDA allocator raises OutOfMemoryError; cuBLAS and cuDNN say so in plain RuntimeErrors, and so does the
# CPU's allocator ("[enforce fail at alloc_cpu.cpp:...] ... DefaultCPUAllocator: can't allocate memory")
ALLOCATION_FAILURES = ("out of memory", "ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED", "NOT_ENOUGH_WORKSPACE",
                       "can't allocate memory")
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # per value in the autocast dtype
MARGIN = 0.10  # of the GPU's memory the auto-fit leaves free: what the plan leaves out (see memory_plan)


@dataclass(frozen=True)
class Layout:
    """How each rank's step is laid out, in the memory plan's terms: its autocast dtype, its rows of block_size
    tokens, its parameters sharded (fsdp) or not, its blocks' activations kept or recomputed."""
    dtype: str
    block_size: int
    sharding: str = "none"
    activation_checkpointing: bool = False


def is_allocation_failure(e):
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in ALLOCATION_FAILURES))


def step_footprint(model, world_size, dtype, block_size, micro_batch):
    """Bytes one GPU holds at the peak of a step: the memory plan's total plus, under FSDP, for the two largest units
    the all-gather's output and the unsharded gradients with their fp32 copy (fsdp/_fully_shard/_fsdp_collectives)."""
    raw = unwrap(model)
    sharding = "fsdp" if is_fsdp(raw) else "none"
    checkpointing = any(getattr(block, "_checkpointed", False) for block in raw.blocks)
    plan = memory_plan(raw, Layout(dtype, block_size, sharding, checkpointing), micro_batch, world_size)
    if sharding == "none":
        return plan["total"]
    root, blocks = raw.units()
    return plan["total"] + (BYTES[dtype] + 4) * sum(sorted(blocks + [root], reverse=True)[:2])


def trial_peak(model, micro_step, shape, accumulation, device, memory):
    """The peak of a step's first two micro-steps of shape (micro-batch b, block size), eagerly (else each size would
    compile); under DDP without the all-reduce, under FSDP (whose micro-steps are collectives) two on every rank,
    whatever its b."""
    b, block_size = shape

    def run():
        for _ in range(2 if is_fsdp(model) else min(accumulation, 2)):
            rows = torch.randint(0, unwrap(model).config.vocab_size, (b, block_size + 1), device=device)
            micro_step(model, rows[:, :-1], rows[:, 1:], sync=False)  # the loader's layout: inputs, targets
    try:
        with torch.compiler.set_stance("force_eager"):
            return memory.peak_of(run)
    finally:
        zero_grad(model)


UNFITTED = 8  # --micro-batch-size auto off CUDA: the largest that divides the batch, up to this (no memory to fit)


def how_chosen(micro_batch_size, device_type):
    """What the run header says of how the micro-batch was chosen: '' where it was given."""
    if micro_batch_size != "auto":
        return ""
    if device_type == "cuda":
        return " (auto-fit)"
    return f" (auto: the {device_type.upper()} default, the largest that divides the batch up to {UNFITTED})"


def choose_micro_batch(total_batch_size, ranks, model, layout, micro_step, memory=None):
    """--micro-batch-size auto (off CUDA: UNFITTED or fewer): the largest size whose plan fits under (1 - MARGIN) of
    the GPU (of its share, where processes share it), checked by a trial of micro_step(model, x, y, sync); where its
    peak is over, the largest size its growth allows (tried again, except under FSDP). The ranks take the smallest by
    one all-reduce. 1 where none divides the batch. Of layout (a Layout) it reads the dtype and the block size: the
    sharding and the activation checkpointing it reads from the model, as they are."""
    dtype, block_size = layout.dtype, layout.block_size
    per_rank, rem = divmod(total_batch_size, block_size * ranks.world_size)
    # the sizes that divide this rank's share of the batch, ascending; beyond 128 only memory is spent
    cands = [] if rem else [b for b in range(1, min(per_rank, 128) + 1) if per_rank % b == 0]
    memory = memory or (CudaMemory(ranks.device) if ranks.device_type == "cuda" else None)
    if not cands or memory is None:
        return max([b for b in cands if b <= UNFITTED], default=1)  # the same on every rank
    room = (1 - MARGIN) * memory.capacity() / ranks.per_gpu  # processes that share a GPU share its memory
    budget = room - 8 * sum(local_part(p).numel() for p in unwrap(model).parameters())  # AdamW's moments come later
    planned = [b for b in cands if step_footprint(model, ranks.world_size, dtype, block_size, b) <= room]
    b = planned[-1] if planned else cands[0]
    while b:
        before = memory.allocated()
        # gradients the trial makes (none before it, except DDP's buckets): bytes that do not grow with b
        grads = 4 * sum(local_part(p).numel() for p in unwrap(model).parameters() if p.grad is None)
        try:
            peak = trial_peak(model, micro_step, (b, block_size), per_rank // b, ranks.device, memory)
        except Exception as e:
            if not is_allocation_failure(e):
                raise
            # under FSDP its collectives and the other ranks' no longer match: torchrun ends them
            if is_fsdp(model) and ranks.multi:
                raise UserError(f"the micro-batch auto-fit ran out of GPU memory on rank {ranks.rank} at {b} x "
                                f"{block_size} tokens under FSDP: pass a --micro-batch-size below {b}")
            b = max([c for c in cands if c < b], default=0)
            continue
        if peak <= budget:
            break
        growth = (peak - before - grads) / b  # bytes per sequence: the activations
        b = max([c for c in cands if c < b and before + grads + growth * c <= budget], default=0)
        if is_fsdp(model):
            break  # one trial: another would be a collective the other ranks do not join
    b = smallest(b, ranks)
    if not b:
        raise UserError(f"even a micro-batch of 1 x {block_size} tokens does not fit in GPU memory: use "
                        "--sharding fsdp over several GPUs, --activation-checkpointing, or a smaller --model")
    return b


def memory_plan(model, layout, micro_batch, world_size, optimizer=None):
    """Estimated bytes each GPU holds at the peak of a training step of `model` (a GPT: it says what a step holds in
    activations and how its parameters fall into units) laid out as layout says over world_size ranks, at
    micro_batch rows, to choose settings by: it leaves out the CUDA context,
    allocator fragmentation and communication buffers (plan a ~10% margin).
    - params: fp32, 1/world under FSDP, plus there the root unit and the two largest blocks (the current and the
      prefetched) unsharded in the compute dtype; under DDP with 16-bit autocast, its copy of every weight.
    - grads: fp32, 1/world under FSDP (DDP's buckets are the gradients: gradient_as_bucket_view).
    - optimizer: the optimizer's state (optim.Optimizers; AdamW's two fp32 moments where there is none yet); 1/world
      under FSDP.
    - activations: GPT.activation_bytes at the compute dtype, with or without activation checkpointing."""
    cb, sharding = BYTES[layout.dtype], layout.sharding
    n_params = model.num_params(non_embedding=False)
    shards = world_size if sharding == "fsdp" else 1
    params = 4 * n_params / shards
    if sharding == "fsdp":
        root, blocks = model.units()
        params += cb * (root + sum(sorted(blocks, reverse=True)[:2]))
    elif cb == 2:
        params += cb * n_params
    grads = 4 * n_params / shards
    state = optimizer.state_bytes() if optimizer is not None else 8 * n_params
    activations = model.activation_bytes(micro_batch, layout.block_size, cb, layout.activation_checkpointing)
    return dict(params=params, grads=grads, optimizer=state / shards, activations=activations,
                total=params + grads + state / shards + activations,
                optimizer_name=optimizer.name if optimizer is not None else "AdamW")


def format_memory_plan(plan, capacity=None, per="GPU"):
    """One line: 'per GPU: params 3.1 GiB + grads 3.1 GiB + AdamW 6.2 GiB + activations ~9.0 GiB = 21.4 GiB
    of 24.0 GiB' (capacity: the GPU's bytes); each figure in the largest unit that shows it (a small model's
    parameters in MiB or KiB beside a GPU's GiB)."""
    of = f" of {size(capacity)}" if capacity else ""
    return (f"per {per}: params {size(plan['params'])} + grads {size(plan['grads'])} "
            f"+ {plan['optimizer_name']} {size(plan['optimizer'])} + activations ~{size(plan['activations'])} "
            f"= {size(plan['total'])}{of}")


def size(n):
    """Bytes as '3.1 GiB', '12.0 MiB' or '0.5 KiB': the largest unit in which the figure is 0.1 or more."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= scale / 10:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2 ** 10:.1f} KiB"
