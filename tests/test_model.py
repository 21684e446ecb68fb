"""model.py against references: Hugging Face's GPT-2 for logits, torch.optim.AdamW for the
optimizer, and itself without the KV cache for generation."""
import math
import os
import stat

import pytest
import torch

import tokenizer
from model import GPT, GPTConfig, PRESETS, sample_next

TINY = dict(block_size=64, n_layer=2, n_head=2, n_embd=32)


def tiny_hf(seed=0, n_positions=64):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=n_positions)
    hf = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF zero-initialises biases and norms: make every parameter matter
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def test_hf_import_logits_match(tmp_path):
    hf = tiny_hf()
    hf.save_pretrained(tmp_path)  # the hub is unreachable here: go through a local directory
    ours = GPT.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, 50257, (2, 40))
    with torch.no_grad():
        ref = hf(idx).logits
        logits, _ = ours(idx)
    assert logits.shape == (2, 40, 50304)
    assert (logits[..., :50257] - ref).abs().max().item() <= 1e-4
    assert torch.isneginf(logits[..., 50257:]).all()


def test_hf_export_loads_in_transformers(tmp_path):
    from transformers import GPT2LMHeadModel, pipeline
    torch.manual_seed(1)
    ours = GPT(GPTConfig(**TINY)).eval()
    ours.export_hf(str(tmp_path), tokenizer_files=tokenizer.gpt2_bpe_files())
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, 50257, (2, 30))
    with torch.no_grad():
        ref, _ = ours(idx)
        out = hf(idx).logits
    assert out.shape == (2, 30, 50257)
    assert (out - ref[..., :50257]).abs().max().item() <= 1e-4
    gen = pipeline("text-generation", model=str(tmp_path), device="cpu")
    text = gen("Hello", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("Hello") and len(text) > len("Hello")
    # every file readable as the user's umask makes ordinary files (safetensors writes its own 0600)
    umask = os.umask(0)
    os.umask(umask)
    assert {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in os.listdir(tmp_path)} == \
        {name: 0o666 & ~umask for name in os.listdir(tmp_path)}


def test_real_gpt2_matches_transformers(hf_hub_online):
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained("gpt2").eval()
    ours = GPT.from_pretrained("gpt2").eval()
    idx = torch.tensor([tokenizer.get_tokenizer().encode("Hello, I'm a language model,")])
    with torch.no_grad():
        assert (ours(idx)[0][..., :50257] - hf(idx).logits).abs().max().item() <= 1e-4


def test_weight_tying_shares_storage():
    m = GPT(GPTConfig(**TINY))
    assert m.lm_head.weight is m.transformer.wte.weight
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()
    names = [n for n, _ in m.named_parameters()]
    assert "lm_head.weight" not in names  # counted once


def test_init_follows_gpt2():
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=256)
    m = GPT(cfg)
    h = m.transformer.h[0]
    assert abs(h.attn.c_attn.weight.std().item() - 0.02) < 0.002
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert abs(h.attn.c_proj.weight.std().item() - resid) < 0.1 * resid
    assert abs(h.mlp.c_proj.weight.std().item() - resid) < 0.1 * resid
    assert h.attn.c_attn.bias.abs().max().item() == 0.0
    assert abs(m.transformer.wte.weight.std().item() - 0.02) < 0.002


def test_loss_at_init_is_uniform():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**TINY))
    idx = torch.randint(0, 50257, (4, 64))
    targets = torch.randint(0, 50257, (4, 64))
    logits, loss = m(idx, targets)
    assert logits.shape == (4, 64, 50304)
    assert abs(loss.item() - math.log(50257)) < 0.1
    loss.backward()  # the -inf padding must not poison gradients
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    # ignore_index=-1 drops targets from the loss
    t2 = targets.clone()
    t2[:, 32:] = -1
    _, loss_half = m(idx, t2)
    _, loss_ref = m(idx[:, :32], targets[:, :32])
    assert abs(loss_half.item() - loss_ref.item()) < 1e-5


def test_presets_and_custom_sizes():
    assert PRESETS["gpt2"] == dict(n_layer=12, n_head=12, n_embd=768)
    assert PRESETS["gpt2-xl"]["n_embd"] == 1600
    with pytest.raises(ValueError):
        GPTConfig(n_embd=100, n_head=3)
    m = GPT(GPTConfig(block_size=16, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(ValueError):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_flops_and_mfu():
    m = GPT(GPTConfig(**PRESETS["gpt2"]))
    assert abs(m.flops_per_token(1024) / 1e6 - 855) < 2  # 6N + 12LdT at T=1024: ~855M
    assert m.estimate_mfu(1e6, None) is None  # peak unknown
    assert m.estimate_mfu(1.16e6, 989e12) == pytest.approx(1.0, abs=0.01)
    assert m.estimate_mfu(1e6, 1e15, seq_len=64) == pytest.approx(m.flops_per_token(64) * 1e6 / 1e15)


def test_optimizer_groups_and_step_match_adamw():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**TINY))
    opt = m.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, device_type="cpu")
    decay, no_decay = opt.param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
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


def test_muon_for_the_block_matrices_adamw_for_the_rest():
    """--optimizer muon: torch.optim.Muon takes exactly the attention and MLP matrices; AdamW the
    embeddings (the tied head with them), the gains and the biases; one step of the pair equals the
    two torch optimizers applied by hand; a GradScaler unscales the gradients before either sees them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    opt = model.configure_optimizers(0.1, 1e-3, muon_lr=0.02, muon_momentum=0.9)
    muon, adamw = opt.optimizers
    blocks = {id(p) for b in model.transformer.h for n, p in b.named_parameters() if n.endswith("weight") and p.dim() == 2}
    assert {id(p) for g in muon.param_groups for p in g["params"]} == blocks
    assert len(blocks) == 4 * TINY["n_layer"]
    rest = [p for g in adamw.param_groups for p in g["params"]]
    assert len(rest) + len(blocks) == len(list(model.parameters()))
    assert any(p is model.transformer.wte.weight for p in rest) and adamw.param_groups[0]["weight_decay"] == 0.1
    assert muon.param_groups[0]["momentum"] == 0.9 and muon.param_groups[0]["weight_decay"] == 0.0

    ref = GPT(GPTConfig(**TINY))
    ref.load_state_dict(model.state_dict())
    by_name = dict(ref.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    ref_muon = torch.optim.Muon([by_name[names[id(p)]] for g in muon.param_groups for p in g["params"]], lr=0.02,
                                momentum=0.9, nesterov=True, weight_decay=0.0)
    ref_adamw = torch.optim.AdamW([{"params": [by_name[names[id(p)]] for p in g["params"]],
                                    "weight_decay": g["weight_decay"]} for g in adamw.param_groups],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    idx = torch.randint(0, 50257, (2, 16))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(model(idx, idx)[1]).backward()
    scaler.step(opt)  # unscales first; scaled gradients would shift AdamW's update (its eps is not scaled)
    ref(idx, idx)[1].backward()
    ref_muon.step()
    ref_adamw.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, by_name[n], rtol=1e-6, atol=1e-7, msg=n)
    state = opt.state_dict()
    assert len(state["optimizers"]) == 2 and "momentum_buffer" in state["optimizers"][0]["state"][0]


def test_muon_without_bf16_orthogonalises_in_another_dtype_and_steps_as_torch_does(monkeypatch):
    """GPUs without bf16 (T4, V100) run Muon's Newton-Schulz in fp16 (or fp32): the iteration is
    torch's, and the step around it (momentum, Nesterov, the shape's LR scale, weight decay) is too."""
    import torch.optim._muon as torch_muon
    from model import Muon, orthogonalize
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


def test_kv_cache_greedy_equals_no_cache():
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    prompt = torch.randint(0, 50257, (3, 7))
    # 40 new tokens run past block_size: exercises the sliding-window fallback too
    a = m.generate(prompt, 40, temperature=0)
    b = m.generate(prompt, 40, temperature=0, use_cache=False)
    assert a.shape == (3, 47)
    assert torch.equal(a, b)
    # a cache sized to prompt + new tokens (12 of 32 positions), never full
    assert torch.equal(m.generate(prompt, 5, temperature=0), b[:, :12])


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_past_the_context_computes_the_last_logits_only(use_cache):
    """Past block_size, generation recomputes a sliding window: the LM head sees its last position
    only, and each token is what a plain forward over the whole window picks (up to a tie within
    rounding between the top two logits, where either pick is right)."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
    prompt = torch.randint(0, 50257, (2, 5))
    seen = []
    hook = m.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(tuple(inputs[0].shape)))
    try:
        out = m.generate(prompt, 30, temperature=0, use_cache=use_cache)
    finally:
        hook.remove()
    assert len(seen) == 30 and all(shape[1] == 1 for shape in seen), seen
    with torch.no_grad():
        for t in range(prompt.size(1), out.size(1)):
            logits, _ = m(out[:, max(0, t - 16):t])  # the whole window, every position's logits
            last = logits[:, -1, :]
            chosen = last.gather(1, out[:, t:t + 1]).squeeze(1)
            assert (last.max(dim=-1).values - chosen <= 1e-4).all(), t


def test_cached_logits_match_full_forward():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**TINY)).eval()
    from model import KVCache
    idx = torch.randint(0, 50257, (2, 20))
    full, _ = m(idx)
    cache = KVCache(2, 2, 2, 64, 16, "cpu")
    m(idx[:, :12], cache=cache)
    step, _ = m(idx[:, 12:15], cache=cache)  # a chunk after the prefill uses the explicit mask
    assert (step[:, -1, :50257] - full[:, 14, :50257]).abs().max().item() < 1e-4
    one, _ = m(idx[:, 15:16], cache=cache)
    assert (one[:, -1, :50257] - full[:, 15, :50257]).abs().max().item() < 1e-4


def test_padded_ids_never_sampled():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**TINY)).eval()
    with torch.no_grad():  # make the padded rows irresistible if they were not masked
        m.transformer.wte.weight[50257:] = 100.0
    prompt = torch.randint(0, 50257, (4, 5))
    for kw in (dict(temperature=0), dict(temperature=1.0), dict(temperature=2.0, top_p=0.99)):
        out = m.generate(prompt, 20, **kw)
        assert out.max().item() < 50257


def test_sampling_controls():
    torch.manual_seed(0)
    logits = torch.randn(5, 50304)
    logits[:, 50257:] = float("-inf")
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits, 1.0, top_k=1), greedy)
    assert torch.equal(sample_next(logits, 1.0, top_p=1e-6), greedy)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(sample_next(logits, 0.8, 50, 0.9, g1), sample_next(logits, 0.8, 50, 0.9, g2))
    # top-k keeps exactly the k best
    picks = torch.stack([sample_next(logits, 5.0, top_k=3) for _ in range(50)])
    top3 = logits.topk(3, dim=-1).indices
    assert all((picks[:, i:i + 1] == top3[i]).any(-1).all() for i in range(5))


def test_generation_stops_at_eot():
    torch.manual_seed(0)
    m = GPT(GPTConfig(**TINY)).eval()
    with torch.no_grad():  # bias the model hard towards <|endoftext|>
        m.transformer.wte.weight[50256] = m.transformer.wte.weight[50256] * 0 + 5.0
        m.transformer.ln_f.bias.fill_(1.0)
        m.transformer.ln_f.weight.zero_()
    out = m.generate(torch.zeros(2, 3, dtype=torch.long), 30, temperature=0, eos_token=50256)
    assert out.shape[1] == 4 and (out[:, -1] == 50256).all()
