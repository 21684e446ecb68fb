"""Data preparation: text in, uint16 GPT-2 token shards out (dataloader.py reads them back for training).

    python fineweb.py                       # FineWeb-Edu sample-10BT -> edu_fineweb10B/ (~10B tokens)
    python fineweb.py --data-files 'corpus/*.jsonl' --out-dir data/corpus   # works offline
    python fineweb.py --out-dir data/corpus --verify

Every document is preceded by <|endoftext|>. The stream's first --val-tokens are the validation shard (a tenth of
a corpus under ten times that), the rest train shards of --shard-size (format: shard_format.py). Shards and then the
manifest are written atomically, so a re-run after a kill goes on from the last whole shard to the bytes of an
uninterrupted run. Bad input leaves nothing behind: the output directory is made once the source has been read.
Worker processes tokenize batches of documents, taken back in order, while a thread writes finished shards."""

import contextlib
import multiprocessing
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common import ArgumentParser, UserError, atomic_write, check_output_dir, left_by_kills, out_of_space, run_script
from fineweb_source import check_utf8, describe, describe_source, load_source, read_tasks, text_bytes
from provenance import versions
from shard_format import (FORMAT, MANIFEST, SHARD_RE, TOKEN_DTYPE, TOKENIZER, intact, read_manifest, sha256_file,
                          shard_name, verify, write_manifest)
from tokenizer import EOT_TOKEN, VOCAB_SIZE, get_tokenizer

DEFAULT_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_NAME = "sample-10BT"
DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "edu_fineweb10B")
DEFAULT_PREFIX = "edufineweb"  # build-nanogpt's shard names, so its scripts find ours
TASKS_PER_WORKER = 4  # in flight per worker (fineweb_source.TASK_BYTES each): hides a slow read, bounded memory
VAL_SHARE = 10  # a corpus under VAL_SHARE * val_tokens gives 1/VAL_SHARE of its tokens to validation
# the least --max-tokens gives each split a batch of one 64-token context (plus the last target), val a tenth
SMALLEST_BATCH_TOKENS = 64 * 1 + 1
MIN_MAX_TOKENS = VAL_SHARE * SMALLEST_BATCH_TOKENS
MIN_SHARD_SIZE = 1024  # a train shard holds one row of GPT-2's context at least: less only makes files


def memory_bytes():
    """This machine's memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_args(argv=None):
    p = ArgumentParser(description="Tokenize a text corpus into uint16 GPT-2 token shards.")
    a = p.add_argument_group("source (a Hugging Face dataset, or local files)").add_argument
    a("--dataset", default=DEFAULT_DATASET, help="Hugging Face dataset name or local directory (default: %(default)s)")
    a("--name", help=f"dataset config (default: {DEFAULT_NAME} for {DEFAULT_DATASET}, none otherwise)")
    a("--split", default="train", help="dataset split to read, also with --data-files (default: train)")
    a("--text-column", default="text", help="column holding the documents (default: text)")
    a("--data-files", nargs="+", metavar="GLOB", help="local parquet / json / jsonl / txt files (globs, read in "
                                                      "sorted order) instead of --dataset; works offline")
    a("--sample-by", default="document", choices=("document", "paragraph", "line"),
      help="for .txt files: what one document is (default: document)")
    a("--encoding-errors", default="strict", choices=("strict", "replace"),
      help="for .txt / .json / .jsonl files, bytes that are not UTF-8: strict (the default) stops before any "
           "work, naming the file and byte offset; replace reads them as U+FFFD")
    a("--streaming", action="store_true", help="read the dataset as it downloads instead of caching it first "
                                               "(less disk; a resume re-reads the skipped documents)")
    a("--cache-dir", help="datasets cache (default: HF_DATASETS_CACHE)")
    a = p.add_argument_group("output").add_argument
    a("--out-dir", help="where shards go (required, except for the default dataset: edu_fineweb10B/ beside fineweb.py)")
    a("--prefix", help=f"shard name prefix (default: {DEFAULT_PREFIX} for the default dataset, data otherwise)")
    a("--shard-size", type=int, default=10**8, help="tokens per train shard (default: %(default)s)")
    a("--val-tokens", type=int, default=10**7,
      help=f"tokens of the validation split, the stream's first ones (default: %(default)s); a corpus with fewer "
           f"than {VAL_SHARE}x this many gives a tenth of its tokens instead")
    a("--max-tokens", type=int, help=f"stop after this many tokens, validation included (quick experiments); at "
                                     f"least {MIN_MAX_TOKENS}, so that each split holds a batch of a 64-token context")
    a("--workers", type=int, default=cpu_count(), help="tokenizer processes, at most the CPU cores this process "
                                                       "may use (default: all of them; 1: no subprocesses)")
    a("--start-method", choices=("fork", "spawn", "forkserver"),
      help="multiprocessing start method (default: the platform's)")
    a("--verify", action="store_true", help="check the shards in --out-dir against the manifest's checksums, then exit")
    args = p.parse_args(argv)

    default_source = args.dataset == DEFAULT_DATASET and not args.data_files
    if args.data_files and args.dataset != DEFAULT_DATASET:
        raise UserError("--dataset and --data-files are alternatives: pass one of them")
    if args.name is None and default_source:
        args.name = DEFAULT_NAME
    if args.out_dir is None:
        if not default_source:
            raise UserError("--out-dir is required with --dataset/--data-files "
                            "(the default edu_fineweb10B/ is kept for FineWeb-Edu)")
        args.out_dir = DEFAULT_OUT_DIR
    if args.prefix is None:
        args.prefix = DEFAULT_PREFIX if default_source else "data"
    if not re.fullmatch(r"[A-Za-z0-9.\-]+", args.prefix):
        raise UserError(f"--prefix {args.prefix!r}: use letters, digits, '.' and '-' only")
    for flag in ("shard_size", "val_tokens", "workers"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    if args.shard_size < MIN_SHARD_SIZE:
        raise UserError(f"--shard-size {args.shard_size} would write a file every {args.shard_size} tokens: give at "
                        f"least {MIN_SHARD_SIZE} (one row of GPT-2's context; the default, {10 ** 8:,}, is 200 MB)")
    memory, itemsize = memory_bytes(), np.dtype(TOKEN_DTYPE).itemsize
    for flag in ("shard_size", "val_tokens"):  # each split's shard is built in memory before it is written
        if memory is not None and getattr(args, flag) * itemsize > memory:
            default, most = p.get_default(flag), memory // itemsize
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: a shard is held in memory while it "
                            f"is written, and this machine has {memory / 2 ** 30:.1f} GiB: give at most {most:,} "
                            f"tokens (the default, {default:,}, is {default * itemsize // 10 ** 6} MB)")
    cores = cpu_count()
    if args.workers > cores:  # more processes than cores only add switching and memory
        print(f"--workers {args.workers} is more than the {cores} CPU cores this process may use: using {cores}")
        args.workers = cores
    if args.max_tokens is not None and args.max_tokens < MIN_MAX_TOKENS:
        raise UserError(f"--max-tokens {args.max_tokens} is too few: each split needs one training batch, "
                        f"{SMALLEST_BATCH_TOKENS} tokens at the smallest (a 64-token context, batch 1, plus 1), and "
                        f"validation gets a tenth of a stream this short, so pass at least {MIN_MAX_TOKENS}")
    args.command = "python fineweb.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    return args


_worker_encoding = None


def _init_worker(encoding):
    # the parent's tokenizer, pickled: building it from the BPE files again costs seconds per spawned worker
    global _worker_encoding
    _worker_encoding = encoding
    _stop_with_parent()


def _stop_with_parent():
    """A worker whose fineweb.py died (kill -9) stops with one line, rather than a BrokenPipeError traceback when it
    hands back its next result: a thread of its own watches for it to be reparented (a signal such as Linux's
    PR_SET_PDEATHSIG can come just as Python enters a blocking wait, its handler then never run). A worker blocked
    handing a result to a full pipe hears first of that (SIGPIPE: a dying process's files close before it is gone)."""
    parent, once = os.getppid(), threading.Lock()

    def stop():
        once.acquire()  # the first of the two threads to see it says it; the other waits for the exit
        try:
            print(f"\nfineweb.py: worker {os.getpid()} stopped: its main process is gone (killed?); the same "
                  "command goes on from the last shard written", file=sys.stderr, flush=True)
        except OSError:  # stderr gone with it (a pipe to a killed tee): stop all the same
            pass
        finally:
            os._exit(1)

    def watch(seconds=float("inf"), every=0.1):
        deadline = time.monotonic() + seconds
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(every)
        if os.getppid() != parent:  # reparented: the main process is gone (else a pipe of another's: Python's error)
            stop()

    threading.Thread(target=watch, name="fineweb: watch the main process", daemon=True).start()
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, lambda signum, frame: watch(5, 0.01))


def encode_documents(task):
    """[EOT] + tokens of each text, concatenated, and each one's length (0 for a null text: no document, no EOT)."""
    texts, nbytes = task
    enc = _worker_encoding or get_tokenizer()
    # no special tokens allowed: a literal "<|endoftext|>" in the text is ordinary text, as in encode_ordinary
    docs = [None if t is None else enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
    lens = np.array([0 if d is None else len(d) + 1 for d in docs], dtype=np.int64)
    out = np.full(int(lens.sum()), EOT_TOKEN, dtype=TOKEN_DTYPE)
    for d, end in zip(docs, np.cumsum(lens)):
        if d is not None:
            out[end - len(d):end] = d
    return out, lens, nbytes


def ordered_map(fn, tasks, pool, depth):
    """fn over tasks in order, at most `depth` in flight (Pool.imap would read the whole input ahead)."""
    if pool is None:
        yield from map(fn, tasks)
        return
    pending = deque()
    for t in tasks:
        pending.append(pool.apply_async(fn, (t,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class ShardWriter:
    """Cuts the token stream into the val shard, then train shards of shard_size, which a thread writes. Until the
    val size is known the stream is held: up to VAL_SHARE * val_tokens tokens (200 MB by default), or to its end."""

    def __init__(self, out_dir, manifest, log):
        self.out_dir, self.manifest, self.log = out_dir, manifest, log
        self.size, self.val_tokens = manifest["shard_size"], manifest["val_tokens"]
        self.index = len(manifest["shards"])
        self.val = self.val_tokens if self.index else None  # a kept val shard has val_tokens (previous_run)
        self.held, self.held_tokens = [], 0  # (tokens, end_at) while self.val is None
        self.buf, self.fill = None, 0
        self.thread = ThreadPoolExecutor(1)
        self.pending = self.thread.submit(lambda: None)  # the last shard's write, awaited before the next one

    def add(self, tokens, end_at):
        """Append tokens; end_at(n) -> [document, offset] just after the first n of them."""
        if self.val is None:
            self.held.append((tokens, end_at))
            self.held_tokens += len(tokens)
            if self.held_tokens >= VAL_SHARE * self.val_tokens:
                self.release(self.val_tokens)
            return
        pos = 0
        while pos < len(tokens):
            if self.buf is None:
                self.buf = np.empty(self.val if self.index == 0 else self.size, dtype=TOKEN_DTYPE)
            take = min(len(self.buf) - self.fill, len(tokens) - pos)
            self.buf[self.fill:self.fill + take] = tokens[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == len(self.buf):
                self.flush(end_at(pos))

    def release(self, val):
        self.val = val
        held, self.held = self.held, []
        for tokens, end_at in held:
            self.add(tokens, end_at)

    def finish(self, end):
        if self.val is None:
            self.release(min(self.val_tokens, max(1, self.held_tokens // VAL_SHARE)))
        self.flush(end)

    def flush(self, end):
        if self.fill == 0:
            return
        self.pending.result()  # re-raises the writer's error here
        buf, n, index = self.buf, self.fill, self.index
        self.pending = self.thread.submit(self._write, buf, n, index, end)
        self.buf, self.fill, self.index = None, 0, index + 1  # the thread owns the old buffer now

    def _write(self, buf, n, index, end):
        name = shard_name(self.manifest["prefix"], index)
        path = os.path.join(self.out_dir, name)
        try:
            atomic_write(path, lambda f: np.save(f, buf[:n]))
            entry = {"name": name, "split": "val" if index == 0 else "train", "tokens": int(n),
                     "max_token": int(buf[:n].max()), "sha256": sha256_file(path), "end": [int(e) for e in end]}
            self.manifest["shards"].append(entry)
            write_manifest(self.out_dir, self.manifest)
        except OSError as e:  # atomic_write has removed its partial file: the earlier shards stand
            full = out_of_space(e, self.out_dir, buf[:n].nbytes)
            what = (f"no space left on the disk holding {self.out_dir}" if full
                    else f"cannot write {path} ({e.strerror or e})")
            raise UserError(f"{what}, at {name}; the {index} shard(s) before it are intact: "
                            f"{'free some space' if full else 'fix that'} and re-run {self.manifest['command']} "
                            "to go on from there")
        self.log(f"wrote {name} ({n:,} tokens)")

    def close(self):
        self.thread.shutdown()
        self.pending.result()


def previous_run(out_dir, settings, max_tokens):
    """The manifest of our shards of the same source and settings in out_dir (None if new or empty; not made here),
    and those to keep: a val shard of --val-tokens and the leading full train shards (others end where that run did)."""
    check_output_dir(out_dir, "--out-dir")
    manifest = read_manifest(out_dir)
    if manifest is None:
        if os.path.isdir(out_dir) and [f for f in os.listdir(out_dir) if not f.startswith(".")]:
            raise UserError(f"--out-dir {out_dir} is not empty and holds no {MANIFEST} from fineweb.py; "
                            "choose an empty or new directory")
        return None, []
    for key, want in settings.items():
        if manifest.get(key) != want:
            raise UserError(f"{out_dir} holds shards made with another {key} ({manifest.get(key)!r}, "
                            f"now {want!r}): use another --out-dir, or delete {out_dir} to start again")
    keep = []
    for s in manifest["shards"]:
        full = manifest["val_tokens"] if s["split"] == "val" else manifest["shard_size"]
        if s["tokens"] != full or not intact(out_dir, s):
            break
        keep.append(s)
    if max_tokens is not None and sum(s["tokens"] for s in keep) > max_tokens:
        held = sum(s["tokens"] for s in manifest["shards"])  # a partial last shard too: what the last run said it did
        raise UserError(f"{out_dir} already holds {held:,} tokens, more than --max-tokens {max_tokens:,}: "
                        "use another --out-dir")
    return manifest, keep


def remove_stale(out_dir, prefix, keep):
    """Delete shards past the kept ones and temporary files left by a kill."""
    kept = {s["name"] for s in keep}
    temporaries = {os.path.basename(path) for path in left_by_kills(out_dir)}
    for f in os.listdir(out_dir):
        m = SHARD_RE.match(f)
        stale_shard = m and m.group("prefix") == prefix and f not in kept
        if stale_shard or f in temporaries:
            os.remove(os.path.join(out_dir, f))


def discard(out_dir, prefix, created):
    """Undo a run that leaves nothing worth keeping (its shards, the manifest, the directory if it made it)."""
    remove_stale(out_dir, prefix, [])
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, MANIFEST))
    if created:
        with contextlib.suppress(OSError):  # not empty after all: leave it, and the error that brought us here
            os.rmdir(out_dir)


def position_after(n, first_doc, ends, skip):
    """[document, its tokens in shards] just after the first n tokens of a task whose documents start at first_doc
    and end at `ends` (cumulative), the first without its first `skip` tokens (in the previous run's last shard)."""
    i = int(np.searchsorted(ends, n, side="right"))
    if i == len(ends):
        return [first_doc + i, 0]
    return [first_doc + i, n - (int(ends[i - 1]) if i else 0) + (skip if i == 0 else 0)]


def tokenize_into_shards(args, ds, pool, manifest):
    """From the manifest's last shard to the end of the source or --max-tokens: (tokens, null texts, tokens/s)."""
    from tqdm import tqdm
    doc, skip = manifest["shards"][-1]["end"] if manifest["shards"] else (0, 0)
    done = before = sum(s["tokens"] for s in manifest["shards"])
    left = text_bytes(ds.data.column(args.text_column).slice(doc)) if hasattr(ds, "data") else None
    end, nulls, read, t0 = [doc, skip], 0, 0, time.perf_counter()
    # the bar closes on an error too, so that the error starts a line of its own
    with tqdm(initial=done, total=args.max_tokens, unit="tok", unit_scale=True, dynamic_ncols=True, smoothing=0.05,
              desc="tokenizing") as bar:
        def say(text):  # above the bar, at once: stdout may share a pipe with the bar's stderr (2>&1 | tee log)
            with tqdm.external_write_mode(file=sys.stdout):
                print(text, flush=True)

        writer = ShardWriter(args.out_dir, manifest, say)
        try:
            tasks = read_tasks(ds, doc, manifest["source"])
            for tokens, lens, nbytes in ordered_map(encode_documents, tasks, pool, TASKS_PER_WORKER * args.workers):
                if skip:  # the document where the last kept shard ended: drop what that shard has
                    tokens, lens = tokens[skip:], lens.copy()
                    lens[0] -= skip
                if args.max_tokens is not None:
                    tokens = tokens[:args.max_tokens - done]
                ends = np.cumsum(lens)
                writer.add(tokens, lambda n, doc=doc, ends=ends, skip=skip: position_after(n, doc, ends, skip))
                end = position_after(len(tokens), doc, ends, skip)
                nulls += int(np.count_nonzero(lens[:end[0] - doc] == 0))  # null texts (encode_documents)
                done += len(tokens)
                doc += len(lens)
                skip = 0
                read += nbytes
                bar.update(len(tokens))
                if left is not None:
                    estimate = done + int((left - read) * (done - before) / max(read, 1))
                    bar.total = estimate if args.max_tokens is None else min(estimate, args.max_tokens)
                if args.max_tokens is not None and done >= args.max_tokens:
                    break
            writer.finish(end)
        finally:
            writer.close()  # on an error too: let a shard being written finish, with its manifest entry
    return done, nulls, (done - before) / max(time.perf_counter() - t0, 1e-9)


def prepare(args):
    out_dir = args.out_dir
    source = describe_source(args)
    settings = {"source": source, "tokenizer": TOKENIZER, "vocab_size": VOCAB_SIZE, "eot_token": EOT_TOKEN,
                "dtype": np.dtype(TOKEN_DTYPE).name, "shard_size": args.shard_size, "val_tokens": args.val_tokens,
                "prefix": args.prefix}
    previous, keep = previous_run(out_dir, settings, args.max_tokens)
    if (previous is not None and previous.get("complete") and previous.get("max_tokens") == args.max_tokens
            and all(intact(out_dir, s) for s in previous["shards"])):
        print(f"{out_dir} is complete ({previous['total_tokens']:,} tokens in {len(previous['shards'])} shards); "
              "nothing to do")
        return previous
    if source.get("encoding_errors") == "strict":
        check_utf8(source["data_files"])

    pool = manifest = None
    created = not os.path.isdir(out_dir)
    if args.workers > 1:
        # before `datasets` and the writer thread exist: forking a threaded process is unsafe. With --workers 1
        # the tokenizer is built on first use, so a bad source fails without that cost.
        pool = multiprocessing.get_context(args.start_method).Pool(args.workers, _init_worker, (get_tokenizer(),))
    try:
        print(f"loading {describe(source)}, column {args.text_column!r}")
        ds = load_source(args, source)
        n_docs = None if args.streaming else len(ds)
        known = previous.get("num_documents") if previous else None
        if None not in (n_docs, known) and n_docs != known:
            raise UserError(f"the source now has {n_docs:,} documents, the shards in {out_dir} were made "
                            f"from {known:,}: use another --out-dir")
        os.makedirs(out_dir, exist_ok=True)
        remove_stale(out_dir, args.prefix, keep)
        manifest = dict(format=FORMAT, **settings, max_tokens=args.max_tokens, command=args.command,
                        out_dir=os.path.abspath(out_dir), versions=versions("datasets"),
                        num_documents=n_docs or known, shards=keep, complete=False)
        write_manifest(out_dir, manifest)  # from here on the directory is ours, even if killed at once
        if keep:
            print(f"resuming {out_dir} after {len(keep)} shards ({sum(s['tokens'] for s in keep):,} tokens), "
                  f"at document {keep[-1]['end'][0]:,}")
        done, nulls, rate = tokenize_into_shards(args, ds, pool, manifest)
        n_train = sum(s["tokens"] for s in manifest["shards"] if s["split"] == "train")
        if n_train == 0:  # known only now for a streamed source
            discard(out_dir, args.prefix, created)
            raise UserError(f"the source makes {done:,} token(s), too few for a validation and a train split: "
                            "add text")
    except BaseException:
        if manifest is not None and not manifest["shards"]:
            discard(out_dir, args.prefix, created)  # failed before its first shard: nothing to resume
        raise
    finally:
        if pool is not None:
            pool.terminate()

    shards = manifest["shards"]
    last_doc, offset = shards[-1]["end"]
    manifest.update(complete=True, total_tokens=done, documents=last_doc + (offset > 0),
                    split_tokens={"val": shards[0]["tokens"], "train": n_train})
    write_manifest(out_dir, manifest)
    if nulls:
        print(f"skipped {nulls:,} document(s) with no text (null in column {args.text_column!r})")
    for split, n in manifest["split_tokens"].items():
        if n < SMALLEST_BATCH_TOKENS:
            print(f"warning: the {split} split holds {n:,} token(s); the trainer needs a sequence of --block-size + 1 "
                  f"in each ({SMALLEST_BATCH_TOKENS} for a 64-token context): add text")
    print(f"done: {done:,} tokens in {len(shards)} shards in {out_dir} ({rate / 1e6:.2f}M tokens/s this run); "
          f"train with: python train_gpt2.py --data-dir {shlex.quote(out_dir)}")
    return manifest


def main(argv=None):
    args = parse_args(argv)
    return verify(args.out_dir) if args.verify else prepare(args)


if __name__ == "__main__":
    run_script(main)
