"""The offline GPT-2 tokenizer: exact ids, no network, and the same files tiktoken pins."""
import pytest

import tokenizer

TEXTS = [
    "Hello, I'm a language model,",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Numbers 1234567 and 3.14159, emoji 🙂🚀, accents: café naïve Zoë, CJK: 日本語のテキスト",
    "contractions: don't won't they'll I've we'd it's",
    "code: def f(x):\n    return x**2  # square\n",
    "<|endoftext|> is plain text here",
]


def test_known_ids():
    enc = tokenizer.get_tokenizer()
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert enc.eot_token == 50256
    assert enc.n_vocab == 50257
    from model import GPT2_VOCAB_SIZE  # model.py imports nothing from the project: it says the size again
    assert tokenizer.VOCAB_SIZE == GPT2_VOCAB_SIZE == enc.n_vocab
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]


def test_matches_independent_bpe_implementation(tmp_path):
    # Hugging Face's GPT-2 tokenizer is a separate implementation of the same BPE
    import shutil
    from transformers import GPT2TokenizerFast
    vocab_json, merges = tokenizer.gpt2_bpe_files()
    shutil.copyfile(vocab_json, tmp_path / "vocab.json")
    shutil.copyfile(merges, tmp_path / "merges.txt")
    hf = GPT2TokenizerFast.from_pretrained(tmp_path)
    enc = tokenizer.get_tokenizer()
    for text in TEXTS[:-1]:
        assert enc.encode_ordinary(text) == hf.encode(text), text
        assert enc.decode(enc.encode_ordinary(text)) == text


def test_no_network(monkeypatch):
    """Building the encoding must never touch the network: make every download path fail."""
    import tiktoken.load
    import requests

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    real_read = tiktoken.load.read_file

    def local_only(path):
        if "://" in path:
            refuse()
        return real_read(path)
    monkeypatch.setattr(tiktoken.load, "read_file", local_only)
    monkeypatch.setattr(requests, "get", refuse)
    monkeypatch.setattr(requests.Session, "request", refuse)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no cache to fall back on either
    tokenizer.get_tokenizer.cache_clear()
    try:
        enc = tokenizer.get_tokenizer()
        assert enc.encode("offline, exact") == enc.encode_ordinary("offline, exact")
        assert len(enc.encode("Hello, I'm a language model,")) == 8
    finally:
        tokenizer.get_tokenizer.cache_clear()


def test_hashes_are_the_ones_tiktoken_pins(monkeypatch):
    """Ask tiktoken's own gpt2 constructor which hashes it would check, without downloading."""
    import tiktoken.load
    import tiktoken_ext.openai_public as openai_public
    pinned = {}

    class Stop(Exception):
        pass

    def capture(vocab_bpe_file, encoder_json_file, vocab_bpe_hash=None, encoder_json_hash=None, **kw):
        pinned.update(vocab=vocab_bpe_hash, encoder=encoder_json_hash)
        raise Stop
    monkeypatch.setattr(openai_public, "data_gym_to_mergeable_bpe_ranks", capture)
    with pytest.raises(Stop):
        openai_public.gpt2()
    assert pinned == {"vocab": tokenizer.VOCAB_BPE_SHA256, "encoder": tokenizer.ENCODER_JSON_SHA256}
