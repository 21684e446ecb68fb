"""
Writing a token-shard directory, for fineweb.py: ShardWriter cuts the token stream into the val
shard and train shards and writes each one with its manifest entry; plan_resume picks the shards
an interrupted run keeps; verify checks every shard against its checksum (fineweb.py --verify).
The format itself is shard_format.py's; the trainer reads it with dataloader.py and never
imports this file.
"""

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common import UserError, atomic_write, out_of_space
from shard_format import MANIFEST, TOKEN_DTYPE, read_manifest, remedy, shard_name

VAL_SHARE = 10  # a corpus under VAL_SHARE * val_tokens gives 1/VAL_SHARE of its tokens to validation


# ----------------------------------------------------------------------------------------------
# The manifest and checksums


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
# Writing


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
