"""export.py: a GGUF file read back by transformers' own GGUF loader (logits at f32, f16 and bf16, the tokenizer
against tiktoken), the Hugging Face directory in the hub's layout, MLX where it is installed, and bad input."""

import importlib.util
import json
import os
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.nn as nn

import checkpoint
import common
import export
import model as model_module
from model import GPT, GPTConfig, Sampling
from tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                                reason="export.py --format gguf needs the gguf package (pip install gguf)")
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama.cpp's own check needs llama-cpp-python, which compiles llama.cpp "
                                            "when installed (pip install llama-cpp-python==0.3.36: minutes)")
# transformers' GGUF loader reads the context into n_ctx but leaves n_positions at GPT-2's 1024: a 1024 context
TINY = dict(block_size=1024, n_layer=2, n_head=2, n_embd=64)
TEXT = ("Hello  world!\n\n\n\tTabs\t\tand   runs of    spaces \r\n"
        "Ünïcödé, 日本語のテキスト, Русский текст, العربية, हिन्दी; emoji 🤖🧠👩‍👩‍👧 and flags 🇫🇷🇯🇵; "
        "code: def f(x):\n        return x**2  # comment\n'quoted' \"double\" it's we'll I'M 1234567 3.14159"
        "<|endoftext|>a new document")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return GPT(GPTConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(1)
    return torch.randint(0, 50257, (2, 24))


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids)[0][..., :50257]


def rounded(model, dtype):
    """A copy of model whose matrices (not the position table) went through dtype, as the GGUF file holds them."""
    copy = GPT(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if p.dim() == 2 and "wpe" not in name:
                p.copy_(p.to(dtype).float())
    return copy


class InMemory:
    """numpy, as gguf's reader sees it, with np.memmap(path) reading the file into memory instead: the same bytes,
    parsed by the same code, without a memory map's cost on each of the vocabulary's 100,000 slices (a read of
    the tokenizer's fields takes 6 s mapped, 2 s in memory)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def memmap(path, mode="r"):
        assert mode == "r", mode  # what is read is read-only, as the map was
        data = np.fromfile(path, dtype=np.uint8)
        data.flags.writeable = False
        return data


@pytest.fixture(autouse=True)
def gguf_read_in_memory(monkeypatch):
    if importlib.util.find_spec("gguf") is not None:
        import gguf.gguf_reader
        monkeypatch.setattr(gguf.gguf_reader, "np", InMemory())


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, tiny):
    """{dtype: path} of the tiny model exported at each --dtype, in one directory."""
    out = tmp_path_factory.mktemp("gguf")
    return {d: export.export(tiny, "gguf", str(out / f"m-{d}.gguf"), d) for d in export.DTYPES}


def from_gguf(path, config=None):
    """transformers' GGUF loader on path (each read of the file's 100,000 vocabulary strings costs seconds: a given
    config saves one)."""
    from transformers import AutoModelForCausalLM
    with model_module.quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    config=config).eval()


@needs_gguf
def test_gguf_f32_loads_in_transformers_with_our_logits(tiny, ids, gguf_files):
    hf = from_gguf(gguf_files["f32"])
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.tie_word_embeddings
    assert (hf.config.n_layer, hf.config.n_head, hf.config.n_embd, hf.config.n_ctx) == (2, 2, 64, 1024)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert theirs.shape == (2, 24, 50257)
    assert (theirs - logits_of(tiny, ids)).abs().max().item() <= 1e-4


@needs_gguf
@pytest.mark.parametrize("dtype,torch_dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_gguf_at_half_precision_holds_our_weights_rounded(tiny, ids, gguf_files, dtype, torch_dtype):
    """f16 and bf16 files give the logits of our model with its matrices rounded so (not the logits of the fp32
    model, which differ by the rounding): the file holds exactly those numbers."""
    hf = from_gguf(gguf_files[dtype], export.hf_config(tiny))
    with torch.no_grad():
        theirs = hf(ids).logits
    expected = logits_of(rounded(tiny, torch_dtype), ids)
    assert (theirs - expected).abs().max().item() <= 1e-4
    assert (theirs - logits_of(tiny, ids)).abs().max().item() > 1e-4  # the rounding is there to be seen


@needs_gguf
def test_gguf_types_and_sizes(tiny, ids, gguf_files):
    """Each --dtype's tensor types as llama.cpp's converter writes them (vectors and the position table in f32; q8_0
    falls back to f16 for rows not a multiple of 32), and the files' sizes in that order."""
    import gguf
    sizes = {d: os.path.getsize(path) for d, path in gguf_files.items()}
    assert sizes["q8_0"] < sizes["f16"] == sizes["bf16"] < sizes["f32"]
    q8 = gguf.GGMLQuantizationType.Q8_0
    types = {name: (data.dtype, qtype) for name, data, qtype in export.gguf_tensors(tiny, "q8_0")}
    assert types["token_embd.weight"][1] == types["blk.1.ffn_down.weight"][1] == q8
    assert types["position_embd.weight"] == types["blk.0.attn_norm.bias"] == (np.float32, None)
    assert "output.weight" not in types and len(types) == 4 + 12 * 2
    narrow = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=48))
    types = {name: (data.dtype, qtype) for name, data, qtype in export.gguf_tensors(narrow, "q8_0")}
    assert types["blk.0.attn_qkv.weight"] == (np.float16, None)  # rows of 48
    assert types["blk.0.ffn_down.weight"][1] == q8  # rows of 192
    f16 = {name: data.dtype for name, data, _ in export.gguf_tensors(narrow, "f16")}
    assert f16["token_embd.weight"] == np.float16 and f16["position_embd.weight"] == np.float32
    # the q8_0 file as written: its tensors' types, and logits near ours through transformers' dequantizer
    written = {t.name: t.tensor_type for t in gguf.GGUFReader(gguf_files["q8_0"]).tensors}
    assert written["blk.0.attn_qkv.weight"] == q8 and written["position_embd.weight"] == gguf.GGMLQuantizationType.F32
    with torch.no_grad():
        theirs = from_gguf(gguf_files["q8_0"], export.hf_config(tiny))(ids).logits
    ours = logits_of(tiny, ids)
    assert 0 < (theirs - ours).abs().max().item() < 0.02 * ours.abs().max().item()


def llama_cpp_shapes(fields, tokens):
    """{tensor: its shape in ggml's order (ne)} that llama.cpp's loader asks of a `gpt2` file with these
    hyper-parameters (src/llama-model.cpp, LLM_ARCH_GPT2: it refuses a file whose tensors differ) and `tokens`
    vocabulary entries; the head is the token embedding (no output.weight)."""
    arch = "gpt2"
    n_embd, n_ff = fields[f"{arch}.embedding_length"], fields[f"{arch}.feed_forward_length"]
    n_head, n_head_kv = fields[f"{arch}.attention.head_count"], fields[f"{arch}.attention.head_count_kv"]
    assert n_embd % n_head == 0, (n_embd, n_head)  # llama.cpp's head size is n_embd / n_head
    qkv = n_embd + 2 * (n_embd // n_head) * n_head_kv
    shapes = {"token_embd.weight": [n_embd, tokens], "position_embd.weight": [n_embd, fields[f"{arch}.context_length"]],
              "output_norm.weight": [n_embd], "output_norm.bias": [n_embd]}
    for i in range(fields[f"{arch}.block_count"]):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in (
            ("attn_norm.weight", [n_embd]), ("attn_norm.bias", [n_embd]), ("attn_qkv.weight", [n_embd, qkv]),
            ("attn_qkv.bias", [qkv]), ("attn_output.weight", [n_embd, n_embd]), ("attn_output.bias", [n_embd]),
            ("ffn_norm.weight", [n_embd]), ("ffn_norm.bias", [n_embd]), ("ffn_up.weight", [n_embd, n_ff]),
            ("ffn_up.bias", [n_ff]), ("ffn_down.weight", [n_ff, n_embd]), ("ffn_down.bias", [n_embd]))})
    return shapes


@needs_gguf
def test_gguf_hyper_parameters_agree_with_its_tensors_and_the_model(tiny, gguf_files):
    """Each file's hyper-parameters are the model's (context, width, the MLP's width as its own weight has it, heads,
    layers), and its tensors have the shapes llama.cpp builds its graph from them: a feed-forward length or a layer
    count that disagrees with the tensors makes llama.cpp refuse the file, a head count the attention."""
    import gguf
    mlp_width = tiny.transformer.h[0].mlp.c_fc.weight.shape[0]
    for dtype, path in gguf_files.items():
        reader = gguf.GGUFReader(path)
        fields = {name: field.contents() for name, field in reader.fields.items() if name.startswith("gpt2.")}
        c = tiny.config
        assert {k: fields[f"gpt2.{k}"] for k in ("context_length", "embedding_length", "feed_forward_length",
                                                   "block_count", "attention.head_count")} == dict(
            context_length=c.block_size, embedding_length=c.n_embd, feed_forward_length=mlp_width,
            block_count=c.n_layer, **{"attention.head_count": c.n_head}), dtype
        tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
        assert {t.name: [int(n) for n in t.shape] for t in reader.tensors} == llama_cpp_shapes(fields, tokens), dtype


@needs_llama_cpp
def test_gguf_loads_in_llama_cpp_with_our_logits(tiny, ids, gguf_files):
    """llama.cpp itself (llama-cpp-python, where installed) loads the f32 file and gives our logits (within its fp16
    GELU table's rounding, BENCHMARKS.md: the exports)."""
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=gguf_files["f32"], n_ctx=64, logits_all=True, verbose=False, flash_attn=False)
    prompt = ids[0].tolist()
    llm.eval(prompt)
    theirs = np.array(llm.scores[:len(prompt)])
    llm.close()  # now, not at the interpreter's exit, where llama-cpp-python's finalizer fails
    assert theirs.shape == (len(prompt), 50257)
    assert np.abs(theirs - logits_of(tiny, ids[:1])[0].numpy()).max() <= 1e-3  # 1.8e-4 here


@needs_gguf
def test_gguf_tokenizer_splits_text_as_tiktoken(gguf_files):
    """The vocabulary, merges and <|endoftext|> in the file tokenize a multilingual, whitespace-heavy and emoji text
    into tiktoken's gpt2 ids (transformers builds its tokenizer from the file alone)."""
    import gguf
    from transformers import AutoTokenizer
    path = gguf_files["q8_0"]
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    expected = get_tokenizer().encode(TEXT, allowed_special="all")
    assert tok(TEXT)["input_ids"] == expected and 50256 in expected
    assert tok.decode(expected) == TEXT
    fields = gguf.GGUFReader(path).fields
    assert fields["general.architecture"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == fields["tokenizer.ggml.bos_token_id"].contents() == 50256
    assert fields["gpt2.attention.head_count_kv"].contents() == 2
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False
    types = fields["tokenizer.ggml.token_type"].contents()
    assert len(types) == 50257 and types[50256] == gguf.TokenType.CONTROL and set(types[:50256]) == {1}


def test_hf_directory_is_the_hub_layout_and_loads_to_the_bit(model, tmp_path):
    """The hf export is laid out as the hub's own gpt2 (no 'transformer.' prefix, no separate head, n_ctx in the
    config), which mlx-lm requires; transformers loads it to the bit."""
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel
    out = export.export(model, "hf", str(tmp_path / "hf"))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "wte.weight" in keys and "h.1.mlp.c_fc.weight" in keys and "lm_head.weight" not in keys
    assert not any(k.startswith("transformer.") for k in keys)
    assert json.load(open(os.path.join(out, "config.json")))["n_ctx"] == model.config.block_size == 64
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= set(os.listdir(out))
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    idx = torch.randint(0, 50257, (1, 16))
    with torch.no_grad():
        assert (hf(idx).logits - logits_of(model, idx)).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("run") / "log"
    d.mkdir()
    checkpoint.save_file(str(d / "ckpt_000005.pt"), {"model_config": asdict(tiny.config), "model": tiny.state_dict()})
    return d


def cli(argv, capsys):
    """export.py in-process as the command line runs it: (exit status, stdout, stderr)."""
    code = 0
    try:
        common.run_main(lambda: export.main(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@needs_gguf
def test_cli_from_a_checkpoint_a_log_directory_and_a_hf_directory(log_dir, tiny, tmp_path, capsys):
    """The three kinds of --model, each the very bytes export() writes of the model it names."""
    code, out, _ = cli(["--model", str(log_dir), "--format", "hf", "--out", str(tmp_path / "hf")], capsys)
    assert code == 0 and out == f"exported checkpoint {log_dir / 'ckpt_000005.pt'} to {tmp_path / 'hf'}: Hugging " \
                                f"Face directory, 19 MB\n"
    code, out, _ = cli(["--model", str(tmp_path / "hf"), "--format", "gguf", "--out", str(tmp_path / "a.gguf")], capsys)
    assert code == 0 and "GGUF file (f16)" in out
    code, _, _ = cli(["--model", str(log_dir / "ckpt_000005.pt"), "--format", "gguf", "--dtype", "q8_0",
                      "--out", str(tmp_path / "b.gguf")], capsys)
    assert code == 0
    export.write(tiny, "gguf", str(tmp_path / "a-ref.gguf"), "f16", name="a")
    export.write(tiny, "gguf", str(tmp_path / "b-ref.gguf"), "q8_0", name="b")
    for name in "ab":
        assert (tmp_path / f"{name}.gguf").read_bytes() == (tmp_path / f"{name}-ref.gguf").read_bytes()
    code, out, _ = cli(["--model", str(log_dir), "--format", "gguf", "--dtype", "f32", "--force",
                        "--out", str(tmp_path / "a.gguf")], capsys)
    export.write(tiny, "gguf", str(tmp_path / "a-ref.gguf"), "f32", name="a")
    assert code == 0 and (tmp_path / "a.gguf").read_bytes() == (tmp_path / "a-ref.gguf").read_bytes()  # replaced


def one_line(argv, capsys):
    code, out, err = cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


def test_bad_input_is_one_line_and_nothing_is_overwritten(log_dir, tmp_path, capsys, monkeypatch):
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"the user's file")
    m = ["--model", str(log_dir)]
    assert "exists: pass another path, or --force" in one_line(m + ["--format", "gguf", "--out", str(taken)], capsys)
    assert taken.read_bytes() == b"the user's file"
    earlier = tmp_path / "earlier"  # an earlier hf export: replaced only with --force, as a file is
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    assert "exists: pass another path, or --force" in one_line(m + ["--format", "hf", "--out", str(earlier)], capsys)
    assert os.listdir(earlier) == ["config.json"] and (earlier / "config.json").read_text() == "{}"
    (earlier / "config.json").unlink()
    earlier.rmdir()
    assert "--dtype is for --format gguf" in one_line(m + ["--format", "hf", "--dtype", "f16", "--out",
                                                           str(tmp_path / "x")], capsys)
    assert "is a directory" in one_line(m + ["--format", "gguf", "--out", str(tmp_path), "--force"], capsys)
    assert "does not exist; make it first" in one_line(m + ["--format", "gguf", "--out",
                                                            str(tmp_path / "no" / "m.gguf")], capsys)
    assert "--format" in one_line(m + ["--out", str(tmp_path / "y.gguf")], capsys)
    assert "invalid choice" in one_line(m + ["--format", "gguf", "--dtype", "q4", "--out", str(tmp_path / "y")], capsys)
    assert "not found" in one_line(["--model", str(tmp_path / "nothing.pt"), "--format", "gguf", "--out",
                                    str(tmp_path / "y.gguf")], capsys)
    monkeypatch.chdir(tmp_path)
    assert "no log/ directory here" in one_line(["--format", "gguf", "--out", "y.gguf"], capsys)
    # --force replaces an earlier export, never a directory of other files, nor what --model names
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "ckpt_000001.pt").write_bytes(b"a checkpoint")
    assert "not an export's" in one_line(m + ["--format", "hf", "--out", "kept", "--force"], capsys)
    assert "is, or holds, --model" in one_line(["--model", "kept/ckpt_000001.pt", "--format", "gguf", "--out",
                                                "kept/ckpt_000001.pt", "--force"], capsys)
    assert (tmp_path / "kept" / "ckpt_000001.pt").read_bytes() == b"a checkpoint"
    (tmp_path / "kept" / "ckpt_000001.pt").unlink()
    (tmp_path / "kept").rmdir()
    monkeypatch.setitem(sys.modules, "gguf", None)  # as where it is not installed
    assert "needs the gguf package" in one_line(m + ["--format", "gguf", "--out", "y.gguf"], capsys)
    assert sorted(os.listdir(tmp_path)) == ["taken.gguf"]


class RMSNormBlock(model_module.Block):
    """A variant defined here: GPT-2's block with its LayerNorms swapped for RMSNorm."""

    def __init__(self, config):
        super().__init__(config)
        self.ln_1, self.ln_2 = nn.RMSNorm(config.n_embd), nn.RMSNorm(config.n_embd)


def test_a_model_neither_format_can_hold_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(model_module.BLOCKS, "rms", RMSNormBlock)
    variant = GPT(GPTConfig(block="rms", **dict(TINY, block_size=64)))
    for fmt in ("hf", "gguf"):
        with pytest.raises(common.UserError, match=f"cannot export to {fmt}: a GPT of 'rms' blocks is not GPT-2's"):
            export.export(variant, fmt, str(tmp_path / fmt))
    other_vocab = GPT(GPTConfig(vocab_size=1000, padded_vocab_size=1024, **dict(TINY, block_size=64)))
    for fmt in ("hf", "gguf"):  # each would carry GPT-2's tokenizer beside it
        with pytest.raises(common.UserError, match="its vocabulary has 1000 tokens, the GPT-2 tokenizer's 50257"):
            export.export(other_vocab, fmt, str(tmp_path / "v"))
    assert os.listdir(tmp_path) == []


@needs_gguf
def test_a_write_cut_short_leaves_what_was_there(tiny, model, tmp_path, monkeypatch):
    """A full disk in the middle of the tensors: --out keeps the older file, and no temporary file is left (nor one
    that a killed export left before); a failed hf export keeps the earlier directory whole."""
    import gguf
    import safetensors.torch
    out = tmp_path / "m.gguf"
    (tmp_path / ".m.gguf.tmp99999").write_bytes(b"left by a kill")
    export.export(tiny, "gguf", str(out), "q8_0")
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]
    before = out.read_bytes()
    export.export(model, "hf", str(tmp_path / "hf"))
    hf_before = {f: (tmp_path / "hf" / f).read_bytes() for f in os.listdir(tmp_path / "hf")}
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", lambda *a, **kw: (_ for _ in ()).throw(OSError(28, "No space")))
        with pytest.raises(common.UserError, match=r"hf \(no space left on its disk\); what was there is as it was"):
            export.export(model, "hf", str(tmp_path / "hf"))
    assert {f: (tmp_path / "hf" / f).read_bytes() for f in os.listdir(tmp_path / "hf")} == hf_before
    assert sorted(os.listdir(tmp_path)) == ["hf", "m.gguf"]

    def half_then_full(self, *a, **kw):
        self.fout[0].write(b"\0" * 1000)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", half_then_full)
    with pytest.raises(common.UserError, match=r"could not write .*m.gguf \(no space left on its disk\); what was"):
        export.export(tiny, "gguf", str(out), "f32")
    assert out.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["hf", "m.gguf"]


def test_mlx_lm_loads_the_hf_export(model, tmp_path):
    """Apple's MLX (its Linux CPU build here): mlx_lm.load gives our logits and our greedy tokens."""
    pytest.importorskip("mlx_lm", reason="MLX is not installed (pip install \"mlx[cpu]\" mlx-lm; on a Mac: mlx-lm)")
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    out = export.export(model, "hf", str(tmp_path / "hf"))
    mlx_model, _ = mlx_lm.load(out)
    idx = torch.randint(0, 50257, (1, 20))
    theirs = np.array(mlx_model(mx.array(idx.numpy())).astype(mx.float32))
    assert np.abs(theirs - logits_of(model, idx).numpy()).max() <= 1e-4
    tokens, ours = idx[0].tolist(), [int(t[0]) for t in model.generate_stream(idx, Sampling(12, temperature=0))]
    for _ in range(12):
        logits = mlx_model(mx.array([tokens]))[0, -1]
        tokens.append(int(mx.argmax(logits).item()))
    assert tokens[20:] == ours


def test_the_readmes_commands_run_as_written(log_dir, tmp_path, monkeypatch, capsys):
    """README's "Run your model elsewhere": its export.py commands as typed (in a directory with a log/ of its
    own), and its mlx_lm.generate command on what they wrote, where MLX is installed."""
    import shlex
    import shutil
    import subprocess
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        section = f.read().split("## Run your model elsewhere", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["python", "export.py"]] * 2
    shutil.copytree(log_dir, tmp_path / "log")
    monkeypatch.chdir(tmp_path)
    for command in commands:
        code, out, err = cli(command[2:], capsys)
        assert code == 0 and out.startswith("exported checkpoint log/ckpt_000005.pt to "), err
    assert {"gpt2.gguf", "gpt2-hf"} <= set(os.listdir(tmp_path))
    mlx = section.split("`mlx_lm.generate", 1)[1].split("`", 1)[0].replace("\n", " ")
    generate = shutil.which("mlx_lm.generate")
    if generate is None:
        pytest.skip("MLX is not installed (pip install \"mlx[cpu]\" mlx-lm): its command was not run")
    proc = subprocess.run([generate] + shlex.split(mlx) + ["--temp", "0"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "Generation: " in proc.stdout, proc.stdout + proc.stderr  # its summary line
