"""
Sample text from a GPT-2 model, streamed to the terminal token by token (KV-cache generation).

    python sample.py                                   # latest checkpoint in log/, unconditional
    python sample.py --model gpt2 --prompt "Hello, I'm a language model,"
    echo "Once upon a time" | python sample.py --model log/ckpt_019073.pt --num-samples 3

With no prompt, generation starts from <|endoftext|>, the token GPT-2 saw between documents.
The samples go to stdout (and nothing else does); where the model came from goes to stderr.
"""

import codecs
import math
import os
import sys

import torch

import checkpoint
import common
from device import autocast, choose, configure_backends, pick_device
from model import Sampling
from tokenizer import EOT_TOKEN, get_tokenizer

SEPARATOR = "\n" + "-" * 40 + "\n"  # printed between samples


def read_prompt(args, stdin=None):
    """The prompt text: --prompt, --prompt-file (- for stdin), piped stdin, or '' (unconditional).
    One trailing newline of a file or stdin is dropped: editors and echo add it."""
    stdin = stdin if stdin is not None else sys.stdin
    if args.prompt is not None:
        return args.prompt
    from_stdin = args.prompt_file == "-" or (args.prompt_file is None and stdin is not None and not stdin.isatty())
    if not from_stdin and args.prompt_file is None:
        return ""
    try:
        if from_stdin:
            text = stdin.read()
        else:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise common.UserError(f"cannot read the prompt from {'stdin' if from_stdin else args.prompt_file}: {e}")
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def encode_prompt(enc, prompt, block_size):
    """Token ids to start from: the prompt's, or <|endoftext|> alone for an empty prompt."""
    tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) if prompt else [EOT_TOKEN]
    if len(tokens) > block_size:
        raise common.UserError(f"the prompt is {len(tokens)} tokens, longer than the model's context of "
                               f"{block_size}: shorten it")
    return tokens


def print_stream(enc, tokens, out):
    """Write token ids to out as text the moment each arrives, and return them. A GPT-2 token can end inside a
    UTF-8 character (emoji, CJK): its bytes wait until the character is whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    written = []
    for t in tokens:
        written.append(t)
        out.write(decoder.decode(enc.decode_single_token_bytes(t)))
        out.flush()
    out.write(decoder.decode(b"", final=True))
    return written


def stream_sample(model, tokens, enc, out, sampling, generator=None):
    """Print the prompt (not a lone <|endoftext|>), then each new token as it is generated (sampling: a
    model.Sampling), under the caller's autocast; return the new ones."""
    idx = torch.tensor([tokens], dtype=torch.long, device=model.lm_head.weight.device)
    new = model.generate_stream(idx, sampling, generator)
    print_stream(enc, [] if tokens == [EOT_TOKEN] else tokens, out)
    return print_stream(enc, (int(t[0]) for t in new), out)


def training_samples(model, tokens, num_samples, max_new_tokens, generator, stop=None):
    """The trainer's samples, under its autocast: num_samples continuations of encode_prompt's tokens, top-k 50 at
    temperature 1, drawn with generator (on the model's device), as one-line strings; None where a stop request
    (stop: a common.StopFlag) cut them short."""
    enc = get_tokenizer()
    idx = torch.tensor([tokens] * num_samples, dtype=torch.long, device=generator.device)
    was_training = model.training
    model.eval()
    new = []
    try:
        for next_tokens in model.generate_stream(idx, Sampling(max_new_tokens, temperature=1.0, top_k=50), generator):
            new.append(next_tokens)
            if stop is not None and stop.signal is not None:
                return None
    finally:
        model.train(was_training)
    rows = torch.cat([idx] + [t[:, None] for t in new], dim=1).tolist()
    shown = 1 if tokens == [EOT_TOKEN] else 0
    return [enc.decode(row[shown:]).replace("\n", " ") for row in rows]


def parse_args(argv=None):
    p = common.ArgumentParser(description="Sample from a GPT-2 model, streaming tokens as they come.")
    p.add_argument("--model", default="log",
                   help="checkpoint written by train_gpt2.py, a log directory (its latest checkpoint), or a "
                        "Hugging Face name or directory such as gpt2 (default: log)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="text to continue (default: piped stdin, else none: from <|endoftext|>)")
    prompt.add_argument("--prompt-file", help="read the prompt from this file (- for stdin)")
    p.add_argument("--num-samples", type=int, default=1, help="samples to draw, one after another (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens generated per sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy, < 1 = more conservative (default 0.8)")
    p.add_argument("--top-k", type=int, default=200, help="sample from the k likeliest tokens; 0 = off (default 200)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much mass; 1 = off (default 1)")
    p.add_argument("--seed", type=int, default=1337, help="same seed, same samples on one device (default 1337)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--dtype", default="auto", help="autocast dtype: auto, bfloat16, float16, float32 "
                                                   "(default auto: bf16 on recent GPUs, fp32 on CPU)")
    args = p.parse_args(argv)
    t = args.temperature
    for flag, value, ok, must in (
            ("--num-samples", args.num_samples, args.num_samples >= 1, "must be at least 1"),
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "must be at least 1"),
            ("--temperature", t, math.isfinite(t) and t >= 0, "must be a number >= 0 (0 = greedy)"),
            ("--top-k", args.top_k, args.top_k >= 0, "must be >= 0 (0 = off)"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "must be in (0, 1]"),
            ("--seed", args.seed, -2 ** 63 <= args.seed < 2 ** 64, "must fit in 64 bits")):
        if not ok:
            raise common.UserError(f"{flag} {must}, got {value}")
    return args


def main(argv=None, stdin=None, stdout=None):
    args = parse_args(argv)
    out = stdout if stdout is not None else sys.stdout
    if args.model == "log" and not os.path.isdir("log"):
        raise common.UserError("no log/ directory here: train a model first (python train_gpt2.py) "
                               "or pass --model (a checkpoint, a log directory or a name such as gpt2)")
    choice = choose(pick_device(args.device), args.dtype, compile=False)
    configure_backends(choice, deterministic=False)
    device, dtype = choice.device, choice.dtype
    prompt = read_prompt(args, stdin)
    model, what = checkpoint.load_model(args.model, device)
    enc = get_tokenizer()
    tokens = encode_prompt(enc, prompt, model.config.block_size)
    print(f"sampling from {what} on {choice.name} ({dtype}), seed {args.seed}", file=sys.stderr, flush=True)
    if len(tokens) + args.max_new_tokens > model.config.block_size + 1:
        print(f"note: prompt + new tokens exceed the context of {model.config.block_size}: later tokens see only "
              "the last part of the text, and generation slows down (no key/value cache)", file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k or None, args.top_p)
    with autocast(device, dtype):
        for i in range(args.num_samples):
            if i:
                out.write(SEPARATOR)
            stream_sample(model, tokens, enc, out, sampling, generator)
    out.write("\n")
    out.flush()


if __name__ == "__main__":
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a console that can't show a character gets '?'
    common.run_script(main)
