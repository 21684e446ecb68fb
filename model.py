"""
GPT-2, in one file: attention, MLP, block, config, and the GPT module with
Hugging Face import/export, FLOPs/MFU and generation (its optimizers are in optim.py).

Parameter names follow Hugging Face's GPT-2 (wte, wpe, h.N.attn.c_attn, ln_f)
so importing weights is a key-for-key copy with four transposes.
This file imports nothing from the project's scripts.
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

GPT2_VOCAB_SIZE = 50257   # real GPT-2 BPE vocabulary (50,000 merges + 256 bytes + <|endoftext|>)
PADDED_VOCAB_SIZE = 50304  # next multiple of 128: tensor-core friendly shapes for the LM head


class KVCache:
    """Keys and values for every layer, filled as generation goes. The memory is allocated at the
    first write, in the dtype attention computes in (the keys' own): that is the parameters' dtype
    only in plain fp32; under autocast, or FSDP's 16-bit parameters for the forward while its
    stored shards stay fp32, it is not. Only positions below pos are ever read, so the memory is
    left uninitialised."""

    def __init__(self, n_layer, batch_size, n_head, max_len, head_dim, device):
        self.shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.device = device
        self.k = self.v = None
        self.pos = 0  # number of positions already written

    @property
    def max_len(self):
        return self.shape[3]

    def append(self, layer, k, v):
        """Store layer's keys and values (B, nh, T, hs) at positions pos..pos+T-1; return the layer's
        keys and values for positions 0..pos+T-1 (pos itself moves on once every layer has written)."""
        if self.k is None:
            self.k = torch.empty(self.shape, device=self.device, dtype=k.dtype)
            self.v = torch.empty(self.shape, device=self.device, dtype=v.dtype)
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x, cache=None, layer=0, mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        if mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # mask: (B, 1, T, T), True = sees
        elif cache is None:
            # flash / memory-efficient kernels; the causal mask is never materialised
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            p = cache.pos
            k, v = cache.append(layer, k, v)  # (B, nh, p+T, hs)
            if p == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif T == 1:
                y = F.scaled_dot_product_attention(q, k, v)  # one new token sees every cached key
            else:
                # query i (absolute position p+i) sees keys 0..p+i
                sees = torch.ones(T, p + T, dtype=torch.bool, device=x.device).tril(diagonal=p)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=sees)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, layer=0, mask=None):
        x = x + self.attn(self.ln_1(x), cache, layer, mask)
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024                 # longest context, in tokens
    vocab_size: int = GPT2_VOCAB_SIZE      # real token ids are < vocab_size
    padded_vocab_size: int = PADDED_VOCAB_SIZE  # rows of the embedding / LM head
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    def __post_init__(self):
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError("padded_vocab_size must be >= vocab_size")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


# OpenAI's four released sizes
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),          # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),   # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),      # 1558M
}


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying: one tensor, two uses
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                # two residual additions per block (attention, MLP): GPT-2 paper, section 2.3
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameter count; position embeddings excluded by default (they do no matmul FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx, targets=None, cache=None, pos=None, mask=None, last_only=False):
        """idx (B, T) token ids -> (logits (B, T, padded_vocab), loss or None).
        pos and mask pack several sequences into one row (hellaswag.py: a context once, then its
        endings side by side): pos (B, T) is each token's position in its own sequence, and mask
        (B, 1, T, T) bool says which tokens each token attends to (True = attends). Without them,
        position t is t and attention is causal. last_only: the last position's logits only,
        (B, 1, padded_vocab), all that generation needs; the LM head is then one position's work
        instead of T's, the larger part of a forward for a small model."""
        B, T = idx.size()
        if pos is None:
            start = cache.pos if cache is not None else 0
            if start + T > self.config.block_size:
                raise ValueError(f"sequence of length {start + T} exceeds block_size {self.config.block_size}")
            pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # (T,)
        elif cache is not None or mask is None:
            raise ValueError("pos needs a mask, and works without a cache")
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i, mask)
        if cache is not None:
            cache.pos += T
        x = self.transformer.ln_f(x)
        if last_only:
            if targets is not None:
                raise ValueError("last_only gives one position's logits: the loss needs them all")
            x = x[:, -1:, :]  # (B, 1, C)
        logits = self.lm_head(x)  # (B, T, padded_vocab)
        if self.config.padded_vocab_size > self.config.vocab_size:
            # padded ids are not tokens: they must get no probability, in the loss or in sampling
            logits[..., self.config.vocab_size:] = float("-inf")
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    # ------------------------------------------------------------------------------------------
    # Hugging Face interop

    @classmethod
    def from_pretrained(cls, name_or_path, block_size=None, local_files_only=False):
        """Load OpenAI's GPT-2 weights (a hub name or a local Hugging Face directory).
        local_files_only: only from Hugging Face's cache, never the network (OSError if absent)."""
        from transformers import GPT2LMHeadModel
        with quiet_transformers():
            hf = GPT2LMHeadModel.from_pretrained(name_or_path, local_files_only=local_files_only).float()
        return cls.from_hf(hf, block_size=block_size)

    @classmethod
    def from_hf(cls, hf, block_size=None):
        """A GPT with the weights of a transformers GPT2LMHeadModel (vocabulary padded to a multiple of 128)."""
        c = hf.config
        if getattr(c, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {c.activation_function!r} (GPT-2 uses gelu_new)")
        if c.n_inner not in (None, 4 * c.n_embd):
            raise ValueError("unsupported MLP width: GPT-2 uses 4 * n_embd")
        padded = max(PADDED_VOCAB_SIZE, -(-c.vocab_size // 128) * 128)
        config = GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, padded_vocab_size=padded,
                           n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd)
        model = cls(config)
        sd, sd_hf = model.state_dict(), hf.state_dict()
        transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        with torch.no_grad():
            for k, v in sd.items():
                if k == "lm_head.weight":
                    continue  # tied to wte
                src = sd_hf[k]
                if k.endswith(transposed):
                    src = src.t()  # HF stores these as Conv1D: (in, out)
                if k == "transformer.wte.weight":
                    v.zero_()
                    v[:src.size(0)].copy_(src)  # padded rows stay zero (and masked in forward)
                else:
                    assert v.shape == src.shape, f"shape mismatch for {k}: {v.shape} vs {src.shape}"
                    v.copy_(src)
        if block_size is not None:
            model.crop_block_size(block_size)
        return model

    def to_hf(self):
        """A transformers.GPT2LMHeadModel with the same weights (vocabulary sliced back to the real one)."""
        from transformers import GPT2Config, GPT2LMHeadModel
        c = self.config
        hf_config = GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
                               n_layer=c.n_layer, n_head=c.n_head, activation_function="gelu_new",
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=GPT2_VOCAB_SIZE - 1, eos_token_id=GPT2_VOCAB_SIZE - 1)
        hf = GPT2LMHeadModel(hf_config)
        sd_hf = hf.state_dict()
        transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        with torch.no_grad():
            for k, v in self.state_dict().items():
                if k == "lm_head.weight":
                    continue
                v = v.detach().float().cpu()
                if k.endswith(transposed):
                    v = v.t()
                if k == "transformer.wte.weight":
                    v = v[:c.vocab_size]
                sd_hf[k].copy_(v)
        hf.tie_weights()
        return hf.eval()

    def export_hf(self, out_dir, tokenizer_files=None):
        """Write a directory that GPT2LMHeadModel.from_pretrained and pipeline() load directly.
        tokenizer_files: optional (encoder.json, vocab.bpe) paths, saved as the GPT-2 tokenizer."""
        hf = self.to_hf()
        with quiet_transformers():
            hf.save_pretrained(out_dir)
        # safetensors writes the weights owner-only (0600): give them the mode of their neighbours
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(out_dir):
            if name.endswith(".safetensors"):
                os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)
        if tokenizer_files is not None:
            # the directory form (vocab.json + merges.txt) loads the same in transformers 4 and 5
            import shutil
            from transformers import GPT2TokenizerFast
            shutil.copyfile(tokenizer_files[0], os.path.join(out_dir, "vocab.json"))
            shutil.copyfile(tokenizer_files[1], os.path.join(out_dir, "merges.txt"))
            tok = GPT2TokenizerFast.from_pretrained(out_dir)
            tok.model_max_length = self.config.block_size
            tok.save_pretrained(out_dir)
        return out_dir

    def crop_block_size(self, block_size):
        """Shorten the context (e.g. to fine-tune OpenAI's 1024-token model at 512)."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    # ------------------------------------------------------------------------------------------
    # Training FLOPs

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token: 6N for the matmuls (forward + backward) plus 12·L·d·T for
        attention scores and values (the nanoGPT / PaLM appendix B convention)."""
        c = self.config
        T = seq_len or c.block_size
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * T

    def estimate_mfu(self, tokens_per_second, peak_flops, seq_len=None):
        """Model FLOPs utilisation in [0, 1]: training FLOP/s achieved over peak_flops, the
        device's peak FLOP/s (device.peak_flops looks it up by GPU name), or None where the peak
        is None (not known). tokens_per_second: of one device."""
        if peak_flops is None:
            return None
        return self.flops_per_token(seq_len) * tokens_per_second / peak_flops

    # ------------------------------------------------------------------------------------------
    # Generation

    @torch.no_grad()
    def generate_stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                        generator=None, eos_token=None, use_cache=True):
        """Yield one (B,) tensor of new token ids per step. idx: (B, T) prompt ids.
        temperature 0 means greedy. Rows that produced eos_token keep yielding eos_token;
        the stream ends when every row has (or after max_new_tokens)."""
        B = idx.size(0)
        cache = None
        # the cache holds the prompt and the new tokens, up to the context: sampling during training
        # adds megabytes, not the full block_size's worth per layer
        cache_len = min(self.config.block_size, idx.size(1) + max_new_tokens)
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            if use_cache and cache is None and idx.size(1) < self.config.block_size:
                hs = self.config.n_embd // self.config.n_head
                cache = KVCache(self.config.n_layer, B, self.config.n_head, cache_len, hs, idx.device)
                logits, _ = self(idx, cache=cache, last_only=True)  # prefill: the whole prompt at once
            elif cache is not None and cache.pos < cache.max_len:
                logits, _ = self(idx[:, -1:], cache=cache, last_only=True)  # one new token per forward
            else:
                # no cache, or the context is full: recompute over the last block_size tokens
                cache = None
                logits, _ = self(idx[:, -self.config.block_size:], last_only=True)
            logits = logits[:, -1, :].float()
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_token is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token), nxt)
                done |= nxt == eos_token
            idx = torch.cat((idx, nxt[:, None]), dim=1)
            yield nxt
            if eos_token is not None and bool(done.all()):
                return
            if cache is not None and cache.pos >= cache.max_len:
                use_cache = False  # full: fall back to a sliding window from here on

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, **kwargs):
        """Return idx extended by up to max_new_tokens sampled tokens: (B, T + n)."""
        new = list(self.generate_stream(idx, max_new_tokens, **kwargs))
        if not new:
            return idx
        return torch.cat((idx, torch.stack(new, dim=1)), dim=1)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Pick the next token from (B, V) logits. Padded ids are already -inf, so never chosen."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # nucleus sampling (Holtzman et al. 2019): keep the smallest set with mass >= top_p
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = F.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@contextmanager
def quiet_transformers():
    """No progress bars from transformers' loading/saving: they would clutter logs and stderr."""
    from transformers.utils import logging as hf_logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
