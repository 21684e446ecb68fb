"""A small CORE bundle in the DCLM eval_bundle's real format (core.yaml, eval_meta_data.csv,
eval_data/*.jsonl), written by the tests that score one: every task type, with and without
few-shot examples, and the two delimiters the real bundle uses."""
import csv
import json
import os
import random

WORDS = "the cat dog sees a red ball runs over old house blue sky small boat friend likes".split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def task_items(kind, n, seed):
    """n items of a task type, in the bundle's JSONL fields."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        if kind == "multiple_choice":  # answers of different lengths, some sharing their first words
            choices = [sentence(rng, rng.randint(1, 4)) for _ in range(rng.choice([2, 4, 5]))]
            choices[-1] = choices[0] + " " + sentence(rng, 1)  # one answer extends another
            items.append({"query": f"Question {i}: {sentence(rng, rng.randint(3, 8))}?", "choices": choices,
                          "gold": rng.randrange(len(choices))})
        elif kind == "schema":
            options = [f"{sentence(rng, 3)} {w}" for w in rng.sample(WORDS, 2)]
            items.append({"context_options": options, "continuation": sentence(rng, rng.randint(1, 5)),
                          "gold": rng.randrange(2)})
        else:
            items.append({"context": f"  {sentence(rng, rng.randint(2, 9))} ", "continuation": sentence(rng, 2)})
    return items


# label, type, shots, delimiter, baseline (%), items
TASKS = [("mc_zero", "multiple_choice", 0, " ", 25.0, 9), ("mc_few", "multiple_choice", 3, "\nAnswer: ", 20.0, 8),
         ("schema_zero", "schema", 0, " ", 50.0, 7), ("lm_few", "language_modeling", 2, " ", 0.0, 8),
         ("lm_answer", "language_modeling", 1, "\nAnswer: ", 0.0, 5)]


def write_bundle(root, tasks=TASKS, yaml_extra="", csv_rows=None):
    """A bundle laid out as DCLM's eval_bundle: core.yaml, eval_meta_data.csv, eval_data/<uri>."""
    os.makedirs(os.path.join(root, "eval_data", "synthetic"), exist_ok=True)
    lines = ["icl_tasks:"]
    for n, (label, kind, shots, delim, _, count) in enumerate(tasks):
        uri = f"synthetic/{label}.jsonl"
        with open(os.path.join(root, "eval_data", uri), "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in task_items(kind, count, n))
        lines += ["-", f"  label: {label}", f"  dataset_uri: {uri}", f"  num_fewshot: [{shots}]",
                  f"  icl_task_type: {kind}", f"  continuation_delimiter: {json.dumps(delim)}"]
    with open(os.path.join(root, "core.yaml"), "w") as f:
        f.write("\n".join(lines) + "\n" + yaml_extra)
    with open(os.path.join(root, "eval_meta_data.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline",
                    "Centered Metric?", "Description"])
        for row in csv_rows if csv_rows is not None else [(t[0], t[4]) for t in tasks]:
            w.writerow([row[0], "test", "test", 0, 0, row[1], "Yes", "synthetic"])
    return str(root)


def write_items(root, label, items):
    """Replace the items of task `label` in the bundle at root with these (dicts, or lines as text)."""
    with open(os.path.join(root, "eval_data", "synthetic", f"{label}.jsonl"), "w") as f:
        f.writelines((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items)
