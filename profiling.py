"""Where a training step's time goes: --timing-breakdown's phase timer, --profile-steps's torch.profiler trace
and --memory-snapshot's record of CUDA's allocations for a step that runs out of memory."""

import argparse
import contextlib
import os
import sys
import time

import torch
from torch.autograd import DeviceType

import device
import memory
from common import UserError


class Flags:
    """This room's flags in the trainer's command line (train_config composes every room's): what a launch profiles,
    its own (a resume does not take them from the run)."""
    ranges, launch_only = {"timing_breakdown": "0 or more"}, ("profile_steps", "memory_snapshot")

    @staticmethod
    def add_flags(a):
        a("--timing-breakdown", type=int, default=0, metavar="N",
          help="every N steps, the time per phase of a step (adds synchronisation, so off by default)")
        a("--profile-steps", type=step_window, metavar="A:B",
          help="torch.profiler over steps A to B: a trace in LOG_DIR/profile/ and the costliest operations in the log")
        a("--memory-snapshot", action="store_true",
          help="CUDA: record allocations, and at an out-of-memory error write a snapshot to LOG_DIR/profile/")

    @staticmethod
    def check_flags(cfg, said):
        if cfg.profile_steps and cfg.profile_steps[1] >= cfg.max_steps:
            raise UserError(f"--profile-steps {cfg.profile_steps[0]}:{cfg.profile_steps[1]} ends after the run's last "
                            f"step, {cfg.max_steps - 1}: profile steps before it, or raise --max-steps")


def step_window(text):
    """'A:B' -> (A, B), both steps included."""
    first, _, last = text.partition(":")
    if not (first.isdecimal() and last.isdecimal()):
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B, two steps (whole numbers, 0 or more)")
    if int(first) > int(last):
        raise argparse.ArgumentTypeError(f"{text!r}: step A comes after step B; write the first step first")
    return int(first), int(last)


class PhaseTimer:
    """Wall time per phase of a step, the GPU synchronised at each boundary, so only when asked for (every > 0)."""

    PHASES = ("data", "copy", "forward", "backward", "optimizer", "eval")  # copy: host to device

    def __init__(self, device_str, every=0):
        self.every, self.device = every, device_str
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        self._t = None

    def start(self):
        self.mark(None)

    def mark(self, phase):
        if self.every:
            device.synchronize(self.device)
            now = time.perf_counter()
            if phase is not None:
                self.totals[phase] += now - self._t
            self._t = now

    def step_done(self, log, step):
        """Every `every` steps, the mean ms per step of each phase since the last report: a log line
        and a timing record."""
        self.steps += 1
        if not self.every or self.steps < self.every:
            return
        ms = {k: 1000 * v / self.steps for k, v in self.totals.items()}
        total = max(sum(ms.values()), 1e-9)
        log.line("timing | " + " | ".join(f"{k}_ms {v:.1f} ({100 * v / total:.0f}%)" for k, v in ms.items()))
        log.record("timing", step=step, **{f"{k}_ms": v for k, v in ms.items()})
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0


class StepProfiler:
    """--profile-steps A:B: torch.profiler over steps A to B, each marked ProfilerStep#N, then a gzipped
    Chrome trace in out_dir and the operations with the most self time, as lines to `write`.
    --memory-snapshot: CUDA's allocations recorded, and a snapshot written at an out-of-memory error."""

    TOP = 8  # operations in the table

    def __init__(self, window, device_str, out_dir, name, write, memory_snapshot=False):
        self.window, self.out_dir, self.name, self.write = window, out_dir, name, write
        self.cuda, self.memory_snapshot, self.prof = device_str.startswith("cuda"), memory_snapshot, None
        if memory_snapshot:  # the last 100,000 allocations and frees, PyTorch's own example's bound
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    @contextlib.contextmanager
    def step(self, step):
        profiled = self.window is not None and self.window[0] <= step <= self.window[1]
        if profiled and self.prof is None:
            from torch.profiler import ProfilerActivity
            self.prof = torch.profiler.profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * self.cuda,
                                               record_shapes=True, profile_memory=True,
                                               acc_events=True)  # one cycle; else torch 2.11-2.12 warn at each start
            self.prof.start()
        try:
            with torch.profiler.record_function(f"ProfilerStep#{step}") if profiled else contextlib.nullcontext():
                yield
        except Exception as e:
            if self.memory_snapshot and memory.is_allocation_failure(e):
                path = self.path("memory_snapshot", "pickle")
                torch.cuda.memory._dump_snapshot(path)
                print(f"out of memory at step {step}: memory snapshot in {path} (drop it on pytorch.org/memory_viz "
                      "to see what held the memory)", file=sys.stderr, flush=True)
            raise
        if profiled and step == self.window[1]:
            self.report()

    def report(self):
        """Stop the profiler, write the trace and the table of what took the most time."""
        self.prof.stop()
        first, last = self.window
        path = self.path(f"steps{first}-{last}", "pt.trace.json.gz")  # Perfetto and TensorBoard read it gzipped
        self.prof.export_chrome_trace(path)
        rows, total = busiest(self.prof.key_averages(), self.cuda)
        steps = last - first + 1
        what = (f"the GPU's kernels and copies, {total / 1e3 / steps:.1f} ms/step summed over its streams (NCCL's "
                "wait for the other ranks included): those with the most time" if self.cuda else
                "the operations with the most self CPU time")
        self.write(f"profile | steps {first}-{last} | trace {path} (ui.perfetto.dev or TensorBoard) | {what}:")
        for e, t in rows[:self.TOP]:
            self.write(f"profile | {t / 1e3 / steps:10.2f} ms/step {100 * t / max(total, 1e-9):5.1f}% "
                       f"{e.count:7d} calls  {e.key}")
        self.prof = None

    def path(self, what, ext):
        """A new file in out_dir, named for this process, what it holds and the time."""
        os.makedirs(self.out_dir, exist_ok=True)
        return os.path.join(self.out_dir, f"{self.name}.{what}.{time.strftime('%Y%m%d-%H%M%S')}.{ext}")


def busiest(averages, cuda):
    """([(event, microseconds)] most first, their sum) of a profile's key_averages(). On CUDA: what ran on the GPU
    (kernels, copies), not the annotations that span it (ProfilerStep#N, a compiled graph's call), nor the CPU
    operators that launched it: each of those holds the same GPU time again. Else: self CPU time."""
    if cuda:
        rows = [(e, e.self_device_time_total) for e in averages
                if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    else:
        rows = [(e, e.self_cpu_time_total) for e in averages]
    rows.sort(key=lambda row: row[1], reverse=True)
    return rows, sum(t for _, t in rows)
