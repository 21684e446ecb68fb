"""
How much memory a training step holds on each GPU: the plan the run header prints (memory_plan,
format_memory_plan), and --micro-batch-size auto, which finds the largest micro-batch that fits by
trying it on the model as it trains (choose_micro_batch). parallel.py wraps and shards the model;
this file measures what that costs.

Imports only torch, the standard library, common.py, device.py, model.py and parallel.py.
"""

import itertools
import json

import torch
import torch.distributed as tdist

import common
from common import UserError
from device import autocast
from model import PADDED_VOCAB_SIZE
from parallel import SHARDINGS, grad_sync, is_fsdp, unwrap, zero_grad


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
        """The bytes this process may allocate: the card's, under torch.cuda.set_per_process_memory_fraction's limit."""
        return int(torch.cuda.get_device_properties(self.device).total_memory
                   * torch.cuda.get_per_process_memory_fraction(self.device))

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
    the last one, which all-reduces, holds no more: the gradients are DDP's buckets themselves
    (parallel.wrap_model). So only a step of one micro-step all-reduces here, as it does in
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
            zero_grad(model)
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
