"""
Plots and a text summary of training runs, from the metrics.jsonl that train_gpt2.py writes (metrics.py).
The PNG's panels, against tokens seen: loss (train per step and smoothed, validation dashed), tokens/s, MFU,
and a panel for each evaluation a run scored (HellaSwag, CORE, ...), drawn as the run record describes it
(evaluation.py: its title, its published figures, whether a figure is over a sample or over other tasks than
theirs); several runs overlay, one colour each.
How the numbers are defined:
- wall time: the sum over launches of (time of its last record - time of its "run" record).
- mean tokens/s: all logged steps weighted by their step time, so warm-up counts for what it cost.
- steady-state tokens/s and MFU: medians past warm-up (the first 10% of the steps, and the first step of
  every launch, with torch.compile and CUDA warm-up), so evaluation and checkpoint stalls do not move them.
- smoothing: an EMA over --smooth N steps (alpha = 2 / (N + 1), pandas' "span"), started at the first value.
- a figure over a sample of a set (HellaSwag's --hellaswag-limit) is drawn hollow, with its 95% half-width near
  chance; a mean over other tasks than the references' (a custom CORE bundle) is not set against them.
"""

import math
import os
import statistics
import sys
import textwrap
import threading

import common
from common import UserError
from checkpoint import list_checkpoints, step_of  # torch-free on import
from metrics import read_metrics, resume_command

LEGEND_WIDTH = 30  # characters per legend line: longer labels wrap, so legends stay narrow


def warmed_up(metrics):
    """Train records without the first step of each launch (torch.compile and CUDA warm-up)."""
    firsts = {launch["first_train_step"] for launch in metrics["launches"]}
    return [r for r in metrics["train"] if r["step"] not in firsts]


def sample_of(records, d):
    """How many items an evaluation scored where its description says it scores a set ("sample") and they are fewer
    than the whole set (--hellaswag-limit), else None: a sample's figure is not comparable with the references."""
    rule = d.get("sample")
    counts = [r[rule["field"]] for r in records if isinstance(r.get(rule["field"]), int)] if rule else []
    return min(counts) if counts and min(counts) < rule["whole"] else None


def half_width(n, chance):
    """The 95% half-width of an accuracy near chance measured on n items (the normal approximation)."""
    return 1.96 * math.sqrt(chance * (1 - chance) / n)


def other_tasks(records, d):
    """How many tasks an evaluation's mean is over where its description says it averages tasks ("tasks") and they
    are not those its references are over (a custom CORE bundle), else None."""
    rule = d.get("tasks")
    found = records[-1].get(rule["field"]) if rule and records else None
    return len(found) if isinstance(found, dict) and len(found) != rule["whole"] else None


def against(records, d):
    """What the summary sets an evaluation's figures against: its references, or why they do not apply."""
    n, tasks = sample_of(records, d), other_tasks(records, d)
    if n is not None:
        rule = d["sample"]
        return (f"a sample of {n} items: chance {rule['chance']}, +/-{half_width(n, rule['chance']):.2f} at 95%; "
                f"the baselines are over all {rule['whole']:,}")
    if tasks is not None:
        return f"over {tasks} tasks: not comparable with {d['tasks']['of']}, over {d['tasks']['whole']}"
    return d.get("against")


def _median(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def summarize(log_dir):
    """The numbers of one run (None where the log has nothing to say); status is the last launch's end reason, or
    "stopped" without one (killed, or running)."""
    m = read_metrics(log_dir)
    train = m["train"]
    runs = [launch["run"] for launch in m["launches"] if launch["run"]]
    run = runs[-1] if runs else {}
    train_cut = (train[-1]["step"] + 1) // 10 if train else 0
    steady = [r for r in warmed_up(m) if r["step"] >= train_cut]
    step_time = sum(r["dt_ms"] for r in train)
    end = m["launches"][-1]["end"]
    s = {
        "log_dir": os.fspath(log_dir),
        "launches": len(runs),
        **{k: run.get(k) for k in ("max_steps", "tokens_per_step", "device_name", "world_size", "per_node", "dtype")},
        "steps": train[-1]["step"] + 1 if train else 0,
        "tokens": train[-1]["tokens"] if train else 0,
        "wall_time_s": sum(launch["last_time"] - launch["start"] for launch in m["launches"]
                           if launch["start"] is not None and launch["last_time"] is not None),
        "tok_per_s_mean": sum(r["tok_per_s"] * r["dt_ms"] for r in train) / step_time if step_time > 0 else None,
        "tok_per_s_steady": _median([r["tok_per_s"] for r in steady]),
        "mfu": _median([r.get("mfu") for r in steady]),
        "status": end["reason"] if end else "stopped",
        "stop_step": end["step"] if end else (train[-1]["step"] if train else None),
        "evaluations": {kind: d["label"] for kind, d in m["evaluations"].items()},
    }
    for kind, d in m["evaluations"].items():  # KIND_best, KIND_best_step, KIND_final, KIND_final_step
        records, field = m.get(kind, []), d["field"]
        pick = min if d["best"] == "min" else max
        best = pick((r for r in records if math.isfinite(r[field])), key=lambda r: r[field], default={})
        last = records[-1] if records else {}
        s.update({f"{kind}_best": best.get(field), f"{kind}_best_step": best.get("step"),
                  f"{kind}_final": last.get(field), f"{kind}_final_step": last.get("step"),
                  f"{kind}_against": against(records, d)})
    saved = list_checkpoints(log_dir)  # the newest is what --resume continues from (where it loads)
    s["checkpoint"] = saved[-1] if saved else None
    s["checkpoint_step"] = step_of(saved[-1]) if saved else None
    return s


def human(n):
    """1234567 -> '1.23M': tokens and tokens/s at a glance."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def format_duration(seconds):
    """Seconds as '1h 02m 03s', '3m 05s' or '12.3s'."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{seconds:.1f}s"


STATUS_WORDS = {"finished": "finished", "signal": "stopped by a signal", "nonfinite": "stopped on a non-finite loss",
                "out_of_memory": "stopped: out of memory", "error": "stopped by an error",
                "stopped": "stopped"}  # "stopped": no end record


def format_summary(s):
    def na(value, fmt):
        return "n/a" if value is None else fmt.format(value)

    lines = [s["log_dir"]]
    if s["device_name"]:
        ranks = f" x{s['world_size']}" if s["world_size"] else ""
        lines.append(f"  device      {s['device_name']}{ranks}, {s['dtype']}")
    of = f" / {s['max_steps']:,}" if s["max_steps"] else ""
    per = f" ({s['tokens_per_step']:,} per step)" if s["tokens_per_step"] else ""
    launches = f", {s['launches']} launches" if s["launches"] > 1 else ""
    lines.append(f"  steps       {s['steps']:,}{of}, {human(s['tokens'])} tokens{per}{launches}")
    lines.append(f"  wall time   {format_duration(s['wall_time_s'])}")
    lines.append(f"  tokens/s    mean {na(s['tok_per_s_mean'], '{:,.0f}')}, "
                 f"steady {na(s['tok_per_s_steady'], '{:,.0f}')} (median past warm-up)")
    lines.append("  MFU         " + (f"{s['mfu']:.1%} (steady median)" if s["mfu"] is not None
                                      else "n/a (peak FLOPs of this device unknown)"))
    for kind, name in s["evaluations"].items():
        against = f" ({s[f'{kind}_against']})" if s.get(f"{kind}_against") else ""
        if s[f"{kind}_best"] is not None:
            lines.append(f"  {name:<11} best {s[f'{kind}_best']:.4f} at step {s[f'{kind}_best_step']}, "
                         f"final {s[f'{kind}_final']:.4f} at step {s[f'{kind}_final_step']}{against}")
    words = STATUS_WORDS.get(s["status"], f"ended ({s['status']})")
    at = f"at step {s['stop_step']}" if s["stop_step"] is not None and s["stop_step"] >= 0 else "before its first step"
    status = f"  status      {words} {at}"
    if s["status"] == "stopped":
        status += " (no end record: killed, or still running)"
    if s["status"] == "finished":
        lines.append(status + (f"; final checkpoint {s['checkpoint']}" if s["checkpoint"] else ""))
    elif s["checkpoint"]:
        command = resume_command(s["log_dir"], s["world_size"] or 1, s["per_node"])
        lines += [status, f"  resume      {command} (continues at step {s['checkpoint_step']} from {s['checkpoint']})"]
    else:
        lines += [status, "  resume      no checkpoint written: a new launch starts from step 0"]
    return "\n".join(lines)


def ema(values, span):
    """Exponential moving average, alpha = 2 / (span + 1); non-finite values are skipped."""
    alpha, avg, out = 2 / (span + 1), None, []
    for v in values:
        if math.isfinite(v):
            avg = v if avg is None else avg + alpha * (v - avg)
        out.append(math.nan if avg is None else avg)
    return out


def default_labels(log_dirs):
    """The paths as given (tryout/log, not log), relative to here where they are below it, else their last two
    parts (MyDrive/gpt2 for /content/drive/MyDrive/gpt2): a legend is 30 characters wide."""
    labels = []
    for d in log_dirs:
        here = os.path.relpath(os.path.abspath(d))
        parts = os.path.normpath(os.path.abspath(d)).split(os.sep)
        labels.append(here if not here.startswith("..") else os.path.join(*parts[-2:]))
    return labels


def thin(x, y, buckets=1500):
    """At most 2 * buckets points: the lowest and highest of each run of consecutive points, so
    spikes survive (a panel is about 600 pixels wide, and 19,073 points took seconds to draw)."""
    k = math.ceil(len(x) / buckets)
    if k <= 1:
        return x, y
    keep = []
    for i in range(0, len(x), k):
        bucket = range(i, min(i + k, len(x)))
        keep += sorted({min(bucket, key=y.__getitem__), max(bucket, key=y.__getitem__)})
    return [x[j] for j in keep], [y[j] for j in keep]


def _curve(ax, records, values, color, label, span):
    """Per-step values against tokens, faint, and their EMA on top; returns what was drawn solid."""
    x = [r["tokens"] for r in records]
    if records and span > 1:
        ax.plot(*thin(x, values), color=color, alpha=0.25, linewidth=0.7)  # no label: the title says it
        values = ema(values, span)
    if records:
        ax.plot(*thin(x, values), color=color, linewidth=1.5, label=label)
    return values


def _points(ax, records, field, color, label, **look):
    """An evaluation's points, joined; look: matplotlib's line settings over these (dashed, hollow markers)."""
    if records and ax is not None:
        ax.plot([r["tokens"] for r in records], [r[field] for r in records],
                **{"marker": "o", "markersize": 3, "color": color, "linewidth": 1.2, "label": label, **look})


def _reference(ax, value, text, color):
    """A baseline across the panel, or, where it is off the panel's axis (a short run's loss, far above GPT-2's),
    named at the edge it lies beyond: the axis fits the runs."""
    bottom, top = ax.get_ylim()
    if bottom <= value <= top:
        ax.axhline(value, color=color, linestyle=":", linewidth=1.2, label=text)
    else:  # bottom left (or top right, for one above): where a falling curve is not
        below = value < bottom
        ax.annotate(f"{'below' if below else 'above'} the axis: {text}", xy=(0.01, 0.015) if below else (0.99, 0.985),
                    xycoords="axes fraction", ha="left" if below else "right", va="bottom" if below else "top",
                    fontsize=8, color=color)


def _late(values):
    """The values after the first 10%: where a y range should look, past the first drop."""
    return [v for v in values[len(values) // 10:] if math.isfinite(v)]


def write_plot(log_dirs, out_png, labels=None, smooth=None):
    """Plot runs into out_png, written atomically; False, writing nothing, when matplotlib is not installed."""
    fig = build_figure(log_dirs, labels, smooth)
    if fig is None:
        return False
    try:
        common.atomic_write(out_png, lambda f: fig.savefig(f, format="png"))
    except OSError as e:  # a read-only location, a full disk
        raise UserError(f"cannot write {out_png} ({e.strerror or e}): give --out a path you can write to")
    return True


def build_figure(log_dirs, labels=None, smooth=None):
    """The runs' panels as a matplotlib Figure (None without matplotlib), made without pyplot to run beside training."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    labels = list(labels) if labels else default_labels(log_dirs)
    runs = [read_metrics(d) for d in log_dirs]
    # one span for every run, so that an ablation and its baseline are smoothed alike: about 4% of the longest
    span = smooth or max(1, min(100, max(len(m["train"]) for m in runs) // 25))
    smoothing = f"EMA over {span} steps" if span > 1 else "per step"
    kinds = {kind: d for m in runs for kind, d in m["evaluations"].items()}
    # a panel of its own for each evaluation that some run recorded and that is not drawn beside the loss (none for
    # runs that never scored it), and no MFU off a GPU; those that say so ("first") come right after the loss
    own = [kind for kind, d in kinds.items() if d["panel"] != "loss" and any(m.get(kind) for m in runs)]
    first = list(dict.fromkeys(kinds[kind]["panel"] for kind in own if kinds[kind].get("first")))
    extra = list(dict.fromkeys(kinds[kind]["panel"] for kind in own if kinds[kind]["panel"] not in first))
    measured = any(r.get("mfu") is not None for m in runs for r in m["train"])
    panels = ["loss", *first, "tps"] + ["mfu"] * measured + extra
    rows = [(panels[i:i + 2] + ["."])[:2] for i in range(0, len(panels), 2)]
    fig = Figure(figsize=(17, 4.5 * len(rows)), dpi=100, layout="constrained")
    ax = fig.subplot_mosaic(rows)
    loss_late, loss_all = [], []
    for i, (m, label) in enumerate(zip(runs, labels)):
        color, train = f"C{i}", m["train"]
        loss = [r["loss"] for r in train]
        smoothed = _curve(ax["loss"], train, loss, color, f"{label} train", span)
        # step -> tokens seen there, each step once; a launch that trained no step (an export) resumed nothing
        resumed = [launch["run"] for launch in m["launches"][1:]
                   if launch["run"] and launch["first_train_step"] is not None]
        resumes = {r["step"]: r["step"] * r["tokens_per_step"] for r in resumed if r.get("tokens_per_step")}
        for j, tokens in enumerate(resumes.values()):
            ax["loss"].axvline(tokens, color=color, linestyle=(0, (1, 3)),
                               label=None if j else f"{label}: resumed at step {', '.join(map(str, resumes))}")
        for kind, d in kinds.items():
            records = m.get(kind, [])
            if d["panel"] == "loss":  # validation, dashed beside the train curve
                _points(ax["loss"], records, d["field"], color, f"{label} {d['label']}", linestyle="--")
                loss_late += _late([r[d["field"]] for r in records])
                loss_all += [r[d["field"]] for r in records if math.isfinite(r[d["field"]])]
                continue
            n_tasks, sample = other_tasks(records, d), sample_of(records, d)  # a sample: hollow
            named = (f"{label} (over {n_tasks} tasks: not comparable with {d['tasks']['of']})" if n_tasks is not None
                     else f"{label} (a sample of {sample} items)" if sample is not None else label)
            hollow = dict(markerfacecolor="none", markersize=5) if sample is not None else {}
            _points(ax.get(d["panel"]), records, d["field"], color, named, **hollow)
        steps = warmed_up(m)
        _curve(ax["tps"], steps, [r["tok_per_s"] for r in steps], color, label, span)
        steps = [r for r in steps if r.get("mfu") is not None]
        if "mfu" in ax:
            _curve(ax["mfu"], steps, [100 * r["mfu"] for r in steps], color, label, span)
        loss_late += _late(smoothed)
        loss_all += [v for v in loss if math.isfinite(v)]
    # the runs' losses, from the lowest up to where the curves are past their first drop: where runs differ
    beside = [ref for d in kinds.values() if d["panel"] == "loss" for ref in d["references"]]
    fallback = [v for v, _, _ in beside] or [0.0]  # no loss yet: where the references are
    low, high = min(loss_all or fallback), max(loss_late or fallback)
    ax["loss"].set_ylim(low - 0.05 * (high - low) - 0.02, high + 0.1 * (high - low) + 0.02)
    references = {"loss": beside}
    for kind in own:  # each panel as its evaluation describes it
        d, recorded = kinds[kind], [m[kind] for m in runs if m.get(kind)]
        whole = [other_tasks(records, d) is None for records in recorded]  # over the tasks of its references
        lines = d["references"] if any(whole) else []
        references[d["panel"]] = lines
        title = d["title"] if all(whole) else d["tasks"]["title"]
        some = [n for records in recorded if (n := sample_of(records, d)) is not None]
        if some:  # hollow points
            n, chance = min(some), d["sample"]["chance"]
            said = f"hollow: a sample of {n} items, +/-{half_width(n, chance):.2f} at 95%"
            title = f"{title[:-1]}; {said})" if title.endswith(")") else f"{title} ({said})"  # inside its brackets
        ax[d["panel"]].set(title=title, ylabel=d["ylabel"])
        if d.get("axis"):  # the range that holds the figures, the references drawn and the axis's own low..high
            at_least, at_most, below, above = d["axis"]
            values = [r[d["field"]] for records in recorded for r in records] + [v for v, _, _ in lines]
            ax[d["panel"]].set_ylim(min([at_least] + values) - below,
                                    max(([] if at_most is None else [at_most]) + values) + above)
    for name, lines in references.items():  # each panel's range set: a baseline off it is named at its edge
        for value, text, color in lines:
            _reference(ax[name], value, text, color)
    dashed = ", ".join(d["label"] for d in kinds.values() if d["panel"] == "loss")  # validation's label
    ax["loss"].set(ylabel="cross-entropy loss (nats/token)",
                   title=f"Loss (train: faint per step, solid {smoothing}; {dashed}: dashed)" if span > 1
                   else f"Loss (train: per step; {dashed}: dashed)")
    ax["tps"].set(title=f"Throughput ({smoothing}; first step of each launch left out)", ylabel="tokens/s (all ranks)",
                  ylim=(0, None))
    ax["tps"].yaxis.set_major_formatter(lambda v, _: human(v))
    if "mfu" in ax:
        ax["mfu"].set(title=f"Model FLOPs utilisation ({smoothing})", ylabel="MFU (% of the device's peak FLOPs)",
                      ylim=(0, None))
    max_tokens = max([1] + [m[k][-1]["tokens"] for m in runs for k in ("train", *kinds) if m.get(k)])
    for panel in ax.values():
        panel.set(xlim=(-0.02 * max_tokens, 1.02 * max_tokens), xlabel="tokens seen")
        panel.xaxis.set_major_formatter(lambda v, _: human(v))
        panel.grid(alpha=0.3)
        handles, texts = panel.get_legend_handles_labels()
        if handles:
            # right of the panel, which the figure's width leaves room for: any corner inside covers some curve
            panel.legend(handles, [textwrap.fill(t, LEGEND_WIDTH) for t in texts], fontsize=8,
                         loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle("GPT-2 training: " + ", ".join(labels))
    return fig


class PlotWriter:
    """Redraws LOG_DIR/plot.png in a background thread (rank 0), never blocking a step."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.thread = None

    def kick(self):
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._draw, daemon=True)
            self.thread.start()

    def _draw(self):
        try:
            write_plot([self.log_dir], os.path.join(self.log_dir, "plot.png"))
        except Exception as e:  # a plot must never take a run down
            print(f"plot: not updated ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

    def join(self):
        if self.thread is not None:
            self.thread.join()


def parse_args(argv=None):
    p = common.ArgumentParser(description="Summarise training runs and plot them against GPT-2's baselines.")
    p.add_argument("log_dirs", nargs="+", metavar="LOG_DIR", help="train_gpt2.py log directories, overlaid in one plot")
    p.add_argument("--out", help="PNG to write (default: LOG_DIR/plot.png for one run, runs.png for several)")
    p.add_argument("--labels", nargs="+", metavar="NAME",
                   help="legend names, one per LOG_DIR (default: the paths as given)")
    p.add_argument("--smooth", type=int, metavar="N",
                   help="EMA span in steps for the per-step curves (default: 4%% of the run, at most 100; 1: none)")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.log_dirs):
        raise UserError(f"--labels has {len(args.labels)} name(s) for {len(args.log_dirs)} log directories")
    if args.smooth is not None and args.smooth < 1:
        raise UserError(f"--smooth {args.smooth}: give a span of at least 1 step (1 means no smoothing)")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = args.out or (os.path.join(args.log_dirs[0], "plot.png") if len(args.log_dirs) == 1 else "runs.png")
    summaries = [summarize(d) for d in args.log_dirs]  # every directory checked before anything prints
    if os.path.isdir(out):
        raise UserError(f"cannot write {out}: it is a directory; give --out the path of a .png file, "
                        f"such as {os.path.join(out, 'runs.png')}")
    for s in summaries:
        print(format_summary(s) + "\n", flush=True)
    if write_plot(args.log_dirs, out, args.labels, args.smooth):
        print(f"wrote {out}")
    else:
        print("matplotlib is not installed: pip install matplotlib to get plots")


if __name__ == "__main__":
    common.run_script(main)
