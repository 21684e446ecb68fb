"""fineweb.py: tokens equal tiktoken's, shard layout and manifest, resume after a kill gives the
same bytes, and one-line errors for bad input. Every test makes its own small corpus."""

import errno
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # conftest.py puts it on sys.path

import common  # noqa: E402
import dataloader  # noqa: E402
import fineweb  # noqa: E402
import fineweb_source  # noqa: E402
from common import UserError, run_main  # noqa: E402
from tokenizer import EOT_TOKEN, get_tokenizer  # noqa: E402

# Real text (public domain) and the cases a tokenizer gets wrong: unicode, long whitespace runs,
# a literal "<|endoftext|>" (ordinary text, not the special token), an empty document.
DOCS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.\n\nHowever little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters.",
    "Call me Ishmael. Some years ago—never mind how long precisely—having little or no money in my "
    "purse, and nothing particular to interest me on shore, I thought I would sail about a little "
    "and see the watery part of the world.",
    "Fourscore and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal.\n",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🎉🚀 and a "
    "zero-width\u200bjoiner; tabs\tand   runs of    spaces\n\n\n  indented line",
    "A literal <|endoftext|> inside a document is ordinary text.",
    "",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code, too\n",
]


def expected_stream(docs):
    enc = get_tokenizer()
    out = []
    for d in docs:
        out.append(EOT_TOKEN)
        out.extend(enc.encode_ordinary(d))
    return np.array(out, dtype=np.uint16)


def big_docs(n_docs, seed=0):
    """Many web-page-sized documents made by shuffling the words of DOCS."""
    words = " ".join(DOCS).split(" ")
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(20, 600))) for _ in range(n_docs)]


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": len(d), "text": d}) + "\n")
    return str(path)


def write_parquet(path, docs, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({column: pa.array(docs, pa.string())}), str(path))
    return str(path)


def prepare(tmp_path, out, *args):
    return fineweb.main(["--out-dir", str(out), "--cache-dir", str(tmp_path / "hf"), "--workers", "1", *args])


def stream_of(out_dir):
    manifest = json.load(open(os.path.join(out_dir, "manifest.json")))
    return np.concatenate([np.load(os.path.join(out_dir, s["name"])) for s in manifest["shards"]])


def shard_bytes(out_dir):
    return {f: open(os.path.join(out_dir, f), "rb").read() for f in sorted(os.listdir(out_dir)) if f.endswith(".npy")}


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "txt"])
def test_tokens_equal_tiktoken(tmp_path, kind):
    docs = DOCS * 15  # four train shards of at least fineweb.MIN_SHARD_SIZE tokens
    if kind == "parquet":  # two files: read in sorted order
        files = [write_parquet(tmp_path / "b.parquet", docs[10:]), write_parquet(tmp_path / "a.parquet", docs[:10])]
        docs = docs[:10] + docs[10:]
        pattern = str(tmp_path / "*.parquet")
    elif kind == "jsonl":
        files = [write_jsonl(tmp_path / "c.jsonl", docs)]
        pattern = files[0]
    else:  # one document per file (--sample-by document)
        os.makedirs(tmp_path / "txt")
        for i, d in enumerate(docs):
            with open(tmp_path / "txt" / f"{i:03d}.txt", "w", encoding="utf-8") as f:
                f.write(d)
        pattern = str(tmp_path / "txt" / "*.txt")
    want = expected_stream(docs)
    prepare(tmp_path, tmp_path / "out", "--data-files", pattern, "--shard-size", str(len(want) // 4))
    got = stream_of(tmp_path / "out")
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)


def test_shards_and_manifest(tmp_path):
    docs = big_docs(300)
    want = expected_stream(docs)
    size, val = len(want) // 5 + 1, 1000  # 10 x 1000 < len(want): the val split is --val-tokens
    data = write_parquet(tmp_path / "d.parquet", docs)
    prepare(tmp_path, tmp_path / "out", "--data-files", data, "--shard-size", str(size), "--prefix", "mine",
            "--val-tokens", str(val))
    out = tmp_path / "out"
    m = json.load(open(out / "manifest.json"))
    names = [s["name"] for s in m["shards"]]
    assert names == ["mine_val_000000.npy"] + [f"mine_train_{i:06d}.npy" for i in range(1, len(names))]
    assert sorted(os.listdir(out)) == sorted(names + ["manifest.json"])
    assert [s["split"] for s in m["shards"]] == ["val"] + ["train"] * (len(names) - 1)
    assert m["shards"][0]["tokens"] == val and all(s["tokens"] == size for s in m["shards"][1:-1])
    assert 0 < m["shards"][-1]["tokens"] <= size and len(names) == 1 + -(-(len(want) - val) // size)
    assert m["complete"] and m["total_tokens"] == len(want) == sum(s["tokens"] for s in m["shards"])
    assert m["split_tokens"] == {"val": val, "train": len(want) - val}
    assert m["out_dir"] == str(out) and m["val_tokens"] == val
    assert m["num_documents"] == m["documents"] == len(docs)
    assert (m["tokenizer"], m["vocab_size"], m["eot_token"], m["dtype"]) == ("gpt2", 50257, 50256, "uint16")
    assert m["source"]["data_files"] == [data] and m["source"]["text_column"] == "text"
    import datasets, tiktoken  # noqa: E401
    assert (m["versions"]["tiktoken"], m["versions"]["datasets"]) == (tiktoken.__version__, datasets.__version__)
    for s in m["shards"]:
        arr = np.load(out / s["name"])
        assert arr.dtype == np.uint16 and len(arr) == s["tokens"] and arr.max() == s["max_token"]
        assert fineweb.sha256_file(out / s["name"]) == s["sha256"]
    assert np.load(out / names[0])[0] == EOT_TOKEN  # every document starts with <|endoftext|>
    np.testing.assert_array_equal(stream_of(out), want)
    fineweb.main(["--out-dir", str(out), "--verify"])
    with open(out / names[1], "r+b") as f:  # flip one token
        f.seek(-2, 2)
        f.write(b"\x01\x02")
    with pytest.raises(UserError, match="checksum: it changed after fineweb.py wrote it. Delete it, then re-run "
                                         "the command that made it"):
        fineweb.main(["--out-dir", str(out), "--verify"])
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)  # a copy says where to copy it from again, as a sentence
    with pytest.raises(UserError, match=f"checksum: .* Delete it, then copy the shards again from {out} "):
        fineweb.main(["--out-dir", str(copy), "--verify"])


@pytest.mark.parametrize("val_tokens", [1500, 10 ** 6])
def test_a_corpus_of_many_read_tasks_is_one_stream_whose_first_tokens_are_validation(tmp_path, monkeypatch,
                                                                                       val_tokens):
    """The source is read in tasks of about TASK_BYTES of text: over many of them the shards hold
    every document in order, and the val shard is the stream's first --val-tokens (or its first
    tenth, for a corpus under ten times that), whichever tasks they came from."""
    monkeypatch.setattr(fineweb_source, "TASK_BYTES", 64)
    docs = big_docs(60, seed=5)
    want = expected_stream(docs)
    val = min(val_tokens, len(want) // 10)
    assert len(want) >= 10 * 1500 and min(len(d.encode()) for d in docs) > 64  # a task per document
    assert len(expected_stream(docs[:2])) < val  # and the val shard spans several
    prepare(tmp_path, tmp_path / "out", "--data-files", write_jsonl(tmp_path / "d.jsonl", docs),
            "--shard-size", "5000", "--val-tokens", str(val_tokens))
    first = json.load(open(tmp_path / "out" / "manifest.json"))["shards"][0]
    assert first["split"] == "val" and first["tokens"] == val
    np.testing.assert_array_equal(np.load(tmp_path / "out" / first["name"]), want[:val])
    np.testing.assert_array_equal(stream_of(tmp_path / "out"), want)


def test_prepares_without_importing_torch(tmp_path):
    """fineweb.py writes shards without importing torch (most of its start-up, and no part of
    tokenizing), and its manifest still records torch's version and CUDA, as torch gives them.
    The command printed at the end names --out-dir as the shell must be given it (a space here)."""
    data = write_jsonl(tmp_path / "d.jsonl", DOCS * 3)
    out = tmp_path / "my data"
    code = ("import sys, fineweb; fineweb.main(sys.argv[1:]); "
            "print(sorted(m for m in ('torch', 'model', 'device', 'dataloader') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, "--data-files", data, "--out-dir", str(out),
                        "--cache-dir", str(tmp_path / "hf"), "--workers", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]"
    command = r.stdout.split("train with: ")[1].splitlines()[0]
    assert shlex.split(command) == ["python", "train_gpt2.py", "--data-dir", str(out)]
    import torch
    versions = json.load(open(out / "manifest.json"))["versions"]
    assert (versions["torch"], versions["cuda"]) == (torch.__version__, torch.version.cuda)


def test_a_listed_shard_left_empty_is_made_again_and_verify_names_a_run_cut_short(tmp_path, capsys):
    """A shard the manifest lists whose file is empty (what a crash before its data reached the disk leaves) is
    found damaged and made again, to the same bytes, not an EOFError. --verify on a directory whose run stopped
    part-way says it is incomplete and gives the command that finishes it, which does."""
    data = write_parquet(tmp_path / "d.parquet", big_docs(200, seed=4))
    args = ["--data-files", data, "--shard-size", "5000", "--val-tokens", "1000"]
    out = tmp_path / "out"
    prepare(tmp_path, out, *args)
    made = shard_bytes(out)
    m = json.load(open(out / "manifest.json"))
    open(out / m["shards"][2]["name"], "wb").close()
    prepare(tmp_path, out, *args)
    assert shard_bytes(out) == made
    os.remove(out / m["shards"][-1]["name"])  # the manifest as a run killed before its last shard left it
    cut = dict(m, complete=False, shards=m["shards"][:-1])
    json.dump(cut, open(out / "manifest.json", "w"))
    capsys.readouterr()
    fineweb.main(["--out-dir", str(out), "--verify"])
    assert capsys.readouterr().out == (f"{out}: {len(m['shards']) - 1} shards match their checksums; incomplete "
                                       f"(re-run the command that made it (it redoes only what is missing): "
                                       f"{m['command']})\n")
    command = shlex.split(m["command"])
    assert command[:2] == ["python", "fineweb.py"]
    fineweb.main(command[2:])
    assert shard_bytes(out) == made and json.load(open(out / "manifest.json"))["complete"]


def test_max_tokens_then_continue_and_rerun(tmp_path, capsys):
    docs = big_docs(200, seed=1)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    want = expected_stream(docs)
    size = len(want) // 6
    # the val size is settled after 10 x --val-tokens, inside the first run: the second keeps it
    args = ["--data-files", data, "--shard-size", str(size), "--val-tokens", str(size // 5)]
    prepare(tmp_path, tmp_path / "out", *args, "--max-tokens", str(2 * size + size // 2))
    np.testing.assert_array_equal(stream_of(tmp_path / "out"), want[:2 * size + size // 2])
    # fewer tokens than its whole shards hold: refused, counting every token it holds (its partial shard too)
    assert fails(capsys, tmp_path, tmp_path / "out", *args, "--max-tokens", str(2 * size)) == (
        f"error: {tmp_path / 'out'} already holds {2 * size + size // 2:,} tokens, more than --max-tokens "
        f"{2 * size:,}: use another --out-dir")
    capsys.readouterr()
    # go on to the end, streamed this time (IterableDataset.skip): the partial shard is made again
    prepare(tmp_path, tmp_path / "out", *args, "--streaming")
    assert "resuming" in capsys.readouterr().out
    np.testing.assert_array_equal(stream_of(tmp_path / "out"), want)
    prepare(tmp_path, tmp_path / "ref", *args)
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")
    capsys.readouterr()
    prepare(tmp_path, tmp_path / "out", *args)
    assert "nothing to do" in capsys.readouterr().out


def test_a_rerun_whose_max_tokens_end_on_a_shard_boundary_has_nothing_to_do(tmp_path, capsys):
    """--max-tokens that ends exactly where a train shard ends (the val split, then two whole shards): the run
    writes those shards and nothing more, and the same command again says there is nothing to do."""
    docs = big_docs(200, seed=1)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    size = len(expected_stream(docs)) // 6
    args = ["--data-files", data, "--shard-size", str(size), "--val-tokens", str(size // 5)]
    first = prepare(tmp_path, tmp_path / "out", *args)  # the val split's size, as a run of this source settles it
    val = next(s["tokens"] for s in first["shards"] if s["split"] == "val")
    bounded = [*args, "--max-tokens", str(val + 2 * size)]
    prepare(tmp_path, tmp_path / "b", *bounded)
    manifest = json.load(open(tmp_path / "b" / "manifest.json"))
    assert [s["tokens"] for s in manifest["shards"]] == [val, size, size] and manifest["complete"]
    capsys.readouterr()
    prepare(tmp_path, tmp_path / "b", *bounded)
    assert "nothing to do" in capsys.readouterr().out


def wchan(pid):
    """Where in the kernel pid waits ('' where it is gone)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/wchan is Linux's")
def test_a_worker_blocked_on_a_full_pipe_says_its_main_process_is_gone(tmp_path):
    """The main process dies while a worker waits to hand it a result: the worker hears of the closed pipe before it
    hears of its parent (the dying process's files close first), and still stops with its one line."""
    import fineweb
    log = tmp_path / "worker.err"
    alive_r, alive_w = os.pipe()  # its read end sees EOF when the worker is gone, whoever its parent is then
    main = os.fork()
    if main == 0:  # the main process: one worker, a pipe it never reads, then a kill -9
        try:
            r, w = os.pipe()
            ready_r, ready_w = os.pipe()
            worker = os.fork()
            if worker == 0:
                try:
                    os.close(r)
                    os.close(alive_r)
                    sys.stderr = open(log, "w")
                    fineweb._stop_with_parent()
                    os.write(ready_w, b"r")
                    while True:
                        os.write(w, b"a result" * 8192)
                except BrokenPipeError:
                    import traceback
                    traceback.print_exc()  # what a pool worker would show
                finally:
                    os._exit(3)
            os.close(w)
            os.close(alive_w)
            os.close(ready_w)
            if os.read(ready_r, 1):  # the worker watches its parent now (or is gone: b"")
                deadline = time.monotonic() + 60  # until the pipe is full and the worker blocked in its write
                while "pipe" not in wchan(worker) and time.monotonic() < deadline:
                    time.sleep(0.01)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.close(alive_w)
    os.waitpid(main, 0)
    assert os.read(alive_r, 1) == b""  # waits for the worker to end
    os.close(alive_r)
    line = log.read_text().strip()
    assert re.fullmatch(r"fineweb\.py: worker \d+ stopped: its main process is gone \(killed\?\); the same "
                        r"command goes on from the last shard written", line), line


def test_killed_run_resumes_to_identical_bytes(tmp_path):
    """SIGKILL a real `python fineweb.py` (2 spawn workers, as on Windows/macOS) mid-way, then
    re-run with one worker: the shards equal those of an uninterrupted run with 2 (forked) workers."""
    docs = big_docs(2500, seed=2)
    data = write_parquet(tmp_path / "d.parquet", docs)
    # --val-tokens 2000: the val size is settled after 20,000 tokens, so shards come early enough to be killed
    args = ["--data-files", data, "--shard-size", "20000", "--val-tokens", "2000", "--cache-dir", str(tmp_path / "hf")]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "fineweb.py"), *args, "--out-dir", str(out),
                             "--workers", "2", "--start-method", "spawn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=str(tmp_path),
                            start_new_session=True)
    deadline = time.time() + 600  # left as soon as 3 shards exist: generous for a busy machine
    try:
        while time.time() < deadline and proc.poll() is None:
            try:
                if len(json.load(open(out / "manifest.json"))["shards"]) >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        try:  # stderr ends when the workers have: they stop with their main process
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("the workers outlived their killed main process by 2 minutes")
    m = json.load(open(out / "manifest.json"))
    assert not m["complete"], f"the run ended before it could be killed: {err.decode()[-500:]}"
    # each worker, left without its main process, says so in one line (no BrokenPipeError traceback)
    gone = [line for line in err.decode().splitlines() if "main process is gone" in line]
    assert "Traceback" not in err.decode() and len(gone) == 2, err.decode()[-3000:]
    assert all(re.fullmatch(r"fineweb\.py: worker \d+ stopped: its main process is gone \(killed\?\); the same "
                            r"command goes on from the last shard written", line) for line in gone), gone
    (out / ".data_train_000099.npy.tmp12345").write_bytes(b"half a shard")  # a kill inside atomic_write
    prepare(tmp_path, out, "--data-files", data, "--shard-size", "20000", "--val-tokens", "2000")
    prepare(tmp_path, tmp_path / "ref", "--data-files", data, "--shard-size", "20000", "--val-tokens", "2000",
            "--workers", "2")
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "ref"))
    assert shard_bytes(out) == shard_bytes(tmp_path / "ref")
    np.testing.assert_array_equal(stream_of(out), expected_stream(docs))


def test_each_wrote_line_is_a_line_of_its_own_beside_the_bar(tmp_path):
    """`python fineweb.py ... 2>&1 | tee log`: stdout a pipe (block-buffered) shared with the bar's stderr. Each
    "wrote" line comes where the bar was cleared for it, not later in the middle of the bar's redraws."""
    data = write_parquet(tmp_path / "d.parquet", big_docs(800, seed=3))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "fineweb.py"), "--data-files", data, "--out-dir",
                        str(tmp_path / "out"), "--shard-size", "20000", "--val-tokens", "2000", "--workers", "1",
                        "--cache-dir", str(tmp_path / "hf")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       env=env, cwd=str(tmp_path), timeout=600)
    out = p.stdout.decode()  # as bytes: text mode would turn the bar's carriage returns into newlines
    shards = json.load(open(tmp_path / "out" / "manifest.json"))["shards"]
    assert p.returncode == 0 and len(shards) >= 3, out[-2000:]
    placed = re.findall(r"\r +\r(wrote \S+) \(", out)
    assert placed == [f"wrote {s['name']}" for s in shards], out[-3000:]


# ----------------------------------------------------------------------------------------------
# bad input: one UserError line that says what to do


def fails(capture, tmp_path, out, *args):
    """fineweb run as the command line runs it (common.run_main): exit status 2, and the one
    line it prints, which starts with "error: " (a traceback would fail the test instead).
    capture: capsys, or capfd to see `datasets`' log too (its handler, made at import, holds the
    stderr of that moment)."""
    capture.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(lambda: prepare(tmp_path, out, *args))
    err = capture.readouterr().err
    *before, line = err.rstrip("\n").split("\n")
    assert e.value.code == 2 and line.startswith("error: ") and "Traceback" not in err, err
    # what `datasets` shows of the work it did before the problem was found: progress bars only,
    # which name no file (its log lines, which would, can share a line with a bar)
    assert all(re.search(r"examples/s|tok/s|it/s", b) and str(tmp_path) not in b for b in before), err
    return line


def test_non_utf8_input(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes("héllo wörld\n".encode() * 1000 + b"caf\xe9\n" + b"more text\n")
    offset = len("héllo wörld\n".encode()) * 1000 + 3
    err = fails(capsys, tmp_path, tmp_path / "out", "--data-files", str(bad))
    assert f"{bad} is not UTF-8 text: byte {offset:,}" in err and "--encoding-errors replace" in err
    assert not os.path.exists(tmp_path / "out")  # failed before making it
    js = tmp_path / "bad.jsonl"  # `datasets` alone would keep these bytes, and fail later
    js.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    assert f"{js} is not UTF-8 text: byte 30" in fails(capsys, tmp_path, tmp_path / "out", "--data-files", str(js))
    for path, docs in ((bad, ["héllo wörld\n" * 1000 + "caf\ufffd\nmore text\n"]), (js, ["fine", "caf\ufffd"])):
        out = tmp_path / ("rep_" + path.suffix[1:])
        prepare(tmp_path, out, "--data-files", str(path), "--encoding-errors", "replace")
        np.testing.assert_array_equal(stream_of(out), expected_stream(docs))


def test_first_bad_utf8_across_chunk_ends(tmp_path):
    """Characters of 2, 3 and 4 bytes cut by every chunk size are not errors; a bad byte is found exactly."""
    text = "aé€😀" * 5
    (tmp_path / "ok").write_bytes(text.encode())
    (tmp_path / "bad").write_bytes(text.encode() + b"\xe2\x82" + b"x")  # a 3-byte character cut short
    for chunk in range(1, 12):
        assert fineweb_source.first_bad_utf8(str(tmp_path / "ok"), chunk) is None
        assert fineweb_source.first_bad_utf8(str(tmp_path / "bad"), chunk) == len(text.encode())


def test_command_line_errors_are_one_line(tmp_path, capsys):
    """argparse's own errors too: the flag, the valid choices, and where to look; no usage block."""
    assert fails(capsys, tmp_path, tmp_path / "out", "--sample-by", "sentence") == (
        "error: argument --sample-by: invalid choice: 'sentence' (choose from 'document', 'paragraph', 'line') "
        "(see --help)")
    assert fails(capsys, tmp_path, tmp_path / "out", "--shard-sise", "10") == (
        "error: unrecognized arguments: --shard-sise 10 (see --help)")
    assert not os.path.exists(tmp_path / "out")


def test_missing_column_and_empty_text_leave_no_out_dir(tmp_path, capsys):
    data = write_parquet(tmp_path / "d.parquet", DOCS, column="content")
    err = fails(capsys, tmp_path, tmp_path / "out", "--data-files", data)
    assert "no column 'text'" in err and "content" in err and "--text-column" in err
    text = tmp_path / "t.txt"  # streamed text files name their column only as they are read
    text.write_text("one line\n")
    err = fails(capsys, tmp_path, tmp_path / "out", "--data-files", str(text), "--streaming", "--text-column", "body")
    assert re.search(r"no column 'body'.*text.*--text-column", err), err
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in fails(capsys, tmp_path, tmp_path / "out", "--data-files", str(tmp_path / "empty.txt"))
    assert not os.path.exists(tmp_path / "out")


def test_unwritable_out_dir(tmp_path, capsys):
    """A path under a regular file cannot be made even by root (ENOTDIR); a read-only directory
    stops everyone but root, so that part is skipped as root."""
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    (tmp_path / "afile").write_text("mine")
    err = fails(capsys, tmp_path, tmp_path / "afile" / "out", "--data-files", data)
    assert f"cannot write to --out-dir {tmp_path / 'afile' / 'out'}: {tmp_path / 'afile'} is a file" in err
    assert "is a file, not a directory" in fails(capsys, tmp_path, tmp_path / "afile", "--data-files", data)
    assert (tmp_path / "afile").read_text() == "mine"
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    os.makedirs(tmp_path / "ro")
    os.chmod(tmp_path / "ro", 0o500)
    try:
        assert "cannot write to --out-dir" in fails(capsys, tmp_path, tmp_path / "ro" / "out", "--data-files", data)
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_disk_full_keeps_earlier_shards(tmp_path, capsys, monkeypatch):
    """The disk fills half-way through the fourth shard: one line saying so; the three before it,
    the manifest and nothing else stay; a re-run goes on to the bytes of an uninterrupted run.
    numpy reports a full disk as a short write with no errno ("N requested and M written"), so the
    free space is what tells; an ENOSPC says it by itself."""
    data = write_jsonl(tmp_path / "d.jsonl", big_docs(200, seed=5))
    args = ["--data-files", data, "--shard-size", "4000", "--val-tokens", "300"]
    real = fineweb.atomic_write
    for error in (OSError("8000 requested and 2304 written"), OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))):
        def full_disk(path, write_fn):
            if not str(path).endswith("_000003.npy"):
                return real(path, write_fn)

            def half_then_full(f):
                f.write(b"\x93NUMPY half a shard")
                raise error
            real(path, half_then_full)
        monkeypatch.setattr(fineweb, "atomic_write", full_disk)
        monkeypatch.setattr(common.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 9, 10 ** 9, 1000))
        out = tmp_path / f"out{error.errno}"
        err = fails(capsys, tmp_path, out, *args)
        assert f"no space left on the disk holding {out}, at data_train_000003.npy" in err
        assert "the 3 shard(s) before it are intact" in err and "re-run python fineweb.py" in err
        assert sorted(os.listdir(out)) == ["data_train_000001.npy", "data_train_000002.npy", "data_val_000000.npy",
                                           "manifest.json"]
    monkeypatch.undo()
    monkeypatch.setattr(fineweb, "atomic_write", real)
    prepare(tmp_path, tmp_path / "ref", *args)
    ref = shard_bytes(tmp_path / "ref")
    names = [s["name"] for s in json.load(open(tmp_path / "ref" / "manifest.json"))["shards"][:3]]
    assert sorted(os.listdir(out)) == sorted(names + ["manifest.json"])
    assert [s["name"] for s in json.load(open(out / "manifest.json"))["shards"]] == names
    assert shard_bytes(out) == {n: ref[n] for n in names}
    prepare(tmp_path, out, *args)
    assert shard_bytes(out) == ref


def test_missing_text_column_lists_columns(tmp_path):
    data = write_parquet(tmp_path / "d.parquet", DOCS, column="content")
    with pytest.raises(UserError, match=r"no column 'text'.*content.*--text-column"):
        prepare(tmp_path, tmp_path / "out", "--data-files", data)


def test_empty_inputs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="empty"):
        prepare(tmp_path, tmp_path / "out1", "--data-files", str(tmp_path / "empty.jsonl"))
    data = write_parquet(tmp_path / "none.parquet", [])
    with pytest.raises(UserError, match="empty|could not read"):
        prepare(tmp_path, tmp_path / "out2", "--data-files", data)


def test_bad_data_files(tmp_path):
    with pytest.raises(UserError, match="matches no file"):
        prepare(tmp_path, tmp_path / "out", "--data-files", str(tmp_path / "nothing*.parquet"))
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    write_parquet(tmp_path / "b.parquet", DOCS)
    with pytest.raises(UserError, match="mixes"):
        prepare(tmp_path, tmp_path / "out", "--data-files", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"))
    (tmp_path / "c.csv").write_text("text\nhello\n")
    with pytest.raises(UserError, match="unsupported file type"):
        prepare(tmp_path, tmp_path / "out", "--data-files", str(tmp_path / "c.csv"))
    with pytest.raises(UserError, match="--out-dir is required"):
        fineweb.main(["--data-files", str(tmp_path / "a.jsonl")])


def test_output_directory_checks(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", big_docs(50, seed=4))
    os.makedirs(tmp_path / "foreign")
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        prepare(tmp_path, tmp_path / "foreign", "--data-files", data)
    prepare(tmp_path, tmp_path / "out", "--data-files", data, "--shard-size", "2000")
    with pytest.raises(UserError, match="another shard_size"):
        prepare(tmp_path, tmp_path / "out", "--data-files", data, "--shard-size", "3000")
    other = write_jsonl(tmp_path / "other.jsonl", DOCS)
    with pytest.raises(UserError, match="another source"):
        prepare(tmp_path, tmp_path / "out", "--data-files", other, "--shard-size", "2000")


def test_corpus_smaller_than_a_shard_works_with_defaults(tmp_path, capsys):
    """A tenth of a small corpus is validation, the rest one train shard; stopping early with
    --max-tokens and going on later remakes the val shard (its size depends on where the stream
    ended) and gives the bytes of an uninterrupted run."""
    docs = DOCS * 15  # four train shards of at least fineweb.MIN_SHARD_SIZE tokens
    want = expected_stream(docs)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    prepare(tmp_path, tmp_path / "out", "--data-files", data)
    m = json.load(open(tmp_path / "out" / "manifest.json"))
    assert m["split_tokens"] == {"val": len(want) // 10, "train": len(want) - len(want) // 10}
    assert [s["name"] for s in m["shards"]] == ["data_val_000000.npy", "data_train_000001.npy"]
    np.testing.assert_array_equal(stream_of(tmp_path / "out"), want)
    prepare(tmp_path, tmp_path / "part", "--data-files", data, "--max-tokens", "700")
    assert json.load(open(tmp_path / "part" / "manifest.json"))["split_tokens"]["val"] == 70
    prepare(tmp_path, tmp_path / "part", "--data-files", data)
    assert shard_bytes(tmp_path / "part") == shard_bytes(tmp_path / "out")


def test_too_little_text_fails_before_tokenizing(tmp_path, capsys, monkeypatch):
    def no_tokenizing(texts):
        raise AssertionError("tokenized a corpus known to be too small")
    monkeypatch.setattr(fineweb, "encode_documents", no_tokenizing)
    data = write_jsonl(tmp_path / "d.jsonl", [""])  # one empty document: its <|endoftext|> only
    err = fails(capsys, tmp_path, tmp_path / "out", "--data-files", data)
    assert "at most 1 token, too few for a validation and a train split" in err
    assert not os.path.exists(tmp_path / "out")


def test_config_and_split_not_found(tmp_path):
    """A local dataset directory with a named config (no network needed)."""
    os.makedirs(tmp_path / "ds" / "data")
    write_parquet(tmp_path / "ds" / "data" / "a.parquet", DOCS)
    (tmp_path / "ds" / "README.md").write_text("---\nconfigs:\n- config_name: small\n"
                                               "  data_files: data/*.parquet\n---\n")
    common = ["--dataset", str(tmp_path / "ds"), "--shard-size", "5000"]
    with pytest.raises(UserError, match=r"'nope' not found.*small.*--name"):
        prepare(tmp_path, tmp_path / "out", *common, "--name", "nope")
    with pytest.raises(UserError, match="--split"):
        prepare(tmp_path, tmp_path / "out", *common, "--name", "small", "--split", "validation")
    with pytest.raises(UserError, match="not found.*--data-files"):
        prepare(tmp_path, tmp_path / "out", "--dataset", str(tmp_path / "no_such_dir"))


def offline_env():
    """The environment of a machine whose hub does not answer: a closed local port, no proxy."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("https_proxy", "http_proxy", "all_proxy") and not k.startswith("HF_")}
    return dict(env, HF_ENDPOINT="http://127.0.0.1:9")


@pytest.mark.parametrize("how", ["unreachable", "HF_HUB_OFFLINE"])
def test_cli_offline_fails_at_once_in_one_line(tmp_path, how):
    """The default source and any hub name, offline: one line naming --data-files, no retries. One process
    runs both as the command line does (the hub's settings are read at import), writing each exit status after."""
    env = offline_env() if how == "unreachable" else dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    code = ("import sys, common, fineweb\n"
            "for source in ([], ['--dataset', 'someone/no-such-dataset']):\n"
            "    try:\n"
            "        common.run_main(lambda: fineweb.main(source + sys.argv[1:]))\n"
            "    except SystemExit as e:\n"
            "        print(e.code, file=sys.stderr, flush=True)\n")
    # no clock here (the machine may be busy): retries would print a warning line each
    r = subprocess.run([sys.executable, "-c", code, "--out-dir", str(tmp_path / "out"), "--workers", "1",
                        "--cache-dir", str(tmp_path / "hf")], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    lines = r.stderr.splitlines()
    assert len(lines) == 4 and lines[1::2] == ["2", "2"], r.stderr  # one line each: no retry warnings
    for line in lines[::2]:
        assert line.startswith("error: ") and "--data-files" in line and "not in the datasets cache" in line, line
    assert not os.path.exists(tmp_path / "out")


def test_offline_hub_dataset_loads_from_the_cache(tmp_path, monkeypatch):
    """A hub dataset prepared in the datasets cache before loads with the hub unreachable. The cache
    entry is made here from a local parquet file, laid out as `datasets` lays out a hub download."""
    import datasets
    import shutil
    docs = DOCS * 2
    cache = tmp_path / "hf"
    datasets.load_dataset("parquet", data_files=[write_parquet(tmp_path / "d.parquet", docs)], split="train",
                          cache_dir=str(cache))
    built = next(p for p in (cache / "parquet").glob("*/*/*") if p.is_dir())
    entry = cache / "someone___tiny" / "default" / "0.0.0" / built.name
    shutil.copytree(built, entry)
    for f in entry.glob("parquet-*"):
        f.rename(entry / f.name.replace("parquet-", "tiny-", 1))
    for k, v in offline_env().items():
        monkeypatch.setenv(k, v)
    for k in [k for k in os.environ if k.lower() in ("https_proxy", "http_proxy", "all_proxy")]:
        monkeypatch.delenv(k)
    prepare(tmp_path, tmp_path / "out", "--dataset", "someone/tiny")
    np.testing.assert_array_equal(stream_of(tmp_path / "out"), expected_stream(docs))


def test_default_fineweb_download(tmp_path, hf_hub_online):
    """The default source, streamed and cut short: the real download path, a few MB."""
    out = tmp_path / "out"
    fineweb.main(["--out-dir", str(out), "--streaming", "--max-tokens", "30000", "--shard-size", "10000",
                  "--workers", "1", "--cache-dir", str(tmp_path / "hf")])
    m = json.load(open(out / "manifest.json"))
    assert m["source"]["dataset"] == fineweb.DEFAULT_DATASET and m["source"]["name"] == fineweb.DEFAULT_NAME
    assert m["complete"] and m["total_tokens"] == 30000
    assert [s["name"] for s in m["shards"]][:2] == ["edufineweb_val_000000.npy", "edufineweb_train_000001.npy"]


@pytest.mark.parametrize("streaming", [False, True])
def test_null_texts_are_skipped_and_counted(tmp_path, capsys, streaming):
    """A null in the text column is no document (no <|endoftext|> of its own), unlike an empty
    string; the run says at the end how many it skipped."""
    docs = [DOCS[0], None, DOCS[1], "", None, DOCS[2]]
    data = write_parquet(tmp_path / "d.parquet", docs)
    prepare(tmp_path, tmp_path / "out", "--data-files", data, *(["--streaming"] if streaming else []))
    np.testing.assert_array_equal(stream_of(tmp_path / "out"), expected_stream([d for d in docs if d is not None]))
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    *_, skipped, done = [line for line in lines if not line.startswith("warning: ")]  # (a split this small warns)
    assert skipped == "skipped 2 document(s) with no text (null in column 'text')" and done.startswith("done: ")


def test_max_tokens_too_few_for_a_batch_in_each_split(tmp_path, capsys):
    """--max-tokens is refused before anything is written when a split would hold less than one
    trainer batch of the smallest useful shape (T=64, B=1); the least it takes gives both splits one."""
    data = write_jsonl(tmp_path / "d.jsonl", big_docs(20, seed=6))
    least = fineweb.MIN_MAX_TOKENS
    for few in (2, least - 1):
        err = fails(capsys, tmp_path, tmp_path / "out", "--data-files", data, "--max-tokens", str(few))
        assert f"--max-tokens {few} is too few" in err and f"at least {least}" in err, err
        assert not os.path.exists(tmp_path / "out")
    capsys.readouterr()
    prepare(tmp_path, tmp_path / "out", "--data-files", data, "--max-tokens", str(least))
    for split in ("val", "train"):
        x, y = dataloader.TokenLoader(str(tmp_path / "out"), split, batch_size=1, seq_len=64).next_batch()
        assert x.shape == y.shape == (1, 64)
    assert "warning" not in capsys.readouterr().out
    # a source too short for that (one sentence: 10 tokens) is written, with a warning for each split short of it
    (tmp_path / "one.txt").write_text("The cat sat on the mat today.\n")
    prepare(tmp_path, tmp_path / "one", "--data-files", str(tmp_path / "one.txt"))
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert warnings == [f"warning: the {split} split holds {n} token(s); the trainer needs a sequence of --block-size "
                        "+ 1 in each (65 for a 64-token context): add text" for split, n in (("val", 1), ("train", 9))]


def test_workers_capped_at_the_cores(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fineweb, "cpu_count", lambda: 3)
    common_args = ["--data-files", "x.jsonl", "--out-dir", str(tmp_path / "out")]
    assert fineweb.parse_args(common_args + ["--workers", "64"]).workers == 3
    assert capsys.readouterr().out == "--workers 64 is more than the 3 CPU cores this process may use: using 3\n"
    assert fineweb.parse_args(common_args + ["--workers", "2"]).workers == 2
    assert fineweb.parse_args(common_args).workers == 3
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("how", [[], ["--streaming"]])
def test_unreadable_file_named_in_one_line(tmp_path, capfd, how):
    """An empty parquet file, one that is not parquet, a bad line in a JSON-lines file and a broken
    JSON document: one line naming the file (and the line), and nothing from `datasets` but its
    progress bars. Streamed, the files are read only while tokenizing."""
    good = write_parquet(tmp_path / "a.parquet", DOCS)
    empty = write_parquet(tmp_path / "b.parquet", [])
    for files in ([empty], [good, empty]):
        line = fails(capfd, tmp_path, tmp_path / "out", *how, "--data-files", *files)
        assert line == f"error: {empty} holds no rows (an empty parquet file): leave it out of --data-files"
    os.remove(empty)
    (tmp_path / "c.parquet").write_text("not parquet at all\n")
    line = fails(capfd, tmp_path, tmp_path / "out", *how, "--data-files", good, str(tmp_path / "c.parquet"))
    assert line.startswith(f"error: {tmp_path / 'c.parquet'} is not a parquet file (")
    lines = tmp_path / "d.jsonl"
    lines.write_text('{"text": "one"}\n{"text": "two"}\n\n{"text": three}\n{"text": "four"}\n')
    line = fails(capfd, tmp_path, tmp_path / "out", *how, "--data-files", str(lines))
    assert line == f"error: {lines}, line 4: not JSON (Expecting value): fix that line, or leave the file out"
    lines.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "thr\n')  # a copy cut short
    line = fails(capfd, tmp_path, tmp_path / "out", *how, "--data-files", str(lines))
    assert line == (f"error: {lines}, line 3: not complete JSON: the line ends before its value does (cut short?): "
                    "fix that line, or leave the file out")
    document = tmp_path / "e.json"
    document.write_text('[\n  {"text": "one"},\n  {"text": "two"}\n  {"text": "three"}\n]\n')
    line = fails(capfd, tmp_path, tmp_path / "out", *how, "--data-files", str(document))
    assert line == (f"error: {document}, line 4: not JSON (Expecting ',' delimiter): fix that line, "
                    "or leave the file out")
    assert not os.path.exists(tmp_path / "out")  # nor did any of them leave a directory behind


def test_data_files_directory_suggests_a_glob(tmp_path, capsys):
    os.makedirs(tmp_path / "corpus")
    for name in ("a.parquet", "b.parquet"):
        write_parquet(tmp_path / "corpus" / name, DOCS)
    write_jsonl(tmp_path / "corpus" / "c.jsonl", DOCS)
    (tmp_path / "corpus" / "notes.md").write_text("not data")
    corpus = str(tmp_path / "corpus")
    err = fails(capsys, tmp_path, tmp_path / "out", "--data-files", corpus)
    assert err == (f"error: --data-files {corpus} is a directory: pass a glob of its files, such as "
                   f"'{corpus}/*.parquet' (2 files) or '{corpus}/*.jsonl' (1 file)")
    prepare(tmp_path, tmp_path / "out", "--data-files", f"{corpus}/*.parquet")  # what it suggested works
    os.makedirs(tmp_path / "only_nested" / "x")  # files in subdirectories only: a recursive glob
    (tmp_path / "only_nested" / "x" / "e.txt").write_text("text")
    err = fails(capsys, tmp_path, tmp_path / "out2", "--data-files", str(tmp_path / "only_nested"))
    assert f"such as '{tmp_path / 'only_nested'}/**/*.txt' (1 file)" in err
    os.makedirs(tmp_path / "nothing")
    err = fails(capsys, tmp_path, tmp_path / "out2", "--data-files", str(tmp_path / "nothing"))
    assert err == (f"error: --data-files {tmp_path / 'nothing'} is a directory with no .parquet, .json, .jsonl "
                   "or .txt files in it: pass a glob of such files")


@pytest.mark.parametrize("flag", ["--shard-size", "--val-tokens"])
def test_the_memory_check_counts_two_bytes_a_token(tmp_path, monkeypatch, flag):
    """On a machine of 1 GiB (as the OS reports it), a split's shard of 600,000,000 tokens is 1.2 GB: refused, in one
    line naming the most it holds (536,870,912 tokens), before anything is written; one of 500,000,000 (1.0 GB) is
    not refused for its size."""
    sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 2 ** 18}.get(
        name) or sysconf(name))
    data = write_parquet(tmp_path / "d.parquet", DOCS)
    with pytest.raises(UserError) as e:
        prepare(tmp_path, tmp_path / "out", "--data-files", data, flag, "600000000")
    default = "100,000,000, is 200 MB" if flag == "--shard-size" else "10,000,000, is 20 MB"
    assert str(e.value) == (f"{flag} 600000000: a shard is held in memory while it is written, and this machine has "
                            f"1.0 GiB: give at most 536,870,912 tokens (the default, {default})")
    assert not (tmp_path / "out").exists()
    fineweb.parse_args(["--data-files", data, "--out-dir", str(tmp_path / "out"), flag, "500000000"])


@pytest.mark.parametrize("size, said", [(1, "--shard-size 1 would write a file every 1 tokens: give at least 1024"),
                                        (10 ** 14, "--shard-size 100000000000000: a shard is held in memory while it "
                                                   "is written, and this machine has ")])
def test_a_shard_size_out_of_range_is_one_line_before_anything_is_written(tmp_path, size, said):
    """A shard of one token (a file per token) or of more tokens than the machine's memory (numpy's allocation
    error, after the val shard and the manifest were written, which then refused the same command with a sane
    size): one line, nothing in --out-dir, and the sane command runs."""
    data = write_parquet(tmp_path / "d.parquet", DOCS)
    with pytest.raises(UserError) as e:
        prepare(tmp_path, tmp_path / "out", "--data-files", data, "--shard-size", str(size))
    assert str(e.value).startswith(said) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    prepare(tmp_path, tmp_path / "out", "--data-files", data, "--shard-size", "5000")
    assert (tmp_path / "out" / "manifest.json").exists()
