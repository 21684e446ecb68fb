"""GPT-2: attention, MLP, block, config, and the GPT with Hugging Face import, FLOPs/MFU and generation (the export to
Hugging Face's format is export.py's). Parameter names follow Hugging Face's, so importing weights is a key-for-key
copy with four transposes."""

from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F

GPT2_VOCAB_SIZE = 50257   # real GPT-2 BPE vocabulary (50,000 merges + 256 bytes + <|endoftext|>)
PADDED_VOCAB_SIZE = 50304  # next multiple of 128: tensor-core friendly shapes for the LM head
HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # HF's Conv1D
PRESETS = {  # OpenAI's four released sizes
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),          # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),   # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),      # 1558M
}
SIZES = ("n_layer", "n_head", "n_embd")  # what a preset sets, and a run may set over it


class KVCache:
    """Every layer's keys and values for generation, allocated at the first write in the keys' dtype:
    the dtype attention computes in, which under autocast or FSDP is not the stored parameters'."""

    def __init__(self, n_layer, max_len):
        self.n_layer = n_layer
        self.max_len = max_len
        self.k = self.v = None
        self.pos = 0  # positions every layer has written

    def append(self, layer, k, v):
        """Store layer's k, v (B, nh, T, hs) at pos..pos+T-1; return its keys and values for 0..pos+T-1."""
        if self.k is None:
            B, nh, _, hs = k.shape
            self.k = k.new_empty(self.n_layer, B, nh, self.max_len, hs)
            self.v = torch.empty_like(self.k)
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x, cache=None, layer=0, mask=None, rotate=None):
        """rotate: a function of (q or k (B, nh, T, hs)) that places them (rotary embeddings), or None."""
        B, T, C = x.size()
        qkv = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in qkv)  # (B, nh, T, hs)
        if rotate is not None:
            q, k = rotate(q), rotate(k)
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, nh, pos+T, hs)
        # no mask, so flash kernels; a decode step's one new token sees every cached key, unmasked too
        causal = mask is None and q.size(-2) == k.size(-2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
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
    """GPT-2's block: pre-LayerNorm, causal self-attention and a tanh-GELU MLP.

    A variant is a class registered in BLOCKS under its --block name, built as cls(config) and called as
    block(x, pos=pos, cache=cache, layer=i, mask=mask): pos holds each token's position in its own sequence ((T,), or
    (B, T) where rows pack several sequences and restart at 0), cache and layer are generation's KVCache and this
    block's index in it, mask the packed rows' attention mask (None: causal). What surrounds the blocks is the
    class's answer too: the attributes below, and the FLOPs and activations of one block."""
    learned_positions = True   # GPT adds a learned position table (wpe) to the tokens; False: the block places them
    final_norm = nn.LayerNorm  # the norm before the LM head, built as final_norm(n_embd)
    exports = True             # GPT-2's architecture, which Hugging Face's GPT2LMHeadModel and llama.cpp's gpt2 hold
    options = {}               # its own settings, {name: (default: int, float, str or bool, help)}: config.options,
    #                            the trainer's --NAME flags (with --block), in the checkpoint's shape, fixed on resume

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.exports = cls.__dict__.get("exports", False)  # a subclass is not GPT-2's architecture unless it says so

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, pos=None, cache=None, layer=0, mask=None):
        x = x + self.attn(self.ln_1(x), cache, layer, mask)
        return x + self.mlp(self.ln_2(x))

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6 per parameter (forward and backward matmuls) and 12 * n_embd * seq_len for
        attention's scores and values (the nanoGPT / PaLM appendix B convention)."""
        return 6 * sum(p.numel() for p in self.parameters()) + 12 * self.attn.n_embd * seq_len

    def activation_values(self, tokens):
        """Values kept for the backward pass over `tokens` tokens: 17 per token and channel (Korthikanti et al. 2022,
        "Reducing Activation Recomputation in Large Transformer Models", without the s x s scores flash attention
        does not store; GPT-2 has no dropout masks, so a little generous)."""
        return 17 * tokens * self.attn.n_embd


# The transformer blocks a GPT can be built of (--block): a variant of the block is a class and a line here.
BLOCKS = {"gpt2": Block}


def shape_setting(shape, name):
    """What a stored shape (GPT.shape(), a checkpoint's model_config) holds for an architecture setting: a size, or its
    block's own setting (the block's default where the shape predates it; None: a setting its block does not have)."""
    if name in SIZES:
        return shape[name]
    own = getattr(BLOCKS.get(shape.get("block", "gpt2")), "options", {})
    return shape.get("options", {}).get(name, own[name][0] if name in own else None)


def shape_export_problem(shape):
    """Why a GPT of this stored shape (GPT.shape(), a checkpoint's model_config) cannot be exported as GPT-2 with
    GPT-2's tokenizer (Hugging Face's GPT2LMHeadModel, llama.cpp's gpt2), or None where it can."""
    block, vocab = shape.get("block", "gpt2"), shape.get("vocab_size", GPT2_VOCAB_SIZE)
    if not getattr(BLOCKS.get(block), "exports", False):  # a block not registered here cannot say it does
        return f"a GPT of {block!r} blocks is not GPT-2's architecture"
    if vocab != GPT2_VOCAB_SIZE:
        return f"its vocabulary has {vocab} tokens, the GPT-2 tokenizer's {GPT2_VOCAB_SIZE}"
    return None


@dataclass
class GPTConfig:
    block_size: int = 1024                 # longest context, in tokens
    vocab_size: int = GPT2_VOCAB_SIZE      # real token ids are < vocab_size
    padded_vocab_size: int = PADDED_VOCAB_SIZE  # rows of the embedding / LM head
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block: str = "gpt2"                    # the kind of transformer block: a key of BLOCKS
    options: dict = field(default_factory=dict)  # the block's own settings (its class's options), by name

    def __post_init__(self):
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.block not in BLOCKS:
            raise ValueError(f"no block {self.block!r}: the blocks are {', '.join(sorted(BLOCKS))} (a variant defined "
                             "elsewhere registers in model.BLOCKS before it is used)")
        own = BLOCKS[self.block].options
        for name in self.options:
            if name not in own:
                raise ValueError(f"{name!r} is no setting of {self.block!r} blocks (theirs: "
                                 f"{', '.join(sorted(own)) or 'none'})")
        self.options = {name: self.options.get(name, default) for name, (default, _) in own.items()}


def config_of(preset, block_size, n_layer=None, n_head=None, n_embd=None, block="gpt2", **options):
    """A GPTConfig from a preset's shape (PRESETS), the sizes given over it and the block's own settings given (None:
    its default); ValueError for one that cannot be."""
    shape = dict(PRESETS[preset], block=block, options={k: v for k, v in options.items() if v is not None})
    shape.update({k: v for k, v in dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd).items() if v is not None})
    return GPTConfig(block_size=block_size, **shape)


def config_from(settings):
    """The GPTConfig of the trainer's settings (Flags'); ValueError for one that cannot be (config_of)."""
    options = {name: getattr(settings, name) for name in BLOCKS[settings.block].options}
    return config_of(settings.model, settings.block_size, settings.n_layer, settings.n_head, settings.n_embd,
                     settings.block, **options)


def block_options():
    """{a variant's own setting: (the blocks that have it, its default, what it is)}, from the blocks registered in
    BLOCKS (Block.options): flags of the trainer, fixed on resume like the rest of the architecture."""
    found = {}
    for block, cls in sorted(BLOCKS.items()):
        for name, (default, text) in cls.options.items():
            blocks, first, _ = found.setdefault(name, ([], default, text))
            if (type(default), default) != (type(first), first):  # one flag: one type, one default
                raise ValueError(f"blocks {blocks[0]!r} and {block!r} both declare {name!r}, with the defaults "
                                 f"{first!r} and {default!r}: give it one default, or two names")
            blocks.append(block)
    return found


class Flags:
    """The model's flags in the trainer's command line (train_config composes every room's): the preset, the sizes,
    the block and its own settings, the context, pretrained weights; all the run's shape, so fixed on resume."""
    ranges = dict.fromkeys((*SIZES, "block_size"), "at least 1")
    architecture = ("model", *SIZES, "block")  # what --init-from's weights decide instead
    fixed_on_resume = architecture + ("block_size", "init_from")

    @staticmethod
    def add_flags(a):
        from argparse import BooleanOptionalAction
        a("--model", default="gpt2", choices=sorted(PRESETS), help="architecture preset (default: gpt2, 124M)")
        a("--n-layer", type=int, help="override the preset's number of layers")
        a("--n-head", type=int, help="override the preset's number of attention heads")
        a("--n-embd", type=int, help="override the preset's embedding width")
        a("--block", default="gpt2", choices=sorted(BLOCKS),
          help="the transformer block (default: gpt2, GPT-2's); model.py's BLOCKS holds the variants")
        for name, (blocks, default, text) in block_options().items():
            kind = dict(action=BooleanOptionalAction) if isinstance(default, bool) else dict(type=type(default))
            a(f"--{name.replace('_', '-')}", **kind,
              help=f"{text} ({' and '.join(f'--block {b}' for b in blocks)}; default: {default})")
        a("--block-size", type=int, default=1024, help="context length T in tokens (default: 1024)")
        a("--init-from", help="start from pretrained weights (a Hugging Face name or directory, a checkpoint or a log "
                              "directory), whose architecture it takes")

    @staticmethod
    def check_flags(cfg, said):
        """A shape flag beside --init-from (whose weights decide the shape), a block's setting with another block."""
        from common import UserError
        options = block_options()
        for flag in Flags.architecture + tuple(options):
            if flag in cfg.given and cfg.init_from:
                raise UserError(f"--{flag.replace('_', '-')} has no effect with --init-from: the architecture comes "
                                f"from {cfg.init_from}; drop it")
        for name, (blocks, _, _) in options.items():
            if getattr(cfg, name, None) is not None and cfg.block not in blocks:
                raise UserError(f"--{name.replace('_', '-')} is a setting of {' and '.join(blocks)} blocks, not of "
                                f"{said('block')}: add --block {blocks[0]}, or drop it")


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        variant = BLOCKS[config.block]
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(config.padded_vocab_size, config.n_embd)))
        if variant.learned_positions:
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.transformer.h = nn.ModuleList([variant(config) for _ in range(config.n_layer)])
        self.transformer.ln_f = variant.final_norm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying: one tensor, two uses
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):  # two residual additions per block: GPT-2 paper, 2.3
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @classmethod
    def from_shape(cls, shape):
        """The GPT of a stored shape (shape(): what checkpoints keep)."""
        return cls(GPTConfig(**shape))

    def shape(self):
        return asdict(self.config)

    @property
    def blocks(self):
        """The repeated units: what FSDP shards one by one, activation checkpointing recomputes and compile compiles
        under FSDP."""
        return self.transformer.h

    def matrices(self):
        """The blocks' 2-D weights, attention's and the MLP's: what Muon trains."""
        return [p for block in self.blocks for p in block.parameters() if p.dim() == 2]

    def units(self):
        """(parameters outside the blocks: the embeddings, the tied head and the final norm; each block's)."""
        blocks = [sum(p.numel() for p in block.parameters()) for block in self.blocks]
        return self.num_params(non_embedding=False) - sum(blocks), blocks

    def activation_bytes(self, micro_batch, seq_len, value_bytes, checkpointing=False):
        """Bytes a training step holds for the backward pass at value_bytes per value (2 in 16-bit, 4 in fp32): what
        each block keeps (Block.activation_values); with activation checkpointing each block's fp32 input, 4 * s * b *
        h bytes, plus one block recomputed in backward. Plus the logits: s * b * V * (2 for 16-bit + 4 for the loss's
        fp32 copy + 4 for its log-softmax), 8 in fp32."""
        tokens = seq_len * micro_batch
        kept = [block.activation_values(tokens) * value_bytes for block in self.blocks]
        layers = len(kept) * 4 * tokens * self.config.n_embd + max(kept, default=0) if checkpointing else sum(kept)
        return layers + tokens * self.config.padded_vocab_size * (10 if value_bytes == 2 else 8)

    def num_params(self, non_embedding=True):
        """Parameter count; position embeddings excluded by default (they do no matmul FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx, targets=None, cache=None, pos=None, mask=None, last_only=False):
        """idx (B, T) token ids -> (logits (B, T, padded_vocab), loss or None). Without targets the padded columns
        are -inf; with them the logits come back detached and as the LM head made them (the loss masks the columns).
        pos (B, T), each token's position in its own sequence, and mask (B, 1, T, T), True where a token attends,
        pack several sequences into one row (hellaswag.py). last_only: the last position's logits, for generation."""
        B, T = idx.size()
        if pos is None:
            start = cache.pos if cache is not None else 0
            if start + T > self.config.block_size:
                raise ValueError(f"sequence of length {start + T} exceeds block_size {self.config.block_size}")
            pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # (T,)
            if start > 0 and T > 1:  # query i (position start+i) sees the cached keys 0..start+i
                mask = torch.ones(T, start + T, dtype=torch.bool, device=idx.device).tril(diagonal=start)
        x = self.transformer.wte(idx)  # (B, T, C)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        for i, block in enumerate(self.transformer.h):
            x = block(x, pos=pos, cache=cache, layer=i, mask=mask)
        if cache is not None:
            cache.pos += T
        x = self.transformer.ln_f(x)
        if last_only:
            x = x[:, -1:, :]  # (B, 1, C): the LM head is the larger part of a small model's forward
        logits = self.lm_head(x)  # (B, T, padded_vocab)
        # padded ids are not tokens: no probability, ever
        padded = torch.arange(logits.size(-1), device=logits.device) >= self.config.vocab_size  # (padded_vocab,)
        if targets is None:
            return logits.masked_fill_(padded, float("-inf")), None
        # masked out of place, inside the loss: written into the matrix product's output, the mask made the compiled
        # forward write every column back and read each row twice
        masked = torch.where(padded, float("-inf"), logits)
        loss = F.cross_entropy(masked.view(-1, masked.size(-1)), targets.reshape(-1), ignore_index=-1)
        # the loss carries the gradient: logits requiring one too cost a compiled backward a zero gradient their size
        return logits.detach(), loss

    @classmethod
    def from_pretrained(cls, name_or_path, local_files_only=False):
        """OpenAI's GPT-2 weights (a hub name or a local Hugging Face directory), the vocabulary padded
        to a multiple of 128. local_files_only: from Hugging Face's cache only (OSError if absent)."""
        from transformers import GPT2LMHeadModel
        with quiet_transformers():
            hf = GPT2LMHeadModel.from_pretrained(name_or_path, local_files_only=local_files_only)
        c = hf.config
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh") or c.n_inner not in (None, 4 * c.n_embd):
            raise ValueError(f"unsupported activation {c.activation_function!r} or MLP width {c.n_inner}: "
                             "GPT-2 uses gelu_new and 4 * n_embd")
        padded = max(PADDED_VOCAB_SIZE, -(-c.vocab_size // 128) * 128)
        model = cls(GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, padded_vocab_size=padded,
                              n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd))
        sd_hf = hf.state_dict()
        for k, v in model.state_dict().items():
            if k == "lm_head.weight":
                continue  # tied to wte
            src = sd_hf[k].t() if k.endswith(HF_TRANSPOSED) else sd_hf[k]
            if k == "transformer.wte.weight":
                v.zero_()  # the padded rows
            v[:src.size(0)].copy_(src)
        return model

    def export_problem(self):
        """Why this model cannot be exported as GPT-2 (shape_export_problem), or None where it can."""
        return shape_export_problem(self.shape())

    def hf_shape(self):
        """Its shape in the names of Hugging Face's GPT2Config (export.py writes its formats from it)."""
        c = self.config
        return dict(vocab_size=c.vocab_size, n_positions=c.block_size, n_ctx=c.block_size, n_embd=c.n_embd,
                    n_layer=c.n_layer, n_head=c.n_head)

    def crop_block_size(self, block_size):
        """Shorten the context (e.g. to fine-tune OpenAI's 1024-token model at 512)."""
        self.config.block_size = block_size
        if "wpe" in self.transformer:
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token: each block's (Block.flops_per_token), and 6 per parameter outside the blocks that
        does a matmul (the tied head; not the position table): 6N + 12·L·d·T for GPT-2's."""
        seq_len = seq_len or self.config.block_size
        _, blocks = self.units()
        return 6 * (self.num_params() - sum(blocks)) + sum(block.flops_per_token(seq_len) for block in self.blocks)

    def estimate_mfu(self, tokens_per_second, peak_flops, seq_len=None):
        """Model FLOPs utilisation in [0, 1] of one device's tokens_per_second; None where peak_flops is unknown."""
        if peak_flops is None:
            return None
        return self.flops_per_token(seq_len) * tokens_per_second / peak_flops

    @torch.no_grad()
    def generate_stream(self, idx, sampling=None, generator=None, use_cache=True):
        """Yield one (B,) tensor of new token ids per step after the (B, T) prompt idx, as sampling says (a Sampling;
        its defaults where None)."""
        sampling = sampling or Sampling()
        max_new_tokens, block_size = sampling.max_new_tokens, self.config.block_size
        cache = None
        if use_cache and idx.size(1) < block_size:
            # the prompt and the new tokens, up to the context: sampling while training adds megabytes
            cache = KVCache(self.config.n_layer, min(block_size, idx.size(1) + max_new_tokens))
        for _ in range(max_new_tokens):
            if cache is not None and cache.pos < cache.max_len:
                logits, _ = self(idx[:, cache.pos:], cache=cache, last_only=True)  # the prompt, then each new token
            else:  # no cache, or it is full: recompute over the last block_size tokens
                cache = None
                logits, _ = self(idx[:, -block_size:], last_only=True)
            nxt = sample_next(logits[:, -1, :].float(), sampling, generator)
            idx = torch.cat((idx, nxt[:, None]), dim=1)
            yield nxt


@dataclass(frozen=True)
class Sampling:
    """What a generation draws: how many new tokens, and how each is picked from the logits."""
    max_new_tokens: int = 200
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None  # only the k likeliest tokens; None or 0: off
    top_p: float | None = None  # nucleus sampling: the smallest set with this much mass; None or 1: off


def sample_next(logits, sampling, generator=None):
    """Pick the next token from (B, V) logits as sampling says. Padded ids are already -inf, so never chosen."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
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
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator).squeeze(-1)


@contextmanager
def quiet_transformers():
    from transformers.utils import logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()
