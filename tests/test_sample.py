"""sample.py on a tiny random GPT: end to end from a checkpoint, a log directory and a local
Hugging Face directory; streaming (token by token, UTF-8 split across tokens); seeds; bad input."""

import io
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import common
import checkpoint
import export
import runs
import tokenizer
import sample
from model import Sampling

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # for the scripts run as subprocesses (see one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny `model` comes from conftest.py


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("run") / "log"
    d.mkdir()
    checkpoint.save_file(str(d / "ckpt_000005.pt"),
                           {"model_config": asdict(model.config), "model": model.state_dict()})
    return d


def run(argv, stdin=""):
    """sample.main in-process; returns what it wrote to stdout."""
    out = io.StringIO()
    sample.main(argv, stdin=io.StringIO(stdin), stdout=out)
    return out.getvalue()


def test_end_to_end_from_log_dir(log_dir, monkeypatch, capsys):
    monkeypatch.chdir(log_dir.parent)  # the default --model is log/ in the working directory: its latest checkpoint
    samples = run(["--prompt", "Hello, I'm", "--max-new-tokens", "12", "--num-samples", "2", "--device", "cpu"])
    samples = samples.split(sample.SEPARATOR)
    assert len(samples) == 2 and all(s.startswith("Hello, I'm") for s in samples)
    assert samples[0] != samples[1]  # the generator moves on between samples
    assert "ckpt_000005.pt" in capsys.readouterr().err  # where the model came from goes to stderr, not into the text


def test_closed_stdout_ends_quietly(log_dir):
    """python sample.py ... | head, head gone: exit status 1, no traceback (common.run_main's way)."""
    from runs import stdout_closed
    code, err = stdout_closed(os.path.join(REPO, "sample.py"), ["--model", str(log_dir), "--device", "cpu", "--prompt",
                                                                "Hello", "--max-new-tokens", "4"])
    assert code == 1 and "Traceback" not in err and "Error" not in err, err


def test_checkpoint_and_hf_dir_agree(model, log_dir, tmp_path):
    hf_dir = export.write_hf(model, str(tmp_path / "hf"), tokenizer_files=tokenizer.gpt2_bpe_files())
    args = ["--prompt", "The meaning of life is", "--max-new-tokens", "10", "--temperature", "0", "--device", "cpu"]
    from_ckpt = run(["--model", str(log_dir / "ckpt_000005.pt")] + args)
    assert from_ckpt == run(["--model", hf_dir] + args)
    assert from_ckpt.startswith("The meaning of life is") and len(from_ckpt) > len("The meaning of life is")


def test_seeds_reproduce(log_dir):
    args = ["--model", str(log_dir), "--max-new-tokens", "16", "--top-k", "50", "--top-p", "0.9"]
    first = run(args + ["--seed", "7"])
    assert first == run(args + ["--seed", "7"])
    assert first != run(args + ["--seed", "8"])


def test_stream_equals_generate(model):
    """The streamed text is the decoded output of GPT.generate_stream with the same generator state."""
    enc = tokenizer.get_tokenizer()
    tokens = [tokenizer.EOT_TOKEN]  # unconditional: the start token is not printed
    out = io.StringIO()
    new = sample.stream_sample(model, tokens, enc, out, Sampling(20, temperature=1.0), torch.Generator().manual_seed(3))
    ref = model.generate_stream(torch.tensor([tokens]), Sampling(20, temperature=1.0), torch.Generator().manual_seed(3))
    assert new == torch.cat(list(ref)).tolist()
    assert out.getvalue() == enc.decode(new)


class Recorder(io.StringIO):
    """A stdout that notes, at each flush, how many forward passes the model has made."""

    def __init__(self, counter):
        super().__init__()
        self.counter, self.flushes = counter, []

    def flush(self):
        self.flushes.append((self.counter[0], self.getvalue()))


def test_tokens_stream_as_generated(model):
    counter = [0]
    hook = model.register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    try:
        out = Recorder(counter)
        enc = tokenizer.get_tokenizer()
        sample.stream_sample(model, enc.encode("Hi"), enc, out, Sampling(8, temperature=0))
    finally:
        hook.remove()
    # the prompt is shown before the first forward pass; then text appears after each one
    # (a flush can only be missing where a token ends inside a UTF-8 character)
    assert out.flushes[0] == (0, "Hi")
    steps = [n for n, _ in out.flushes[1:]]
    assert steps == sorted(steps) and steps[0] == 1 and len(steps) >= 4


def test_utf8_split_across_tokens_is_held_back():
    enc = tokenizer.get_tokenizer()
    text = "naïve café 😀 世界 👋🏽!"
    tokens = enc.encode(text)
    assert any(_is_partial(enc.decode_single_token_bytes(t)) for t in tokens)  # the case being tested
    out = io.StringIO()
    sample.print_stream(enc, tokens, out)
    assert out.getvalue() == text and "\ufffd" not in out.getvalue()


def _is_partial(b):
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_prompt_sources(log_dir, tmp_path):
    args = ["--model", str(log_dir), "--max-new-tokens", "3", "--temperature", "0"]
    piped = run(args, stdin="Once upon a time\n")  # echo's newline is dropped
    assert piped.startswith("Once upon a time") and not piped.startswith("Once upon a time\n")
    f = tmp_path / "prompt.txt"
    f.write_text("Once upon a time\n", encoding="utf-8")
    assert run(args + ["--prompt-file", str(f)]) == piped == run(args + ["--prompt", "Once upon a time"])
    assert run(args + ["--prompt-file", "-"], stdin="Once upon a time") == piped
    unconditional = run(args)  # empty stdin: starts from <|endoftext|>, which is not printed
    assert not unconditional.startswith("<|endoftext|>")


def cli_error(argv, capsys, cwd=None):
    """Run the CLI in-process as `python sample.py` would; return its one error line (nothing on stdout)."""
    out = io.StringIO()
    with pytest.raises(SystemExit) as e:
        common.run_main(lambda: sample.main(argv, stdin=io.StringIO(""), stdout=out))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert out.getvalue() == ""
    return err[0]


def test_bad_input(log_dir, tmp_path, capsys, monkeypatch):
    assert "--num-samples" in cli_error(["--model", str(log_dir), "--num-samples", "0"], capsys)
    assert "--top-p" in cli_error(["--model", str(log_dir), "--top-p", "1.5"], capsys)
    missing = str(tmp_path / "no")
    assert "cannot read the prompt" in cli_error(["--model", str(log_dir), "--prompt-file", missing], capsys)
    truncated = tmp_path / "ckpt_000009.pt"
    truncated.write_bytes((log_dir / "ckpt_000005.pt").read_bytes()[:2000])
    assert "truncated" in cli_error(["--model", str(truncated)], capsys)
    foreign = tmp_path / "foreign.pt"
    torch.save([1, 2, 3], foreign)
    assert "not a checkpoint written by train_gpt2.py" in cli_error(["--model", str(foreign)], capsys)
    monkeypatch.chdir(tmp_path)  # no log/ here
    assert "train a model first" in cli_error([], capsys)
    (tmp_path / "log").mkdir()
    assert "no ckpt_*.pt" in cli_error([], capsys)


@pytest.mark.parametrize("flags, needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be at least 1, got -3"),
    (["--num-samples", "-1"], "--num-samples must be at least 1, got -1"),
    (["--temperature", "-0.5"], "--temperature must be a number >= 0"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "-0.1"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.01"], "--top-p must be in (0, 1]"),
    (["--top-p", "nan"], "--top-p must be in (0, 1]"),
    (["--seed", str(2 ** 64)], "--seed must fit in 64 bits"),
    (["--top-k", "many"], "error: argument --top-k: invalid int value: 'many' (see --help)"),
    (["--temprature", "1"], "error: unrecognized arguments: --temprature 1 (see --help)"),
])
def test_bad_numbers(log_dir, capsys, flags, needle):
    assert needle in cli_error(["--model", str(log_dir)] + flags, capsys)


def test_log_dir_whose_newest_checkpoint_is_corrupt(log_dir, tmp_path, capsys):
    """sample.py and hellaswag.py fall back to the newest checkpoint that loads, as the trainer's
    --resume does, and say which they skipped; with none that loads, one line naming no trainer flag."""
    import hellaswag
    run_dir = tmp_path / "run"
    shutil.copytree(log_dir, run_dir)
    (run_dir / "ckpt_000009.pt").write_bytes((log_dir / "ckpt_000005.pt").read_bytes()[:3000])  # a full disk's
    args = ["--prompt", "Hi", "--max-new-tokens", "4", "--temperature", "0", "--device", "cpu"]
    assert run(["--model", str(run_dir)] + args) == run(["--model", str(log_dir / "ckpt_000005.pt")] + args)
    assert "ckpt_000005.pt (skipped 1 newer that do not load: " in capsys.readouterr().err
    items = tmp_path / "hs.jsonl"
    items.write_text('{"ctx": "A cat", "endings": ["sat.", "ran.", "is.", "a."], "label": 0}\n')
    hellaswag.main(["--model", str(run_dir), "--data-file", str(items), "--device", "cpu"])
    assert "ckpt_000005.pt (skipped 1 newer" in capsys.readouterr().out
    (run_dir / "ckpt_000005.pt").write_bytes(b"garbage")
    err = cli_error(["--model", str(run_dir)], capsys)
    assert "none of the 2 checkpoints" in err and "--resume" not in err


def test_model_naming_nothing_loadable(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "no_such_run")
    assert f"model {missing!r} not found" in cli_error(["--model", missing], capsys)
    assert "not found" in cli_error(["--model", str(tmp_path / "ckpt_000001.pt")], capsys)
    monkeypatch.chdir(tmp_path)  # a checkpoint named as in its log directory, or by a relative path: no hub name
    for name in ("ckpt_000123.pt", "runs/a.pt"):
        assert cli_error(["--model", name], capsys) == (f"error: model {name!r} not found: pass a checkpoint file, "
                                                        "a log directory, a Hugging Face directory, or a name such "
                                                        "as gpt2")
    (tmp_path / "empty_log").mkdir()
    assert "has no ckpt_*.pt checkpoint" in cli_error(["--model", str(tmp_path / "empty_log")], capsys)
    for name, content, why in (("garbage.pt", b"\x00not a checkpoint" * 50, "is not a checkpoint: not a torch zip"),
                               ("empty.pt", b"", "not a readable checkpoint")):  # an empty file: one cut short
        (tmp_path / name).write_bytes(content)
        assert why in cli_error(["--model", str(tmp_path / name)], capsys)


def test_prompt_longer_than_context_is_one_line(log_dir, capsys):
    assert "longer than the model's context of 64" in cli_error(["--model", str(log_dir), "--prompt", "word " * 100],
                                                                capsys)


def test_openai_gpt2_from_the_hub(hf_hub_online):
    text = run(["--model", "gpt2", "--prompt", "Hello, I'm a language model,", "--max-new-tokens", "5"])
    assert text.startswith("Hello, I'm a language model,")


def test_hub_name_offline(model, tmp_path):
    """A hub name loads from Hugging Face's cache without the network; one that is not cached
    fails at once with one line, not after minutes of retries."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-gpt2" / "snapshots" / ("0" * 40)  # the hub cache's layout
    export.write_hf(model, str(snapshot), tokenizer_files=tokenizer.gpt2_bpe_files())
    (cache / "models--tiny-org--tiny-gpt2" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-gpt2" / "refs" / "main").write_text("0" * 40)
    env = dict(ENV, HF_HUB_CACHE=str(cache), HF_ENDPOINT="http://127.0.0.1:9")  # a port nothing serves
    env.pop("HF_HUB_OFFLINE", None)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(proxy, None)
    cmd = [runs.python(), os.path.join(REPO, "sample.py"), "--device", "cpu", "--max-new-tokens", "4",
           "--prompt", "Hi", "--seed", "1", "--model"]
    proc = subprocess.run(cmd + ["tiny-org/tiny-gpt2"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == run(["--model", str(snapshot), "--device", "cpu", "--max-new-tokens", "4",
                               "--prompt", "Hi", "--seed", "1"])
    proc = subprocess.run(cmd + ["tiny-org/not-cached"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'tiny-org/not-cached' is not in the Hugging Face cache" in lines[0], proc.stderr
    assert "127.0.0.1 cannot be reached" in lines[0]
