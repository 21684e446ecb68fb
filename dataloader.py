"""
The token-shard directory: its format (names, manifest, checksums), the writer fineweb.py fills
it with, and TokenLoader, which the trainer reads it with: (x, y) batches for every rank of a DDP
run, resumable to the exact batch. Shards from build-nanogpt (no manifest) load too.

    from dataloader import TokenLoader
    loader = TokenLoader("edu_fineweb10B", "train", batch_size=16, seq_len=1024, rank=0, world_size=1)
    x, y = loader.next_batch()

Writing and reading live together so that they agree on the format. The trainer imports this
file, so it needs only numpy and torch: no `datasets`, no tokenizer (those are fineweb.py's).
"""

import bisect
import hashlib
import json
import os
import re
import shlex
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from common import UserError, atomic_write, first_line, out_of_space
from model import GPT2_VOCAB_SIZE

MANIFEST = "manifest.json"
FORMAT = "gpt2-token-shards-v1"
TOKEN_DTYPE = np.uint16
NPY_MAGIC = b"\x93NUMPY"  # how every .npy file begins
VAL_SHARE = 10  # a corpus under VAL_SHARE * val_tokens gives 1/VAL_SHARE of its tokens to validation
SHARD_RE = re.compile(r"^(?P<prefix>.+)_(?P<split>val|train)_(?P<index>\d{6})\.npy$")


# ----------------------------------------------------------------------------------------------
# The format: names, manifest, checksums


def read_manifest(out_dir):
    """The manifest.json of a shard directory as a dict, or None where there is none."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({first_line(e)}): delete {out_dir} and prepare it again")
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise UserError(f"{path} was not written by fineweb.py: use another --out-dir or delete {out_dir}")
    return m


def shard_name(prefix, index):
    """The file name of shard `index` (0 is the val split, the rest train)."""
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.npy"


def write_manifest(out_dir, manifest):
    """Write manifest.json atomically."""
    data = json.dumps(manifest, indent=1).encode()
    atomic_write(os.path.join(out_dir, MANIFEST), lambda f: f.write(data))


def sha256_file(path):
    """The sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def intact(out_dir, entry):
    """Whether a listed shard's file is there with all its tokens (a cheap check, the header
    only: --verify reads every byte)."""
    try:
        return len(np.load(os.path.join(out_dir, entry["name"]), mmap_mode="r")) == entry["tokens"]
    except (OSError, ValueError, EOFError):
        return False


def verify(out_dir):
    """Check every listed shard against its sha256 (reads every byte; intact() reads headers)."""
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise UserError(f"{out_dir} has no {MANIFEST}: nothing to verify (prepare it with python fineweb.py)")
    for s in manifest["shards"]:
        path = os.path.join(out_dir, s["name"])
        if not os.path.isfile(path):
            raise UserError(f"{path} is missing: {remedy(out_dir, manifest)}")
        if sha256_file(path) != s["sha256"]:
            raise UserError(f"{path} does not match its checksum: it changed after fineweb.py wrote it. Delete "
                            f"it, then {remedy(out_dir, manifest)}")
    state = "complete" if manifest.get("complete") else f"incomplete ({remedy(out_dir, manifest)})"
    print(f"{out_dir}: {len(manifest['shards'])} shards match their checksums; {state}")


# ----------------------------------------------------------------------------------------------
# Writing (for fineweb.py)


def plan_resume(out_dir, manifest, max_tokens):
    """Shards of an earlier run to keep: a val shard of --val-tokens, then the leading full train
    shards. A smaller val shard was sized by where that run's stream ended and a partial last
    shard ends there, so both are made again: going on later gives the same bytes."""
    keep = []
    for s in manifest["shards"]:
        full = manifest["val_tokens"] if s["split"] == "val" else manifest["shard_size"]
        if s["tokens"] != full or not intact(out_dir, s):
            break
        keep.append(s)
    done = sum(s["tokens"] for s in keep)
    if max_tokens is not None and done > max_tokens:
        raise UserError(f"{out_dir} already holds {done:,} tokens, more than --max-tokens {max_tokens:,}: "
                        "use another --out-dir")
    return keep


def val_size(total, val_tokens):
    """Tokens of the validation split in a stream of `total`: val_tokens, or a tenth of a corpus
    with fewer than VAL_SHARE * val_tokens, so a small corpus keeps most of its text for training."""
    return min(val_tokens, max(1, total // VAL_SHARE))


class ShardWriter:
    """Cuts the token stream into the val shard, then train shards of shard_size; a background
    thread writes each one (shard, then manifest, both atomically) while the caller goes on.

    val_size() depends on the stream's length, so until it is known the stream is held in memory:
    up to VAL_SHARE * val_tokens tokens (200 MB by default; any longer stream gives val_tokens),
    or to the end of the stream."""

    def __init__(self, out_dir, manifest, log):
        self.out_dir, self.manifest, self.log = out_dir, manifest, log
        self.size, self.val_tokens = manifest["shard_size"], manifest["val_tokens"]
        self.index = len(manifest["shards"])
        self.val = self.val_tokens if self.index else None  # a kept val shard has val_tokens (plan_resume)
        self.held, self.held_tokens = [], 0  # (tokens, end_at) while self.val is None
        self.buf, self.fill = None, 0
        self.thread = ThreadPoolExecutor(1)
        self.pending = None

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
        """The end of the stream: cut what is held, write the last, partial shard."""
        if self.val is None:
            self.release(val_size(self.held_tokens, self.val_tokens))
        self.flush(end)

    def flush(self, end):
        if self.fill == 0:
            return
        self.wait()
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

    def wait(self):
        if self.pending is not None:
            self.pending.result()  # re-raises the writer's error here
            self.pending = None

    def close(self):
        self.wait()
        self.thread.shutdown()


# ----------------------------------------------------------------------------------------------
# Reading


def remedy(data_dir, manifest):
    """What to do about a missing, damaged or unfinished shard directory. The directory may be a
    copy of the one fineweb.py wrote: its manifest names the original, and the command that made it."""
    if manifest is None or not manifest.get("command"):
        return f"prepare it with: python fineweb.py --out-dir {shlex.quote(data_dir)}"
    origin = manifest.get("out_dir")
    if origin and not (os.path.isdir(origin) and os.path.samefile(origin, data_dir)):
        return (f"copy the shards again from {origin} ({data_dir} is a copy of {origin}, made by: "
                f"{manifest['command']}), or re-run that command with --out-dir {shlex.quote(data_dir)}")
    return f"re-run the command that made it (it redoes only what is missing): {manifest['command']}"


def unlisted_shards(data_dir, split, fix):
    """A split's shard names in a directory without a manifest (build-nanogpt's, or copied ones)."""
    npy = sorted(f for f in os.listdir(data_dir) if f.endswith(".npy"))
    matches = [SHARD_RE.match(f) for f in npy]
    names = [m.group(0) for m in matches if m and m.group("split") == split]
    if not names and npy and not any(matches):
        raise UserError(f"{data_dir} holds {len(npy)} .npy file(s) ({npy[0]}, ...) but none named like "
                        f"PREFIX_{split}_000001.npy, as fineweb.py writes them: {fix}")
    prefixes = sorted({SHARD_RE.match(n).group("prefix") for n in names})
    if len(prefixes) > 1:
        raise UserError(f"{data_dir} holds {split} shards of several data sets ({', '.join(prefixes)}): "
                        "keep one set of shards per directory")
    return names


def find_shards(data_dir, split, vocab_size):
    """Paths of a split's shards, in order, checked against the manifest when there is one.
    Shards without a manifest (e.g. build-nanogpt's edufineweb_train_000001.npy) load too."""
    fix = remedy(data_dir, None)
    if not os.path.isdir(data_dir):
        what = "is a file, not a directory" if os.path.exists(data_dir) else "does not exist"
        raise UserError(f"data directory {data_dir} {what}: {fix}  (or point --data-dir at your shards)")
    manifest = read_manifest(data_dir)
    fix = remedy(data_dir, manifest)
    if manifest is None:
        names = unlisted_shards(data_dir, split, fix)
    else:
        if not manifest.get("complete"):
            raise UserError(f"preparation of {data_dir} has not finished: {fix}")
        if manifest.get("dtype") != "uint16":
            raise UserError(f"{data_dir} holds {manifest.get('dtype')} tokens, this loader reads uint16: {fix}")
        entries = [s for s in manifest["shards"] if s["split"] == split]
        too_big = [s for s in entries if s["max_token"] >= vocab_size]
        if too_big:
            raise UserError(f"{too_big[0]['name']} holds token id {too_big[0]['max_token']}, but the model's "
                            f"vocabulary has {vocab_size} ids (tokenizer {manifest.get('tokenizer')}): "
                            "use a model with a larger vocab_size, or re-create the shards with python fineweb.py")
        names = [s["name"] for s in entries]
    if not names:
        raise UserError(f"no {split} shards (*_{split}_*.npy) in {data_dir}: {fix}")
    paths = [os.path.join(data_dir, n) for n in names]
    shards = [open_shard(p, fix) for p in paths]
    if manifest is not None:
        for path, s, arr in zip(paths, entries, shards):
            if len(arr) != s["tokens"]:
                raise UserError(f"shard {path} has {len(arr):,} tokens, its manifest says {s['tokens']:,}: {fix}")
    return paths, shards


def open_shard(path, fix):
    """A read-only memory map of one shard: pages are read on use, so data may exceed RAM."""
    if not os.path.isfile(path):
        raise UserError(f"shard {path} is missing: {fix}")
    with open(path, "rb") as f:
        head = f.read(len(NPY_MAGIC))
    if head and head != NPY_MAGIC:  # numpy would take it for pickled data, and advise allow_pickle
        raise UserError(f"shard {path} is not a .npy file (it begins {head!r}, not numpy's {NPY_MAGIC!r}): {fix}")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # a short file fails the memory map or the header's parser
        raise UserError(f"shard {path} is truncated or its header is damaged ({first_line(e)}): {fix}")
    if arr.dtype != TOKEN_DTYPE or arr.ndim != 1:
        raise UserError(f"shard {path} holds a {arr.dtype} array of shape {arr.shape}, expected 1-D uint16 "
                        f"tokens as fineweb.py writes them: {fix}")
    return arr


class TokenLoader:
    """(x, y) batches of B×T int64 next-token pairs from one split's shards.

    Order: the split's shards form one token stream (in name order, or permuted per epoch with
    shuffle_seed), cut into sequences of T tokens: sequence s is x = stream[s*T : s*T+T] with the
    targets y one token further on, so no token is skipped or repeated at shard boundaries. An
    epoch is all (num_tokens - 1) // T sequences, in order, or permuted with rng(seed, epoch) when
    shuffle_seed is set; after it the next epoch begins (wraps), also inside a batch.
    All ranks draw from one sequence counter: each next_batch() takes the next world_size * B
    sequences (world_size * size for a smaller batch), B consecutive ones for each rank, rank 0
    first (in order, rank r's i-th batch is the stream's window i*world_size + r of B*T+1 tokens).

    The position is that counter, in sequences: state_dict() from any rank restores every rank,
    and the batch size may differ on resume (a run moved to a GPU with less memory takes a
    smaller micro-batch): the same sequences come in the same order, only grouped otherwise. With
    prefetch (default on CUDA) the next batch is made by a background thread into pinned memory
    and copied with non_blocking=True.
    """

    def __init__(self, data_dir, split, batch_size, seq_len, rank=0, world_size=1,
                 vocab_size=GPT2_VOCAB_SIZE, shuffle_seed=None, device="cpu", prefetch=None):
        if split not in ("train", "val"):
            raise UserError(f"split must be 'train' or 'val', not {split!r}")
        for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
            if not isinstance(v, int) or v < 1:
                raise UserError(f"{name} must be a positive integer (got {v!r})")
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")
        if shuffle_seed is not None and not (isinstance(shuffle_seed, int) and shuffle_seed >= 0):
            raise UserError(f"shuffle_seed must be None or an integer >= 0 (got {shuffle_seed!r})")
        self.data_dir, self.split = data_dir, split
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.vocab_size, self.shuffle_seed = vocab_size, shuffle_seed
        self.device = torch.device(device)
        self.paths, self.shards = find_shards(data_dir, split, vocab_size)
        self.sizes = [len(s) for s in self.shards]
        self.num_tokens = sum(self.sizes)
        self.tokens_per_batch = batch_size * seq_len
        self.num_sequences = (self.num_tokens - 1) // seq_len  # in one epoch
        self.batches_per_epoch = self.num_sequences // (world_size * batch_size)  # whole batches, per rank
        if self.batches_per_epoch == 0:
            need = world_size * self.tokens_per_batch + 1
            raise UserError(f"the {split} split of {data_dir} has {self.num_tokens:,} tokens, fewer than one batch "
                            f"on every rank ({world_size}×{batch_size}×{seq_len}+1 = {need:,}): use a smaller "
                            "batch size / sequence length, or prepare more data with python fineweb.py")
        names = [os.path.basename(p) for p in self.paths]
        self.fingerprint = hashlib.sha256(json.dumps([split, names, self.sizes]).encode()).hexdigest()[:16]
        self.position = 0  # sequences handed out so far, over all ranks
        self._layout_cache = None
        if prefetch is None:
            prefetch = self.device.type == "cuda"
        self._pin = self.device.type == "cuda"
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="TokenLoader") if prefetch else None
        self._ahead = None  # (position, future) being made in the background

    # -- order --------------------------------------------------------------------------------

    def _layout(self, epoch):
        """Shard order, where each shard starts in the epoch's stream, and the sequence order."""
        if self._layout_cache is None or self._layout_cache[0] != epoch:
            order = np.arange(len(self.shards))
            sequences = None
            if self.shuffle_seed is not None:
                rng = np.random.default_rng([self.shuffle_seed, epoch])
                order = rng.permutation(len(self.shards))
                sequences = rng.permutation(self.num_sequences)
            starts = np.concatenate(([0], np.cumsum([self.sizes[i] for i in order])[:-1])).tolist()
            self._layout_cache = (epoch, order.tolist(), starts, sequences)
        return self._layout_cache[1:]

    def sequence_start(self, g):
        """(epoch, stream position) of the g-th sequence handed out since the start."""
        epoch, j = divmod(g, self.num_sequences)
        _, _, sequences = self._layout(epoch)
        return epoch, (j if sequences is None else int(sequences[j])) * self.T

    def _read(self, epoch, start, out):
        """Fill out (a 1-D numpy view) with the epoch's stream from position start; it may span shards."""
        order, starts, _ = self._layout(epoch)
        k = bisect.bisect_right(starts, start) - 1
        filled, n = 0, len(out)
        while filled < n:
            shard = self.shards[order[k]]
            lo = start + filled - starts[k]
            take = min(n - filled, len(shard) - lo)
            out[filled:filled + take] = shard[lo:lo + take]
            filled += take
            k += 1

    def _make(self, position, size):
        """This rank's batch of `size` sequences when `position` sequences have been handed out, as
        one CPU int64 tensor of `size` rows of T+1 tokens (pinned for CUDA)."""
        buf = torch.empty(size, self.T + 1, dtype=torch.int64, pin_memory=self._pin)
        rows = buf.numpy()
        first = position + self.rank * size
        r = 0
        while r < size:
            epoch, start = self.sequence_start(first + r)
            run = 1  # consecutive sequences of one epoch are one contiguous read
            while (r + run < size and self.sequence_start(first + r + run) == (epoch, start + run * self.T)):
                run += 1
            span = np.empty(run * self.T + 1, dtype=np.int64)
            self._read(epoch, start, span)
            rows[r:r + run] = np.lib.stride_tricks.as_strided(span, (run, self.T + 1), (self.T * 8, 8))
            r += run
        top = int(rows.max())
        if top >= self.vocab_size:
            raise UserError(f"token id {top} in the {self.split} data of {self.data_dir} is >= the model's "
                            f"vocab_size {self.vocab_size}: the shards were made with another tokenizer; "
                            "re-create them with python fineweb.py")
        return buf

    # -- batches --------------------------------------------------------------------------------

    def next_batch(self, size=None, timer=None):
        """The next batch, (x, y) on the loader's device: `size` sequences on this rank (default B;
        validation's last batch may hold fewer), x (size, T) and y the same tokens one further on.
        Then the following batch of B is started in the background (with prefetch), so that it is
        made while the caller computes. timer: a metrics.PhaseTimer, marked "data" once the batch is
        in host memory and "copy" once it is on the device (--timing-breakdown)."""
        size = size or self.B
        position = self.position
        if self._ahead is not None and self._ahead[0] == (position, size):
            buf = self._ahead[1].result()
            self._ahead = None
        else:
            self._cancel_ahead()
            buf = self._make(position, size)
        self.position = position + self.world_size * size
        if timer is not None:
            timer.mark("data")
        if self.device.type != "cpu":
            buf = buf.to(self.device, non_blocking=self._pin)  # from pinned memory: an async copy
        if timer is not None:
            timer.mark("copy")
        if self._thread is not None and self._ahead is None:
            self._ahead = ((self.position, self.B), self._thread.submit(self._make, self.position, self.B))
        return buf[:, :-1], buf[:, 1:]

    def _cancel_ahead(self):
        if self._ahead is not None:
            _, future = self._ahead
            self._ahead = None
            if not future.cancel():
                try:
                    future.result()  # let it finish: it uses the layout cache
                except UserError:
                    pass  # raised again if that batch is ever asked for

    @property
    def epoch(self):
        return self.position // self.num_sequences

    def reset(self):
        """Back to the first batch of the split (the trainer calls this before each validation)."""
        self._cancel_ahead()
        self.position = 0

    # -- resume -----------------------------------------------------------------------------------

    def state_dict(self):
        """Position after the batches handed out so far, in sequences over all ranks (a prefetched
        batch does not count)."""
        return {"format": "token-loader-v2", "sequences": self.position, "epoch": self.epoch,
                "split": self.split, "world_size": self.world_size, "batch_size": self.B,
                "seq_len": self.T, "shuffle_seed": self.shuffle_seed, "num_tokens": self.num_tokens,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, sd):
        """Continue where sd (any rank's state_dict(), with any batch size) left off."""
        if not isinstance(sd, dict) or sd.get("format") not in ("token-loader-v1", "token-loader-v2"):
            raise UserError("the loader state is not from TokenLoader: start without resuming the data position")
        mine = self.state_dict()
        for key, what in (("split", "split"), ("seq_len", "sequence length"), ("shuffle_seed", "shuffle seed"),
                          ("fingerprint", "data (shard names and sizes)")):
            if sd.get(key) != mine[key]:
                raise UserError(f"the loader state was saved with another {what} ({sd.get(key)!r}, now "
                                f"{mine[key]!r}): resume with the same settings and data as the saved run")
        if sd["format"] == "token-loader-v1":  # counted in batches of a fixed size, in epochs that
            position = sd["batches"] * sd["world_size"] * sd["batch_size"]  # dropped their last round
            first_epoch = (self.num_tokens - 1) // (sd["batch_size"] * self.T) // sd["world_size"]
            if sd["shuffle_seed"] is not None or sd["batches"] >= first_epoch:
                raise UserError("the loader state was saved by an older version of this loader, in an order it "
                                "no longer makes (shuffled, or past the first epoch): start a new run")
        else:
            position = int(sd["sequences"])
        self._cancel_ahead()
        self.position = position
