"""TokenLoader: (x, y) batches of a token-shard directory (format: shard_format.py) for every rank of a DDP run,
resumable to the exact sequence. Shards from build-nanogpt (no manifest) load too. The trainer imports this file,
so it needs only numpy and torch: no writer, no `datasets`, no tokenizer."""

import bisect
import hashlib
import json
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from common import UserError, first_line
from model import GPT2_VOCAB_SIZE
from shard_format import SHARD_RE, TOKEN_DTYPE, TOKENIZER, read_manifest, remedy, retokenize

NPY_MAGIC = b"\x93NUMPY"  # how every .npy file begins


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
    """(names, memory maps, manifest or None) of a split's shards in order, checked against the manifest."""
    if os.path.isfile(data_dir):  # a corpus file (text, parquet) given for its shards
        raise UserError(f"data directory {data_dir} is a file, not a directory of shards: tokenize it with python "
                        f"fineweb.py --data-files {shlex.quote(data_dir)} --out-dir NEW_DIR, and train with "
                        "--data-dir NEW_DIR")
    if not os.path.isdir(data_dir):
        raise UserError(f"data directory {data_dir} does not exist: {remedy(data_dir, None)}  "
                        "(or point --data-dir at your shards)")
    manifest = read_manifest(data_dir)
    fix = remedy(data_dir, manifest)
    if manifest is None:
        entries = [{"name": name} for name in unlisted_shards(data_dir, split, fix)]
    else:
        if not manifest.get("complete"):
            raise UserError(f"preparation of {data_dir} has not finished: {fix}")
        # another tokenizer's ids can fit under the model's vocabulary and train silently on the wrong tokens
        tokenizer = manifest.get("tokenizer", TOKENIZER)
        ids = manifest.get("vocab_size", GPT2_VOCAB_SIZE)
        if tokenizer != TOKENIZER or ids != GPT2_VOCAB_SIZE:
            raise UserError(f"{data_dir} holds the token ids of the {tokenizer} tokenizer ({ids} ids), and the model "
                            f"reads {TOKENIZER}'s ({GPT2_VOCAB_SIZE}): tokenize the text again with GPT-2's, "
                            f"{retokenize(manifest)}, and train with --data-dir NEW_DIR")
        entries = [s for s in manifest["shards"] if s["split"] == split]
        too_big = [s for s in entries if s["max_token"] >= vocab_size]
        if too_big:
            raise UserError(f"{too_big[0]['name']} holds token id {too_big[0]['max_token']}, but the model's "
                            f"vocabulary has {vocab_size} ids (tokenizer {manifest.get('tokenizer')}): "
                            "use a model with a larger vocab_size, or re-create the shards with python fineweb.py")
    if not entries:
        raise UserError(f"no {split} shards (*_{split}_*.npy) in {data_dir}: {fix}")
    shards = [open_shard(os.path.join(data_dir, s["name"]), s.get("tokens"), fix) for s in entries]
    return [s["name"] for s in entries], shards, manifest


def open_shard(path, tokens, fix):
    """A read-only memory map of one shard (pages are read on use, so data may exceed RAM), of `tokens` if known."""
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
    if tokens is not None and len(arr) != tokens:
        raise UserError(f"shard {path} has {len(arr):,} tokens, its manifest says {tokens:,}: {fix}")
    return arr


class Flags:
    """This room's flags in the trainer's command line (train_config composes every room's)."""
    ranges, paths, fixed_on_resume = {"shuffle_seed": "0 or more"}, ("data_dir",), ("shuffle_seed",)

    @staticmethod
    def add_flags(a):
        a("--data-dir", default="edu_fineweb10B", help="token shards from fineweb.py (default: edu_fineweb10B)")
        a("--shuffle-seed", type=int, help="shuffle shard and sequence order per epoch with this seed (default: off)")


@dataclass(frozen=True)
class Data:
    """The data's settings: the directory of the shards (fineweb.py's), the vocabulary every token must lie in,
    the per-epoch shuffle (None: in order), where batches go, and whether the next one is made in the background
    (None: on CUDA)."""
    data_dir: str
    vocab_size: int = GPT2_VOCAB_SIZE
    shuffle_seed: int = None
    device: str = "cpu"
    prefetch: bool = None


class TokenLoader:
    """(x, y) batches of B×T int64 next-token pairs from one split's shards. The shards form one token stream (in
    name order, or permuted per epoch with shuffle_seed), cut into sequences of T tokens: sequence s is
    x = stream[s*T : s*T+T], y one token further on, so nothing is skipped or repeated at shard ends. An epoch is
    all (num_tokens - 1) // T sequences, in order or permuted with rng(seed, epoch); the next epoch follows on, also
    inside a batch. All ranks draw from one counter, `position`: each next_batch() takes the next world_size * size
    sequences, `size` consecutive ones for each rank, rank 0's first. That counter is the resume state, so any
    rank's restores every rank, with any batch size. With prefetch (default on CUDA) the next batch is made by a
    background thread into pinned memory and copied with non_blocking=True."""

    def __init__(self, data, split, batch_size, seq_len, ranks=None, whole_batches=True):
        """data: a Data, or the shards' directory (Data(directory)); ranks: the rank served and how many there are
        (parallel.Ranks; None: one process); whole_batches=False (validation, which fills a short last batch): one
        sequence on every rank will do."""
        data = data if isinstance(data, Data) else Data(data)
        self.data_dir, self.split, self.B, self.T = data.data_dir, split, batch_size, seq_len
        self.rank, self.world_size = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
        self.vocab_size, self.shuffle_seed = data.vocab_size, data.shuffle_seed
        self.device = torch.device(data.device)
        names, self.shards, self.manifest = find_shards(self.data_dir, split, self.vocab_size)
        self.sizes = [len(s) for s in self.shards]
        self.num_tokens = sum(self.sizes)
        self.tokens_per_batch = batch_size * seq_len
        self.num_sequences = (self.num_tokens - 1) // seq_len  # in one epoch
        self.batches_per_epoch = self.num_sequences // (self.world_size * batch_size)  # whole batches, per rank
        per_rank, what = (batch_size, "batch") if whole_batches else (1, "sequence")
        world = self.world_size
        if self.num_sequences < world * per_rank:
            need = world * per_rank * seq_len + 1
            raise UserError(f"the {split} split of {self.data_dir} has {self.num_tokens:,} tokens, fewer than one "
                            f"{what} on every rank ({world}×{per_rank}×{seq_len}+1 = {need:,}): use a smaller batch "
                            "size / sequence length, or prepare more data with python fineweb.py")
        self.fingerprint = hashlib.sha256(json.dumps([split, names, self.sizes]).encode()).hexdigest()[:16]
        self.position = 0  # sequences handed out so far, over all ranks
        self._layout_cache = None
        prefetch = self.device.type == "cuda" if data.prefetch is None else data.prefetch
        self._pin = prefetch and self.device.type == "cuda"
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="TokenLoader") if prefetch else None
        self._ahead = None  # ((position, size), future) being made in the background

    def _layout(self, epoch):
        """The epoch's shard order, where each of them starts in its stream, and its sequence order (None: in order)."""
        if self._layout_cache is None or self._layout_cache[0] != epoch:
            order, sequences = np.arange(len(self.shards)), None
            if self.shuffle_seed is not None:
                rng = np.random.default_rng([self.shuffle_seed, epoch])
                order = rng.permutation(len(self.shards))
                sequences = rng.permutation(self.num_sequences)
            starts = np.cumsum([0] + [self.sizes[i] for i in order])[:-1].tolist()
            self._layout_cache = (epoch, order.tolist(), starts, sequences)
        return self._layout_cache[1:]

    def _make(self, position, size):
        """This rank's `size` rows of T+1 tokens when `position` sequences have been handed out, on the CPU."""
        buf = torch.empty(size, self.T + 1, dtype=torch.int64, pin_memory=self._pin)
        rows = buf.numpy()
        for r in range(size):
            epoch, j = divmod(position + self.rank * size + r, self.num_sequences)
            order, starts, sequences = self._layout(epoch)
            start = (j if sequences is None else int(sequences[j])) * self.T
            k = bisect.bisect_right(starts, start) - 1
            filled = 0
            while filled < self.T + 1:  # a row may span shards
                shard = self.shards[order[k]]
                lo = start + filled - starts[k]
                take = min(self.T + 1 - filled, len(shard) - lo)
                rows[r, filled:filled + take] = shard[lo:lo + take]
                filled += take
                k += 1
        top = int(rows.max())
        if top >= self.vocab_size:
            why = "the shards were made with another tokenizer; re-create them with python fineweb.py"
            if self.manifest is not None:  # whose token ids were checked at the start: the shard changed since
                why = f"its manifest lists none so large, so a shard is damaged; {remedy(self.data_dir, self.manifest)}"
            raise UserError(f"token id {top} in the {self.split} data of {self.data_dir} is >= the model's "
                            f"vocab_size {self.vocab_size}: {why}")
        return buf

    def next_batch(self, size=None, timer=None):
        """The next `size` sequences of this rank (default B; validation's last batch may hold fewer) on the loader's
        device. timer: a profiling.PhaseTimer, marked "data" once the batch is in host memory, "copy" on the device."""
        key = (self.position, size or self.B)
        if self._ahead is not None and self._ahead[0] == key:
            buf = self._ahead[1].result()
            self._ahead = None
        else:
            self._drop_ahead()
            buf = self._make(*key)
        self.position += self.world_size * key[1]
        if timer is not None:
            timer.mark("data")
        buf = buf.to(self.device, non_blocking=self._pin)  # from pinned memory: an async copy
        if timer is not None:
            timer.mark("copy")
        if self._thread is not None:
            self._ahead = ((self.position, self.B), self._thread.submit(self._make, self.position, self.B))
        return buf[:, :-1], buf[:, 1:]

    def _drop_ahead(self):
        if self._ahead is not None:
            self._ahead[1].exception()  # waits: it shares the layout cache; an error comes again if it is asked for
            self._ahead = None

    def reset(self):
        """Back to the split's first batch (before each validation)."""
        self._drop_ahead()
        self.position = 0

    def state_dict(self):
        """The position after the batches handed out (not a prefetched one), in sequences over all ranks."""
        return {"format": "token-loader-v2", "sequences": self.position, "split": self.split, "seq_len": self.T,
                "shuffle_seed": self.shuffle_seed, "fingerprint": self.fingerprint}

    def load_state_dict(self, sd):
        """Continue where sd (any rank's state_dict(), with any batch size) left off."""
        if not isinstance(sd, dict) or sd.get("format") != "token-loader-v2":
            raise UserError("the loader state is not from TokenLoader: start without resuming the data position")
        mine = self.state_dict()
        for key, what in (("split", "split"), ("seq_len", "sequence length"), ("shuffle_seed", "shuffle seed"),
                          ("fingerprint", "data (shard names and sizes)")):
            if sd.get(key) != mine[key]:
                raise UserError(f"the loader state was saved with another {what} ({sd.get(key)!r}, now "
                                f"{mine[key]!r}): resume with the same settings and data as the saved run")
        self._drop_ahead()
        self.position = int(sd["sequences"])
