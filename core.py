"""
CORE (Li et al. 2024, "DataComp-LM", section 3.5 and appendix G): 22 in-context tasks, each task's accuracy
centred on its random baseline, (acc - baseline) / (1 - baseline), and their mean: the yardstick of nanochat's
time-to-GPT-2 leaderboard, where OpenAI's GPT-2 scores GPT2_CORE.

    python core.py --model log/ --limit 500 --tasks arc_easy,piqa   # a run's newest checkpoint, 500 items a task
    torchrun --nproc_per_node=8 core.py --model gpt2 --json         # a Hugging Face name or directory

The tasks come from nanochat's DCLM eval bundle, downloaded once into a cache or read from --bundle-dir:
core.yaml lists them (type, few-shot count, the delimiter between question and answer), eval_meta_data.csv
holds their random baselines in percent, eval_data/ one JSONL per task. Three kinds of task:
    multiple_choice    one question, several answers: the lowest mean loss per answer token wins
    schema             several contexts, one continuation: the context giving it the lowest mean loss wins
    language_modeling  right if every continuation token is the model's greedy prediction
Prompts are rendered, and degenerate items judged, as nanochat does, so the numbers compare: docs/evaluation.md
says how.
"""

import csv
import io
import json
import math
import os
import random
import sys
import zipfile
from dataclasses import dataclass, field

import common
import scoring
from common import UserError
from tokenizer import EOT_TOKEN, get_tokenizer

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # ~162 MB, nanochat's
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
N_CORE_TASKS = 22  # in the bundle's core.yaml
# OpenAI's GPT-2 as nanochat measured it: full data, bf16, 1024 tokens (dev/estimate_gpt3_core.ipynb; README)
GPT2_CORE = {"124M": 0.1139, "355M": 0.1849, "774M": 0.2146, "1.5B": 0.2565}
SHUFFLE_SEED = 1337  # each task's items are shuffled with this before --limit (nanochat's base_eval)
FEWSHOT_SEED = 1234  # item i's few-shot examples: random.Random(FEWSHOT_SEED + i)
CACHE = ("CORE_CACHE", "gpt2-core")  # where the download is kept: $CORE_CACHE, else ~/.cache/gpt2-core
FIELDS = {"multiple_choice": {"query": str, "choices": list, "gold": int},
          "schema": {"context_options": list, "continuation": str, "gold": int},
          "language_modeling": {"context": str, "continuation": str}}


def is_bundle(path):
    return os.path.isfile(os.path.join(path, "core.yaml"))


def download(cache_dir=None, flag="--bundle-dir"):
    hint = f"download {BUNDLE_URL} on a machine with network access, unzip it and pass {flag} path/to/eval_bundle"

    def unzip(archive, tmp):
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
        if not is_bundle(os.path.join(tmp, "eval_bundle")):
            raise UserError(f"{BUNDLE_URL} holds no eval_bundle/core.yaml; {hint}")
        return os.path.join(tmp, "eval_bundle")
    return scoring.download(BUNDLE_URL, os.path.join(scoring.cache_dir(cache_dir, *CACHE), "eval_bundle"),
                            "the CORE bundle", hint, unzip, is_bundle)


@dataclass
class Task:
    label: str
    kind: str            # one of TASK_TYPES
    path: str            # its JSONL
    shots: int           # few-shot examples before each item
    delimiter: str       # between a question or context and its answer
    baseline: float      # accuracy of random guessing, a fraction
    items: list = field(default_factory=list)


def read_tasks(bundle_dir, only=None, flag="--bundle-dir"):
    """The bundle's tasks in core.yaml's order (only: the labels to keep); flag: the option that named bundle_dir."""
    import yaml
    if not is_bundle(bundle_dir):
        raise UserError(f"{bundle_dir} is not a directory with core.yaml: pass the unzipped eval_bundle to {flag}")
    spec_path = os.path.join(bundle_dir, "core.yaml")
    meta_path = os.path.join(bundle_dir, "eval_meta_data.csv")
    try:
        reader = csv.DictReader(io.StringIO(read_text(meta_path), newline=""))
        baselines = {row["Eval Task"]: (row["Random baseline"], reader.line_num) for row in reader}
        # YAML reads `label: 2020` as a number; num_fewshot is a list of one
        entries = [(str(e["label"]), e["icl_task_type"], e["num_fewshot"][0], e["dataset_uri"],
                    e.get("continuation_delimiter", " ")) for e in yaml.safe_load(read_text(spec_path))["icl_tasks"]]
    except (KeyError, TypeError, IndexError, csv.Error, yaml.YAMLError) as e:
        raise UserError(f"{bundle_dir} is not a DCLM eval_bundle: its core.yaml or eval_meta_data.csv does not "
                        f"read ({type(e).__name__} {common.first_line(e)})")
    tasks = {}
    for n, (label, kind, shots, uri, delimiter) in enumerate(entries, 1):
        if label in tasks:  # else one would hide the other in the report, and CORE count it twice
            raise UserError(f"{spec_path}: tasks {list(tasks).index(label) + 1} and {n} are both labelled {label}: "
                            f"give each task its own label")
        if kind not in TASK_TYPES:
            raise UserError(f"{spec_path}: task {label} has the unknown type {kind!r} (known: {', '.join(TASK_TYPES)})")
        if not isinstance(delimiter, str):  # a bare `null` would be rendered as "None"
            raise UserError(f"{spec_path}: task {label} has the continuation_delimiter {json.dumps(delimiter)}: give "
                            f"a string in quotes, or leave it out for a space")
        if label not in baselines:
            raise UserError(f"{meta_path} has no random baseline for task {label} (its 'Eval Task' column)")
        text, line = baselines[label]
        try:
            baseline = float(text)
        except (TypeError, ValueError):
            baseline = math.nan
        if not 0 <= baseline < 100:  # NaN too; 100 would centre by dividing by zero
            raise UserError(f"{meta_path} line {line}: task {label} has the random baseline {text!r}: give "
                            f"the accuracy of chance in percent, at least 0 and below 100")
        tasks[label] = Task(label, kind, os.path.join(bundle_dir, "eval_data", uri), shots, delimiter, baseline / 100)
    for name in only or []:
        if name not in tasks:
            raise UserError(f"--tasks: no task {name!r} in {spec_path}; the tasks: {', '.join(tasks)}")
    return [t for t in tasks.values() if not only or t.label in only]


def read_text(path, where=""):
    """A bundle file's text, without the byte-order mark Excel's "CSV UTF-8" puts first."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"{where}cannot read {path} ({e.strerror}): pass the unzipped eval_bundle, whole")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{where}{path} line {line}: not UTF-8 text ({e.reason}): save the file as UTF-8")


def parse_item(line, kind, where):
    fix = f"a {kind} item is a JSON object with " + ", ".join(f"{k} ({t.__name__})" for k, t in FIELDS[kind].items())
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: {common.json_line_problem(line, e)}; {fix}")
    for key, kind_of in FIELDS[kind].items():
        value = item.get(key) if isinstance(item, dict) else None
        if not isinstance(value, kind_of) or isinstance(value, bool):
            raise UserError(f"{where}: {key!r} is missing or not a {kind_of.__name__}; {fix}")
    return item


def load_items(task, limit=None):
    """A task's items, shuffled with SHUFFLE_SEED, the first `limit` of them, each checked."""
    where = f"task {task.label}: "
    lines = enumerate(io.StringIO(read_text(task.path, where), newline=None), 1)
    numbered = [(n, parse_item(line, task.kind, f"{where}{task.path} line {n}")) for n, line in lines if line.strip()]
    if not numbered:
        raise UserError(f"{where}{task.path} holds no items")
    random.Random(SHUFFLE_SEED).shuffle(numbered)
    numbered = numbered[:limit]
    enc = get_tokenizer()
    for n, item in numbered:
        problem = nothing_to_score(task, item, enc)
        if problem:
            raise UserError(f"{where}{task.path} line {n}: {problem}: fix the item or remove it")
    return [item for _, item in numbered]


def load_tasks(bundle_dir, only, limit, flag="--bundle-dir", cache_dir=None):
    """The tasks with their items: from bundle_dir, else the cached (downloaded) bundle."""
    tasks = read_tasks(bundle_dir if bundle_dir is not None else download(cache_dir, flag), only, flag)
    for task in tasks:
        task.items = load_items(task, limit)
    return tasks


def fewer_shots(tasks, flag="--limit"):
    """A note for each task with no more items than its few-shot count (nanochat's sampling fails there)."""
    return [f"note: task {t.label} is {t.shots}-shot, but with {len(t.items)} items each shows only the "
            f"{len(t.items) - 1} others: fewer shots than the benchmark's (a {flag} above {t.shots} gives them all)"
            for t in tasks if t.shots and t.shots >= len(t.items)]


def fewshot(items, index, shots):
    """The examples shown before item `index`: drawn with its own seed, never the item itself."""
    drawn = random.Random(FEWSHOT_SEED + index).sample(range(len(items) - 1), min(shots, len(items) - 1))
    return [items[j + (j >= index)] for j in drawn]  # position j among the others, the item itself left out


def prompts(task, item, examples):
    """The full prompt of each option; language modelling's are (without the continuation, with it), contexts and
    the first prompt stripped (the continuation's first token carries the delimiter's space)."""
    d = task.delimiter
    if task.kind == "multiple_choice":
        shown = "".join(f"{ex['query']}{d}{ex['choices'][ex['gold']]}\n\n" for ex in examples)
        return [f"{shown}{item['query']}{d}{choice}" for choice in item["choices"]]
    if task.kind == "schema":
        shown = "".join(f"{ex['context_options'][ex['gold']]}{d}{ex['continuation']}\n\n" for ex in examples)
        return [f"{shown}{option}{d}{item['continuation']}" for option in item["context_options"]]
    stem = "".join(f"{ex['context'].strip()}{d}{ex['continuation']}\n\n" for ex in examples)
    stem += f"{item['context'].strip()}{d}"
    return [stem.strip(), stem + item["continuation"]]


def common_prefix(seqs):
    return len(os.path.commonprefix(seqs))  # lists too, element by element


def spans(task, seqs):
    """[(sequence, start of its scored tokens)] per option, as nanochat finds them (none: start = the length)."""
    if task.kind == "language_modeling":
        return [(seqs[1], common_prefix(seqs))]  # len(without), unless the continuation re-merged its last tokens
    if task.kind == "multiple_choice":
        start = common_prefix(seqs)  # where the answers part
        return [(s, start) for s in seqs]
    shared = common_prefix([s[::-1] for s in seqs])  # schema: the continuation, shared at the end
    # a sequence that is all shared: nanochat's span starts before its first token, which leaves it empty
    return [(s, len(s) if shared == len(s) else len(s) - shared) for s in seqs]


def nothing_to_score(task, item, enc):
    """Why an item's prompts leave nothing to score, or None. Few-shot examples end in a blank line,
    after which the tokenizer starts afresh: the end of the prompts is the same without them."""
    seqs = [[EOT_TOKEN] + enc.encode_ordinary(p) for p in prompts(task, item, [])]
    if task.kind == "language_modeling" and common_prefix(seqs) >= len(seqs[1]):
        return "its continuation adds no tokens to its context"
    if task.kind == "schema" and common_prefix([s[::-1] for s in seqs]) == 0:
        return "its prompts share no tokens at their end: the continuation is empty, or merges into the contexts"
    return None


def rows_of(task, item, examples, enc, block_size):
    """The item as rows for scoring.scored_batches: one row when its options fit side by side in block_size
    tokens, else a row per option."""
    seqs = [[EOT_TOKEN] + enc.encode_ordinary(p) for p in prompts(task, item, examples)]
    options = []
    for seq, start in spans(task, seqs):
        cut = max(0, len(seq) - block_size)
        options.append((seq[cut:], max(1, start - cut)))
    shared = min(common_prefix([s for s, _ in options]), min(start for _, start in options))
    if shared + sum(len(s) - shared for s, _ in options) <= block_size:
        return [(options[0][0][:shared], [(s[shared:start], s[start:]) for s, start in options])]
    return [(s[:start], [([], s[start:])]) for s, start in options]


def judge(task, item, sums, counts, exact):
    if task.kind == "language_modeling":
        return bool(exact[0])
    means = (sums / counts).tolist()
    # nanochat's pick: min() compares with <, so a NaN first wins and a NaN later never; index() takes the first
    return means.index(min(means)) == item["gold"]


def centered(acc, baseline):
    return (acc - baseline) / (1 - baseline)


class Core:
    """CORE's pieces of an evaluation (scoring.py): every task's items, each named (task index, item index)."""
    name = "core"

    def __init__(self, tasks):
        self.tasks = tasks
        self.items = [(t, i) for t, task in enumerate(tasks) for i in range(len(task.items))]
        self.tallies = (len(tasks), 1)

    def rows(self, item, block_size):
        t, i = item
        task = self.tasks[t]
        return rows_of(task, task.items[i], fewshot(task.items, i, task.shots), get_tokenizer(), block_size)

    def marks(self, item, sums, counts, exact):
        t, i = item
        return t, (judge(self.tasks[t], self.tasks[t].items[i], sums, counts, exact),)

    def result(self, tally):
        results = {}
        for task, (right, n) in zip(self.tasks, tally):
            acc = right / n if n else 0.0
            results[task.label] = {"acc": acc, "centered": centered(acc, task.baseline), "n": n}
        core = sum(r["centered"] for r in results.values()) / len(results)
        return {"core": core, "tasks": results}

    def report(self, result):
        centred = {label: r["centered"] for label, r in result["tasks"].items()}
        return f"{result['core']:.4f} over {len(centred)} tasks", dict(core=result["core"], centered=centred)


def main(argv=None):
    p = common.ArgumentParser(description="CORE (22 in-context tasks, DCLM) of a GPT-2 model.")
    p.add_argument("--bundle-dir", help="the unzipped DCLM eval_bundle (core.yaml, eval_meta_data.csv, eval_data/); "
                                        "default: download it once into the cache")
    p.add_argument("--tasks", default=None, help="comma-separated task labels to score (default: all 22)")
    p.add_argument("--limit", type=int, help="score the first N items per task after a fixed shuffle (default: all)")
    args = scoring.parse_args(p, argv, "core, and each task's acc, centred acc and items", CACHE)
    only = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None

    def load():
        tasks = load_tasks(args.bundle_dir, only, args.limit, cache_dir=args.cache_dir)
        for note in fewer_shots(tasks):
            common.print0(note, file=sys.stderr)
        return Core(tasks)

    def show(result, seconds):
        lines = [f"{'task':34s} {'acc':>7s} {'centred':>8s} {'items':>6s}"]
        for label, r in result["tasks"].items():
            lines.append(f"{label:34s} {r['acc']:7.4f} {r['centered']:8.4f} {r['n']:6d}")
        n = len(result["tasks"])
        of = "" if n == N_CORE_TASKS else f" (over {n} of the {N_CORE_TASKS} tasks: not comparable with the references)"
        refs = ", ".join(f"{size} {v:.4f}" for size, v in GPT2_CORE.items())
        items = sum(r["n"] for r in result["tasks"].values())
        lines += [f"CORE {result['core']:.4f}{of}  (OpenAI GPT-2 as nanochat measures it: {refs})",
                  f"{items / seconds:.1f} items/s"]
        return "\n".join(lines)
    scoring.run_script(args, load, lambda bench: f"{len(bench.tasks)} tasks, {len(bench.items):,} items", show)


if __name__ == "__main__":
    common.run_script(main)
