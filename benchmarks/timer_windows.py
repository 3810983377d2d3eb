"""Where in each millisecond the host takes the cores away, and which timed calls it hit.

On this project's VM most gaps longer than 20 µs (`benchmarks.probes.clock_gaps`) start at
one or two fixed phases of a 1 ms period, the same on both cores: the timer tick. A call
running across such a phase is the one that meets a gap; the others meet the remaining,
scattered gaps only. Splitting a run's calls by whether they ran across one tells the
host's tail apart from the code's (docs/results.md's figures table reads it per run).

Pure functions of the probe's gaps and the calls' clock readings (`time.perf_counter_ns`,
CLOCK_MONOTONIC: one clock for every process on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the period the gaps repeat with: the kernel's timer tick at HZ=1000
PERIOD_NS = 1_000_000
#: the phase resolution: 20 bins of a period
BIN_NS = 50_000
#: a bin is a window when it holds this many times its share of gaps (1/20 each if the gaps
#: fell anywhere): three times, 15% of the gaps in one bin of 5% of the period
CROWDED = 3.0
#: gaps needed before a phase histogram means anything
MIN_GAPS = 40


@dataclass(frozen=True)
class TimerWindows:
    """Phases of each period where the host's gaps bunch.

    Attributes:
        spans: `(lo, hi)` ns within `[0, period_ns)` (adjacent bins merged; one that wraps
            past the period's end is two spans).
        period_ns: the period.
        share_of_gaps: fraction of the probe's gaps that started inside the windows.
        share_of_time: fraction of each period the windows cover.
        gaps: how many gaps the estimate was made from.
    """

    spans: tuple[tuple[int, int], ...]
    period_ns: int
    share_of_gaps: float
    share_of_time: float
    gaps: int


def find_windows(starts_ns, *, period_ns: int = PERIOD_NS, bin_ns: int = BIN_NS,
                 crowded: float = CROWDED, min_gaps: int = MIN_GAPS) -> TimerWindows | None:
    """The windows of the period where gaps starting at `starts_ns` bunch, or None: too few
    gaps (`min_gaps`), or no bin holding `crowded` times its even share."""
    starts = np.asarray(starts_ns, dtype=np.int64)
    if period_ns % bin_ns:
        raise ValueError(f"bin_ns={bin_ns} must divide period_ns={period_ns}")
    if starts.size < min_gaps:
        return None
    nbins = period_ns // bin_ns
    hist = np.bincount((starts % period_ns) // bin_ns, minlength=nbins)
    hot = hist >= crowded * starts.size / nbins
    if not hot.any():
        return None
    spans, k = [], 0
    while k < nbins:
        if hot[k]:
            j = k
            while j + 1 < nbins and hot[j + 1]:
                j += 1
            spans.append((k * bin_ns, (j + 1) * bin_ns))
            k = j + 1
        else:
            k += 1
    return TimerWindows(spans=tuple(spans), period_ns=period_ns,
                        share_of_gaps=float(hist[hot].sum() / starts.size),
                        share_of_time=float(hot.sum() / nbins), gaps=int(starts.size))


def overlaps(lo_ns, hi_ns, windows: TimerWindows) -> np.ndarray:
    """For each interval `[lo_ns[i], hi_ns[i]]` (clock readings, ns): whether it runs across
    a window of some period (an interval a whole period long always does)."""
    lo = np.asarray(lo_ns, dtype=np.int64)
    hi = np.asarray(hi_ns, dtype=np.int64)
    if np.any(hi < lo):
        raise ValueError("every interval must end at or after its start (hi_ns >= lo_ns)")
    p = windows.period_ns
    length = hi - lo
    phase = lo % p
    hit = length >= p
    for w_lo, w_hi in windows.spans:
        # the interval [phase, phase + length] meets [w_lo, w_hi) or its next repeat
        for shift in (0, p):
            hit |= (phase < w_hi + shift) & (phase + length >= w_lo + shift)
    return hit
