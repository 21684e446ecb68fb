"""
How close fineweb.py gets to tiktoken's own speed.

    python bench/bench_fineweb.py --input books.parquet --workers 2   # a parquet of texts (column "text")

Books are cut into web-page-sized documents (log-normal lengths, median ~2,600 characters, mean
~4,500: roughly FineWeb-Edu's ~1,000 tokens a page) and written to a temporary parquet file.
Then, alternating, `--repeat` times:
  ceiling     tiktoken encode_ordinary_batch over the same documents, one process per worker,
              each with its share already in memory, no I/O; wall time from a common start.
  numpy ceiling  the same with encode_to_numpy per document, the call fineweb's workers make
              (it skips building a Python list of ints: faster than the ceiling).
  end-to-end  fineweb.main() on the parquet file: pool start, reading through `datasets`,
              tokenizing, writing shards (fsync, sha256) and the manifest.
The one-off conversion of the parquet file into the `datasets` Arrow cache is timed apart (it
happens once per corpus; for FineWeb it comes with the download).

    python bench/bench_fineweb.py --startup 5 --input ../shared/data/tinyshakespeare.txt

Start-up instead, with --startup N: N fresh `python` processes each run fineweb.main() on --input
(any --data-files kind; its Arrow cache built by a first, uncounted run) and stop when the first
document is about to be read. Each reports the wall time from just before the parent started it
to the end of `import fineweb`, and to that first read, and whether torch was imported by then.
"""

import argparse
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fineweb  # noqa: E402
import measure  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402


def web_pages(texts, seed=0):
    """Cut books into documents of log-normal length, at a space near the cut."""
    rng = np.random.default_rng(seed)
    docs = []
    for text in texts:
        pos = 0
        while pos < len(text):
            n = int(rng.lognormal(mean=np.log(2600), sigma=1.0)) + 200
            end = text.find(" ", pos + n)
            end = len(text) if end < 0 else end
            docs.append(text[pos:end])
            pos = end
    return docs


def _ceiling_worker(api, docs, start, done):
    enc = get_tokenizer()
    if api == "encode_ordinary_batch":
        def encode(d):
            return sum(len(t) for t in enc.encode_ordinary_batch(d, num_threads=1))
    else:  # what fineweb's workers call: no Python list of ints per document
        def encode(d):
            return sum(len(enc.encode_to_numpy(t, disallowed_special=())) for t in d)
    encode(docs[:20])  # warm up
    start.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    n = encode(docs)
    done.put((t0, time.perf_counter(), n, time.process_time() - c0))


def ceiling(docs, workers, api="encode_ordinary_batch"):
    """Tokens/s of `workers` processes running tiktoken on equal shares of the text."""
    ctx = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    sizes = np.cumsum([len(d) for d in docs])
    cuts = [0] + [int(np.searchsorted(sizes, sizes[-1] * k / workers)) for k in range(1, workers)] + [len(docs)]
    start, done = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_ceiling_worker, args=(api, docs[a:b], start, done)) for a, b in zip(cuts, cuts[1:])]
    for p in procs:
        p.start()
    results = [done.get() for _ in procs]
    for p in procs:
        p.join()
    wall = max(r[1] for r in results) - min(r[0] for r in results)
    tokens = sum(r[2] for r in results)
    return tokens, wall, sum(r[3] for r in results)


def end_to_end(data, out_dir, cache_dir, workers, shard_size):
    shutil.rmtree(out_dir, ignore_errors=True)
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    m = fineweb.main(["--data-files", data, "--out-dir", out_dir, "--cache-dir", cache_dir,
                      "--workers", str(workers), "--shard-size", str(shard_size)])
    return m["total_tokens"], time.perf_counter() - t0, cpu_seconds() - cpu0


# A child process: fineweb.main() up to the first document read (read_tasks' first step), timed
# from the parent's clock reading just before it started the process (argv[1]).
STARTUP_CHILD = """
import json, sys, time
t0 = float(sys.argv[1])
import fineweb
imported = time.time() - t0
class FirstRead(BaseException):
    pass
def first_read(*args, **kwargs):
    print(json.dumps({"import": imported, "first_read": time.time() - t0, "torch": "torch" in sys.modules}))
    raise FirstRead
    yield
fineweb.read_tasks = first_read
try:
    fineweb.main(sys.argv[2:])
except FirstRead:
    pass
"""


def startup(args):
    """Seconds from process start to `import fineweb` done and to the first document read."""
    import json
    import statistics
    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_fineweb_startup_")
    cache = os.path.join(tmp, "hf")
    rows = []
    for r in range(args.startup + 1):  # run 0 builds the Arrow cache: not counted
        out = os.path.join(tmp, f"out{r}")
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", STARTUP_CHILD, repr(t0), "--data-files", args.input,
                               "--out-dir", out, "--cache-dir", cache, "--workers", str(args.workers)],
                              cwd=ROOT, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            sys.exit(f"run {r} failed:\n{proc.stdout}{proc.stderr}")
        if r:
            rows.append(json.loads(lines[-1]))
            print(f"run {r}: import fineweb done at {rows[-1]['import']:.2f} s, first document read at "
                  f"{rows[-1]['first_read']:.2f} s, torch imported: {rows[-1]['torch']}")
    for key in ("import", "first_read"):
        values = [row[key] for row in rows]
        print(f"{key}: median {statistics.median(values):.2f} s, min {min(values):.2f} s, max {max(values):.2f} s "
              f"over {len(values)} runs")
    if args.tmp is None:
        shutil.rmtree(tmp, ignore_errors=True)


def cpu_seconds():
    """CPU time of this process and its finished children (the pool's workers, once joined)."""
    import resource
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def machine():
    model = "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        pass
    import datasets
    import tiktoken
    return (f"{model}, {fineweb.cpu_count()} cores; python {platform.python_version()}, "
            f"tiktoken {tiktoken.__version__}, "
            f"datasets {datasets.__version__}, numpy {np.__version__}; load average at start "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", default=os.path.join(ROOT, "..", "shared", "data", "gutenberg.parquet"),
                   help="parquet file with a text column (books)")
    p.add_argument("--max-mb", type=float, default=None, help="use only this many MB of text")
    p.add_argument("--workers", type=int, default=fineweb.cpu_count())
    p.add_argument("--repeat", type=int, default=2, help="ceiling / end-to-end pairs, alternated")
    p.add_argument("--tmp", default=None, help="scratch directory (default: a new temporary one)")
    p.add_argument("--startup", type=int, default=None, metavar="N",
                   help="measure start-up instead, over N runs, on --input as --data-files")
    args = p.parse_args()
    if args.startup is not None:
        print(machine())
        return startup(args)

    import pyarrow as pa
    import pyarrow.parquet as pq
    print(machine())
    texts = pq.read_table(args.input, columns=["text"]).column("text").to_pylist()
    if args.max_mb is not None:
        keep, total = [], 0
        for t in texts:
            if total >= args.max_mb * 1e6:
                break
            keep.append(t)
            total += len(t)
        texts = keep
    docs = web_pages(texts)
    del texts
    n_chars = sum(map(len, docs))
    print(f"corpus: {len(docs):,} documents, {n_chars / 1e6:.0f}M characters, "
          f"median {int(np.median([len(d) for d in docs])):,} / mean {n_chars // len(docs):,} characters")

    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_fineweb_")
    os.makedirs(tmp, exist_ok=True)
    data = os.path.join(tmp, "pages.parquet")
    pq.write_table(pa.table({"text": docs}), data)
    cache, out = os.path.join(tmp, "hf"), os.path.join(tmp, "out")
    import datasets
    t0 = time.perf_counter()
    datasets.load_dataset("parquet", data_files=[os.path.abspath(data)], split="train", cache_dir=cache)
    print(f"one-off Arrow cache conversion by datasets: {time.perf_counter() - t0:.1f} s")

    shard_size = min(10**7, n_chars // 4 // 8)  # several shards, whatever the slice
    get_tokenizer()  # built once here (seconds, in tokenizer.py), as a long run builds it once
    rows = []
    for r in range(args.repeat):
        tok_c, wall_c, cpu_c = ceiling(docs, args.workers)
        tok_n, wall_n, cpu_n = ceiling(docs, args.workers, api="encode_to_numpy")
        tok_e, wall_e, cpu_e = end_to_end(data, out, cache, args.workers, shard_size)
        assert tok_e == tok_c + len(docs) == tok_n + len(docs)  # one <|endoftext|> per document
        rows.append((tok_c / wall_c, tok_n / wall_n, tok_e / wall_e, cpu_c / tok_c, cpu_n / tok_n, cpu_e / tok_e))
        print(f"run {r + 1}: " + "; ".join(
            f"{what} {tok / wall / 1e6:.2f}M tok/s ({wall:.1f} s, {cpu / tok * 1e6:.3f} CPU-s/Mtok)"
            for what, tok, wall, cpu in (("ceiling", tok_c, wall_c, cpu_c), ("numpy ceiling", tok_n, wall_n, cpu_n),
                                         ("end-to-end", tok_e, wall_e, cpu_e)))
              + f"; end-to-end/ceiling {tok_e / wall_e / (tok_c / wall_c):.1%}")
    if not rows:
        return
    print("end-to-end/ceiling, pair by pair: "
          + measure.ratio_text(measure.paired_ratios([r[2] for r in rows], [r[0] for r in rows]))
          + "; end-to-end/numpy ceiling: "
          + measure.ratio_text(measure.paired_ratios([r[2] for r in rows], [r[1] for r in rows])))
    best = [max(r[i] for r in rows) for i in range(3)]
    cpu = [min(r[i] for r in rows) for i in range(3, 6)]
    print(f"best of {args.repeat}: ceiling {best[0] / 1e6:.2f}M tok/s, numpy ceiling {best[1] / 1e6:.2f}M tok/s, "
          f"end-to-end {best[2] / 1e6:.2f}M tok/s: end-to-end/ceiling {best[2] / best[0]:.1%} (goal >= 90%), "
          f"end-to-end/numpy ceiling {best[2] / best[1]:.1%}")
    print(f"least CPU per token (contention-proof): ceiling {cpu[0] * 1e6:.3f}, numpy ceiling {cpu[1] * 1e6:.3f}, "
          f"end-to-end {cpu[2] * 1e6:.3f} CPU-s/Mtok: ceiling/end-to-end {cpu[0] / cpu[2]:.1%}, "
          f"numpy ceiling/end-to-end {cpu[1] / cpu[2]:.1%}")
    if args.tmp is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
