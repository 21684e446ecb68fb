"""How a run's evaluations are described in its run record ("evaluations": {kind: description}): what their records
hold (the headline field, which way is better, the name) and how plot.py draws them (the panel, its title, published
figures to set them against, a sample's and other tasks' rules). evaluation.py's classes write descriptions
(description), metrics.py reads them back (described), for runs logged before descriptions too (EVALUATIONS).
"""

# how plot.py shows an evaluation, in its description (evaluation.Evaluation says what each key means), and what
# each key must hold: a description that holds something else is drawn plainly (its defaults)
SHOWN = dict(title=None, ylabel=None, references=(), against=None, axis=None, first=False, sample=None, tasks=None)
NUMBER, TEXT = (int, float), str
SHAPES = {"title": TEXT, "ylabel": TEXT, "against": (TEXT, type(None)), "first": bool,
          "references": lambda v: isinstance(v, list) and all(_holds(r, [NUMBER, TEXT, TEXT]) for r in v),
          "axis": lambda v: v is None or _holds(v, [NUMBER, (*NUMBER, type(None)), NUMBER, NUMBER]),
          "sample": lambda v: v is None or _holds(v, {"field": TEXT, "whole": int, "chance": NUMBER}),
          "tasks": lambda v: v is None or _holds(v, {"field": TEXT, "whole": int, "title": TEXT, "of": TEXT})}


def _holds(value, shape):
    """Whether value is a list of the types in the list shape, or a dict of the keys and types in the dict shape."""
    if isinstance(shape, list):
        return isinstance(value, list) and len(value) == len(shape) and all(
            isinstance(v, t) and not isinstance(v, bool) for v, t in zip(value, shape))
    return isinstance(value, dict) and all(isinstance(value.get(k), t) for k, t in shape.items())


def description(field, best, label, panel, **shown):
    """An evaluation's description in the run record: its records' headline field, which way is better ("min" or
    "max"), its name, its panel, and how it is shown (SHOWN's keys: by default a title and y label of its field)."""
    unknown = set(shown) - set(SHOWN)
    if unknown:
        raise TypeError(f"description() has no key {sorted(unknown)[0]!r}: SHOWN lists them")
    d = dict(SHOWN, field=field, best=best, label=label, panel=panel, **shown)
    d["title"] = d["title"] or f"{label} ({field}, {'lower' if best == 'min' else 'higher'} is better)"
    d["ylabel"] = d["ylabel"] or field
    d["references"] = [list(r) for r in d["references"]]  # as JSON reads them back: lists
    d["axis"] = list(d["axis"]) if d["axis"] else None
    return d


# the built-in evaluations of runs logged before run records described them, or how they are shown: as
# evaluation.py's describe them (a test holds the two alike)
EVALUATIONS = {
    "val": description("val_loss", "min", "val loss", "loss", against="OpenAI GPT-2 124M: 3.2924", references=[
        [3.2924, "OpenAI GPT-2 124M (val loss on FineWeb-Edu val shard: 3.2924)", "black"]]),
    "hellaswag": description(
        "acc_norm", "max", "HellaSwag", "hellaswag", title="HellaSwag (acc_norm, 0-shot)", ylabel="accuracy",
        references=[[0.337, "GPT-3 124M 0.337 (Brown et al. 2020)", "firebrick"],
                    [0.2955, "OpenAI GPT-2 124M HellaSwag 0.2955", "black"],
                    [0.25, "chance 0.25 (four endings)", "gray"]],
        against="GPT-2 124M: 0.2955, GPT-3 124M: 0.337", axis=[0.24, 0.35, 0.005, 0.01], first=True,
        sample=dict(field="n", whole=10042, chance=0.25)),
    "core": description(
        "core", "max", "CORE", "core", title="CORE (22 in-context tasks, centred accuracy: 0 = chance)", ylabel="CORE",
        references=[[0.2565, "OpenAI GPT-2 1.5B CORE 0.2565 (nanochat)", "firebrick"],
                    [0.1139, "OpenAI GPT-2 124M CORE 0.1139 (nanochat)", "black"]],
        against="GPT-2 124M: 0.1139, 1.5B: 0.2565", axis=[0.0, None, 0.01, 0.02],
        tasks=dict(field="centered", whole=22, title="CORE (centred accuracy: 0 = chance)", of="GPT-2's"))}


def described(records):
    """{kind: description} of the evaluations the run records describe, in their order (EVALUATIONS for a run
    record that predates descriptions; a description that predates SHOWN's keys gets them as it was drawn then,
    one that holds what no reader can use is left out, and one whose SHOWN keys are damaged is drawn plainly). The
    loss is set against GPT-2's validation loss in every run: val's description is there whether it ran or not."""
    found = {}
    for rec in records:
        if rec["kind"] == "run":
            evaluations = rec.get("evaluations")
            found.update(evaluations if isinstance(evaluations, dict) else EVALUATIONS)
    found = {"val": EVALUATIONS["val"], **(found or EVALUATIONS)}
    for kind, d in list(found.items()):
        named = [d.get(k) for k in ("field", "best", "label", "panel")] if isinstance(d, dict) else []
        if not (all(isinstance(v, str) for v in named) and named and named[1] in ("min", "max")):
            del found[kind]
        elif "title" not in d:
            found[kind] = {**(EVALUATIONS.get(kind) or description(*named)), **d}
        elif not all(isinstance(d.get(k), t) if isinstance(t, (type, tuple)) else t(d.get(k))
                     for k, t in SHAPES.items()):
            found[kind] = description(*named)
    return found
