"""dataloader.TokenLoader: every token read once per epoch across 1/2/3 ranks (shard boundaries included),
exact resume, shuffling, and one-line errors for bad input. Shards are tiny and made here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import dataloader  # noqa: E402
import fineweb  # noqa: E402
import shard_format  # noqa: E402
from common import UserError, run_main  # noqa: E402
from dataloader import Data, TokenLoader  # noqa: E402
from parallel import Ranks  # noqa: E402

TWO = Ranks(rank=0, world_size=2)  # rank 0 of two

# odd sizes, one a single token, so windows cross shard ends at every offset
TRAIN_SIZES = [37, 50, 13, 1, 61, 29]
VAL_SIZE = 41


def make_shards(d, train_sizes=TRAIN_SIZES, val_size=VAL_SIZE, prefix="edufineweb", manifest=False, dtype=np.uint16):
    """Shards whose token ids are their positions in the split's stream (so a batch says where
    it came from), named like build-nanogpt's; optionally with a fineweb.py-style manifest."""
    os.makedirs(d, exist_ok=True)
    entries = []
    for index, n in enumerate([val_size] + list(train_sizes)):
        split = "val" if index == 0 else "train"
        first = 0 if index == 0 else sum(train_sizes[:index - 1])
        name = f"{prefix}_{split}_{index:06d}.npy"
        arr = np.arange(first, first + n).astype(dtype)
        np.save(os.path.join(d, name), arr)
        entries.append({"name": name, "split": split, "tokens": n, "max_token": int(arr.max())})
    if manifest:
        write_manifest(d, entries)
    return str(d)


def write_manifest(d, entries, complete=True, dtype="uint16"):
    m = {"format": shard_format.FORMAT, "dtype": dtype, "tokenizer": "gpt2", "complete": complete,
         "command": "python fineweb.py --out-dir " + str(d), "out_dir": str(d), "shards": entries}
    with open(os.path.join(d, shard_format.MANIFEST), "w") as f:
        json.dump(m, f)


def epoch_batches(data_dir, split, B, T, world, **data):
    """All ranks' batches of the first epoch, as lists of (x, y) numpy arrays per rank; data: Data's settings."""
    loaders = [TokenLoader(Data(data_dir, **data), split, B, T, Ranks(rank=r, world_size=world)) for r in range(world)]
    n = loaders[0].batches_per_epoch
    return [[tuple(t.numpy() for t in ld.next_batch()) for _ in range(n)] for ld in loaders], loaders[0]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_token_once_per_epoch_across_ranks(tmp_path, world):
    d = make_shards(tmp_path)
    B, T = 2, 3
    per_rank, loader = epoch_batches(d, "train", B, T, world)
    total = sum(TRAIN_SIZES)
    assert loader.num_tokens == total and loader.tokens_per_batch == B * T
    n_windows = (total - 1) // (B * T) // world * world
    # window k went to rank k % world: interleave the ranks back into stream order
    stream = [per_rank[k % world][k // world] for k in range(n_windows)]
    xs = np.concatenate([x.ravel() for x, _ in stream])
    np.testing.assert_array_equal(xs, np.arange(n_windows * B * T))  # nothing skipped or repeated
    for x, y in stream:
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int64
        np.testing.assert_array_equal(y, x + 1)  # targets continue across shard boundaries


@pytest.mark.parametrize("world", [1, 3])
def test_shuffled_epoch_is_a_permutation(tmp_path, world):
    d = make_shards(tmp_path)
    starts = np.cumsum([0] + TRAIN_SIZES)[:-1]
    ends = np.cumsum(TRAIN_SIZES) - 1
    per_rank, loader = epoch_batches(d, "train", 1, 4, world, shuffle_seed=7)
    xs = np.concatenate([x.ravel() for rank in per_rank for x, _ in rank])
    assert len(np.unique(xs)) == len(xs) == loader.batches_per_epoch * world * 4  # no token twice
    for rank in per_rank:
        for x, y in rank:
            # inside a shard the next token is x+1; at a shard's end it is the start of another
            ok = (y == x + 1) | (np.isin(x, ends) & np.isin(y, starts))
            assert ok.all()
    seq, _ = epoch_batches(d, "train", 1, 4, world)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(per_rank[0], seq[0]))


def test_val_split_is_disjoint_across_ranks(tmp_path):
    d = make_shards(tmp_path)
    per_rank, _ = epoch_batches(d, "val", 2, 4, 2)
    xs = [set(x.ravel()) for rank in per_rank for x, _ in rank]
    assert len(set().union(*xs)) == sum(len(s) for s in xs) == (VAL_SIZE - 1) // 8 // 2 * 2 * 8


def test_wraps_to_next_epoch_and_reset(tmp_path):
    d = make_shards(tmp_path)
    ld = TokenLoader(d, "train", 2, 5)
    first = [ld.next_batch() for _ in range(ld.batches_per_epoch)]
    again = ld.next_batch()  # sequential order: epoch 1 repeats epoch 0
    assert ld.position // ld.num_sequences == 1 and torch.equal(again[0], first[0][0])
    ld.reset()
    assert ld.position == 0 and torch.equal(ld.next_batch()[1], first[0][1])
    sh = TokenLoader(Data(d, shuffle_seed=1), "train", 2, 5)
    e0 = [sh.next_batch()[0] for _ in range(sh.batches_per_epoch)]
    e1 = [sh.next_batch()[0] for _ in range(sh.batches_per_epoch)]
    assert any(not torch.equal(a, b) for a, b in zip(e0, e1))  # a new order every epoch


@pytest.mark.parametrize("seed,prefetch", [(None, False), (3, True)])
def test_resume_sees_the_same_batches(tmp_path, seed, prefetch):
    d = make_shards(tmp_path, manifest=True)
    data, ranks = Data(d, shuffle_seed=seed, prefetch=prefetch), Ranks(rank=1, world_size=2)
    ref = TokenLoader(data, "train", 2, 3, ranks)
    n = 3 * ref.batches_per_epoch + 2  # across epoch ends
    want = [ref.next_batch() for _ in range(n)]
    a = TokenLoader(data, "train", 2, 3, ranks)
    for _ in range(5):
        a.next_batch()
    sd = a.state_dict()
    assert sd["sequences"] == 5 * 2 * 2  # 5 batches of 2 ranks x 2; the one prefetched does not count
    json.dumps(sd)  # plain python types
    b = TokenLoader(data, "train", 2, 3, Ranks(rank=0, world_size=2))
    b.load_state_dict(sd)  # any rank's state restores every rank: they move in lockstep
    b = TokenLoader(data, "train", 2, 3, ranks)
    b.next_batch()
    b.load_state_dict(sd)
    for x, y in want[5:]:
        bx, by = b.next_batch()
        assert torch.equal(bx, x) and torch.equal(by, y)


def test_state_from_another_run_is_refused(tmp_path):
    d = make_shards(tmp_path / "a")
    sd = TokenLoader(d, "train", 2, 3, TWO).state_dict()
    with pytest.raises(UserError, match="sequence length"):
        TokenLoader(d, "train", 2, 4, TWO).load_state_dict(sd)
    with pytest.raises(UserError, match="shuffle seed"):
        TokenLoader(Data(d, shuffle_seed=1), "train", 2, 3, TWO).load_state_dict(sd)
    other = make_shards(tmp_path / "b", train_sizes=[40, 40, 40])
    with pytest.raises(UserError, match="data"):
        TokenLoader(other, "train", 2, 3, TWO).load_state_dict(sd)
    with pytest.raises(UserError, match="not from TokenLoader"):
        TokenLoader(d, "train", 2, 3).load_state_dict({"step": 3})


@pytest.mark.parametrize("seed", [None, 4])
@pytest.mark.parametrize("new_batch", [1, 3, 6])
def test_resume_with_another_batch_size_reads_the_same_sequences_in_order(tmp_path, seed, new_batch):
    """A run moved to a smaller (or larger) GPU changes its micro-batch: resumed with another batch
    size, the ranks together read the same sequences in the same order, across epoch ends too."""
    d = make_shards(tmp_path)
    world, T = 2, 3

    def sequences(loaders, batches):
        """Every rank's rows, in the order the ranks hand them out (rank 0's batch first)."""
        rows = []
        for _ in range(batches):
            for ld in loaders:
                rows += [tuple(r) for r in ld.next_batch()[0].tolist()]
        return rows
    data, ranks = Data(d, shuffle_seed=seed), [Ranks(rank=r, world_size=world) for r in range(world)]
    ref = [TokenLoader(data, "train", 2, T, rank) for rank in ranks]
    want = sequences(ref, 3 * ref[0].batches_per_epoch)
    first = [TokenLoader(data, "train", 2, T, rank) for rank in ranks]
    got = sequences(first, 5)
    sd = first[1].state_dict()
    resumed = [TokenLoader(data, "train", new_batch, T, rank) for rank in ranks]
    for ld in resumed:
        ld.load_state_dict(sd)
    got += sequences(resumed, (len(want) - len(got)) // (world * new_batch))
    assert got == want[:len(got)] and len(got) > len(want) - world * new_batch


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_smaller_batch_takes_the_next_sequences_on_every_rank(tmp_path, prefetch):
    """Validation's last batch may hold fewer sequences than B: next_batch(size) hands every rank
    the next `size` sequences, the ranks together the next world * size, so that 5 sequences on
    each of 2 ranks are the same 10 whether taken as 2 + 2 + 1 or 5 x 1 (and a prefetched batch of
    B at the same position is not mistaken for it)."""
    d = make_shards(tmp_path)
    world, T = 2, 3

    def taken(sizes, B):
        loaders = [TokenLoader(Data(d, prefetch=prefetch), "train", B, T, Ranks(rank=r, world_size=world))
                   for r in range(world)]
        rows = set()
        for size in sizes:
            for ld in loaders:
                x, y = ld.next_batch(size)
                assert x.shape == y.shape == (size, T)
                rows |= {tuple(r) for r in torch.cat([x, y[:, -1:]], dim=1).tolist()}
        assert all(ld.position == world * sum(sizes) for ld in loaders)
        return rows
    first_ten = taken([5], 5)
    assert taken([2, 2, 1], 2) == taken([1] * 5, 1) == first_ten and len(first_ten) == 10


def test_reads_fineweb_output(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = ["The quick brown fox jumps over the lazy dog. " * (i % 7 + 1) for i in range(200)]
    pq.write_table(pa.table({"text": docs}), str(tmp_path / "d.parquet"))
    out = tmp_path / "out"
    fineweb.main(["--data-files", str(tmp_path / "d.parquet"), "--out-dir", str(out), "--shard-size", "1024",
                  "--workers", "1", "--cache-dir", str(tmp_path / "hf")])
    m = json.load(open(out / "manifest.json"))
    train = np.concatenate([np.load(out / s["name"]) for s in m["shards"] if s["split"] == "train"])
    ld = TokenLoader(str(out), "train", 4, 16)
    assert ld.num_tokens == len(train)
    for k in range(ld.batches_per_epoch):
        x, y = ld.next_batch()
        np.testing.assert_array_equal(x.numpy().ravel(), train[k * 64:(k + 1) * 64])
        np.testing.assert_array_equal(y.numpy().ravel(), train[k * 64 + 1:(k + 1) * 64 + 1])


def test_trainer_imports_no_writer():
    """The trainer reads shards through dataloader.py, which holds no writing code: the writer
    (fineweb.py), its source and `datasets` stay out of the trainer's imports."""
    assert [name for name in ("ShardWriter", "write_manifest", "previous_run", "verify", "sha256_file", "intact",
                              "val_size", "VAL_SHARE") if hasattr(dataloader, name)] == []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys, train_gpt2, dataloader; "
            "print(sorted(m for m in ('fineweb', 'fineweb_source', 'datasets') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefetch_matches_cpu(tmp_path):
    d = make_shards(tmp_path)
    gpu = TokenLoader(Data(d, shuffle_seed=5, device="cuda"), "train", 2, 3)
    cpu = TokenLoader(Data(d, shuffle_seed=5), "train", 2, 3)
    assert gpu._thread is not None
    for _ in range(2 * cpu.batches_per_epoch):
        (gx, gy), (cx, cy) = gpu.next_batch(), cpu.next_batch()
        assert gx.is_cuda and torch.equal(gx.cpu(), cx) and torch.equal(gy.cpu(), cy)


# ----------------------------------------------------------------------------------------------
# bad input: what the trainer shows is one line (common.run_main), exit status 2, no traceback


def fails(capsys, *args, **kw):
    """TokenLoader(*args, **kw) run as the scripts run main(): the one line it prints."""
    with pytest.raises(SystemExit) as e:
        run_main(lambda: TokenLoader(*args, **kw))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_missing_empty_or_file_data_dir(tmp_path, capsys):
    assert "does not exist" in fails(capsys, str(tmp_path / "nope"), "train", 2, 3)
    os.makedirs(tmp_path / "empty dir")
    err = fails(capsys, str(tmp_path / "empty dir"), "train", 2, 3)
    assert "no train shards" in err and f"python fineweb.py --out-dir '{tmp_path / 'empty dir'}'" in err
    (tmp_path / "afile").write_text("x")
    assert "is a file, not a directory" in fails(capsys, str(tmp_path / "afile"), "train", 2, 3)


@pytest.mark.parametrize("kind", ["float32", "2-D", "names"])
def test_npy_files_not_written_by_fineweb(tmp_path, capsys, kind):
    d = tmp_path / "d"
    os.makedirs(d)
    if kind == "names":  # token arrays, but under names the loader cannot order or split
        for i in range(3):
            np.save(d / f"tokens_{i}.npy", np.arange(100, dtype=np.uint16))
        err = fails(capsys, str(d), "train", 2, 3)
        assert "3 .npy file(s) (tokens_0.npy, ...)" in err and "PREFIX_train_000001.npy" in err
        return
    arr = np.zeros(100, dtype=np.float32) if kind == "float32" else np.zeros((10, 10), dtype=np.uint16)
    for name in ("x_val_000000.npy", "x_train_000001.npy"):
        np.save(d / name, arr)
    err = fails(capsys, str(d), "train", 2, 3)
    assert f"holds a {arr.dtype} array of shape {arr.shape}, expected 1-D uint16" in err


def test_two_sets_of_shards_in_one_directory(tmp_path, capsys):
    d = make_shards(tmp_path, prefix="a")
    make_shards(tmp_path, prefix="b")
    assert "several data sets (a, b)" in fails(capsys, d, "train", 2, 3)


def test_corrupted_shard_header(tmp_path, capsys):
    d = make_shards(tmp_path)
    path = os.path.join(d, "edufineweb_train_000003.npy")
    with open(path, "r+b") as f:
        f.write(b"garbage!")  # over the magic string and version
    err = fails(capsys, d, "train", 2, 3)
    assert f"shard {path} is not a .npy file (it begins b'garbag', not numpy's b'\\x93NUMPY')" in err
    with open(path, "r+b") as f:
        f.write(b"\x93NUMPY\xff\xff")  # the magic string, then a version numpy does not know
    err = fails(capsys, d, "train", 2, 3)
    assert f"shard {path} is truncated or its header is damaged" in err
    with open(path, "r+b") as f:
        f.write(b"\x93NUMPY\x01\x00\x27")  # a header length that ends it mid-dict (numpy's parser: TokenError)
    err = fails(capsys, d, "train", 2, 3)
    assert f"shard {path} is truncated or its header is damaged" in err


def test_text_file_as_a_shard(tmp_path, capsys):
    """Not numpy's advice on pickled data (allow_pickle=), which would mislead here."""
    d = make_shards(tmp_path)
    path = os.path.join(d, "edufineweb_train_000002.npy")
    with open(path, "w") as f:
        f.write("Call me Ishmael. Some years ago...\n")
    err = fails(capsys, d, "train", 2, 3)
    assert f"shard {path} is not a .npy file (it begins b'Call m'" in err and "pickle" not in err


def test_truncated_shard_in_a_copied_directory(tmp_path, capsys):
    """The error names the directory being read, and the original and its command from the manifest."""
    import shutil
    orig = make_shards(tmp_path / "orig", manifest=True)
    copy = str(tmp_path / "copy")
    shutil.copytree(orig, copy)
    path = os.path.join(copy, "edufineweb_train_000002.npy")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    err = fails(capsys, copy, "train", 2, 3)
    assert f"shard {path} is truncated" in err
    assert f"{copy} is a copy of {orig}, made by: python fineweb.py --out-dir {orig}" in err
    assert f"with --out-dir {copy}" in err
    TokenLoader(orig, "train", 2, 3)  # the original is intact
    path = os.path.join(orig, "edufineweb_train_000002.npy")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    err = fails(capsys, orig, "train", 2, 3)  # not a copy: re-running the command mends it
    assert "re-run the command that made it" in err and "is a copy" not in err


def test_missing_directory_and_split(tmp_path):
    with pytest.raises(UserError, match="does not exist.*python fineweb.py"):
        TokenLoader(str(tmp_path / "nope"), "train", 2, 3)
    d = make_shards(tmp_path / "d")
    os.remove(os.path.join(d, "edufineweb_val_000000.npy"))
    with pytest.raises(UserError, match=r"no val shards.*python fineweb.py"):
        TokenLoader(d, "val", 2, 3)


def test_wrong_dtype(tmp_path):
    d = make_shards(tmp_path, dtype=np.int32)
    with pytest.raises(UserError, match="int32.*uint16.*python fineweb.py"):
        TokenLoader(d, "train", 2, 3)


@pytest.mark.parametrize("manifest", [False, True])
def test_the_vocabulary_check_at_its_boundary(tmp_path, manifest):
    """The train split's largest id is 190 (ids are positions; 10-token rows reach its last token): a vocabulary
    of 191 ids holds it, one of 190 does not, with a manifest (at once) and without (at the batch that holds it)."""
    d = make_shards(tmp_path, manifest=manifest)
    ld = TokenLoader(Data(d, vocab_size=191), "train", 1, 10)
    assert max(int(ld.next_batch()[1].max()) for _ in range(ld.batches_per_epoch)) == 190
    if manifest:
        with pytest.raises(UserError, match=r"edufineweb_train_000006.npy holds token id 190, but the model's "
                                            r"vocabulary has 190 ids"):
            TokenLoader(Data(d, vocab_size=190), "train", 1, 10)
        return
    ld = TokenLoader(Data(d, vocab_size=190), "train", 1, 10)
    with pytest.raises(UserError, match=r"^token id 190 in the train data of .* is >= the model's vocab_size 190"):
        for _ in range(ld.batches_per_epoch):
            ld.next_batch()


def test_shards_of_another_tokenizer_are_refused_with_the_command_that_retokenizes(tmp_path):
    """A 32K-vocabulary tokenizer's ids all fit under GPT-2's 50,257, so no id check catches them: the manifest's
    tokenizer and vocabulary do, in one line naming them and the command that tokenizes the same text again."""
    d = make_shards(tmp_path, manifest=True)
    m = json.load(open(os.path.join(d, shard_format.MANIFEST)))
    m.update(tokenizer="llama", vocab_size=32000, source={"data_files": ["/books/a b.txt"], "kind": "text"})
    with open(os.path.join(d, shard_format.MANIFEST), "w") as f:
        json.dump(m, f)
    with pytest.raises(UserError) as e:
        TokenLoader(d, "train", 2, 3)
    assert str(e.value) == (f"{d} holds the token ids of the llama tokenizer (32000 ids), and the model reads gpt2's "
                            "(50257): tokenize the text again with GPT-2's, python fineweb.py --data-files "
                            "'/books/a b.txt' --out-dir NEW_DIR, and train with --data-dir NEW_DIR")
    m.update(tokenizer="gpt2", vocab_size=32000, source={"dataset": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT"})
    with open(os.path.join(d, shard_format.MANIFEST), "w") as f:
        json.dump(m, f)
    with pytest.raises(UserError, match=r"\(32000 ids\).*python fineweb.py --dataset HuggingFaceFW/fineweb-edu --name "
                                        r"sample-10BT --out-dir NEW_DIR"):
        TokenLoader(d, "val", 2, 3)
    m.update(vocab_size=50257)  # fineweb.py's own: read
    with open(os.path.join(d, shard_format.MANIFEST), "w") as f:
        json.dump(m, f)
    TokenLoader(d, "train", 2, 3)


def test_token_ids_beyond_vocabulary(tmp_path):
    d = make_shards(tmp_path / "plain")  # no manifest: found when a batch holds one
    ld = TokenLoader(Data(d, vocab_size=100), "train", 2, 3)
    with pytest.raises(UserError, match="vocab_size 100"):
        for _ in range(ld.batches_per_epoch):
            ld.next_batch()
    d = make_shards(tmp_path / "m", manifest=True)  # with a manifest: at once
    with pytest.raises(UserError, match="holds token id 1[0-9][0-9].*vocabulary has 100"):
        TokenLoader(Data(d, vocab_size=100), "train", 2, 3)
    # a shard whose manifest vouched for its ids, changed since: damaged, not another tokenizer's
    ld = TokenLoader(d, "train", 2, 3)
    arr = np.load(os.path.join(d, "edufineweb_train_000001.npy"), mmap_mode="r+")
    arr[0] = 65535
    arr.flush()
    with pytest.raises(UserError, match=r"^token id 65535 in the train data of .* is >= the model's vocab_size 50257: "
                                        r"its manifest lists none so large, so a shard is damaged; re-run the command "
                                        r"that made it"):
        ld.next_batch()


def test_split_shorter_than_one_batch(tmp_path):
    d = make_shards(tmp_path)
    with pytest.raises(UserError, match=r"fewer than one batch.*smaller batch"):
        TokenLoader(d, "val", 8, 8)  # 41 tokens < 65
    with pytest.raises(UserError, match="fewer than one batch"):
        TokenLoader(d, "val", 2, 11, TWO)  # 41 < 2*2*11+1
    TokenLoader(d, "val", 2, 10, TWO)  # 41 = 2*2*10+1: exactly one batch per rank
    # validation fills a short last batch: one sequence on every rank will do
    assert TokenLoader(d, "val", 8, 8, whole_batches=False).num_sequences == 5
    TokenLoader(d, "val", 8, 20, TWO, whole_batches=False)  # 41 = 2*20+1
    with pytest.raises(UserError, match=r"fewer than one sequence on every rank \(2×1×21\+1 = 43\)"):
        TokenLoader(d, "val", 8, 21, TWO, whole_batches=False)


def test_broken_shards_and_manifests(tmp_path):
    d = make_shards(tmp_path / "t")
    path = os.path.join(d, "edufineweb_train_000002.npy")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(UserError, match="truncated"):
        TokenLoader(d, "train", 2, 3)
    d = make_shards(tmp_path / "inc", manifest=True)
    m = json.load(open(os.path.join(d, shard_format.MANIFEST)))
    write_manifest(d, m["shards"], complete=False)
    with pytest.raises(UserError, match="not finished: re-run .*python fineweb.py"):
        TokenLoader(d, "train", 2, 3)
    write_manifest(d, m["shards"] + [{"name": "edufineweb_train_000009.npy", "split": "train", "tokens": 5,
                                     "max_token": 5}])
    with pytest.raises(UserError, match="missing"):
        TokenLoader(d, "train", 2, 3)
    m["shards"][1]["tokens"] += 1
    write_manifest(d, m["shards"])
    with pytest.raises(UserError, match="manifest says"):
        TokenLoader(d, "train", 2, 3)
