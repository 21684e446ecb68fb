"""memory.py: the memory plan's arithmetic against hand-computed numbers, and the micro-batch auto-fit on one process
against memory counted as CUDA's allocator counts it (the two-rank fits are test_parallel.py's)."""
import datetime
import functools
import os

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

import memory
import optim
import parallel
from model import GPT, GPTConfig
from tiny import CONFIG, CountedMemory, FakeMemory, out_of_memory_in_backward, outcome, tiny_gpt, trial_step


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
    layout = memory.Layout("float32", T)
    assert memory.choose_micro_batch(16 * T, ranks, raw, layout, trial_step(ranks), memory=counter) == 4
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
    layout = memory.Layout("float32", T)
    assert memory.choose_micro_batch(64 * T, ranks, raw, layout, trial_step(ranks), memory=counter) == 4
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
        plan = memory.memory_plan(raw, memory.Layout("bfloat16", T, "fsdp"), b, 1)
        assert raw.num_params(non_embedding=False) == 12_704 * 2 + 5_184
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
    three_on_two = parallel.Ranks(per_node=3, gpus=2)  # one of the GPUs holds two of them: each plans for half
    assert shared.per_gpu == 2 and shared.shares_gpus and not alone.shares_gpus
    assert three_on_two.per_gpu == 2 and three_on_two.shares_gpus

    def chosen(ranks, capacity):
        return memory.choose_micro_batch(16 * T, ranks, raw, memory.Layout("float32", T), trial_step(ranks),
                                         memory=CountedMemory(raw, capacity=capacity))
    half, whole = chosen(alone, room / 2 / 0.9), chosen(alone, room / 0.9)
    assert half < whole and chosen(shared, room / 0.9) == half and chosen(three_on_two, room / 0.9) == half


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
    result = outcome(memory.choose_micro_batch, 4 * T * world, ranks, model, memory.Layout("float32", T),
                     trial_step(ranks), memory=FakeMemory())
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


def gpt2_xl():
    """GPT-2 XL's shape on the meta device: its parameters counted, none allocated."""
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=48, n_head=25, n_embd=1600))


def test_memory_plan_ddp_gpt2_xl_fp32_does_not_shard():
    n = 1_557_686_400
    plan = memory.memory_plan(gpt2_xl(), memory.Layout("float32", 1024), micro_batch=1, world_size=8)
    assert plan["params"] == 4 * n and plan["grads"] == 4 * n and plan["optimizer"] == 8 * n
    sbh = 1024 * 1600
    assert plan["activations"] == 48 * 68 * sbh + 1024 * 50304 * 8
    assert plan["total"] == 16 * n + plan["activations"]
    assert round(16 * n / 1e9, 1) == 24.9  # the ~25 GB that does not fit a 24 GB card before any activation


def test_memory_plan_fsdp_gpt2_xl_bf16_with_checkpointing():
    n, world, b, s, h, L = 1_557_686_400, 8, 8, 1024, 1600, 48
    plan = memory.memory_plan(gpt2_xl(), memory.Layout("bfloat16", s, "fsdp", activation_checkpointing=True),
                              micro_batch=b, world_size=world)
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
    """A 3.3M-parameter model on an 80 GiB GPU: every part in a unit that shows it, none 0.0 GiB. By hand: 3,323,648
    parameters (wte 50,304 x 64, wpe 64 x 64, 2 blocks of 12 x 64^2 + 13 x 64, ln_f 2 x 64); params x (4 fp32 + 2 bf16)
    B = 19.0 MiB, grads x 4 = 12.7 MiB, AdamW x 8 = 25.4 MiB; activations 2 layers x 34 x 64 x 8 x 64 B + the logits
    64 x 8 x 50,304 x 10 B = 247.8 MiB = 0.2 GiB; 0.3 GiB in all."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64))
    assert model.num_params(non_embedding=False) == 50304 * 64 + 64 * 64 + 2 * (12 * 64 ** 2 + 13 * 64) + 2 * 64
    plan = memory.memory_plan(model, memory.Layout("bfloat16", 64), micro_batch=8, world_size=1)
    assert memory.format_memory_plan(plan, capacity=80 * GIB) == (
        "per GPU: params 19.0 MiB + grads 12.7 MiB + AdamW 25.4 MiB + activations ~0.2 GiB = 0.3 GiB of 80.0 GiB")
    assert memory.size(512) == "0.5 KiB"


def test_memory_plan_activations_without_checkpointing_and_ddp_autocast_copy():
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=4, block_size=8, vocab_size=10, padded_vocab_size=16))
    n = 16 * 4 + 8 * 4 + 3 * (12 * 4 ** 2 + 13 * 4) + 2 * 4  # wte, wpe, 3 blocks, ln_f
    assert model.num_params(non_embedding=False) == n
    plan = memory.memory_plan(model, memory.Layout("bfloat16", 8), micro_batch=2, world_size=2)
    assert plan["params"] == 4 * n + 2 * n  # fp32 weights + autocast's bf16 copies
    assert plan["activations"] == 3 * 34 * (8 * 2 * 4) + 8 * 2 * 16 * 10
    # Muon keeps one buffer for the blocks' matrices
    optimizer = optim.configure(model, optim.Settings(0.1, 1e-3, muon_lr=0.02))
    matrices = 3 * 12 * 4 ** 2
    muon = memory.memory_plan(model, memory.Layout("bfloat16", 8), micro_batch=2, world_size=2,
                              optimizer=optimizer)
    assert muon["optimizer"] == 8 * (n - matrices) + 4 * matrices and muon["optimizer_name"] == "Muon+AdamW"
