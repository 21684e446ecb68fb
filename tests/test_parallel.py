"""parallel.py: FSDP2 and DDP on two CPU processes (gloo) against one process, activation checkpointing against none,
an exact resume from full state dicts. Each two-process scenario sits above the test that reads it and runs on a pair
of ranks started once for the module (tests/pair.py); every one trains with the trainer's own step
(train_gpt2.train_step) on its own loader."""
import functools
import os
import random
import shutil
import threading

import numpy as np
import pytest
import torch
import torch.distributed as tdist
from torch import nn

import checkpoint
import memory
import model
import optim
import parallel
import runs
from metrics import RunLog
from model import GPT, GPTConfig, Sampling
from pair import Pair
from tiny import (CONFIG, RESUME_AT, STEPS, CountedMemory, FakeMemory, Watched, draws, failing_forward, grad_storages,
                  loader, outcome, run, some_tokens, tiny_gpt, train, trial_step, write_shard)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """pair.Pair: two_ranks(scenario, *args) -> [rank 0's result, rank 1's]."""
    tmp = tmp_path_factory.mktemp("parallel")
    os.makedirs(tmp / "data")
    write_shard(str(tmp / "data"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pair = Pair(str(tmp))
    yield pair
    pair.close()


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


def trained(ranks, tmp, sharding, checkpointing=False):
    model, _, _, losses, norms = run(tiny_gpt(), sharding, f"{tmp}/data", ranks, checkpointing=checkpointing)
    return dict(losses=losses, norms=norms, state=parallel.model_state(model))


SHARDINGS = {"ddp": ("none", False), "fsdp": ("fsdp", False), "fsdp_ac": ("fsdp", True), "ddp_ac": ("none", True)}


@pytest.mark.parametrize("name", SHARDINGS)
def test_two_processes_match_one_process(two_ranks, one_process, name):
    r0, r1 = two_ranks(trained, *SHARDINGS[name])
    assert r0["losses"] == r1["losses"]  # the reduced loss is the same on every rank
    assert r0["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
    assert r0["norms"] == pytest.approx(one_process["norms"], rel=1e-5)
    assert_states_close(r0["state"], one_process["state"])
    if name.startswith("fsdp"):
        assert r1["state"] == {}  # the full state dict is gathered on rank 0 only


def test_activation_checkpointing_gives_the_same_training(two_ranks):
    fsdp, fsdp_ac = two_ranks(trained, "fsdp", False)[0], two_ranks(trained, "fsdp", True)[0]
    assert fsdp_ac["losses"] == pytest.approx(fsdp["losses"], rel=1e-6)
    assert_states_close(fsdp_ac["state"], fsdp["state"], rtol=1e-6, atol=1e-7)
    assert two_ranks(trained, "none", True)[0]["losses"] == two_ranks(trained, "none", False)[0]["losses"]  # exact


def test_fsdp_checkpoint_is_a_plain_gpt_state_dict(two_ranks):
    """Activation checkpointing and sharding leave the names alone: sample.py's GPT.load_state_dict
    reads the checkpoint, weight tying included."""
    state = two_ranks(trained, "fsdp", True)[0]["state"]
    assert list(state) == list(tiny_gpt().state_dict())
    assert all(v.device.type == "cpu" and not hasattr(v, "to_local") for v in state.values())
    fresh = tiny_gpt(seed=1)
    fresh.load_state_dict(state)  # strict
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert two_ranks(fsdp_compiled_per_block)[0]["keys"] == list(state)


def trained_with_muon(ranks, tmp, sharding, dtype):
    """Muon under DDP, and under FSDP, where each matrix is sharded and gathered for its Newton-Schulz iteration (in
    bf16, and in fp16 as on GPUs without bf16); the optimizer state in the unsharded format."""
    model, opt, _, losses, norms = run(tiny_gpt(), sharding, f"{tmp}/data", ranks, muon=dtype)
    return dict(losses=losses, norms=norms, state=parallel.model_state(model),
                optimizer=parallel.optimizer_state(model, opt))


# 16-bit Newton-Schulz rounds its input to 8 or 11 bits: where FSDP's gradients differ from one process's in the last
# bit (torch 2.9's FSDP sums in another order; 2.13's match to the bit), a rounding can flip and spread through the
# iteration: after 4 steps, states within 1e-3 (bf16) and 1e-4 (fp16) on 2.9. float32 shows the logic to 5e-8.
SIXTEEN_BIT = {torch.bfloat16: 2e-3, torch.float16: 3e-4}


@pytest.mark.parametrize("sharding, dtype", [("none", torch.bfloat16), ("fsdp", torch.float32),
                                             ("fsdp", torch.bfloat16), ("fsdp", torch.float16)])
def test_muon_on_two_processes_matches_one_process(two_ranks, one_process, sharding, dtype):
    """--optimizer muon under DDP and under FSDP trains as one process does (under FSDP each
    matrix's update is gathered and orthogonalised whole, in fp32, bf16 or fp16), and its checkpointed
    state (Muon's momentum, AdamW's moments) has the one-process format."""
    got, r1 = two_ranks(trained_with_muon, sharding, dtype)
    ref = one_process["muon"][dtype]
    atol = SIXTEEN_BIT.get(dtype) if sharding == "fsdp" else None
    assert got["losses"] == r1["losses"]
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
        muon, _ = optim.configure(raw, optim.Settings(0.1, 1e-3, muon_lr=0.02), muon_dtype=dtype).optimizers
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


def ddp_gradient_storages(ranks, tmp):
    """DDP with accumulation: where the gradients are between its micro-steps, over 3 steps (DDP rebuilds its
    buckets in the second)."""
    raw = tiny_gpt()
    model = parallel.wrap_model(raw, "none", "cpu", "float32")
    opt = optim.configure(raw, optim.Settings(0.1, 1e-3), device_type="cpu")
    watched = Watched(loader(f"{tmp}/data", ranks.rank, ranks.world_size), raw)
    seen = []
    for _ in range(3):
        watched.seen = []
        train(model, opt, watched, 1, ranks)
        seen.append((watched.seen, grad_storages(raw)))
    return seen


def test_ddp_accumulates_in_its_buckets(two_ranks):
    """Under DDP the micro-steps accumulate into its buckets (gradient_as_bucket_view) from the first
    step on: between micro-steps every gradient is in the storages that hold the gradients after
    the step, fewer than the parameters (one per bucket), never in fresh tensors beside them (a
    second copy of the gradients, which the memory plan does not count)."""
    n = len(list(tiny_gpt().parameters()))
    for r in two_ranks(ddp_gradient_storages):
        for seen, (count, after) in r:
            assert count == n and len(after) < n
            for held in seen[1:]:  # the first is taken before the step's first backward
                assert held == (n, after), (seen, after)


def fsdp_between_micro_steps(ranks, tmp):
    """What a rank holds between micro-steps: its shard of each gradient, reduce-scattered at once."""
    raw = tiny_gpt()
    model = parallel.wrap_model(raw, "fsdp", "cpu", "float32")
    x, _ = loader(f"{tmp}/data", 0, 1).next_batch()
    with parallel.grad_sync(model, False):  # a micro-step that is not the last
        model(x, x)[1].backward()
    return [(p.to_local().numel(), p.numel(), None if p.grad is None else p.grad.to_local().numel())
            for p in raw.parameters()]


def test_fsdp_holds_only_gradient_shards_between_micro_steps(two_ranks):
    """Under gradient accumulation each rank holds 1/world of the gradients, as the memory plan
    counts them (at GPT-2 XL the full ones would be 6.2 GB more per GPU), never the full fp32 gradient kept until the
    last micro-step."""
    for held in two_ranks(fsdp_between_micro_steps):
        assert all(grad == shard for shard, _, grad in held), held
        assert sum(shard for shard, _, _ in held) <= sum(full for _, full, _ in held) // 2 + 128


def auto_fit_with_less_memory_on_rank_1(ranks, tmp, sharding):
    """The micro-batch auto-fit where rank 1 cannot hold a micro-batch of 4: under DDP its trial there fails (a cuBLAS
    failure in the forward), under FSDP its memory plan says so (a smaller GPU)."""
    T, world = CONFIG["block_size"], ranks.world_size
    raw = tiny_gpt()
    model = parallel.wrap_model(raw, sharding, "cpu", "float32")
    capacity = 2 ** 40
    if ranks.rank == 1 and sharding == "fsdp":
        capacity = (memory.step_footprint(model, world, "float32", T, 2) + 1) / 0.9
    elif ranks.rank == 1:
        failure = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")
        raw.forward = functools.partial(failing_forward, raw, failure)
    return outcome(memory.choose_micro_batch, 16 * T * world, ranks, model, memory.Layout("float32", T),
                   trial_step(ranks), memory=FakeMemory(capacity))


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_micro_batch_auto_fit_agrees_when_one_rank_has_less_memory(two_ranks, sharding):
    """Rank 1 cannot hold a micro-batch of 4: under DDP its trial there fails (a cuBLAS failure inside the
    forward) and it tries smaller sizes by itself, without collectives; under FSDP its memory plan says so.
    Both ranks take 2, the largest size that fits everywhere, by one all-reduce."""
    assert two_ranks(auto_fit_with_less_memory_on_rank_1, sharding) == [2, 2]


def ddp_probe_against_the_step(ranks, tmp):
    """The peaks of the real training step (train_gpt2.train_step, through DDP) and of the auto-fit's
    trials at micro-batches 1, 2 and 4 of 4 sequences per rank (accumulation 4, 2, 1); and the
    micro-batch it chooses where the step's own peaks say 1 fits and 2 does not. The step's
    optimizer keeps no state, so its peak is the micro-steps' (the fit adds AdamW's moments); after the fit the
    gradients are DDP's buckets, zeroed: the first real step starts from zero."""
    import train_gpt2
    from dataloader import Data, TokenLoader
    T, per_rank = CONFIG["block_size"], 4
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**CONFIG))  # fp32, the bytes the plan's arithmetic assumes
    model = parallel.wrap_model(raw, "none", "cpu", "float32")
    optimizer = optim.Optimizers(torch.optim.SGD(raw.parameters(), lr=0.0))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step = {}
    for b in (1, 2, 4):
        data = TokenLoader(Data(f"{tmp}/data", CONFIG["vocab_size"]), "train", b, T, ranks)
        one_step = functools.partial(train_gpt2.train_step,
                                     train_gpt2.StepParts(model, optimizer, scaler, ranks, "float32", per_rank // b),
                                     data)
        for _ in range(2):  # DDP rebuilds its buckets after its first step
            one_step()
        step[b] = CountedMemory(model).peak_of(one_step)
    counter = CountedMemory(model)
    for b in (1, 2, 4):
        memory.trial_peak(model, trial_step(ranks), (b, T), per_rank // b, "cpu", counter)
    moments = 8 * sum(p.numel() for p in raw.parameters())
    room = (step[1] + step[2]) / 2 + moments  # room for the step at 1, not at 2
    chosen = memory.choose_micro_batch(per_rank * T * ranks.world_size, ranks, model, memory.Layout("float32", T),
                                       trial_step(ranks), memory=CountedMemory(model, capacity=room / 0.9))
    zero = all(p.grad is None or not p.grad.any() for p in raw.parameters())
    return dict(step=[step[b] for b in (1, 2, 4)], probe=counter.peaks, chosen=chosen, zero=zero)


def test_ddp_auto_fit_measures_the_step_as_it_trains(two_ranks):
    """Through DDP's wrapper, with the trainer's own micro-step: the trials' peaks are the real step's (to
    the bytes of its target tensor); the bare GPT's single forward and backward missed the
    gradients that accumulation holds between micro-steps, and counted a copy of them where DDP's
    buckets take them at once. So where the step's own peaks leave room for 1 and not 2, 1 it is; and the trials
    leave no gradient behind."""
    for got in two_ranks(ddp_probe_against_the_step):
        for probe, step in zip(got["probe"], got["step"]):
            assert abs(probe - step) <= 0.001 * step, (got["probe"], got["step"])
        assert got["chosen"] == 1 and got["zero"]


def fsdp_plan_against_the_trial(ranks, tmp, checkpointing):
    """What the FSDP memory plan (step_footprint) says a rank holds at micro-batches 1, 2 and 4, and what the
    trial there allocates on top of the weights."""
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**CONFIG))
    model = parallel.wrap_model(raw, "fsdp", "cpu", "float32", activation_checkpointing=checkpointing)
    counter = CountedMemory(model)
    for b in (1, 2, 4):
        memory.trial_peak(model, trial_step(ranks), (b, CONFIG["block_size"]), 4 // b, "cpu", counter)
    return dict(plan=[memory.step_footprint(model, ranks.world_size, "float32", CONFIG["block_size"], b)
                      for b in (1, 2, 4)], allocated=[p - a for p, a in zip(counter.peaks, counter.before)])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp_memory_plan_covers_what_the_trial_allocates(two_ranks, checkpointing):
    """Under FSDP a rank tries one micro-batch only (a second trial would be a collective the others do not
    join), so the plan that picks it must hold at least what the trial allocates on top of the weights
    (activations, gradient shards, the collectives' buffers)."""
    for got in two_ranks(fsdp_plan_against_the_trial, checkpointing):
        assert len(got["plan"]) == len(got["allocated"]) == 3
        assert all(plan >= allocated for plan, allocated in zip(got["plan"], got["allocated"])), got


def fsdp_saved_and_restored(ranks, tmp):
    """An interrupted FSDP run, saved after RESUME_AT steps as the trainer saves it (rank 0 writes the full state) and
    restored as the trainer restores it (every rank reads the file) into a fresh, differently initialised model;
    each rank's generators moved between save and restore; a save of the same step again on every rank."""
    data_dir, log_dir = f"{tmp}/data", f"{tmp}/ckpt"
    model, opt, data, losses, _ = run(tiny_gpt(), "fsdp", data_dir, ranks, steps=RESUME_AT)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    saver = checkpoint.Checkpointer(log_dir, 1, ranks, RunLog(log_dir, ranks.is_master))
    saver.restore(model=model, optimizer=opt, scaler=scaler, train_loader=data, config={}, fsdp=True)
    torch.rand(ranks.rank + 1), np.random.rand(ranks.rank + 1), random.random()  # each rank's generators elsewhere
    saver.save(RESUME_AT)
    out = dict(draws_after_save=draws(), optimizer_at_resume=parallel.optimizer_state(model, opt))
    path = checkpoint.checkpoint_path(log_dir, RESUME_AT)
    tdist.barrier()
    written = os.stat(path).st_mtime_ns
    saver.save(RESUME_AT)  # every rank knows it is written: no collective, nothing written again
    out["saved_once"] = os.stat(path).st_mtime_ns == written
    tdist.barrier()
    saved = checkpoint.load_file(path)
    raw = tiny_gpt(seed=1)
    model = parallel.wrap_model(raw, "fsdp", "cpu", "float32")
    opt = optim.configure(raw, optim.Settings(0.1, 1e-3), device_type="cpu")
    data = loader(data_dir, ranks.rank, ranks.world_size)
    restorer = checkpoint.Checkpointer(log_dir, 1, ranks, RunLog(log_dir, False), checkpoint.Resume("ckpt", saved, []))
    torch.manual_seed(999), np.random.seed(999), random.seed(999)
    assert restorer.restore(model=model, optimizer=opt, scaler=scaler, train_loader=data, config={},
                            fsdp=True) == RESUME_AT
    out["draws_after_restore"] = draws()
    more, _ = train(model, opt, data, STEPS - RESUME_AT, ranks)
    out["resumed"] = dict(losses=losses + more, state=parallel.model_state(model))
    return out


def test_each_rank_gets_its_own_random_state_back(two_ranks):
    """Nothing in training draws from the global generators today, so no loss shows whether they come back; a
    future dropout or unseeded sampling would. Each rank's state, saved with the checkpoint, is restored on that
    rank: the draws after the restore are the draws after the save, and the ranks' differ."""
    r0, r1 = two_ranks(fsdp_saved_and_restored)
    assert r0["draws_after_restore"] == r0["draws_after_save"]
    assert r1["draws_after_restore"] == r1["draws_after_save"]
    assert r0["draws_after_save"] != r1["draws_after_save"]


def test_every_rank_knows_the_checkpoint_was_written(two_ranks):
    """Rank 0 writes the file; a stop right after a scheduled checkpoint saves that step again, and a rank that did not
    know it was written would call save()'s collectives alone and wait for the others forever."""
    r0, r1 = two_ranks(fsdp_saved_and_restored)
    assert r0["saved_once"] and r1["saved_once"]


def test_fsdp_resume_from_full_state_dicts_is_exact(two_ranks):
    resumed, fsdp = two_ranks(fsdp_saved_and_restored)[0]["resumed"], two_ranks(trained, "fsdp", False)[0]
    assert resumed["losses"] == fsdp["losses"]
    for k, v in fsdp["state"].items():
        assert torch.equal(resumed["state"][k], v), k


def test_fsdp_optimizer_state_has_the_unsharded_format(two_ranks, one_process):
    """optimizer_state numbers parameters as optimizer.state_dict() does on one process, so DDP and
    FSDP checkpoints are interchangeable."""
    got, ref = two_ranks(fsdp_saved_and_restored)[0]["optimizer_at_resume"], one_process["optimizer_at_resume"]
    assert got["param_groups"] == ref["param_groups"]
    assert list(got["state"]) == list(ref["state"])
    for i, s in ref["state"].items():
        assert list(got["state"][i]) == list(s)
        for key in s:
            torch.testing.assert_close(got["state"][i][key], s[key], rtol=1e-4, atol=1e-7)


def fsdp_compiled_per_block(ranks, tmp):
    """Per-block torch.compile under FSDP, with the aot_eager backend: the same graphs as inductor's up to code
    generation, without a C++ compile on a small CPU."""
    real_compile = torch.compile
    torch.compile = functools.partial(real_compile, backend="aot_eager")
    try:
        model, _, _, losses, _ = run(tiny_gpt(), "fsdp", f"{tmp}/data", ranks, steps=2, checkpointing=True,
                                     compile=True)
    finally:
        torch.compile = real_compile
    return dict(losses=losses, keys=list(parallel.model_state(model)))


def test_fsdp_per_block_compile_matches_eager(two_ranks):
    compiled = two_ranks(fsdp_compiled_per_block)[0]
    assert compiled["losses"] == pytest.approx(two_ranks(trained, "fsdp", False)[0]["losses"][:2], rel=1e-6)


def fsdp_overflow_in_one_shard(ranks, tmp):
    """fp16 loss scaling: an inf in rank 1's shard of one gradient; what the scaler finds on this rank."""
    raw = tiny_gpt()
    model = parallel.wrap_model(raw, "fsdp", "cpu", "float32")
    adamw, = optim.configure(raw, optim.Settings(0.1, 1e-3), device_type="cpu").optimizers
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    x, _ = loader(f"{tmp}/data", 0, 1).next_batch()
    scaler.scale(model(x, x)[1]).backward()
    if ranks.rank == 1:
        raw.transformer.h[0].mlp.c_fc.weight.grad.to_local().view(-1)[0] = float("inf")
    scaler.unscale_(adamw)
    return sum(v.item() for v in scaler._found_inf_per_device(adamw).values())


def test_fsdp_grad_scaler_skips_on_every_rank_when_one_shard_overflows(two_ranks):
    found_inf = two_ranks(fsdp_overflow_in_one_shard)
    assert found_inf[0] > 0 and found_inf[1] > 0


class RotaryBlock(model.Block):
    """A variant defined here: rotary position embeddings (Su et al. 2021, RoFormer) on the queries and keys, and no
    learned position table: the block places each token by its position, as the GPT hands it. Its base angle is a
    setting of its own (--rope-theta)."""
    learned_positions = False
    options = {"rope_theta": (10000.0, "the rotary embeddings' base")}

    def __init__(self, config):
        super().__init__(config)
        self.theta = config.options["rope_theta"]

    def forward(self, x, pos=None, cache=None, layer=0, mask=None):
        half = self.attn.n_embd // self.attn.n_head // 2
        freq = self.theta ** -(torch.arange(half, device=x.device, dtype=torch.float64) / half)
        angle = pos.to(torch.float64)[..., None] * freq  # (T, half), or (B, T, half) for packed rows
        angle = angle[:, None] if angle.dim() == 3 else angle  # over the heads
        cos, sin = angle.cos(), angle.sin()

        def rotate(t):  # (B, nh, T, hs): each pair of halves turned by its position's angles
            a, b = t[..., :half], t[..., half:]
            return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(t.dtype)
        x = x + self.attn(self.ln_1(x), cache, layer, mask, rotate=rotate)
        return x + self.mlp(self.ln_2(x))


class RMSNormBlock(model.Block):
    """A variant defined here: RMSNorm (no bias, no mean) in place of every LayerNorm, the final one included."""
    final_norm = nn.RMSNorm

    def __init__(self, config):
        super().__init__(config)
        self.ln_1, self.ln_2 = nn.RMSNorm(config.n_embd), nn.RMSNorm(config.n_embd)


VARIANTS = {"rotary": RotaryBlock, "rmsnorm": RMSNormBlock}


def variant_gpt(name, seed=0):
    model.BLOCKS[name] = VARIANTS[name]  # registered where it is used: in this process, or a rank's
    torch.manual_seed(seed)
    return GPT(GPTConfig(**CONFIG, block=name)).double()


def trained_variant(ranks, tmp, name, sharding):
    model_, _, _, losses, norms = run(variant_gpt(name), sharding, f"{tmp}/data", ranks)
    return dict(losses=losses, norms=norms, state=parallel.model_state(model_))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_variant_defined_in_a_test_trains_checkpoints_resumes_and_shards(two_ranks, data_dir, tmp_path, name,
                                                                        monkeypatch):
    """Nothing outside this test changes for a model of another block: sharded by FSDP2 over two ranks it trains
    as one process does (every room asks the model for its blocks, matrices and units); through the trainer's
    command line (--block) it trains, checkpoints and resumes to the losses of the run that never stopped, its
    checkpoint keeps the variant's own weights, and the run exports nothing (the variant is not GPT-2's)."""
    one = parallel.Ranks()
    write_shard(str(tmp_path))
    _, _, _, losses, norms = run(variant_gpt(name), "none", str(tmp_path), one)
    r0, r1 = two_ranks(trained_variant, name, "fsdp")
    assert r0["losses"] == r1["losses"] and r0["losses"] == pytest.approx(losses, rel=1e-5)
    assert r0["norms"] == pytest.approx(norms, rel=1e-5)
    state = r0["state"]
    if name == "rotary":
        assert "transformer.wpe.weight" not in state and "transformer.ln_f.bias" in state
    else:
        assert "transformer.h.0.ln_1.bias" not in state and "transformer.ln_f.bias" not in state

    monkeypatch.setitem(model.BLOCKS, name, VARIANTS[name])
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    settings = dict(data_dir=data_dir, block=name, export_hf=None)  # the export's default: the variant's answer
    assert runs.train(runs.tiny(log_dir=whole, max_steps=6, **settings)) == 0
    assert runs.train(runs.tiny(log_dir=part, max_steps=3, **settings)) == 0
    assert runs.train(["--log-dir", part, "--resume", "--max-steps", "6"]) == 0
    assert [r["loss"] for r in runs.records(part, "train")] == [r["loss"] for r in runs.records(whole, "train")]
    saved = checkpoint.load_model(part)[0]
    assert isinstance(saved.blocks[0], VARIANTS[name]) and saved.config.block == name
    assert not os.path.exists(os.path.join(part, "hf")) and not os.path.exists(os.path.join(whole, "hf"))
    # a run started from its weights (--init-from: no --block) exports what it can: nothing, and says so
    tuned = str(tmp_path / "tuned")
    p = runs.run(runs.tiny(data_dir=data_dir, log_dir=tuned, init_from=part, max_steps=2, export_hf=None,
                           n_layer=None, n_head=None, n_embd=None))
    assert f"not exported to Hugging Face's format: a GPT of {name!r} blocks is not GPT-2's" in p.stdout
    assert "already finished" in runs.run(["--log-dir", tuned, "--resume"]).stdout  # no export owed


def test_a_variants_own_setting_is_a_flag_its_checkpoints_keep_and_a_resume_may_not_change(data_dir, tmp_path,
                                                                                             monkeypatch):
    """The rotary block's base (its options, declared in the class above): --rope-theta joins the trainer's flags
    (in --help, with its block), reaches the model and its losses, is kept in the checkpoint's shape, holds on a
    resume that does not name it, and is refused, in one line, where a resume would change it or another block is
    trained; nothing outside this file was told of it."""
    import common
    import train_config
    monkeypatch.setitem(model.BLOCKS, "rotary", RotaryBlock)
    helped = " ".join(runs.run(["--help"]).stdout.split())
    assert "--rope-theta ROPE_THETA the rotary embeddings' base (--block rotary; default: 10000.0)" in helped
    low, plain = str(tmp_path / "low"), str(tmp_path / "plain")
    settings = dict(data_dir=data_dir, block="rotary", export_hf=None, max_steps=2)
    assert runs.train(runs.tiny(log_dir=low, rope_theta=500.0, **settings)) == 0
    assert runs.train(runs.tiny(log_dir=plain, **settings)) == 0
    assert [r["loss"] for r in runs.records(low, "train")] != [r["loss"] for r in runs.records(plain, "train")]
    saved = checkpoint.load_model(low)[0]
    assert saved.config.options == {"rope_theta": 500.0} and saved.blocks[0].theta == 500.0
    assert checkpoint.load_model(plain)[0].config.options == {"rope_theta": 10000.0}
    assert runs.train(["--log-dir", low, "--resume", "--max-steps", "3", "--rope-theta", "500"]) == 0  # the same
    assert checkpoint.load_model(low)[0].blocks[0].theta == 500.0
    assert runs.train(["--log-dir", plain, "--resume", "--max-steps", "3", "--rope-theta", "10000"]) == 0  # its default
    ckpt = checkpoint.load_file(checkpoint.list_checkpoints(plain)[-1])
    del ckpt["config"]["rope_theta"]  # a run from before the block had the setting: its shape says the value
    checkpoint.save_file(checkpoint.list_checkpoints(plain)[-1], ckpt)
    for log_dir, was in ((low, "500.0"), (plain, "10000.0")):
        refused = runs.run(["--log-dir", log_dir, "--resume", "--max-steps", "4", "--rope-theta", "600"], check=False)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"the run was trained with --rope-theta {was} and this command asks for --rope-theta 600.0" in \
            refused.stderr
    monkeypatch.delitem(model.BLOCKS, "rotary")  # a process that has not registered the variant: one line
    refused = runs.run(["--log-dir", low, "--resume", "--max-steps", "4"], check=False)
    assert refused.returncode == 2 and refused.stderr.startswith("error: cannot build the model the run starts from: "
                                                                 "no block 'rotary'"), refused.stderr
    monkeypatch.setitem(model.BLOCKS, "rotary", RotaryBlock)

    class Gated(model.Block):  # a switch: --gated / --no-gated
        options = {"gated": (False, "a gate on the MLP")}
    monkeypatch.setitem(model.BLOCKS, "gated", Gated)
    for on in (True, False):
        args = train_config.parse_args(runs.tiny(data_dir=data_dir, block="gated", gated=on))
        assert GPT(model.config_of("gpt2", 32, block="gated", gated=args.gated)).config.options == {"gated": on}

    class Counted(model.Block):  # the same name, another default: one flag cannot hold both
        options = {"gated": (2, "a count")}
    monkeypatch.setitem(model.BLOCKS, "counted", Counted)
    with pytest.raises(ValueError, match="blocks 'counted' and 'gated' both declare 'gated', with the defaults 2 and "):
        train_config.parse_args(["--help"])
    monkeypatch.delitem(model.BLOCKS, "counted")
    with pytest.raises(common.UserError, match=r"^--rope-theta is a setting of rotary blocks, not of --block gpt2 "
                                               r"\(the default's\): add --block rotary, or drop it$"):
        train_config.resolve(train_config.parse_args(runs.tiny(data_dir=data_dir, rope_theta=500.0)))


def test_a_blocks_own_setting_parses_as_its_default_and_sits_with_the_architecture(data_dir, reference_run, tmp_path,
                                                                                    monkeypatch):
    """A block's own setting takes its default's type: an int takes an int (not 2.5) and has no --no- form, a float a
    float; only a bool is a switch. Like a size, it is refused beside --init-from, whose weights decide the
    architecture (drop it, not add a --block). A run whose checkpoint predates the setting (its shape holds no
    options) resumes with the setting at its default."""
    import train_config

    class Grouped(model.Block):
        options = {"kv_groups": (2, "groups of heads")}
    monkeypatch.setitem(model.BLOCKS, "grouped", Grouped)
    monkeypatch.setitem(model.BLOCKS, "rotary", RotaryBlock)
    settings = dict(data_dir=data_dir, log_dir=str(tmp_path / "fresh"), block="grouped", export_hf=None, max_steps=2)
    args = train_config.parse_args(runs.tiny(kv_groups=3, **settings))
    assert args.kv_groups == 3 and type(args.kv_groups) is int
    args = train_config.parse_args(runs.tiny(**dict(settings, block="rotary"), rope_theta=500))
    assert args.rope_theta == 500.0 and type(args.rope_theta) is float
    for bad, said in ((["--kv-groups", "2.5"], "error: argument --kv-groups: invalid int value: '2.5' (see --help)"),
                      (["--no-kv-groups"], "error: unrecognized arguments: --no-kv-groups (see --help)")):
        p = runs.run(runs.tiny(**settings) + bad, check=False)
        assert (p.returncode, p.stderr) == (2, said + "\n"), p.stderr
    p = runs.run(runs.tiny(**dict(settings, block=None), init_from=reference_run, n_layer=None, n_head=None,
                           n_embd=None, rope_theta=500.0), check=False)
    assert (p.returncode, p.stderr) == (2, f"error: --rope-theta has no effect with --init-from: the architecture "
                                           f"comes from {reference_run}; drop it\n"), p.stderr
    assert not os.path.exists(settings["log_dir"])
    older = str(tmp_path / "older")
    assert runs.train(runs.tiny(**dict(settings, block="rotary", log_dir=older))) == 0
    path = checkpoint.list_checkpoints(older)[-1]
    ckpt = checkpoint.load_file(path)
    del ckpt["model_config"]["options"]  # written before the block had a setting of its own
    del ckpt["config"]["rope_theta"]
    checkpoint.save_file(path, ckpt)
    shutil.copytree(older, older + "-given")
    for log_dir, given in ((older, []), (older + "-given", ["--rope-theta", "10000"])):  # its default, or the same
        assert runs.train(["--log-dir", log_dir, "--resume", "--max-steps", "3", *given]) == 0, given
        assert checkpoint.load_model(log_dir)[0].blocks[0].theta == 10000.0
        assert runs.records(log_dir, "train")[-1]["step"] == 2


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_variant_generates_and_scores_packed_rows_as_gpt2_does(name, monkeypatch):
    """The positions reach the blocks in generation (the KV cache's decode steps) and in HellaSwag's packed rows
    (positions restarting for each ending): the same greedy tokens with and without the cache, the same logits
    packed and one row at a time; and the model's own answers: it does not export, its FLOPs are its blocks'."""
    import scoring
    monkeypatch.setitem(model.BLOCKS, name, VARIANTS[name])
    net = variant_gpt(name).float().eval()
    idx = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        cached = [t.tolist() for t in net.generate_stream(idx, Sampling(12, temperature=0))]
        uncached = [t.tolist() for t in net.generate_stream(idx, Sampling(12, temperature=0), use_cache=False)]
        assert cached == uncached
        ctx, endings = [5, 6, 7], [[8, 9], [10], [11, 12, 13], [14]]
        tokens, pos, seg, _ = scoring.pack(ctx, [([], e) for e in endings])
        packed, _ = net(torch.tensor([tokens]), pos=torch.tensor([pos]),
                        mask=scoring.attention_mask(torch.tensor([seg])))
        at = len(ctx)
        for e in endings:
            alone, _ = net(torch.tensor([ctx + e]))
            torch.testing.assert_close(packed[0, at:at + len(e)], alone[0, len(ctx):], rtol=1e-5, atol=1e-5)
            at += len(e)
    assert net.export_problem() == f"a GPT of {name!r} blocks is not GPT-2's architecture"
    import common
    import train_config
    args = train_config.parse_args(runs.tiny(block=name, export_hf=None, data_dir="d"))
    assert train_config.resolve(args)[0].export_hf is False  # the variant's answer, where no flag asks otherwise
    with pytest.raises(common.UserError, match=f"--export-hf writes GPT-2's .* --block {name} is another"):
        train_config.resolve(train_config.parse_args(runs.tiny(block=name, export_hf=True, data_dir="d")))
    blocks = sum(b.flops_per_token(32) for b in net.blocks)
    outside = net.transformer.wte.weight.numel() + sum(p.numel() for p in net.transformer.ln_f.parameters())
    assert net.flops_per_token(32) == blocks + 6 * outside  # the 6N convention: every parameter but the positions'

    class Costlier(VARIANTS[name]):  # a block that says it costs more: the model's figure follows
        def flops_per_token(self, seq_len):
            return 2 * super().flops_per_token(seq_len)
    monkeypatch.setitem(model.BLOCKS, name, Costlier)
    assert GPT(GPTConfig(**CONFIG, block=name)).flops_per_token(32) == 2 * blocks + 6 * outside


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
        step = made.restore(model=model, optimizer=opt, scaler=scaler, train_loader=data, config={}, fsdp=False)
        return made, step, scaler
    checkpointer(saved_fp16)[0].save(1)
    path = checkpoint.checkpoint_path(str(tmp_path / "log"), 1)
    _, step, scaler = checkpointer(not saved_fp16, checkpoint.Resume(path, checkpoint.load_file(path), []))
    assert step == 1
    assert scaler.is_enabled() != saved_fp16
    if not saved_fp16:
        assert scaler.get_scale() == 2.0 ** 10  # a fresh scale


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
