"""
Export a trained model to run where people run models: Hugging Face's format (transformers, mlx-lm, vLLM) or one
GGUF file (llama.cpp, Ollama, LM Studio).

    python export.py --model log --format gguf --out gpt2.gguf        # the newest checkpoint in log/, f16
    python export.py --model log/ckpt_019073.pt --format hf --out gpt2-hf
    python export.py --model log --format gguf --dtype q8_0 --out gpt2-q8_0.gguf

hf: the directory the end of a training run writes (LOG_DIR/hf), laid out as the hub's own gpt2: fp32 weights,
config.json (with n_ctx) and the GPT-2 tokenizer. gguf: llama.cpp's `gpt2` architecture in one file: the weights
at --dtype (norms, biases and the position table stay fp32, as llama.cpp's converter keeps them), the head tied
to the token embedding as GPT-2's is, and the GPT-2 tokenizer (vocabulary, merges, <|endoftext|>), so llama.cpp
splits text into the very ids tiktoken does. Both drop the embedding's padded rows (50,257 of 50,304 are
tokens). A model of another block (--block) is not GPT-2's architecture: neither format can hold it.
"""

import argparse
import glob
import json
import os

import common
from common import UserError
from tokenizer import EOT_TOKEN, VOCAB_SIZE, gpt2_bpe_files


class Flags:
    """The trainer's export flag (train_config composes every room's flags), and the model's answer to it: a block
    that is not GPT-2's exports nothing to Hugging Face's GPT2LMHeadModel (model.BLOCKS[block].exports)."""

    @staticmethod
    def add_flags(a):
        a("--export-hf", action=argparse.BooleanOptionalAction, default=True,
          help="export the final model in Hugging Face format to LOG_DIR/hf (default: on where the --block is "
               "GPT-2's)")

    @staticmethod
    def exports(block):
        from model import BLOCKS
        return BLOCKS[block].exports

    @staticmethod
    def check_flags(cfg, said):
        if cfg.export_hf and not Flags.exports(cfg.block):
            raise UserError(f"--export-hf writes GPT-2's Hugging Face format, and {said('block')} is another "
                            "architecture: drop --export-hf")

    @staticmethod
    def settle_flags(values, given):
        if values["export_hf"] and "export_hf" not in given and not Flags.exports(values["block"]):
            values["export_hf"] = False  # the variant's answer: no export where it is not GPT-2's architecture


DTYPES = ("f32", "f16", "bf16", "q8_0")  # llama.cpp's names; f16 is its converter's default too
# what an hf export's directory holds: --force replaces a directory of these (or an empty one), nothing else
HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"}


# Hugging Face's format: the hub's own gpt2 layout
def hf_config(model):
    """transformers.GPT2Config of a GPT, with the hub's n_ctx beside n_positions (mlx-lm reads it); ValueError where it
    is not GPT-2's architecture (model.export_problem)."""
    from transformers import GPT2Config
    problem = model.export_problem()
    if problem:
        raise ValueError(problem)
    return GPT2Config(**model.hf_shape(), activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, architectures=["GPT2LMHeadModel"])  # bos, eos: 50256


def hf_state_dict(model, config):
    """A GPT's weights in fp32 as the hub's own gpt2 stores them (config: its hf_config): no 'transformer.' prefix,
    the four Conv1D matrices (in, out), the real vocabulary's rows, and no head (tied to wte)."""
    import torch
    from model import HF_TRANSPOSED
    state = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        v = v.t() if k.endswith(HF_TRANSPOSED) else v[:config.vocab_size] if k.endswith("wte.weight") else v
        state[k.removeprefix("transformer.")] = v.detach().to("cpu", torch.float32).contiguous().clone()
    return state


def to_hf(model):
    """A transformers.GPT2LMHeadModel with a GPT's weights (the vocabulary sliced back to the real one)."""
    from transformers import GPT2LMHeadModel
    from model import quiet_transformers
    config = hf_config(model)
    with quiet_transformers():
        hf = GPT2LMHeadModel(config)
    hf.transformer.load_state_dict(hf_state_dict(model, config))
    return hf.eval()


def write_hf(model, out_dir, tokenizer_files=None):
    """Write a GPT into out_dir laid out as the hub's own gpt2 (config.json with n_ctx, model.safetensors without the
    'transformer.' prefix), which transformers, mlx-lm, vLLM and llama.cpp's converter load directly.
    tokenizer_files: optional (encoder.json, vocab.bpe) paths, saved as the GPT-2 tokenizer. out_dir."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    from model import quiet_transformers
    config = hf_config(model)
    config.save_pretrained(out_dir)
    with quiet_transformers():
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    save_file(hf_state_dict(model, config), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes the weights owner-only (0600): give them the mode of their neighbours
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o666 & ~umask)
    if tokenizer_files is not None:
        # the directory form (vocab.json + merges.txt) loads the same in transformers 4 and 5
        import shutil
        from transformers import GPT2TokenizerFast
        shutil.copyfile(tokenizer_files[0], os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(tokenizer_files[1], os.path.join(out_dir, "merges.txt"))
        tok = GPT2TokenizerFast.from_pretrained(out_dir)
        tok.model_max_length = config.n_positions
        tok.save_pretrained(out_dir)
    return out_dir


# GGUF: llama.cpp's gpt2
def gguf_tensors(model, dtype):
    """(llama.cpp's name, numpy array, its GGML type or None) for each weight of a GPT-2 model: the names from the
    gguf package's own map for GPT-2, the embedding cut to the real vocabulary, no separate head (tied)."""
    import gguf
    import numpy as np
    c = hf_config(model)  # the shape as exported, as llama.cpp's converter reads it from config.json
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, c.n_layer)
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}.get(dtype)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # the same tensor as wte: llama.cpp reuses the token embedding as the head when none is given
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        data = tensor.detach().float().cpu().numpy()
        if key.endswith("wte.weight"):
            data = data[:c.vocab_size]
        # vectors and the position table stay fp32 (llama.cpp's kernels expect them so); Q8_0 packs rows of 32
        if qtype is None or data.ndim < 2 or name == "position_embd.weight":
            yield name, np.ascontiguousarray(data, dtype=np.float32), None
        elif qtype == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
            yield name, data.astype(np.float16), None  # as llama.cpp's converter falls back
        elif qtype == gguf.GGMLQuantizationType.F16:
            yield name, data.astype(np.float16), None
        else:
            yield name, gguf.quants.quantize(data, qtype), qtype


def gpt2_vocabulary():
    """(tokens, token types, merges) of the GPT-2 tokenizer as llama.cpp's `gpt2` tokenizer model reads them: each
    token in the byte-to-unicode spelling of encoder.json, <|endoftext|> a control token, the merges of vocab.bpe."""
    import gguf
    encoder_json, vocab_bpe = gpt2_bpe_files()
    with open(encoder_json, encoding="utf-8") as f:
        ids = json.load(f)
    tokens = [None] * VOCAB_SIZE
    for text, i in ids.items():
        tokens[i] = text
    types = [gguf.TokenType.NORMAL] * VOCAB_SIZE
    types[EOT_TOKEN] = gguf.TokenType.CONTROL
    with open(vocab_bpe, encoding="utf-8") as f:
        merges = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]
    return tokens, types, merges


def write_gguf(model, path, dtype="f16", name="gpt2"):
    """One GGUF file of llama.cpp's `gpt2` architecture at path (written whole or not at all by the caller)."""
    import gguf
    c = hf_config(model)
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT2])
    w.add_name(name)
    w.add_context_length(c.n_ctx)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head)  # no grouped keys and values (Ollama's memory estimate reads it)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types, merges = gpt2_vocabulary()
    w.add_tokenizer_model("gpt2")  # byte-level BPE
    w.add_tokenizer_pre("gpt-2")   # GPT-2's own pre-split pattern
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(EOT_TOKEN)
    w.add_eos_token_id(EOT_TOKEN)
    w.add_add_bos_token(False)  # GPT-2 continues the text as given, with no token put in front
    for tensor_name, data, qtype in gguf_tensors(model, dtype):
        w.add_tensor(tensor_name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write(model, fmt, out, dtype=None, name="gpt2"):
    """Write model to out in fmt ('hf': a directory, 'gguf': a file) through a temporary name beside out that takes
    its place only when whole: a failure or a kill leaves what was there. The end of a training run writes its
    LOG_DIR/hf here too. Raises what the writers raise (OSError, safetensors' error)."""
    if fmt == "hf":
        return common.atomic_directory(out, lambda tmp: write_hf(model, tmp, gpt2_bpe_files()))
    parent = os.path.dirname(os.path.abspath(out))
    for stale in common.left_by_kills(parent, glob.escape(os.path.basename(out))):
        os.remove(stale)
    common.atomic_file(out, lambda tmp: write_gguf(model, tmp, dtype or "f16", name))


def why_not_written(model, fmt, out, dtype=None, name="gpt2"):
    """write(); None where it wrote out, else why not, in a few words (a full disk says so)."""
    from safetensors import SafetensorError  # the weights' writer: its own error type, not OSError
    try:
        write(model, fmt, out, dtype, name)
    except (OSError, SafetensorError) as e:
        full = common.out_of_space(e, os.path.dirname(os.path.abspath(out)))
        return "no space left on its disk" if full else common.first_line(e)
    return None


def export(model, fmt, out, dtype=None, name="gpt2"):
    """write(), with one line (UserError) for a model fmt cannot hold and for a place that cannot be written."""
    why = model.export_problem()
    if why:
        runs = "Hugging Face's GPT2LMHeadModel loads" if fmt == "hf" else "llama.cpp's gpt2 runs"
        raise UserError(f"cannot export to {fmt}: {why}, which {runs}; its checkpoint (ckpt_*.pt) "
                        "runs in this project's sample.py, hellaswag.py and core.py")
    why = why_not_written(model, fmt, out, dtype, name)
    if why:
        raise UserError(f"could not write {out} ({why}); what was there is as it was, and nothing half-written is "
                        "left: free space or pass another --out")
    return out


def run_export(model, ranks, log_dir, command, last_checkpoint):
    """LOG_DIR/hf at a training run's end: model (what trains: compiled, DDP-wrapped or FSDP-sharded) and the GPT-2
    tokenizer in Hugging Face's format, written by rank 0 (under FSDP every rank helps gather the shards); command:
    how to export again after a failure. The folder, on rank 0."""
    import parallel  # torch: the trainer's process
    from model import GPT
    state = parallel.model_state(model) if parallel.is_fsdp(model) else None  # a collective under FSDP
    if not ranks.is_master:
        return None
    model = parallel.unwrap(model)
    if state is not None:  # the gathered weights in a plain copy
        model = GPT.from_shape(model.shape())
        model.load_state_dict(state)
    out = os.path.join(log_dir, "hf")
    why = why_not_written(model, "hf", out)
    if why:
        raise UserError(f"could not export the final model to {out} ({why}); the checkpoints are intact "
                        f"(the last: {last_checkpoint}): free space under --log-dir, then {command} exports it")
    return out


def file_size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def parse_args(argv=None):
    p = common.ArgumentParser(description="Export a model to Hugging Face's format or to one GGUF file "
                                          "(llama.cpp, Ollama, LM Studio).")
    p.add_argument("--model", default="log",
                   help="checkpoint written by train_gpt2.py, a log directory (its newest checkpoint that loads), "
                        "or a Hugging Face name or directory such as gpt2 (default: log)")
    p.add_argument("--format", required=True, choices=("hf", "gguf"),
                   help="hf: a directory laid out as the hub's gpt2 (fp32; transformers, mlx-lm, vLLM); gguf: one "
                        "file for llama.cpp's gpt2 (Ollama, LM Studio). Both drop the 47 padded vocabulary rows")
    p.add_argument("--out", required=True, help="the directory (hf) or file (gguf) to write; never overwritten "
                                                "unless --force")
    p.add_argument("--dtype", choices=DTYPES,
                   help="gguf only: f32, f16 (default, as llama.cpp's converter), bf16 or q8_0 (8-bit blocks of "
                        "32); norms, biases and positions stay f32. GPT-2 124M: 500, 252, 252, 137 MB")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (whole, once the new is)")
    args = p.parse_args(argv)
    if args.dtype and args.format == "hf":
        raise UserError("--dtype is for --format gguf; --format hf writes fp32, as the hub's gpt2 is")
    if not args.out.strip():
        raise UserError("--out is empty: pass the file (gguf) or directory (hf) to write")
    if os.path.lexists(args.out) and not args.force:
        raise UserError(f"--out {args.out} exists: pass another path, or --force to replace it")
    if args.format == "gguf" and os.path.isdir(args.out):
        raise UserError(f"--out {args.out} is a directory: --format gguf writes one file (e.g. {args.out}/model.gguf)")
    if args.format == "hf" and os.path.lexists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out} is a file: --format hf writes a directory")
    if args.format == "hf" and os.path.isdir(args.out) and not set(os.listdir(args.out)) <= HF_FILES:
        raise UserError(f"--out {args.out} holds files that are not an export's: --force replaces only an earlier "
                        "export (or an empty directory); pass another --out")
    out, source = os.path.abspath(args.out), os.path.abspath(args.model)
    if os.path.exists(args.model) and os.path.commonpath([out, source]) == out:
        raise UserError(f"--out {args.out} is, or holds, --model {args.model}: pass another --out")
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise UserError(f"--out {args.out}: its directory {parent} does not exist; make it first")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.format == "gguf":
        try:
            from importlib.metadata import version
            import gguf  # noqa: F401
            new_enough = tuple(int(x) for x in version("gguf").split(".")[:2]) >= (0, 19)
        except ImportError:
            new_enough = None
        if not new_enough:
            raise UserError("--format gguf needs the gguf package (llama.cpp's own reader and writer of the format), "
                            "0.19 or newer: pip install -U 'gguf>=0.19' (or pip install -r requirements.txt)")
    if args.model == "log" and not os.path.isdir("log"):
        raise UserError("no log/ directory here: train a model first (python train_gpt2.py) "
                        "or pass --model (a checkpoint, a log directory or a name such as gpt2)")
    import checkpoint  # torch and the model: after the flags are checked
    model, what = checkpoint.load_model(args.model)
    name = os.path.splitext(os.path.basename(os.path.normpath(args.out)))[0]  # what Ollama and LM Studio show
    export(model, args.format, args.out, args.dtype, name)
    kind = "Hugging Face directory" if args.format == "hf" else f"GGUF file ({args.dtype or 'f16'})"
    print(f"exported {what} to {args.out}: {kind}, {file_size(args.out) / 1e6:.0f} MB")


if __name__ == "__main__":
    common.run_script(main)
