"""fineweb.py: tokens equal tiktoken's, shard layout and manifest, resume after a kill gives the
same bytes, and one-line errors for bad input. Every test makes its own small corpus."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # conftest.py puts it on sys.path

import fineweb  # noqa: E402
from common import EOT_TOKEN, UserError, get_tokenizer  # noqa: E402

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
    docs = DOCS * 3
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
    size = len(want) // 5 + 1
    data = write_parquet(tmp_path / "d.parquet", docs)
    prepare(tmp_path, tmp_path / "out", "--data-files", data, "--shard-size", str(size), "--prefix", "mine")
    out = tmp_path / "out"
    m = json.load(open(out / "manifest.json"))
    names = [s["name"] for s in m["shards"]]
    assert names == ["mine_val_000000.npy"] + [f"mine_train_{i:06d}.npy" for i in range(1, len(names))]
    assert sorted(os.listdir(out)) == sorted(names + ["manifest.json"])
    assert [s["split"] for s in m["shards"]] == ["val"] + ["train"] * (len(names) - 1)
    assert all(s["tokens"] == size for s in m["shards"][:-1]) and 0 < m["shards"][-1]["tokens"] <= size
    assert m["complete"] and m["total_tokens"] == len(want) == sum(s["tokens"] for s in m["shards"])
    assert m["split_tokens"] == {"val": size, "train": len(want) - size}
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
    with pytest.raises(UserError, match="checksum"):
        fineweb.main(["--out-dir", str(out), "--verify"])


def test_max_tokens_then_continue_and_rerun(tmp_path, capsys):
    docs = big_docs(200, seed=1)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    want = expected_stream(docs)
    size = len(want) // 6
    args = ["--data-files", data, "--shard-size", str(size)]
    prepare(tmp_path, tmp_path / "out", *args, "--max-tokens", str(2 * size + size // 2))
    np.testing.assert_array_equal(stream_of(tmp_path / "out"), want[:2 * size + size // 2])
    # go on to the end, streamed this time (IterableDataset.skip): the partial shard is made again
    prepare(tmp_path, tmp_path / "out", *args, "--streaming")
    np.testing.assert_array_equal(stream_of(tmp_path / "out"), want)
    prepare(tmp_path, tmp_path / "ref", *args)
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")
    capsys.readouterr()
    prepare(tmp_path, tmp_path / "out", *args)
    assert "nothing to do" in capsys.readouterr().out


def test_killed_run_resumes_to_identical_bytes(tmp_path):
    """SIGKILL a real `python fineweb.py` (2 spawn workers, as on Windows/macOS) mid-way, then
    re-run with one worker: the shards equal those of an uninterrupted run."""
    docs = big_docs(2500, seed=2)
    data = write_parquet(tmp_path / "d.parquet", docs)
    args = ["--data-files", data, "--shard-size", "20000", "--cache-dir", str(tmp_path / "hf")]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "fineweb.py"), *args, "--out-dir", str(out),
                             "--workers", "2", "--start-method", "spawn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=str(tmp_path))
    deadline = time.time() + 60
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
        _, err = proc.communicate()
    m = json.load(open(out / "manifest.json"))
    assert not m["complete"], f"the run ended before it could be killed: {err.decode()[-500:]}"
    (out / ".data_train_000099.npy.tmp12345").write_bytes(b"half a shard")  # a kill inside atomic_write
    prepare(tmp_path, out, "--data-files", data, "--shard-size", "20000")
    prepare(tmp_path, tmp_path / "ref", "--data-files", data, "--shard-size", "20000")
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "ref"))
    assert shard_bytes(out) == shard_bytes(tmp_path / "ref")
    np.testing.assert_array_equal(stream_of(out), expected_stream(docs))


def test_worker_processes_give_same_bytes(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", big_docs(400, seed=3))
    fineweb.main(["--data-files", data, "--out-dir", str(tmp_path / "w2"), "--shard-size", "30000",
                  "--workers", "2", "--cache-dir", str(tmp_path / "hf")])
    prepare(tmp_path, tmp_path / "w1", "--data-files", data, "--shard-size", "30000")
    assert shard_bytes(tmp_path / "w1") == shard_bytes(tmp_path / "w2")


# ----------------------------------------------------------------------------------------------
# bad input: one UserError line that says what to do


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
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="cannot write"):
        prepare(tmp_path, tmp_path / "afile" / "out", "--data-files", data)
    with pytest.raises(UserError, match="is a file"):
        prepare(tmp_path, tmp_path / "afile", "--data-files", data)
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


def test_too_small_for_a_train_shard(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    with pytest.raises(UserError, match="smaller --shard-size"):
        prepare(tmp_path, tmp_path / "out", "--data-files", data)
    assert os.listdir(tmp_path / "out") == []  # so a re-run with a smaller shard size just works
    prepare(tmp_path, tmp_path / "out", "--data-files", data, "--shard-size", "100")


def test_token_id_beyond_uint16():
    with pytest.raises(UserError, match="does not fit in uint16"):
        fineweb.to_uint16(np.array([1, 70000], dtype=np.uint32))
    assert fineweb.to_uint16(np.array([0, 65535], dtype=np.uint32)).dtype == np.uint16


def test_config_and_split_not_found(tmp_path):
    """A local dataset directory with a named config (no network needed)."""
    os.makedirs(tmp_path / "ds" / "data")
    write_parquet(tmp_path / "ds" / "data" / "a.parquet", DOCS)
    (tmp_path / "ds" / "README.md").write_text("---\nconfigs:\n- config_name: small\n  data_files: data/*.parquet\n---\n")
    common = ["--dataset", str(tmp_path / "ds"), "--shard-size", "50"]
    with pytest.raises(UserError, match=r"'nope' not found.*small.*--name"):
        prepare(tmp_path, tmp_path / "out", *common, "--name", "nope")
    with pytest.raises(UserError, match="--split"):
        prepare(tmp_path, tmp_path / "out", *common, "--name", "small", "--split", "validation")
    with pytest.raises(UserError, match="not found.*--data-files"):
        prepare(tmp_path, tmp_path / "out", "--dataset", str(tmp_path / "no_such_dir"))


def test_cli_offline_error_is_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "fineweb.py"), "--dataset", "someone/no-such-dataset",
                        "--out-dir", str(tmp_path / "out"), "--workers", "1", "--cache-dir", str(tmp_path / "hf")],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "--data-files" in lines[-1] and "Traceback" not in r.stderr


def test_default_fineweb_download(tmp_path, hf_hub_online):
    """The default source, streamed and cut short: the real download path, a few MB."""
    out = tmp_path / "out"
    fineweb.main(["--out-dir", str(out), "--streaming", "--max-tokens", "30000", "--shard-size", "10000",
                  "--workers", "1", "--cache-dir", str(tmp_path / "hf")])
    m = json.load(open(out / "manifest.json"))
    assert m["source"]["dataset"] == fineweb.DEFAULT_DATASET and m["source"]["name"] == fineweb.DEFAULT_NAME
    assert m["complete"] and m["total_tokens"] == 30000
    assert [s["name"] for s in m["shards"]][:2] == ["edufineweb_val_000000.npy", "edufineweb_train_000001.npy"]
