"""
fineweb.py's source: the documents it tokenizes, from a Hugging Face dataset (the hub, or the
datasets cache offline) or local --data-files, read through `datasets` as Arrow tables and cut
into worker tasks (read_tasks). Most of this file explains inputs that cannot be read, in one
line naming the file and what to do: a directory given as a glob, bytes that are not UTF-8, a
parquet file with no rows, a line that is not JSON, an unreachable hub.

`datasets` and pyarrow are imported only where a source is read, so that --verify and bad flags
answer without them.
"""

import codecs
import contextlib
import glob
import os
import re

import numpy as np

from common import UserError, first_line, hub_unreachable, json_line_problem

FILE_KINDS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}
FILE_TYPES = ", ".join(list(FILE_KINDS)[:-1]) + " or " + list(FILE_KINDS)[-1]  # for messages
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
HUB_NAME = re.compile(r"[\w.\-]+(/[\w.\-]+)?")  # a hub id (owner/name), not a local path
READ_DOCS = 256          # documents per Arrow read
TASK_BYTES = 1 << 20     # text per worker task: ~250k tokens, ~0.1 s of tiktoken, IPC cost < 1%


# ----------------------------------------------------------------------------------------------
# What the source is: --data-files resolved, or a hub dataset's name


def data_suffix(path):
    """A file's type suffix and the compression after it, lower case: ('.jsonl', '.gz') for a.JSONL.gz."""
    compression = next((c for c in COMPRESSED if path.endswith(c)), "")
    return os.path.splitext(path[:len(path) - len(compression)])[1].lower(), compression


def directory_globs(directory):
    """UserError for --data-files DIR: the globs that would take its data files, by kind, the most
    files first; a recursive glob where they are in subdirectories only."""
    found = {}
    for recursive in (False, True):
        for path in glob.glob(os.path.join(directory, "**" if recursive else "", "*"), recursive=recursive):
            ext, compression = data_suffix(path)
            if os.path.isfile(path) and ext in FILE_KINDS:
                pattern = os.path.join(directory, "**" if recursive else "", "*" + ext + compression)
                found[pattern] = found.get(pattern, 0) + 1
        if found:
            break
    if not found:
        return UserError(f"--data-files {directory} is a directory with no {FILE_TYPES} files in it: "
                         "pass a glob of such files")
    globs = " or ".join(f"'{p}' ({n} file{'s' if n > 1 else ''})"
                        for p, n in sorted(found.items(), key=lambda item: (-item[1], item[0])))
    return UserError(f"--data-files {directory} is a directory: pass a glob of its files, such as {globs}")


def resolve_data_files(patterns):
    """Expand globs (sorted within each, in the order given); all files must be one kind."""
    files, seen = [], set()
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if os.path.isdir(path):
            raise directory_globs(path.rstrip(os.sep) or os.sep)
        found = sorted(glob.glob(path, recursive=True))
        found = [f for f in found if os.path.isfile(f)]
        if not found:
            raise UserError(f"--data-files {pattern!r} matches no file")
        files += [f for f in map(os.path.abspath, found) if f not in seen]
        seen.update(files)
    kinds = set()
    for f in files:
        ext, _ = data_suffix(f)
        if ext not in FILE_KINDS:
            raise UserError(f"{f}: unsupported file type {ext or '(none)'!r}; use {FILE_TYPES}")
        kinds.add(FILE_KINDS[ext])
    if len(kinds) > 1:
        raise UserError(f"--data-files mixes {' and '.join(sorted(kinds))} files; prepare one kind at a time")
    if all(os.path.getsize(f) == 0 for f in files):
        raise UserError(f"the input is empty: every file in --data-files ({len(files)}) has 0 bytes")
    return files, kinds.pop()


def describe_source(args):
    """What the shards are made of; a re-run must describe the same source to continue them."""
    if args.data_files:
        files, kind = resolve_data_files(args.data_files)
        source = {"data_files": files, "bytes": [os.path.getsize(f) for f in files], "kind": kind,
                  "split": args.split}
        if kind == "text":
            source["sample_by"] = args.sample_by
        if kind in ("text", "json"):
            source["encoding_errors"] = args.encoding_errors
    else:
        source = {"dataset": args.dataset, "name": args.name, "split": args.split}
    source["text_column"] = args.text_column
    return source


def describe(source):
    """A short description of the data source for the progress lines."""
    if "data_files" in source:
        return f"{len(source['data_files'])} local {source['kind']} file(s), column {source['text_column']!r}"
    name = f" ({source['name']})" if source["name"] else ""
    return f"{source['dataset']}{name} split {source['split']!r}, column {source['text_column']!r}"


# ----------------------------------------------------------------------------------------------
# Checks before reading, and the one-line errors for a source that cannot be read


def first_bad_utf8(path, chunk=1 << 23):
    """Offset of the first byte of a file that is not UTF-8, or None."""
    decoder, pos = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            held = len(decoder.getstate()[0])  # the start of a character cut by the last chunk's end
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                return pos - held + e.start
            if not data:
                return None
            pos += len(data)


def check_utf8(files):
    """Stop at the first byte that is not UTF-8, naming the file: `datasets` fails on one in a
    .txt file without saying which file, and keeps one from a .json file for a later crash.
    Compressed files are left to `datasets` (load_source words its error)."""
    for path in files:
        offset = None if path.endswith(COMPRESSED) else first_bad_utf8(path)
        if offset is not None:
            raise UserError(f"{path} is not UTF-8 text: byte {offset:,} is not valid UTF-8; convert the file to "
                            "UTF-8, or pass --encoding-errors replace to read such bytes as U+FFFD")


def hub_problem(args, source):
    """Why the hub cannot be reached, when the source is a hub dataset; None otherwise. A quick
    probe, so that an offline machine is told at once instead of after a minute of retries."""
    if "data_files" in source or os.path.exists(args.dataset) or not HUB_NAME.fullmatch(args.dataset):
        return None
    return hub_unreachable()


@contextlib.contextmanager
def datasets_errors_held():
    """`datasets` logs a file it cannot read, with pyarrow's message, just before it raises; the
    caller words that error in one line (naming the file: unreadable_file), so such records are
    dropped from its handlers meanwhile. Warnings and progress bars still show."""
    import logging
    handlers = logging.getLogger("datasets").handlers

    def below_error(record):
        return record.levelno < logging.ERROR
    for h in handlers:
        h.addFilter(below_error)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(below_error)


def parquet_problem(path):
    """Why a parquet file cannot be read, or None. `datasets` fails on a file with no rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError, ValueError) as e:
        return f"{path} is not a parquet file ({first_line(e)}): leave it out of --data-files"
    if rows == 0:
        return f"{path} holds no rows (an empty parquet file): leave it out of --data-files"
    return None


def json_problem(path):
    """Where a .json / .jsonl file stops being JSON, or None. A file whose first line is a whole
    JSON value is JSON lines, checked line by line; any other is one JSON document."""
    import json

    def bad(number, problem):
        return f"{path}, line {number}: {problem}: fix that line, or leave the file out"
    with open(path, encoding="utf-8", errors="replace") as f:
        first = True
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                if not first:
                    return bad(number, json_line_problem(line, e))
                break  # the first line is not a whole value: the file is one JSON document
            first = False
        else:
            return None
        f.seek(0)
        try:
            json.load(f)
        except json.JSONDecodeError as e:
            return bad(e.lineno, f"not JSON ({e.msg})")
    return None


def unreadable_file(source):
    """The first local file `datasets` cannot read, as a one-line error, or None; asked once it has
    failed, since it names the file only in a log record (compressed files are left to its words)."""
    check = {"parquet": parquet_problem, "json": json_problem}.get(source.get("kind"))
    for path in source.get("data_files", []) if check else []:
        problem = None if path.endswith(COMPRESSED) else check(path)
        if problem:
            return problem
    return None


def read_failure(source, what, cause):
    """The one-line error for a source `datasets` failed to read; cause: the exception it raised."""
    problem = unreadable_file(source)
    if problem:
        return UserError(problem)
    if isinstance(cause, UnicodeDecodeError):  # from a compressed file the UTF-8 check could not open
        return UserError(f"{what} holds bytes that are not UTF-8 ({first_line(cause)}): convert the files "
                         "to UTF-8, or pass --encoding-errors replace")
    return UserError(f"could not read {what}: {type(cause).__name__}: {first_line(cause)} "
                     "(an empty or malformed file?)")


# ----------------------------------------------------------------------------------------------
# Reading


def load_cached(args, kwargs):
    """A hub dataset from the datasets cache without the network, or None if it is not there.
    `datasets` and huggingface_hub read HF_HUB_OFFLINE at import, so their copies are set."""
    import datasets
    import datasets.config as dconf
    import huggingface_hub.constants as hconf
    from datasets.load import CachedDatasetModuleFactory
    try:  # the lookup load_dataset itself falls back on when the hub fails: a glob of the cache
        CachedDatasetModuleFactory(args.dataset, cache_dir=args.cache_dir).get_module()
    except OSError:
        return None
    saved = dconf.HF_HUB_OFFLINE, hconf.HF_HUB_OFFLINE
    dconf.HF_HUB_OFFLINE = hconf.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(args.dataset, name=args.name, **kwargs)
    finally:
        dconf.HF_HUB_OFFLINE, hconf.HF_HUB_OFFLINE = saved


def load_source(args, source, offline=None):
    """The documents as a datasets.Dataset (or IterableDataset with --streaming), one column.
    offline: why the hub cannot be reached (then only the datasets cache is tried)."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError, DatasetGenerationError
    offline_hint = ("to work offline, prepare local files instead: "
                    "python fineweb.py --data-files 'corpus/*.parquet' --out-dir data/corpus")
    what = f"dataset {args.dataset!r}" + (f" (config {args.name!r})" if args.name else "")
    kwargs = dict(split=args.split, streaming=args.streaming, cache_dir=args.cache_dir)
    try:
        with datasets_errors_held():
            if "data_files" in source:
                what = f"--data-files ({len(source['data_files'])} {source['kind']} files)"
                if source["kind"] == "text":
                    kwargs["sample_by"] = source["sample_by"]
                if source["kind"] in ("text", "json"):
                    kwargs["encoding_errors"] = source["encoding_errors"]
                ds = datasets.load_dataset(source["kind"], data_files=source["data_files"], **kwargs)
            elif offline:
                ds = None if args.streaming else load_cached(args, kwargs)
                if ds is None:
                    raise UserError(f"cannot download {what}: {offline}, and it is not in the datasets cache "
                                    f"(--streaming never is); {offline_hint}")
            else:
                ds = datasets.load_dataset(args.dataset, name=args.name, **kwargs)
    except DatasetNotFoundError as e:
        raise UserError(f"{what} not found on the Hugging Face hub ({first_line(e)}); "
                        f"check --dataset, or {offline_hint}")
    except ConnectionError as e:
        raise UserError(f"could not reach the Hugging Face hub for {what} ({first_line(e)}); {offline_hint}")
    except DatasetGenerationError as e:
        raise read_failure(source, what, e.__cause__ or e)
    except ValueError as e:
        msg = first_line(e)
        if "BuilderConfig" in msg or "Config name is missing" in msg:
            raise UserError(f"{what}: {msg}; pass one of them with --name")
        if "Unknown split" in msg or "Bad split" in msg:
            raise UserError(f"{what}: {msg}; pass it with --split")
        raise UserError(f"could not load {what}: {msg}")
    except FileNotFoundError as e:
        raise UserError(f"{what} not found ({first_line(e)}); check --dataset, or {offline_hint}")

    columns = ds.column_names or list(ds.features or {})  # unknown for some streamed sources
    if columns and args.text_column not in columns:
        raise UserError(f"{what} has no column {args.text_column!r}; its columns are: "
                        f"{', '.join(columns)} (choose one with --text-column)")
    feature = ds.features[args.text_column] if ds.features else None
    if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise UserError(f"column {args.text_column!r} of {what} holds {feature}, not text; "
                        f"choose a text column with --text-column (columns: {', '.join(columns)})")
    if columns:  # else read_tasks checks the column, as the source says it
        ds = ds.select_columns([args.text_column])
    if not args.streaming and len(ds) == 0:
        raise UserError(f"the input is empty: {what} has no documents")
    return ds


def text_bytes(column):
    """UTF-8 bytes of an Arrow string column (nulls count 0), without touching the text."""
    import pyarrow.compute as pc
    return pc.sum(pc.binary_length(column)).as_py() or 0


def arrow_tables(ds, source):
    """ds as Arrow tables of READ_DOCS documents. A streamed source is read only here, so a file
    that fails to read fails here, in one line as in load_source."""
    import pyarrow as pa
    tables = ds.with_format("arrow").iter(batch_size=READ_DOCS)
    while True:
        try:
            with datasets_errors_held():
                table = next(tables)
        except StopIteration:
            return
        except (pa.ArrowException, ValueError) as e:
            raise read_failure(source, describe(source), e)
        yield table


def read_tasks(ds, start_doc, column, source, encoding_errors="strict"):
    """Yield (texts, bytes): runs of consecutive documents of about TASK_BYTES, from start_doc."""
    import pyarrow as pa
    import pyarrow.compute as pc
    if start_doc:
        ds = ds.skip(start_doc)
    doc = start_doc
    for table in arrow_tables(ds, source):
        if table.num_rows == 0:
            continue
        if column not in table.column_names:  # a streamed source may say its columns only now
            raise UserError(f"the source has no column {column!r}; its columns are: "
                            f"{', '.join(table.column_names)} (choose one with --text-column)")
        col = table.column(column)
        try:
            texts = col.to_pylist()
        except UnicodeDecodeError as e:  # `datasets` puts json text into Arrow without checking its UTF-8
            if encoding_errors == "strict":
                raise UserError(f"a document from number {doc:,} on is not UTF-8 ({first_line(e)}): convert the "
                                "input to UTF-8, or pass --encoding-errors replace")
            texts = [None if b is None else b.decode("utf-8", "replace")
                     for b in col.cast(pa.large_binary()).to_pylist()]
        doc += table.num_rows
        sizes = np.cumsum(pc.fill_null(pc.binary_length(col), 0).to_numpy())
        # cut where the running byte count crosses each multiple of TASK_BYTES
        cuts = np.searchsorted(sizes, np.arange(TASK_BYTES, sizes[-1], TASK_BYTES), side="left") + 1
        prev = 0
        for cut in list(np.unique(cuts)) + [len(texts)]:
            if cut > prev:
                yield texts[prev:cut], int(sizes[cut - 1] - (sizes[prev - 1] if prev else 0))
                prev = cut
