"""core.py on a tiny random GPT and a small bundle in the DCLM format written here: each task type
against a plain re-computation (one option at a time, no batching or packing), the centring
arithmetic, few-shot sampling, truncation, the --model forms, and bad bundles."""

import json
import math
import os
import random
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

import checkpoint
import common
import core
import export
import runs
import tokenizer
from core_bundle import TASKS, task_items, write_bundle, write_items

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1")

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_bundle(tmp_path_factory.mktemp("bundle"))


def reference_option_scores(model, task, item, examples):
    """nanochat's definition, one option at a time: each whole prompt tokenised after <|endoftext|>,
    the last block_size tokens kept, one forward pass each; the scored tokens found by comparing
    the options' token sequences: from where they part to the end (multiple choice), the end they
    share (schema), or what the continuation adds. A sequence that is all shared has none scored
    (nanochat's slice of its losses, from one before the start to one before the end, is empty).
    Returns [(summed loss, token count, all greedy)] per option."""
    enc = tokenizer.get_tokenizer()
    texts = core.prompts(task, item, examples)
    seqs = [[tokenizer.EOT_TOKEN] + enc.encode(t) for t in texts]
    if task.kind == "language_modeling":
        without, full = seqs
        assert full[:len(without)] == without and len(full) > len(without)
        scored = [(full, len(without))]
    elif task.kind == "multiple_choice":
        start = 0
        while all(len(s) > start for s in seqs) and len({s[start] for s in seqs}) == 1:
            start += 1
        scored = [(s, start) for s in seqs]
    else:
        shared = 0
        while all(len(s) > shared for s in seqs) and len({s[-1 - shared] for s in seqs}) == 1:
            shared += 1
        scored = [(s, len(s) - shared) for s in seqs]
    out = []
    for seq, start in scored:
        if start in (0, len(seq)):
            out.append((0.0, 0, True))
            continue
        cut = max(0, len(seq) - model.config.block_size)
        seq, start = seq[cut:], max(1, start - cut)
        tokens = torch.tensor(seq)
        logits, _ = model(tokens[None, :-1])
        losses = F.cross_entropy(logits[0].float(), tokens[1:], reduction="none")[start - 1:]
        greedy = (logits[0].argmax(-1) == tokens[1:])[start - 1:]
        out.append((losses.sum().item(), len(losses), bool(greedy.all())))
    return out


def nanochat_pick(ref):
    """The option nanochat picks from reference_option_scores: min() over the mean losses (NaN for
    an option with nothing scored), then list.index."""
    means = [s / c if c else math.nan for s, c, _ in ref]
    return means.index(min(means))


@torch.no_grad()
def test_every_task_type_matches_the_one_at_a_time_definition(model, bundle):
    """Batched and packed scores equal the one-option-at-a-time definition for multiple choice,
    schema and language modelling, with and without few-shot examples, and so do the accuracies."""
    tasks = core.load_tasks(bundle, None, None)
    assert [t.kind for t in tasks] == [t[1] for t in TASKS] and tasks[1].delimiter == "\nAnswer: "
    enc = tokenizer.get_tokenizer()
    for task in tasks:
        rows, refs = [], []
        for i, item in enumerate(task.items):
            examples = core.fewshot(task.items, i, task.shots)
            rows += core.rows_of(task, item, examples, enc, model.config.block_size)
            refs += reference_option_scores(model, task, item, examples)
        for batch_size in (1, 3, 64):
            *_, (sums, counts, exact) = core.scoring.scored_batches(model, rows, "cpu", batch_size=batch_size)
            assert counts.tolist() == [float(c) for _, c, _ in refs], task.label
            torch.testing.assert_close(sums, torch.tensor([s for s, _, _ in refs], dtype=torch.float64),
                                       rtol=1e-5, atol=1e-4, msg=task.label)
            assert exact.tolist() == [g for _, _, g in refs], task.label
    # the accuracies: each item judged from the reference's scores, where no two options are so
    # close that float rounding could order them either way
    result = core.scoring.evaluate(model, core.Core(tasks), core.scoring.Scoring(batch_size=3))
    for task in tasks:
        right, close = 0, 0
        for i, item in enumerate(task.items):
            ref = reference_option_scores(model, task, item, core.fewshot(task.items, i, task.shots))
            if task.kind == "language_modeling":
                right += ref[0][2]
                continue
            means = [s / c if c else math.nan for s, c, _ in ref]
            finite = sorted(m for m in means if not math.isnan(m))
            close += not math.isnan(means[0]) and len(finite) > 1 and 0 < finite[1] - finite[0] < 1e-4
            right += nanochat_pick(ref) == item["gold"]
        got = result["tasks"][task.label]
        assert got["n"] == len(task.items)
        assert abs(got["acc"] * got["n"] - right) <= close, task.label
        assert got["centered"] == pytest.approx(core.centered(got["acc"], task.baseline))
    assert result["core"] == pytest.approx(sum(r["centered"] for r in result["tasks"].values()) / len(tasks))


# Items where nanochat's rule, not the model, decides: (type, item, right?). A multiple-choice answer
# whose tokens begin every other answer's has nothing scored and a NaN mean, which nanochat's min()
# and list.index pick when it comes first and never elsewhere; schema options with identical
# contexts all have nothing scored; of identical options the first is picked.
DEGENERATE = [
    ("multiple_choice", {"query": "Which one?", "choices": ["the cat", "the cat sees", "the cat runs far"], "gold": 0},
     True),
    ("multiple_choice", {"query": "Which one?", "choices": ["the cat sees", "the cat", "the cat runs far"], "gold": 1},
     False),
    ("multiple_choice", {"query": "Which one?", "choices": ["a red ball", "a red ball"], "gold": 0}, True),
    ("multiple_choice", {"query": "Which one?", "choices": ["a red ball", "a red ball"], "gold": 1}, False),
    ("multiple_choice", {"query": "Which?", "choices": ["the blue sky", "a red ball", "a red ball"], "gold": 2}, False),
    ("schema", {"context_options": ["the dog sees", "the dog sees"], "continuation": "a small boat", "gold": 0}, True),
    ("schema", {"context_options": ["the dog sees", "the dog sees"], "continuation": "a small boat", "gold": 1}, False),
]


@torch.no_grad()
@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_degenerate_items_are_judged_as_nanochat_judges_them(model, batch_size):
    """Each item a task of its own, so that its accuracy is its verdict, among ordinary items that
    change how the rows are batched; the same verdicts at every batch size."""
    tasks = [core.Task(f"degenerate{i}", kind, "", 0, " ", 0.0, [item]) for i, (kind, item, _) in enumerate(DEGENERATE)]
    tasks.append(core.Task("ordinary", "multiple_choice", "", 2, " ", 0.25, task_items("multiple_choice", 9, 5)))
    result = core.scoring.evaluate(model, core.Core(tasks), core.scoring.Scoring(batch_size=batch_size))
    for task, (_, item, right) in zip(tasks, DEGENERATE):
        assert result["tasks"][task.label]["acc"] == float(right), (task.label, item)
        assert (nanochat_pick(reference_option_scores(model, task, item, [])) == item["gold"]) == right


@torch.no_grad()
def test_identical_options_get_identical_scores(model):
    """Identical options are scored once and share the result, whether they share a row or, too
    long for one, each has its own; at any batch size. Options with nothing scored count 0 tokens
    and are exact, as an all() over nothing is."""
    enc = tokenizer.get_tokenizer()
    long_answer = " ".join(["the old house by the river"] * 4)
    items = [(core.Task("mc", "multiple_choice", "", 0, " ", 0.25), item) for kind, item, _ in DEGENERATE[:5]]
    items += [(core.Task("schema", "schema", "", 0, " ", 0.5), DEGENERATE[5][1])]
    # another answer between the two: packed side by side, each on its own, these differed in the
    # last bit on some CPUs
    items += [(core.Task("mc", "multiple_choice", "", 0, " ", 0.25), {"query": q, "choices": [a, b, a, c], "gold": 0})
              for q, a, b, c in [("Q over", "likes old blue sky", "a the boat", "dog house"),
                                 ("Q runs friend runs", "sees a", "ball boat dog small", "sky cat"),
                                 ("Q runs blue friend old red a", "over sees blue runs", "runs runs dog", "likes old")]]
    items += [(core.Task("long", "multiple_choice", "", 0, " ", 0.25),  # a row per option: 3 x 25 tokens > 64
               {"query": "Where?", "choices": [long_answer, "a small boat " * 6, long_answer], "gold": 0})]
    rows, first = [], [0]
    for task, item in items:
        these = core.rows_of(task, item, [], enc, model.config.block_size)
        rows += these
        first.append(first[-1] + sum(len(options) for _, options in these))
    assert len(core.rows_of(*items[-1], [], enc, 64)) == 3
    for batch_size in (1, 3, 4):
        *_, (sums, counts, exact) = core.scoring.scored_batches(model, rows, "cpu", batch_size=batch_size)
        for (task, item), a in zip(items, first):
            options = item.get("choices", item.get("context_options"))
            for j, k in [(j, k) for j in range(len(options)) for k in range(j) if options[j] == options[k]]:
                assert (sums[a + j], counts[a + j], exact[a + j]) == (sums[a + k], counts[a + k], exact[a + k])
        assert counts[first[2]:first[3]].tolist() == [0, 0] and exact[first[2]:first[3]].all()
        assert counts[first[0]] == 0 and counts[first[0] + 1] > 0  # "the cat" begins the other answers


def test_centring_by_hand():
    assert core.centered(0.25, 0.25) == 0.0 and core.centered(1.0, 0.25) == 1.0
    assert core.centered(0.5, 0.25) == pytest.approx(1 / 3)
    assert core.centered(0.5841, 0.62) == pytest.approx(-0.0945, abs=1e-4)  # below chance stays negative
    assert core.centered(0.3, 0.0) == 0.3
    tasks = core.read_tasks(write_bundle(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"b{os.getpid()}")))
    assert [t.baseline for t in tasks] == [0.25, 0.20, 0.50, 0.0, 0.0]  # percent in the csv, fractions here


def test_fewshot_draws_per_item_with_its_seed_and_never_the_item():
    items = [{"context": str(i), "continuation": "x"} for i in range(12)]
    for i in range(12):
        shown = core.fewshot(items, i, 5)
        assert len(shown) == 5 and items[i] not in shown and len({id(x) for x in shown}) == 5
        assert shown == [items[k] for k in random.Random(1234 + i).sample([k for k in range(12) if k != i], 5)]
        assert core.fewshot(items, i, 5) == shown  # the same every time
    assert core.fewshot(items, 0, 0) == [] and len(core.fewshot(items[:3], 0, 10)) == 2  # as many as there are


def test_prompts_are_rendered_as_the_bundle_defines_them():
    mc = core.Task("t", "multiple_choice", "", 1, "\nAnswer: ", 0.25)
    ex = {"query": "Q1", "choices": ["a", "b"], "gold": 1}
    assert core.prompts(mc, {"query": "Q2", "choices": ["c", "d"], "gold": 0}, [ex]) == [
        "Q1\nAnswer: b\n\nQ2\nAnswer: c", "Q1\nAnswer: b\n\nQ2\nAnswer: d"]
    schema = core.Task("t", "schema", "", 1, " ", 0.5)
    ex = {"context_options": ["A", "B"], "continuation": "c.", "gold": 0}
    assert core.prompts(schema, {"context_options": ["X", "Y"], "continuation": "z.", "gold": 1}, [ex]) == [
        "A c.\n\nX z.", "A c.\n\nY z."]
    lm = core.Task("t", "language_modeling", "", 1, " ", 0.0)
    ex = {"context": " one two ", "continuation": "three"}
    assert core.prompts(lm, {"context": "four five\n", "continuation": "six"}, [ex]) == [
        "one two three\n\nfour five", "one two three\n\nfour five six"]  # contexts stripped, and the first prompt


@torch.no_grad()
def test_a_prompt_longer_than_the_context_keeps_its_end(model):
    """Many shots make prompts longer than the model's 64 tokens: each sequence keeps its last 64,
    and is scored as the definition scores that cropped sequence."""
    enc = tokenizer.get_tokenizer()
    task = core.Task("long", "multiple_choice", "", 6, " ", 0.25, task_items("multiple_choice", 10, 3))
    for i, item in enumerate(task.items):
        examples = core.fewshot(task.items, i, task.shots)
        rows = core.rows_of(task, item, examples, enc, model.config.block_size)
        assert all(len(prefix) + sum(len(o) + len(c) for o, c in options) <= 64 for prefix, options in rows)
        *_, (sums, counts, _) = core.scoring.scored_batches(model, rows, "cpu")
        ref = reference_option_scores(model, task, item, examples)
        torch.testing.assert_close(sums, torch.tensor([s for s, _, _ in ref], dtype=torch.float64), rtol=1e-5,
                                   atol=1e-4)
    assert len(enc.encode(core.prompts(task, task.items[0], core.fewshot(task.items, 0, 6))[0])) > 64


def test_limit_takes_the_first_items_of_a_fixed_shuffle(bundle):
    whole = core.load_tasks(bundle, ["mc_zero"], None)[0].items
    some = core.load_tasks(bundle, ["mc_zero"], 4)[0].items
    assert some == whole[:4]
    with open(os.path.join(bundle, "eval_data", "synthetic", "mc_zero.jsonl")) as f:
        in_file = [json.loads(line) for line in f]
    random.Random(1337).shuffle(in_file)
    assert whole == in_file


def test_scores_a_checkpoint_a_log_directory_and_a_hugging_face_directory(model, bundle, tmp_path, capsys):
    """python core.py --model in its three local forms (in this process, through the script's main)."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    ckpt = str(log_dir / "ckpt_000005.pt")
    checkpoint.save_file(ckpt, {"model_config": asdict(model.config), "model": model.state_dict()})
    hf = export.write_hf(model, str(tmp_path / "hf"))
    results = []
    for spec in (ckpt, str(log_dir), hf):
        core.main(["--model", spec, "--bundle-dir", bundle, "--device", "cpu", "--json", "--tasks",
                   "mc_few,lm_few,schema_zero", "--limit", "5"])
        out = capsys.readouterr()
        result = json.loads(out.out)
        assert list(result["tasks"]) == ["mc_few", "schema_zero", "lm_few"]  # the bundle's order
        assert all(r["n"] == 5 for r in result["tasks"].values())
        assert "CORE" in out.err and "over 3 of the 22 tasks" in out.err
        assert result.pop("model") == spec
        results.append(result)
    assert results[0] == results[1]  # the same weights
    for a, b in zip(results[0]["tasks"].values(), results[2]["tasks"].values()):
        assert a["n"] == b["n"]


def test_two_ranks_score_as_one_process(model, bundle, tmp_path):
    """torchrun core.py over 2 gloo ranks: each scores its share (rows of several sizes: the ranks
    agree on the batch count), the counts summed, the same result as one process."""
    ckpt = str(tmp_path / "ckpt_000001.pt")
    checkpoint.save_file(ckpt, {"model_config": asdict(model.config), "model": model.state_dict()})
    args = [os.path.join(REPO, "core.py"), "--model", ckpt, "--bundle-dir", bundle, "--device", "cpu", "--json",
            "--batch-size", "2"]
    one = subprocess.run([runs.python()] + args, capture_output=True, text=True, env=ENV, timeout=600)
    two = subprocess.run([runs.python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] + args,
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-1500:] + two.stderr[-1500:]
    assert "2 process(es)" in two.stderr
    assert json.loads(two.stdout.strip().splitlines()[-1]) == json.loads(one.stdout)


def test_a_closed_stdout_ends_it_quietly(model, bundle, tmp_path):
    """python core.py ... | head, head gone: exit status 1, no traceback."""
    from runs import stdout_closed
    ckpt = str(tmp_path / "ckpt_000001.pt")
    checkpoint.save_file(ckpt, {"model_config": asdict(model.config), "model": model.state_dict()})
    code, err = stdout_closed(os.path.join(REPO, "core.py"), ["--model", ckpt, "--bundle-dir", bundle,
                                                              "--device", "cpu", "--tasks", "mc_zero", "--limit", "2"])
    assert code == 1 and "Traceback" not in err and "Error" not in err, err


def run_main(capsys, argv):
    """core.main as the script runs it: the exit status and the stderr lines."""
    with pytest.raises(SystemExit) as e:
        common.run_main(lambda: core.main(argv))
    return e.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def bad_bundle_cases(tmp_path):
    """Bundles that once read wrongly or failed later: {case: (bundle, what its one line says)}."""
    cases = {}
    b = write_bundle(tmp_path / "twice", tasks=TASKS + [TASKS[0]])
    cases["one label twice"] = (b, "core.yaml: tasks 1 and 6 are both labelled mc_zero: give each task its own label")
    b = write_bundle(tmp_path / "null", tasks=TASKS[:1] + [("no_delimiter", "schema", 0, None, 50.0, 3)])
    cases["null delimiter"] = (b, "core.yaml: task no_delimiter has the continuation_delimiter null: give a string")
    for text in ("nan", "-5", "100", ""):
        rows = [(t[0], text if t[0] == "lm_few" else t[4]) for t in TASKS]
        b = write_bundle(tmp_path / f"baseline{text}", csv_rows=rows)
        cases[f"baseline {text!r}"] = (b, f"eval_meta_data.csv line 5: task lm_few has the random baseline {text!r}")
    b = write_bundle(tmp_path / "latin1")
    with open(os.path.join(b, "eval_data", "synthetic", "mc_few.jsonl"), "ab") as f:
        f.write('{"query": "Caf\u00e9?", "choices": ["a", "b"], "gold": 0}\n'.encode("latin-1"))
    cases["not UTF-8"] = (b, "task mc_few: " + os.path.join(b, "eval_data", "synthetic", "mc_few.jsonl")
                          + " line 9: not UTF-8 text")
    b = write_bundle(tmp_path / "cut")
    with open(os.path.join(b, "eval_data", "synthetic", "mc_zero.jsonl"), "a") as f:
        f.write('{"query": "Question 9: the cat\n')
    cases["cut short"] = (b, "mc_zero.jsonl line 10: not complete JSON: the line ends before its value does")
    # nothing to score: a continuation that merges into the contexts, one that adds no tokens
    b = write_bundle(tmp_path / "glued", tasks=TASKS[:1] + [("glued", "schema", 0, "", 50.0, 2)])
    write_items(b, "glued", [{"context_options": ["the cat", "the dog"], "continuation": " runs", "gold": 0},
                             {"context_options": ["the cat", "the dog"], "continuation": "s", "gold": 1}])
    cases["schema: nothing to score"] = (b, "glued.jsonl line 2: its prompts share no tokens at their end")
    b = write_bundle(tmp_path / "empty", tasks=TASKS[:1] + [("lm_empty", "language_modeling", 0, "", 0.0, 2)])
    write_items(b, "lm_empty", [{"context": "the cat", "continuation": ""}, {"context": "a", "continuation": " b"}])
    cases["language modelling: nothing to score"] = (b, "lm_empty.jsonl line 1: its continuation adds no tokens")
    return cases


def test_bad_bundles_are_one_line_naming_the_file(capsys, tmp_path, model):
    ckpt = str(tmp_path / "ckpt_000001.pt")
    checkpoint.save_file(ckpt, {"model_config": asdict(model.config), "model": model.state_dict()})
    base = ["--model", ckpt, "--device", "cpu"]
    cases = {}
    b = write_bundle(tmp_path / "malformed")
    with open(os.path.join(b, "eval_data", "synthetic", "schema_zero.jsonl"), "a") as f:
        f.write('{"context_options": ["a"], "continuation": 3}\n')
    cases["malformed"] = (b, "schema_zero.jsonl line 8: 'continuation' is missing or not a str")
    b = write_bundle(tmp_path / "nobaseline", csv_rows=[(t[0], t[4]) for t in TASKS if t[0] != "lm_few"])
    cases["no baseline"] = (b, "eval_meta_data.csv has no random baseline for task lm_few")
    b = write_bundle(tmp_path / "unknown", tasks=TASKS[:1] + [("odd", "generation", 0, " ", 0.0, 3)])
    cases["unknown type"] = (b, "core.yaml: task odd has the unknown type 'generation'")
    b = write_bundle(tmp_path / "notjson")
    with open(os.path.join(b, "eval_data", "synthetic", "mc_zero.jsonl"), "a") as f:
        f.write("{not json\n")
    cases["not json"] = (b, "mc_zero.jsonl line 10: not JSON")
    cases["no such task"] = (write_bundle(tmp_path / "fine"), "--tasks: no task 'nope'")
    cases.update(bad_bundle_cases(tmp_path))
    for name, (bundle_dir, expect) in cases.items():
        extra = ["--tasks", "nope"] if name == "no such task" else []
        code, lines = run_main(capsys, base + ["--bundle-dir", bundle_dir] + extra)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], (name, lines)
    code, lines = run_main(capsys, base + ["--bundle-dir", str(tmp_path / "missing")])
    assert code == 2 and len(lines) == 1 and "is not a directory" in lines[0]


def test_the_trainer_reads_and_checks_the_bundle_before_it_starts(tmp_path):
    """--core-bundle is read as the run will read it, items up to --core-limit among them: a bad
    bundle is one line naming the trainer's flag at launch, never a CORE skipped, or a crash, at
    the first evaluation."""
    import evaluation
    import train_config
    argv = ["--log-dir", str(tmp_path / "log"), "--core-every", "100"]

    def resolve(argv):  # the settings, with the evaluations' files checked as the trainer checks them at start
        cfg, _ = train_config.resolve(train_config.parse_args(argv))
        evaluation.prepare(cfg)
        return cfg
    for name, (bundle, expect) in bad_bundle_cases(tmp_path).items():
        with pytest.raises(common.UserError) as e:
            resolve(argv + ["--core-bundle", bundle])
        assert str(e.value).startswith("--core-bundle: ") and expect in str(e.value), name
    with pytest.raises(common.UserError) as e:
        resolve(argv + ["--core-bundle", str(tmp_path / "missing")])
    assert "is not a directory" in str(e.value) and "--bundle-dir" not in str(e.value)
    assert not os.path.exists(tmp_path / "log")
    # the items past --core-limit are not the run's: a bad one there is left alone
    order = list(range(3))
    random.Random(core.SHUFFLE_SEED).shuffle(order)
    continuations = [" runs", " sees", " likes"]
    continuations[order[2]] = "s"  # the item the shuffle puts last
    b = write_bundle(tmp_path / "limited", tasks=TASKS[:1] + [("glued", "schema", 0, "", 50.0, 3)])
    write_items(b, "glued", [{"context_options": ["the cat", "the dog"], "continuation": c, "gold": 0}
                             for c in continuations])
    assert resolve(argv + ["--core-bundle", b, "--core-limit", "2"]).core_bundle == b
    with pytest.raises(common.UserError, match=f"glued.jsonl line {order[2] + 1}: its prompts share no tokens"):
        resolve(argv + ["--core-bundle", b, "--core-limit", "3"])


def test_a_bom_and_a_numeric_label_are_read(tmp_path):
    """Excel's "CSV UTF-8" starts the table with a byte-order mark; YAML reads `label: 2020` as a
    number, which the table names by its text."""
    b = write_bundle(tmp_path / "b", tasks=[("2020", "multiple_choice", 0, " ", 25.0, 4)] + TASKS[1:2])
    path = os.path.join(b, "eval_meta_data.csv")
    with open(path, "rb") as f:
        table = f.read()
    with open(path, "wb") as f:
        f.write(b"\xef\xbb\xbf" + table)
    assert [(t.label, t.baseline) for t in core.read_tasks(b)] == [("2020", 0.25), ("mc_few", 0.20)]
    assert len(core.load_tasks(b, ["2020"], None)[0].items) == 4


def test_a_limit_at_or_below_the_shot_count_says_it_shows_fewer(bundle, capsys, model, tmp_path):
    """nanochat's sampling fails there; here each item shows the others, and a note says so."""
    assert core.fewer_shots(core.load_tasks(bundle, None, 4)) == []  # mc_few 3-shot, lm_few 2-shot
    notes = core.fewer_shots(core.load_tasks(bundle, None, 3))
    assert notes == ["note: task mc_few is 3-shot, but with 3 items each shows only the 2 others: fewer shots "
                     "than the benchmark's (a --limit above 3 gives them all)"]
    ckpt = str(tmp_path / "ckpt_000001.pt")
    checkpoint.save_file(ckpt, {"model_config": asdict(model.config), "model": model.state_dict()})
    core.main(["--model", ckpt, "--bundle-dir", bundle, "--device", "cpu", "--tasks", "mc_few", "--limit", "3"])
    assert notes[0] in capsys.readouterr().err


def test_offline_without_a_bundle_is_one_line_naming_the_flag(capsys, tmp_path, monkeypatch, model):
    monkeypatch.setenv("CORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(common, "unreachable", lambda url, timeout=5.0: "the network is unreachable (test)")
    code, lines = run_main(capsys, ["--model", "gpt2", "--device", "cpu"])
    assert code == 2 and len(lines) == 1 and "--bundle-dir" in lines[0] and "not in the cache" in lines[0]
    assert not os.path.exists(tmp_path / "cache" / "eval_bundle")


def test_the_bundle_downloads_once_and_whole(tmp_path, monkeypatch):
    """The download against a web server on this machine: the zip unpacked into the cache, then
    read from there with the server gone. A damaged zip, one without the bundle or a missing file is
    one line naming the flag for a local copy, and leaves the cache without a bundle or anything
    half-made."""
    import http.server
    import threading
    import zipfile
    source = write_bundle(tmp_path / "src" / "eval_bundle")
    served = tmp_path / "served"
    served.mkdir()
    with zipfile.ZipFile(served / "eval_bundle.zip", "w") as z:
        for root, _, names in os.walk(source):
            for name in names:
                z.write(os.path.join(root, name), os.path.relpath(os.path.join(root, name), tmp_path / "src"))
    (served / "damaged.zip").write_bytes(b"PK\x03\x04 cut short")
    with zipfile.ZipFile(served / "other.zip", "w") as z:
        z.writestr("something/else.txt", "not a bundle")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args):
            pass

    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cache = tmp_path / "cache"
    try:
        site = f"http://127.0.0.1:{server.server_address[1]}"
        for name, problem in [("damaged.zip", "(File is not a zip file)"),
                              ("other.zip", "holds no eval_bundle/core.yaml"), ("missing.zip", "(File not found)")]:
            monkeypatch.setattr(core, "BUNDLE_URL", f"{site}/{name}")
            with pytest.raises(common.UserError) as e:
                core.download(str(cache))
            assert problem in str(e.value) and str(e.value).endswith("pass --bundle-dir path/to/eval_bundle"), name
            assert os.listdir(cache) == [], name
        monkeypatch.setattr(core, "BUNDLE_URL", f"{site}/eval_bundle.zip")
        bundle = core.download(str(cache))
    finally:
        server.shutdown()
        server.server_close()
    assert bundle == str(cache / "eval_bundle") and os.listdir(cache) == ["eval_bundle"]
    assert [t.label for t in core.read_tasks(bundle)] == [t[0] for t in TASKS]
    assert core.download(str(cache)) == bundle  # cached: the server is gone


def test_the_public_bundle_downloads_and_reads(tmp_path):
    """The network path: the real bundle, once (skipped where its host cannot be reached)."""
    problem = common.unreachable(core.BUNDLE_URL, 5.0)
    if problem:
        pytest.skip(f"the CORE bundle's host is not reachable from here: {problem}")
    tasks = core.read_tasks(core.download(str(tmp_path)))
    assert len(tasks) == core.N_CORE_TASKS and {t.kind for t in tasks} == set(core.TASK_TYPES)
    for task in tasks:
        assert core.load_items(task, 3)


def test_a_share_with_nothing_to_score_still_makes_its_forward(model):
    """Under FSDP each batch is a forward every rank makes in step: a rank whose share holds only
    options with nothing to score (a schema item whose contexts are identical) makes its forward
    pass all the same, and yields once for it."""
    enc = tokenizer.get_tokenizer()
    task = core.Task("schema", "schema", "", 0, " ", 0.5)
    rows = core.rows_of(task, DEGENERATE[5][1], [], enc, model.config.block_size)
    calls = []
    hook = model.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        scored = list(core.scoring.scored_batches(model, rows, "cpu"))
    finally:
        hook.remove()
    assert len(scored) == len(calls) == 1
    _, counts, exact = scored[0]
    assert counts.tolist() == [0, 0] and exact.all()

