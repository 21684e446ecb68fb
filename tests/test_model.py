"""model.py against references: Hugging Face's GPT-2 for logits, torch.optim.AdamW for the
optimizer, and itself without the KV cache for generation."""
import math
import os
import stat

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tokenizer
from export import write_hf
from model import GPT, GPTConfig, PRESETS, Sampling, sample_next

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


def generate(model, idx, max_new_tokens, generator=None, use_cache=True, **picking):
    """idx extended by what model.generate_stream yields: (B, T + new tokens)."""
    new = model.generate_stream(idx, Sampling(max_new_tokens, **picking), generator, use_cache)
    return torch.cat([idx] + [t[:, None] for t in new], dim=1)


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
    write_hf(ours, str(tmp_path), tokenizer_files=tokenizer.gpt2_bpe_files())
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


def test_a_compiled_backward_builds_no_gradient_of_the_logits():
    """Training differentiates the loss alone: the logits that come back with it must not ask a compiled backward for
    a gradient of their own, which it would fill with zeros (B x T x 50,304 values) and add in at every micro-step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    # aot_eager: the forward and backward graphs inductor is handed, without its C++ build (minutes here); the gradient
    # of an output that requires one is autograd's to materialize, whatever the backend
    compiled = torch.compile(model, backend="aot_eager")
    idx, targets = torch.randint(0, 50257, (2, 16)), torch.randint(0, 50257, (2, 16))
    logits, loss = compiled(idx, targets)
    assert logits.shape == (2, 16, 50304) and not logits.requires_grad
    with torch.profiler.profile(record_shapes=True) as prof:
        loss.backward()
    filled = [(e.name, e.input_shapes[0]) for e in prof.events()
              if e.name in ("aten::zeros", "aten::zero_", "aten::fill_") and e.input_shapes and e.input_shapes[0]]
    assert not [f for f in filled if f[1] == [2, 16, 50304]], filled
    assert abs(loss.item() - model(idx, targets)[1].item()) < 1e-4  # the same loss as eager
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def in_place_loss(model, idx, targets):
    """The loss as the forward computed it before the mask moved into it: the padded columns written to -inf in the
    LM head's output, then cross-entropy over every column."""
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(idx.size(1)))
    for block in model.transformer.h:
        x = block(x)
    logits = model.lm_head(model.transformer.ln_f(x))
    logits[..., model.config.vocab_size:] = float("-inf")
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def loss_and_grads(loss_fn, model, idx, targets, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss = loss_fn(model, idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,compiled", [("float32", False), ("bfloat16", True)])
def test_the_loss_masks_the_padded_columns_as_the_in_place_write_did(dtype, compiled):
    """The mask out of place inside the loss gives the very loss and gradients of the in-place write into the logits,
    bit for bit, in eager fp32 and in a compiled bf16 forward and backward."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=0, n_head=2, n_embd=16))  # no blocks: the loss is the claim
    idx, targets = torch.randint(0, 50257, (2, 16)), torch.randint(0, 50257, (2, 16))
    targets[0, :3] = -1  # ignored positions too

    def ours(m, i, t):
        return m(i, t)[1]
    fns = (torch.compile(ours), torch.compile(in_place_loss)) if compiled else (ours, in_place_loss)
    loss, grads = loss_and_grads(fns[0], model, idx, targets, dtype)
    ref_loss, ref_grads = loss_and_grads(fns[1], model, idx, targets, dtype)
    assert torch.equal(loss, ref_loss)
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name


class InPlaceWrites(TorchDispatchMode):
    """The operations that write into a tensor in place (a mutable schema's written arguments), with the number of
    values in the storage written into: a write into a slice of the logits writes into the logits' storage."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                self.writes.append((str(func), value.untyped_storage().nbytes() // value.element_size()))
        return func(*args, **kwargs)

    def into(self, numel):
        return [op for op, values in self.writes if values == numel]


def test_the_training_forward_writes_nothing_into_the_logits():
    """A write into the LM head's output makes the compiled forward store every column back; without targets the
    padded columns still come back -inf."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    idx, targets = torch.randint(0, 50257, (2, 16)), torch.randint(0, 50257, (2, 16))
    with InPlaceWrites() as writes:
        logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 50304) and loss.requires_grad
    assert writes.into(logits.numel()) == []
    with InPlaceWrites() as writes:  # the check sees such a write where there is one
        in_place_loss(model, idx, targets)
    assert writes.into(logits.numel())
    with torch.no_grad():
        logits, loss = model(idx)
    assert loss is None and torch.isneginf(logits[..., 50257:]).all() and torch.isfinite(logits[..., :50257]).all()


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


def test_kv_cache_greedy_equals_no_cache():
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    prompt = torch.randint(0, 50257, (3, 7))
    # 40 new tokens run past block_size: exercises the sliding-window fallback too
    a = generate(m, prompt, 40, temperature=0)
    b = generate(m, prompt, 40, temperature=0, use_cache=False)
    assert a.shape == (3, 47)
    assert torch.equal(a, b)
    # a cache sized to prompt + new tokens (12 of 32 positions), never full
    assert torch.equal(generate(m, prompt, 5, temperature=0), b[:, :12])


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
        out = generate(m, prompt, 30, temperature=0, use_cache=use_cache)
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
    cache = KVCache(2, 64)
    m(idx[:, :12], cache=cache)
    step, _ = m(idx[:, 12:15], cache=cache)  # a chunk after the prefill uses the explicit mask
    assert (step[:, -1, :50257] - full[:, 14, :50257]).abs().max().item() < 1e-4
    one, _ = m(idx[:, 15:16], cache=cache)
    assert (one[:, -1, :50257] - full[:, 15, :50257]).abs().max().item() < 1e-4


def test_padded_ids_never_sampled():
    """Weights under which every padded id would win if the mask were gone: the final LayerNorm's bias b makes every
    hidden state h = LN(x)g + b lean along b, and the padded rows of the tied embedding are 100 b, so their logits
    h . 100b hold 100 |b|^2 = 3,200 where the real ones (rows of std 0.02) stay near 0."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(**TINY)).eval()
    with torch.no_grad():
        m.transformer.ln_f.bias.fill_(1.0)
        m.transformer.wte.weight[50257:] = 100.0 * m.transformer.ln_f.bias
        unmasked = m.lm_head(m.transformer.ln_f(torch.randn(1, 3, 32)))  # what the head gives before the mask
    assert (unmasked.argmax(-1) >= 50257).all()
    prompt = torch.randint(0, 50257, (4, 5))
    for kw in (dict(temperature=0), dict(temperature=1.0), dict(temperature=2.0, top_p=0.99)):
        out = generate(m, prompt, 20, **kw)
        assert out.max().item() < 50257


def test_sampling_controls():
    torch.manual_seed(0)
    logits = torch.randn(5, 50304)
    logits[:, 50257:] = float("-inf")
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits, Sampling(temperature=1.0, top_k=1)), greedy)
    assert torch.equal(sample_next(logits, Sampling(temperature=1.0, top_p=1e-6)), greedy)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    nucleus = Sampling(temperature=0.8, top_k=50, top_p=0.9)
    assert torch.equal(sample_next(logits, nucleus, g1), sample_next(logits, nucleus, g2))
    # top-k keeps exactly the k best
    picks = torch.stack([sample_next(logits, Sampling(temperature=5.0, top_k=3)) for _ in range(50)])
    top3 = logits.topk(3, dim=-1).indices
    assert all((picks[:, i:i + 1] == top3[i]).any(-1).all() for i in range(5))
