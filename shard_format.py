"""The token-shard directory's format, said once for its writer (fineweb.py) and its reader (dataloader.py).

A directory holds <prefix>_val_000000.npy, then <prefix>_train_000001.npy, ... (plain uint16 .npy files, as in
build-nanogpt) and manifest.json, which lists each shard with its token count, largest token id, sha256 and where
in the source it ends, and the command that made them; `fineweb.py --verify` checks the shards against it."""

import hashlib
import json
import os
import re
import shlex

import numpy as np

from common import UserError, atomic_write, first_line

MANIFEST = "manifest.json"
FORMAT = "gpt2-token-shards-v1"
TOKENIZER = "gpt2"  # whose token ids the shards hold: the model reads GPT-2's
TOKEN_DTYPE = np.uint16
SHARD_RE = re.compile(r"^(?P<prefix>.+)_(?P<split>val|train)_(?P<index>\d{6})\.npy$")


def shard_name(prefix, index):
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.npy"


def read_manifest(out_dir):
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


def remedy(data_dir, manifest):
    """What to do about a missing, damaged or unfinished shard directory (which may be a copy of the one made)."""
    if manifest is None or not manifest.get("command"):
        return f"prepare it with: python fineweb.py --out-dir {shlex.quote(data_dir)}"
    origin = manifest.get("out_dir")
    if origin and not (os.path.isdir(origin) and os.path.samefile(origin, data_dir)):
        return (f"copy the shards again from {origin} ({data_dir} is a copy of {origin}, made by: "
                f"{manifest['command']}), or re-run that command with --out-dir {shlex.quote(data_dir)}")
    return f"re-run the command that made it (it redoes only what is missing): {manifest['command']}"


def retokenize(manifest):
    """The fineweb.py command that tokenizes a manifest's source again, with GPT-2's tokenizer, into NEW_DIR."""
    source = manifest.get("source") or {}
    if source.get("data_files"):
        what = "--data-files " + " ".join(shlex.quote(f) for f in source["data_files"])
    elif source.get("dataset"):
        what = f"--dataset {shlex.quote(source['dataset'])}" + (f" --name {shlex.quote(source['name'])}"
                                                                  if source.get("name") else "")
    else:
        what = "--data-files YOUR_TEXT"
    return f"python fineweb.py {what} --out-dir NEW_DIR"


# Writing the manifest, and checking the shards against it (fineweb.py, and its --verify)
def write_manifest(out_dir, manifest):
    atomic_write(os.path.join(out_dir, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def intact(out_dir, entry):
    """Whether a listed shard's file is there with all its tokens (its header only: --verify reads every byte)."""
    try:
        return len(np.load(os.path.join(out_dir, entry["name"]), mmap_mode="r")) == entry["tokens"]
    except (OSError, ValueError, EOFError):
        return False


def verify(out_dir):
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
