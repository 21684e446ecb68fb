"""The optimizers (optim.py) against torch's own: AdamW's parameter groups and step, Muon for the
block matrices beside AdamW, and Muon's Newton-Schulz iteration in fp16/fp32 for GPUs without bf16."""
import torch

import optim
from model import GPT, GPTConfig

TINY = dict(block_size=64, n_layer=2, n_head=2, n_embd=32)


def test_optimizer_groups_and_step_match_adamw():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**TINY))
    opt = optim.configure(m, optim.Settings(weight_decay=0.1, max_lr=1e-3), device_type="cpu")
    adamw, = opt.optimizers  # AdamW alone: the same shape as the Muon+AdamW pair
    decay, no_decay = adamw.param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))
    assert adamw.defaults["betas"] == (0.9, 0.95) and adamw.defaults["eps"] == 1e-8 and opt.name == "AdamW"
    # one step equals a hand-configured torch.optim.AdamW on a copy
    import copy
    m2 = copy.deepcopy(m)
    ref = torch.optim.AdamW([
        {"params": [p for p in m2.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in m2.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    idx = torch.randint(0, 50257, (2, 16))
    for model, o in ((m, opt), (m2, ref)):
        model(idx, idx)[1].backward()
        o.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def torch_pair(model, opt, fused=None):
    """A copy of model, with torch.optim.Muon and torch.optim.AdamW set up by hand as
    optim.configure set up the pair opt."""
    muon, adamw = opt.optimizers
    ref = GPT(GPTConfig(**TINY))
    ref.load_state_dict(model.state_dict())
    by_name = dict(ref.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    ref_muon = torch.optim.Muon([by_name[names[id(p)]] for g in muon.param_groups for p in g["params"]], lr=0.02,
                                momentum=muon.param_groups[0]["momentum"], nesterov=True, weight_decay=0.0)
    ref_adamw = torch.optim.AdamW([{"params": [by_name[names[id(p)]] for p in g["params"]],
                                    "weight_decay": g["weight_decay"]} for g in adamw.param_groups],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    return ref, ref_muon, ref_adamw


def test_muon_for_the_block_matrices_adamw_for_the_rest():
    """--optimizer muon: torch.optim.Muon takes exactly the attention and MLP matrices; AdamW the
    embeddings (the tied head with them), the gains and the biases; one step of the pair equals the
    two torch optimizers applied by hand; stepped through a GradScaler, the gradients are unscaled before
    either uses them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    opt = optim.configure(model, optim.Settings(0.1, 1e-3, muon_lr=0.02, muon_momentum=0.9))
    muon, adamw = opt.optimizers
    blocks = {id(p) for b in model.transformer.h for n, p in b.named_parameters()
              if n.endswith("weight") and p.dim() == 2}
    assert {id(p) for g in muon.param_groups for p in g["params"]} == blocks
    assert len(blocks) == 4 * TINY["n_layer"]
    rest = [p for g in adamw.param_groups for p in g["params"]]
    assert len(rest) + len(blocks) == len(list(model.parameters()))
    assert any(p is model.transformer.wte.weight for p in rest) and adamw.param_groups[0]["weight_decay"] == 0.1
    assert muon.param_groups[0]["momentum"] == 0.9 and muon.param_groups[0]["weight_decay"] == 0.0

    ref, ref_muon, ref_adamw = torch_pair(model, opt)
    idx = torch.randint(0, 50257, (2, 16))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(model(idx, idx)[1]).backward()
    for o in opt.optimizers:  # each unscales first (Muon by itself, given the scale), as AdamW's eps is not scaled
        scaler.step(o)
    ref(idx, idx)[1].backward()
    ref_muon.step()
    ref_adamw.step()
    by_name = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, by_name[n], rtol=1e-6, atol=1e-7, msg=n)
    for p, q in zip(muon.param_groups[0]["params"], ref_muon.param_groups[0]["params"]):
        torch.testing.assert_close(muon.state[p]["momentum_buffer"], ref_muon.state[q]["momentum_buffer"])
    state = opt.state_dict()
    assert len(state["optimizers"]) == 2 and "momentum_buffer" in state["optimizers"][0]["state"][0]


class Batches:
    """A loader whose every micro-batch is idx (as input and as targets)."""

    def __init__(self, idx):
        self.idx = idx

    def next_batch(self, timer=None):
        return self.idx, self.idx


def test_fp16_step_of_the_pair_skips_or_updates_both_without_a_host_sync(monkeypatch):
    """train_step in fp16 with Muon and fused AdamW (the pair of a GPU): an overflow skips both
    optimizers, a finite step updates both, with the scale of stepping torch's two optimizers
    through the scaler one by one; and found_inf is never read on the host (GradScaler's path that
    sums it with .item() for an optimizer that cannot skip a step by itself is not taken)."""
    import train_gpt2
    from parallel import Ranks
    host_reads = []
    real = torch.amp.GradScaler._maybe_opt_step
    monkeypatch.setattr(torch.amp.GradScaler, "_maybe_opt_step",
                        lambda self, *a, **kw: host_reads.append(1) or real(self, *a, **kw))
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    for init_scale, overflow in ((2.0 ** 127, True), (16.0, False)):  # 2^127 x the loss is inf in fp32
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = optim.configure(model, optim.Settings(0.1, 1e-3, muon_lr=0.02), fused=True)
        ref, ref_muon, ref_adamw = torch_pair(model, opt, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        *_, finite = train_gpt2.train_step(train_gpt2.StepParts(model, opt, scaler, Ranks(), "float16"), Batches(idx))
        assert finite != overflow and host_reads == []

        ref_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(idx, idx)[1]
        ref_scaler.scale(loss).backward()
        for o in (ref_muon, ref_adamw):
            ref_scaler.unscale_(o)
        for o in (ref_muon, ref_adamw):
            ref_scaler.step(o)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale() == (init_scale / 2 if overflow else init_scale)
        by_name = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            torch.testing.assert_close(p, by_name[n], rtol=1e-6, atol=1e-7, msg=n)
            assert torch.equal(p, before[n]) == overflow, n
        host_reads.clear()


def test_muon_without_bf16_orthogonalises_in_another_dtype_and_steps_as_torch_does(monkeypatch):
    """GPUs without bf16 (T4, V100) run Muon's Newton-Schulz in fp16 (or fp32): the iteration is
    torch's, and the step around it (momentum, Nesterov, the shape's LR scale, weight decay) is too."""
    import torch.optim._muon as torch_muon
    from optim import Muon, orthogonalize
    torch.manual_seed(0)
    coefficients, steps, eps = (3.4445, -4.775, 2.0315), 5, 1e-7
    for shape in ((8, 24), (24, 8)):  # wide and tall
        g = torch.randn(shape)
        exact = orthogonalize(g.double(), coefficients, steps, eps, torch.float64)
        theirs = torch_muon._zeropower_via_newtonschulz(g, coefficients, steps, eps).double()
        bf16 = (theirs - exact).abs().max()  # torch's own iteration, in bf16
        assert bf16 < 0.05 and (orthogonalize(g, coefficients, steps, eps, torch.bfloat16).double() - exact
                                ).abs().max() <= 2 * bf16
        for scale in (1.0, 1e-7):  # small gradients too: fp16 subnormals start at 6e-8
            for dtype, tol in ((torch.float16, 5e-3), (torch.float32, 1e-5)):
                got = orthogonalize(g * scale, coefficients, steps, eps, dtype).double()
                assert (got - exact).abs().max() < tol, (dtype, scale)
    # the step: ours in float32 against torch's with its iteration run in float32 as well
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda g, c, n, e: orthogonalize(g, c, n, e, torch.float32))
    a, b = torch.nn.Parameter(torch.randn(24, 8)), torch.nn.Parameter(torch.randn(8, 24))
    a2, b2 = (torch.nn.Parameter(t.detach().clone()) for t in (a, b))
    kw = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01)
    ours, ref = Muon([a, b], ortho_dtype=torch.float32, **kw), torch.optim.Muon([a2, b2], **kw)
    for _ in range(3):
        for p, q in ((a, a2), (b, b2)):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q in ((a, a2), (b, b2)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert ours.state_dict()["state"].keys() == ref.state_dict()["state"].keys()
    torch.testing.assert_close(ours.state[a]["momentum_buffer"], ref.state[a2]["momentum_buffer"])


def test_the_optimizer_room_owns_its_settings_schedule_header_and_advice():
    """optim.build reads its own settings from the run's: the header's line, each step's rates, the settings put back
    over a resumed state and the rates a diverged run lowers all come from optim.py, and so do its flags, their ranges,
    defaults and checks (optim.Flags, which train_config composes); neither train_gpt2.py nor train_config.py names an
    optimizer, so a new one is added here alone."""
    import os
    from types import SimpleNamespace
    for name in ("train_gpt2.py", "train_config.py"):
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)) as f:
            text = f.read().lower()
        assert "muon" not in text and "adamw" not in text, name
    cfg = SimpleNamespace(weight_decay=0.1, max_lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, muon_lr=0.02,
                          muon_momentum=0.95, warmup_steps=10, max_steps=100, min_lr_ratio=0.1, lr_schedule="cosine",
                          given=frozenset({"warmup_steps"}))
    model = GPT(GPTConfig(**TINY))
    opt = optim.build(model, cfg, "cpu", SimpleNamespace(muon_dtype=torch.float16))
    assert opt.describe() == ("lr 0.0006 (AdamW), Muon 0.02 on the block matrices (Newton-Schulz in float16: no "
                                   "bfloat16 on this GPU): 10 warm-up steps, cosine to 6e-05 at step 100")
    muon, adamw = opt.optimizers
    assert opt.at_step(0) == adamw.param_groups[0]["lr"] == 6e-4 / 10 and muon.param_groups[0]["lr"] == 0.02 / 10
    for group in adamw.param_groups + muon.param_groups:  # a resumed state's settings, then this launch's
        group.update(weight_decay=0.5, eps=1.0, momentum=0.5)
    opt.settle()
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0] and adamw.param_groups[0]["eps"] == 1e-8
    assert muon.param_groups[0]["momentum"] == 0.95 and opt.rates() == "--max-lr or --muon-lr"
    plain = optim.build(model, SimpleNamespace(**dict(vars(cfg), muon_lr=None, lr_schedule="wsd", given=())), "cpu")
    assert plain.describe() == ("lr 0.0006: 10 warm-up steps (10% of --max-steps; --warmup-steps sets it), "
                                "stable, then linear to 6e-05 at step 100") and plain.rates() == "--max-lr"
    assert plain.describe(resumed=True) == "lr 0.0006: 10 warm-up steps, stable, then linear to 6e-05 at step 100"
