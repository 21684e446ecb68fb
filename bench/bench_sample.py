"""
Generation speed: our KV-cache generation (model.GPT.generate_stream) against transformers'
GPT2LMHeadModel.generate on the same weights (export.to_hf(model)), greedy, same prompt, same number of
new tokens, use_cache=True, batch 1. A 124M GPT-2 with random weights (speed does not depend on them).

    python bench/bench_sample.py                       # CPU, 256 new tokens
    python bench/bench_sample.py --device cuda --dtype bfloat16 --new-tokens 512
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import measure  # noqa: E402
import export  # noqa: E402

from device import autocast, device_name, pick_device, pick_dtype  # noqa: E402
from tokenizer import EOT_TOKEN, get_tokenizer  # noqa: E402
from model import GPT, GPTConfig, Sampling  # noqa: E402

PROMPT = "Hello, I'm a language model, and today I would like to tell you about"


def add_device_args(p):
    """The flags both benchmarks share (bench_hellaswag.py imports these helpers)."""
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default cpu)")
    p.add_argument("--dtype", default="float32", help="autocast dtype (default float32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def setup(args):
    """(device, dtype) from the flags; CPU threads set; torch seeded, so both runs get the same weights."""
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return device, dtype


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per run (default 256)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per side, the sides taking turns; median and range reported (default 3)")
    return p.parse_args(argv)


def main():
    args = parse_args()
    device, dtype = setup(args)
    model = GPT(GPTConfig()).to(device).eval()
    hf = export.to_hf(model).to(device).eval()
    idx = torch.tensor([get_tokenizer().encode(PROMPT)], device=device)
    n = args.new_tokens

    def ours():
        with torch.no_grad(), autocast(device, dtype):
            return torch.cat(list(model.generate_stream(idx, Sampling(n, temperature=0)))).tolist()

    def theirs():
        with torch.no_grad(), autocast(device, dtype):
            out = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, use_cache=True, pad_token_id=EOT_TOKEN)
            return out[0, idx.size(1):].tolist()

    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device_name(device)}, "
          f"{torch.get_num_threads()} threads, {dtype}; prompt {idx.size(1)} tokens, {n} new tokens, greedy, "
          f"batch 1, {args.repeats} runs each, taking turns")
    (s_ours, s_hf), (tok_ours, tok_hf) = measure.in_turns([ours, theirs], device, args.repeats)
    same = next((i for i, (a, b) in enumerate(zip(tok_ours, tok_hf)) if a != b), len(tok_ours))
    print(f"ours (GPT.generate_stream, KV cache): {measure.value_text([n / t for t in s_ours], '{:.1f}')} tokens/s")
    print(f"transformers generate (use_cache):    {measure.value_text([n / t for t in s_hf], '{:.1f}')} tokens/s")
    print(f"speed ours/transformers: {measure.ratio_text(measure.paired_ratios(s_hf, s_ours))}; greedy tokens "
          f"identical for the first {same} of {n}")
    print(measure.LEGEND)


if __name__ == "__main__":
    main()
