"""
TokenLoader, which the trainer reads a token-shard directory with: (x, y) batches for every rank
of a DDP run, resumable to the exact batch. Shards from build-nanogpt (no manifest) load too.

    from dataloader import TokenLoader
    loader = TokenLoader("edu_fineweb10B", "train", batch_size=16, seq_len=1024, rank=0, world_size=1)
    x, y = loader.next_batch()

The format is shard_format.py's, which the writer (fineweb.py) shares. The
trainer imports this file, so it needs only numpy and torch: no writer, no `datasets`, no tokenizer.
"""

import bisect
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from common import UserError, first_line
from model import GPT2_VOCAB_SIZE
from shard_format import SHARD_RE, TOKEN_DTYPE, read_manifest, remedy

NPY_MAGIC = b"\x93NUMPY"  # how every .npy file begins


# ----------------------------------------------------------------------------------------------
# Finding and opening a split's shards


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
    """Paths of a split's shards, in order, their memory maps, and the manifest (None without one),
    checked against it. Shards without a manifest (build-nanogpt's edufineweb_train_000001.npy) load too."""
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
    return paths, shards, manifest


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
    except Exception as e:  # a short file fails the memory map, a damaged header numpy's parser (many kinds)
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
        self.paths, self.shards, self.manifest = find_shards(data_dir, split, vocab_size)
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
        self._pin = self.device.type == "cuda" and prefetch
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
        one CPU int64 tensor of `size` rows of T+1 tokens (pinned for CUDA with prefetch)."""
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
            why = ("the shards were made with another tokenizer; re-create them with python fineweb.py"
                   if self.manifest is None else  # whose token ids it checked: the shard changed since
                   f"its manifest lists none so large, so a shard is damaged; {remedy(self.data_dir, self.manifest)}")
            raise UserError(f"token id {top} in the {self.split} data of {self.data_dir} is >= the model's "
                            f"vocab_size {self.vocab_size}: {why}")
        return buf

    # -- batches --------------------------------------------------------------------------------

    def next_batch(self, size=None, timer=None):
        """The next batch, (x, y) on the loader's device: `size` sequences on this rank (default B;
        validation's last batch may hold fewer), x (size, T) and y the same tokens one further on.
        Then the following batch of B is started in the background (with prefetch), so that it is
        made while the caller computes. timer: a train_gpt2.PhaseTimer, marked "data" once the batch is
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
