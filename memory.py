"""What a training step holds in memory on each GPU (the plan the run header prints), and --micro-batch-size auto."""

import bisect
import itertools
import json

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel

import common
from common import UserError
from device import autocast
from model import PADDED_VOCAB_SIZE
from optim import local_part
from parallel import SHARDINGS, grad_sync, is_fsdp, unwrap, zero_grad

# PyTorch's allocator raises OutOfMemoryError; cuBLAS and cuDNN say so in plain RuntimeErrors
ALLOCATION_FAILURES = ("out of memory", "ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED", "NOT_ENOUGH_WORKSPACE")
_votes = itertools.count()  # every rank votes in the same order: one set of store keys per vote


def largest_fitting(candidates, fits):
    """The largest of the ascending candidates that fits, or None: a binary search, as memory grows with b."""
    first_too_large = bisect.bisect_left(candidates, True, key=lambda b: not fits(b))
    return candidates[first_too_large - 1] if first_too_large else None


def micro_batch_candidates(total_batch_size, block_size, world_size, cap=128):
    """Micro-batch sizes that divide the per-rank share of the batch, ascending; beyond `cap` only memory is spent."""
    per_rank, rem = divmod(total_batch_size, block_size * world_size)
    if rem or per_rank == 0:
        return []
    return [b for b in range(1, min(per_rank, cap) + 1) if per_rank % b == 0]


def is_allocation_failure(e):
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in ALLOCATION_FAILURES))


class CudaMemory:
    """The GPU memory counters the micro-batch auto-fit reads (tests pass counters of their own)."""

    def __init__(self, device):
        # 'cuda' is the current GPU; torch's memory-fraction query refuses a device without its index
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def capacity(self):
        """The bytes this process may allocate: the card's, under torch.cuda.set_per_process_memory_fraction's limit."""
        return int(torch.cuda.get_device_properties(self.device).total_memory
                   * torch.cuda.get_per_process_memory_fraction(self.device))

    def allocated(self):
        return torch.cuda.memory_allocated(self.device)

    def reserve(self, nbytes):
        """Raise where nbytes more are not free now. Handed back to the device at once: kept in PyTorch's cache
        they would serve this stream only, and FSDP allocates its collectives' buffers on streams of its own."""
        torch.cuda.empty_cache()
        torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)
        torch.cuda.empty_cache()

    def peak_of(self, run):
        """run(); the most memory allocated while it ran, what was allocated before included."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        return torch.cuda.max_memory_allocated(self.device)


def step_footprint(model, world_size, dtype, block_size, micro_batch):
    """Bytes one GPU holds at the peak of a step of the model as it trains: the memory plan's total plus, under
    FSDP, for the two largest units the all-gather's output and in backward the unsharded gradients with their
    fp32 copy for the reduce-scatter (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)."""
    raw = unwrap(model)
    c = raw.config
    sharding = "fsdp" if is_fsdp(raw) else "none"
    checkpointing = any(getattr(block, "_checkpointed", False) for block in raw.transformer.h)
    plan = memory_plan(raw.num_params(non_embedding=False), world_size, sharding, dtype, micro_batch, block_size,
                       c.n_layer, c.n_embd, checkpointing, c.padded_vocab_size)
    if sharding == "none":
        return plan["total"]
    blocks = [sum(p.numel() for p in block.parameters()) for block in raw.transformer.h]
    root = raw.num_params(non_embedding=False) - sum(blocks)
    return plan["total"] + (_dtype_bytes(dtype) + 4) * sum(sorted(blocks + [root], reverse=True)[:2])


def memory_probe(model, block_size, ranks, dtype, memory, per_rank, margin=0.10):
    """fits(b), the same on every rank: whether a step at micro-batch b, tried on the model as it trains, stays
    under (1 - margin) of memory.capacity() with AdamW's moments added. Where a trial talks to the other ranks
    they first agree that each has the memory it needs: one that still runs out stops every rank with one line."""
    raw = unwrap(model)
    budget = (1 - margin) * memory.capacity() - 8 * sum(local_part(p).numel() for p in raw.parameters())

    def fits(b):
        accumulation = per_rank // b
        talks = ranks.multi and (is_fsdp(raw) or (isinstance(model, DistributedDataParallel) and accumulation == 1))
        phase = "reserve"

        def reserve():
            memory.reserve(max(step_footprint(model, ranks.world_size, dtype, block_size, b) - memory.allocated(), 0))
            return True

        def trial():
            """Micro-steps up to the step's peak: the second holds the first's gradients and its own activations."""
            nonlocal phase
            for sync in [True] if accumulation == 1 else [False, False]:
                phase = "forward"
                x = torch.randint(0, raw.config.vocab_size, (b, block_size), device=ranks.device)
                with grad_sync(model, sync):
                    with autocast(ranks.device, dtype):
                        _, loss = model(x, x)
                    phase = "backward"
                    loss.backward()

        def vote(run):
            """run()'s answer; where it raised, False or [whether memory ran out, the line every rank stops with]."""
            try:
                return run()
            except Exception as e:  # noqa: BLE001 (every rank must vote, whatever happened)
                if not is_allocation_failure(e):
                    return [False, f"the micro-batch probe failed on rank {ranks.rank}: {type(e).__name__}: "
                                   f"{common.first_line(e)}"]
                if phase == "reserve" or not talks:
                    return False
                smaller = [d for d in range(1, b) if per_rank % d == 0]
                todo = (f"pass --micro-batch-size {smaller[-1]} (or smaller) instead of auto" if smaller else
                        "use more GPUs, --activation-checkpointing or a smaller --model")
                return [True, f"the micro-batch auto-fit ran out of GPU memory on rank {ranks.rank} in the {phase} "
                              f"pass at {b} x {block_size} tokens, although the memory the step needs was free "
                              f"before it; the ranks' collectives are out of step after that, so the fit cannot "
                              f"go on: {todo}"]

        try:
            if talks and not _agree(vote(reserve), ranks, stranded=False):
                return False
            with torch.compiler.set_stance("force_eager"):
                verdict = vote(lambda: memory.peak_of(trial) <= budget)
            return _agree(verdict, ranks, stranded=talks and isinstance(verdict, list))
        finally:
            zero_grad(model)
            for m in raw.modules():  # FSDP: a forward that stopped half-way may leave blocks gathered
                if hasattr(m, "reshard"):
                    m.reshard()
    return fits


def _agree(vote, ranks, stranded):
    """Whether every rank's vote is true; a line to stop with raises on every rank, memory first. The votes go
    through the store, which answers while collectives hang: a stranded rank reads what was posted, not waiting."""
    votes = [vote]
    if ranks.multi:
        store = tdist.distributed_c10d._get_default_store()  # no public accessor
        key = f"microbatch_fit/{next(_votes)}"
        store.set(f"{key}/{ranks.rank}", json.dumps(vote))
        keys = [f"{key}/{rank}" for rank in range(ranks.world_size)]
        if not stranded:
            store.wait(keys)
        votes = [json.loads(store.get(k)) for k in keys if not stranded or store.check([k])]
    stops = sorted((v for v in votes if isinstance(v, list)), key=lambda v: not v[0])
    if stops:
        raise (UserError if stops[0][0] else RuntimeError)(stops[0][1])
    return all(votes)


def choose_micro_batch(total_batch_size, ranks, model, dtype, block_size, *, memory=None):
    """The micro-batch for --micro-batch-size auto, tried on the model as it trains; 8 or fewer off CUDA. 1 where
    none divides the batch, which the trainer's divisibility check then refuses."""
    cands = micro_batch_candidates(total_batch_size, block_size, ranks.world_size)
    if not cands:
        return 1
    if memory is None and ranks.device_type == "cuda":
        memory = CudaMemory(ranks.device)
    if memory is None:
        return max(b for b in cands if b <= 8)  # the same on every rank
    per_rank = total_batch_size // (block_size * ranks.world_size)
    best = largest_fitting(cands, memory_probe(model, block_size, ranks, dtype, memory, per_rank))
    if best is None:
        raise UserError(f"even a micro-batch of 1 x {block_size} tokens does not fit in GPU memory: use "
                        "--sharding fsdp over several GPUs, --activation-checkpointing, or a smaller --model")
    return best


def _dtype_bytes(dtype):
    return 2 if dtype in ("bfloat16", "float16") else 4


def block_params(n_embd):
    """Parameters of one GPT-2 block: attention 4h^2 + 4h, MLP 8h^2 + 5h, two LayerNorms 4h."""
    return 12 * n_embd * n_embd + 13 * n_embd


def memory_plan(n_params, world_size, sharding, dtype, micro_batch, block_size, n_layer, n_embd,
                activation_checkpointing=False, vocab_size=PADDED_VOCAB_SIZE, muon_params=0):
    """Estimated bytes each GPU holds at the peak of a training step, to choose settings by: it leaves out the
    CUDA context, allocator fragmentation and communication buffers (plan a ~10% margin).
    - params: fp32, 1/world under FSDP, plus there the root (embeddings, ln_f) and two blocks (the current and
      the prefetched) unsharded in the compute dtype; under DDP with 16-bit autocast, its copy of every weight.
    - grads: fp32, 1/world under FSDP (DDP's buckets are the gradients: gradient_as_bucket_view).
    - optimizer: AdamW's two fp32 moments, Muon's one (momentum) for muon_params; 1/world under FSDP.
    - activations (s = block_size, b = micro_batch, h = n_embd): per layer 34*s*b*h bytes in 16-bit, twice that
      in fp32 (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", without
      the s x s scores flash attention does not store; GPT-2 has no dropout masks, so 34 is a little generous).
      With activation checkpointing each block's fp32 input, 4*s*b*h, plus one block recomputed in backward.
      Plus the logits: s*b*V*(2 for 16-bit + 4 for cross_entropy's fp32 copy + 4 for log-softmax), 8 in fp32."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, not {sharding!r}")
    cb = _dtype_bytes(dtype)
    shards = world_size if sharding == "fsdp" else 1
    params = 4 * n_params / shards
    if sharding == "fsdp":
        params += cb * (n_params - (n_layer - 2) * block_params(n_embd))  # the root and two blocks
    elif cb == 2:
        params += cb * n_params
    grads = 4 * n_params / shards
    optimizer = (8 * (n_params - muon_params) + 4 * muon_params) / shards
    sbh = block_size * micro_batch * n_embd
    per_layer = 34 * sbh * cb // 2  # 34 sbh bytes in 16-bit, 68 sbh in fp32
    layers = n_layer * per_layer
    if activation_checkpointing:
        layers = n_layer * 4 * sbh + per_layer
    activations = layers + block_size * micro_batch * vocab_size * (10 if cb == 2 else 8)  # + the logits
    return dict(params=params, grads=grads, optimizer=optimizer, activations=activations,
                total=params + grads + optimizer + activations, optimizer_name="Muon+AdamW" if muon_params else "AdamW")


def format_memory_plan(plan, capacity=None, per="GPU"):
    """One line: 'per GPU: params 3.1 GiB + grads 3.1 GiB + AdamW 6.2 GiB + activations ~9.0 GiB = 21.4 GiB
    of 24.0 GiB' (capacity: the GPU's bytes); in MiB for small models, whose figures would all be 0.0."""
    unit, scale = ("GiB", 2 ** 30) if max(plan["total"], capacity or 0) >= 2 ** 30 else ("MiB", 2 ** 20)
    size = lambda n: f"{n / scale:.1f} {unit}"  # noqa: E731
    of = f" of {size(capacity)}" if capacity else ""
    return (f"per {per}: params {size(plan['params'])} + grads {size(plan['grads'])} "
            f"+ {plan['optimizer_name']} {size(plan['optimizer'])} + activations ~{size(plan['activations'])} "
            f"= {size(plan['total'])}{of}")
