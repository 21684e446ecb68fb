"""fineweb.py's source: the documents of a Hugging Face dataset (the hub, or the datasets cache offline) or local
--data-files, read through `datasets` as Arrow tables and cut into worker tasks. An input that cannot be read gets
one line naming the file and what to do. `datasets` and pyarrow are imported only where a source is read."""

import codecs
import contextlib
import glob
import os
import re
from collections import Counter

from common import UserError, first_line, hub_unreachable, json_line_problem

FILE_KINDS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}
FILE_TYPES = ", ".join(list(FILE_KINDS)[:-1]) + " or " + list(FILE_KINDS)[-1]  # for messages
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
HUB_NAME = re.compile(r"[\w.\-]+(/[\w.\-]+)?")  # a hub id (owner/name), not a local path
OFFLINE_HINT = ("to work offline, prepare local files instead: "
                "python fineweb.py --data-files 'corpus/*.parquet' --out-dir data/corpus")
READ_DOCS = 256  # documents per Arrow read
TASK_BYTES = 1 << 20  # text per worker task: ~250k tokens, ~0.1 s of tiktoken, IPC cost < 1%


def data_suffix(path):
    """A file's type suffix and the compression after it, lower case: ('.jsonl', '.gz') for a.JSONL.gz."""
    compression = next((c for c in COMPRESSED if path.endswith(c)), "")
    return os.path.splitext(path[:len(path) - len(compression)])[1].lower(), compression


def directory_globs(directory):
    """UserError for --data-files DIR: the globs that would take its data files, the most files first; a
    recursive glob where they are in subdirectories only."""
    found = Counter()
    for sub in ("", "**"):
        for path in glob.glob(os.path.join(directory, sub, "*"), recursive=True):
            ext, compression = data_suffix(path)
            if os.path.isfile(path) and ext in FILE_KINDS:
                found[os.path.join(directory, sub, "*" + ext + compression)] += 1
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
    files = []
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if os.path.isdir(path):
            raise directory_globs(path.rstrip(os.sep) or os.sep)
        found = [os.path.abspath(f) for f in sorted(glob.glob(path, recursive=True)) if os.path.isfile(f)]
        if not found:
            raise UserError(f"--data-files {pattern!r} matches no file")
        files += found
    files = list(dict.fromkeys(files))  # a file two globs match is read once
    for f in files:
        ext = data_suffix(f)[0]
        if ext not in FILE_KINDS:
            raise UserError(f"{f}: unsupported file type {ext or '(none)'!r}; use {FILE_TYPES}")
    kinds = {FILE_KINDS[data_suffix(f)[0]] for f in files}
    if len(kinds) > 1:
        raise UserError(f"--data-files mixes {' and '.join(sorted(kinds))} files; prepare one kind at a time")
    if all(os.path.getsize(f) == 0 for f in files):
        raise UserError(f"the input is empty: every file in --data-files ({len(files)}) has 0 bytes")
    return files, kinds.pop()


def describe_source(args):
    """What the shards are made of; a re-run must describe the same source to continue them."""
    source = {"split": args.split, "text_column": args.text_column}
    if not args.data_files:
        return dict(source, dataset=args.dataset, name=args.name)
    files, kind = resolve_data_files(args.data_files)
    source.update(data_files=files, bytes=[os.path.getsize(f) for f in files], kind=kind)
    if kind == "text":
        source["sample_by"] = args.sample_by
    if kind in ("text", "json"):
        source["encoding_errors"] = args.encoding_errors
    return source


def describe(source):
    if "data_files" in source:
        return f"--data-files ({len(source['data_files'])} {source['kind']} files)"
    config = f" (config {source['name']!r})" if source["name"] else ""
    return f"dataset {source['dataset']!r}{config} split {source['split']!r}"


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
    """Stop at the first byte that is not UTF-8, naming the file: `datasets` fails on one in a .txt file without
    saying which file, and keeps one from a .json file for a later crash. Compressed files are left to it."""
    for path in files:
        offset = None if path.endswith(COMPRESSED) else first_bad_utf8(path)
        if offset is not None:
            raise UserError(f"{path} is not UTF-8 text: byte {offset:,} is not valid UTF-8; convert the file to "
                            "UTF-8, or pass --encoding-errors replace to read such bytes as U+FFFD")


@contextlib.contextmanager
def datasets_errors_held():
    """Hide the ERROR records `datasets` logs just before raising on a file it cannot read (read_failure says it
    in one line instead); warnings and progress bars still show."""
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
    """Where a .json / .jsonl file stops being JSON, or None. A file whose first line is a whole JSON value is
    JSON lines, checked line by line; any other is one JSON document."""
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


def read_failure(source, cause):
    """The one-line error for a source `datasets` failed to read with `cause`, naming the first unreadable local
    file (`datasets` names it only in a log record; compressed files are left to its words)."""
    check = {"parquet": parquet_problem, "json": json_problem}.get(source.get("kind"))
    for path in source.get("data_files", []) if check else []:
        problem = None if path.endswith(COMPRESSED) else check(path)
        if problem:
            return UserError(problem)
    if isinstance(cause, UnicodeDecodeError):  # from a compressed file the UTF-8 check could not open
        return UserError(f"{describe(source)} holds bytes that are not UTF-8 ({first_line(cause)}): convert the files "
                         "to UTF-8, or pass --encoding-errors replace")
    return UserError(f"could not read {describe(source)}: {type(cause).__name__}: {first_line(cause)} "
                     "(an empty or malformed file?)")


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


def load_source(args, source):
    """The documents as a datasets.Dataset (or IterableDataset with --streaming), with at least two tokens where
    that is known before tokenizing; a hub dataset from the datasets cache where the hub cannot be reached."""
    import datasets
    from datasets.exceptions import DatasetGenerationError
    what = describe(source)
    offline = None  # a quick probe of the hub: an offline machine is told at once, not after a minute of retries
    if "data_files" not in source and not os.path.exists(args.dataset) and HUB_NAME.fullmatch(args.dataset):
        offline = hub_unreachable()
    kwargs = dict(split=args.split, streaming=args.streaming, cache_dir=args.cache_dir)
    try:
        with datasets_errors_held():
            if "data_files" in source:
                kwargs.update({k: source[k] for k in ("sample_by", "encoding_errors") if k in source})
                ds = datasets.load_dataset(source["kind"], data_files=source["data_files"], **kwargs)
            elif offline:
                ds = None if args.streaming else load_cached(args, kwargs)
                if ds is None:
                    raise UserError(f"cannot download {what}: {offline}, and it is not in the datasets cache "
                                    f"(--streaming never is); {OFFLINE_HINT}")
            else:
                ds = datasets.load_dataset(args.dataset, name=args.name, **kwargs)
    except DatasetGenerationError as e:
        raise read_failure(source, e.__cause__ or e)
    except FileNotFoundError as e:  # datasets' DatasetNotFoundError is one
        raise UserError(f"{what} not found ({first_line(e)}); check --dataset, or {OFFLINE_HINT}")
    except (ValueError, OSError) as e:  # an unknown config or split, or the hub failing mid-way
        msg = first_line(e)
        if "BuilderConfig" in msg or "Config name is missing" in msg:
            raise UserError(f"{what}: {msg}; pass one of them with --name")
        if "Unknown split" in msg or "Bad split" in msg:
            raise UserError(f"{what}: {msg}; pass it with --split")
        raise UserError(f"could not load {what}: {msg}")

    columns = ds.column_names or list(ds.features or {})  # unknown for some streamed sources: read_tasks checks
    if columns:
        if args.text_column not in columns:
            raise missing_column(source, columns)
        feature = ds.features[args.text_column] if ds.features else None
        if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise UserError(f"column {args.text_column!r} of {what} holds {feature}, not text; "
                            f"choose a text column with --text-column (columns: {', '.join(columns)})")
        ds = ds.select_columns([args.text_column])
    if not args.streaming:
        # each token of GPT-2's byte-level BPE takes a byte of text at least, and each non-null document one
        # <|endoftext|>: too little text for a val and a train split (a token each) is known before tokenizing
        column = ds.data.column(args.text_column)
        if text_bytes(column) + len(ds) - column.null_count < 2:
            raise UserError(f"{what} makes at most 1 token, too few for a validation and a train split: add text")
    return ds


def missing_column(source, columns):
    return UserError(f"{describe(source)} has no column {source['text_column']!r}; its columns are: "
                     f"{', '.join(columns)} (choose one with --text-column)")


def text_bytes(column):
    """UTF-8 bytes of an Arrow string column (nulls count 0), without touching the text."""
    import pyarrow.compute as pc
    return pc.sum(pc.binary_length(column)).as_py() or 0


def read_tasks(ds, start_doc, source):
    """Yield (texts, bytes): runs of consecutive documents of about TASK_BYTES, from start_doc. A streamed
    source is read only here, so a file that fails to read fails here, in one line as in load_source."""
    import pyarrow as pa
    import pyarrow.compute as pc
    column = source["text_column"]
    tables = (ds.skip(start_doc) if start_doc else ds).with_format("arrow").iter(batch_size=READ_DOCS)
    while True:
        try:
            with datasets_errors_held():
                table = next(tables)
        except StopIteration:
            return
        except (pa.ArrowException, ValueError) as e:
            raise read_failure(source, e)
        if table.num_rows == 0:
            continue
        if column not in table.column_names:
            raise missing_column(source, table.column_names)
        col = table.column(column)
        try:
            texts = col.to_pylist()
        except UnicodeDecodeError as e:  # `datasets` puts json text into Arrow without checking its UTF-8
            if source.get("encoding_errors") != "replace":
                raise read_failure(source, e)
            texts = [None if b is None else b.decode("utf-8", "replace")
                     for b in col.cast(pa.large_binary()).to_pylist()]
        start, nbytes = 0, 0
        for i, size in enumerate(pc.fill_null(pc.binary_length(col), 0).to_pylist()):
            nbytes += size
            if nbytes >= TASK_BYTES or i == len(texts) - 1:
                yield texts[start:i + 1], nbytes
                start, nbytes = i + 1, 0
