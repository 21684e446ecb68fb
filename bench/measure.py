"""
Measuring, for the benchmarks: timing work on a device (whole training steps with CUDA events,
or calls that take turns), peak memory, and the spread of repeated measurements and of the
ratios between them.

Repeated measurements and their ratios: the benchmarks take turns
(run A, run B, run A, run B, ...) so that a load that comes and goes on the machine falls on both
sides alike, and a ratio is taken pair by pair: repeat i of A over repeat i of B. A speed-up whose
pairs range across 1.0x is within the noise of this machine, and is marked so ("~") rather than
shown as an effect. With one repeat there is no spread to judge: the mark is "?".
"""

import statistics
import sys
import time

import torch

from device import synchronize


class StepTimer:
    """Milliseconds of whole steps: CUDA events on CUDA (GPU timestamps and no syncs beyond the
    step's own, so a step's tail overlaps the next step's start as it does in training), else a
    synchronised perf_counter. Each step's host time is kept as well, as a cross-check."""

    def __init__(self, device):
        self.device, self.cuda, self.events, self.wall = device, device.startswith("cuda"), [], []

    def start(self):
        if self.cuda:
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()
        else:
            synchronize(self.device)
        self._t = time.perf_counter()

    def stop(self):
        if self.cuda:
            self.events[-1][1].record()
        else:
            synchronize(self.device)
        self.wall.append(1e3 * (time.perf_counter() - self._t))

    def times_ms(self):
        if not self.cuda:
            return list(self.wall)
        synchronize(self.device)
        return [start.elapsed_time(end) for start, end in self.events]


def in_turns(fns, device, repeats):
    """Seconds of each of fns over `repeats` turns (fn 0, fn 1, ..., fn 0, fn 1, ...), each call
    synchronised with the device, after one untimed warm-up call each; and each fn's last result."""
    outs = [fn() for fn in fns]
    seconds = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            synchronize(device)
            t0 = time.perf_counter()
            outs[i] = fn()
            synchronize(device)
            seconds[i].append(time.perf_counter() - t0)
    return seconds, outs


def peak_memory(device):
    """(bytes, what was measured) since the last reset_peak_memory_stats."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    try:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss * (1 if sys.platform == "darwin" else 1024), "process peak RSS"
    except ImportError:  # Windows
        return None, None


def spread(values):
    """(median, lowest, highest) of repeated measurements."""
    return statistics.median(values), min(values), max(values)


def paired_ratios(numerators, denominators):
    """numerators[i] / denominators[i]: each pair was measured in the same turn."""
    return [a / b for a, b in zip(numerators, denominators)]


def verdict(ratios):
    """'' when every pair says the same direction; '~' when they range across 1.0 (noise); '?' for
    a single pair (no spread to judge)."""
    if len(ratios) < 2:
        return "?"
    return "~" if min(ratios) <= 1.0 <= max(ratios) else ""


def ratio_text(ratios):
    """'1.23x (1.10-1.31)' plus the verdict mark: the median pair and the range of the pairs."""
    mid, lo, hi = spread(ratios)
    text = f"{mid:.2f}x" if len(ratios) < 2 else f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"
    return text + verdict(ratios)


def value_text(values, fmt="{:,.0f}"):
    """'1,234 (1,200-1,260)': the median and the range of repeated measurements."""
    mid, lo, hi = spread(values)
    return fmt.format(mid) if len(values) < 2 else f"{fmt.format(mid)} ({fmt.format(lo)}-{fmt.format(hi)})"


LEGEND = ("ratios: median of the repeats taken in turn (lowest-highest); ~ the range reaches 1.0x, within "
          "this machine's noise; ? one repeat, no spread to judge")
