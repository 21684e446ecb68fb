"""
llama.cpp itself, through llama-cpp-python, on the GGUF files export.py writes: for each --dtype, does llama.cpp
split text into tiktoken's ids, give our logits over a prompt, and continue it greedily with the tokens
`sample.py --temperature 0` prints? Not part of the suite: llama-cpp-python compiles llama.cpp when installed.

    pip install "llama-cpp-python==0.3.36"      # builds llama.cpp from source: about 13 minutes on 2 cores
    python bench/bench_gguf.py --model log      # a trained model: a checkpoint, a log directory, an HF directory
    python bench/bench_gguf.py --sizes          # the files' sizes for GPT-2 124M's shape at each dtype

llama.cpp runs here with an fp32 KV cache and no flash attention, so that the file's weights are the only
rounding; the logits compared are over the whole prompt.
"""

import argparse
import io
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import export  # noqa: E402
from checkpoint import load_model  # noqa: E402
from model import GPT, Sampling, config_of  # noqa: E402
from sample import stream_sample  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
TEXTS = ("Hello  world!\n\n\n\tTabs\t\tand   runs of    spaces \r\n",
         "Ünïcödé, 日本語のテキスト, Русский текст, العربية, हिन्दी",
         "emoji 🤖🧠👩‍👩‍👧 and flags 🇫🇷🇯🇵; def f(x):\n        return x**2  # it's we'll I'M 1234567",
         "one document<|endoftext|>and the next")


def llama(path, n_ctx):
    from llama_cpp import Llama
    return Llama(model_path=path, n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=os.cpu_count(),
                 type_k=0, type_v=0, flash_attn=False, seed=0)  # 0: GGML_TYPE_F32


def greedy(llm, ids, n):
    llm.reset()
    llm.eval(ids)
    new = []
    for _ in range(n):
        new.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(new[-1:])
    return new


def check(model, dtype, folder, n_new):
    path = os.path.join(folder, f"model-{dtype}.gguf")
    t0 = time.perf_counter()
    export.write(model, "gguf", path, dtype)
    seconds = time.perf_counter() - t0
    enc = get_tokenizer()
    ids = enc.encode(PROMPT)
    llm = llama(path, min(model.config.block_size, len(ids) + n_new + 8))
    same_ids = all(llm.tokenize(t.encode(), add_bos=False, special=True) == enc.encode(t, allowed_special="all")
                   for t in TEXTS + (PROMPT,))
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0, :, :model.config.vocab_size].numpy()
    ours_new = stream_sample(model, ids, enc, io.StringIO(), Sampling(n_new, temperature=0.0))  # sample.py's own
    theirs_new = greedy(llm, ids, n_new)
    agree = next((i for i, (a, b) in enumerate(zip(ours_new, theirs_new)) if a != b), n_new)
    llm.close()
    return dict(dtype=dtype, mb=os.path.getsize(path) / 1e6, seconds=seconds, same_ids=same_ids,
                max_diff=float(np.abs(theirs - ours).max()), agree=agree, n=n_new,
                text=enc.decode(theirs_new[:agree]))


def sizes(folder):
    model = GPT(config_of("gpt2", 1024))
    print("| GPT-2 124M as | size |\n|---|---:|")
    for dtype in export.DTYPES:
        path = os.path.join(folder, f"gpt2-{dtype}.gguf")
        export.write(model, "gguf", path, dtype)
        print(f"| gguf {dtype} | {os.path.getsize(path) / 1e6:.0f} MB |")
        os.remove(path)
    export.write(model, "hf", os.path.join(folder, "hf"))
    print(f"| hf (fp32 safetensors, tokenizer) | {export.file_size(os.path.join(folder, 'hf')) / 1e6:.0f} MB |")


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", help="a checkpoint, log directory or HF directory (as sample.py --model takes)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens to compare (default 32)")
    p.add_argument("--sizes", action="store_true", help="the sizes of GPT-2 124M's files at each dtype")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count())
    with tempfile.TemporaryDirectory() as folder:
        if args.sizes:
            sizes(folder)
        if args.model:
            model, what = load_model(args.model)
            print(f"{what}: {model.num_params(False) / 1e6:.1f}M parameters; prompt {PROMPT!r}")
            rows = [check(model, dtype, folder, args.tokens) for dtype in export.DTYPES]
            print("| dtype | file | export | ids = tiktoken's | max abs logit diff | greedy tokens equal | "
                  "llama.cpp's greedy text (the agreeing part) |\n|---|---:|---:|---|---:|---|---|")
            for r in rows:
                print(f"| {r['dtype']} | {r['mb']:.1f} MB | {r['seconds']:.1f} s | {'yes' if r['same_ids'] else 'NO'} "
                      f"| {r['max_diff']:.2e} | {r['agree']} of {r['n']} | {r['text']!r} |")


if __name__ == "__main__":
    main()
