"""The tail the host alone gives a call: replay calls that never vary over the gaps it took.

A run's gap probes (`ubep.bench.flags.clock_gaps`) record, on every rank's core at once,
when the host took the core away and for how long. Replaying back-to-back calls of a fixed
`work` over that record — each needing `work` of its own core on every rank, each core
stopping while it is away, a call done when the last core is — gives the p99/median a call
of that length would have here if its own code never varied: the floor under the measured
tail. The model is the forgiving one: it ignores gaps shorter than the probe's threshold
and lets each core progress on its own, where a real call's ranks also wait for each
other, so a measured ratio is at least this floor (docs/results.md, "The host's own gaps").

Pure functions of the probes' records (`time.perf_counter_ns`, CLOCK_MONOTONIC: one clock
for every process on the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: calls a replay needs before its p99 means anything
MIN_CALLS = 1000


class _Core:
    """One core's gaps within a probe: its own progress against the clock."""

    def __init__(self, starts: np.ndarray, lengths: np.ndarray, t0: int):
        order = np.argsort(starts)
        self.starts, self.lengths = starts[order], lengths[order]
        self.cum = np.cumsum(self.lengths)              # time away up to the end of gap i
        self.before = self.cum - self.lengths           # ... up to its start
        self.t0 = t0
        self.at_progress = self.starts - t0 - self.before   # progress when gap i begins

    def progress(self, t: int) -> int:
        """The core's own time (ns) from `t0` to `t`, its gaps left out."""
        k = int(np.searchsorted(self.starts, t, "right"))      # gaps begun by t
        away = 0 if k == 0 else int(self.before[k - 1]
                                    + min(self.lengths[k - 1], t - self.starts[k - 1]))
        return t - self.t0 - away

    def time_at(self, p: int) -> int:
        """The clock reading at which the core has had `p` ns of its own since `t0`."""
        k = int(np.searchsorted(self.at_progress, p, "left"))   # gaps begun before p
        return self.t0 + p + (0 if k == 0 else int(self.cum[k - 1]))

    def clear_until(self, t: int, limit: int) -> int:
        """How far from `t` the core runs without a gap (up to `limit`); `t` itself if it is
        away at `t`."""
        k = int(np.searchsorted(self.starts, t, "right"))
        if k and self.starts[k - 1] + self.lengths[k - 1] > t:
            return t
        return limit if k == len(self.starts) else min(limit, int(self.starts[k]))


def replay(work_ns: int, probes: Sequence[Sequence[tuple[int, int, np.ndarray, np.ndarray]]]
           ) -> np.ndarray:
    """Durations (ns) of back-to-back calls of `work_ns` each over every probe window, in
    the order they ran.

    `probes[k][r]` is rank r's k-th probe: `(first, last, starts, lengths)`, its first and
    last clock readings and its gaps' starts and lengths (ns). Calls run in the window every
    rank was probing (the latest first reading to the earliest last one), the next starting
    when the last core finished the previous one.
    """
    if work_ns <= 0:
        raise ValueError(f"work_ns={work_ns} must be > 0")
    out: list[np.ndarray] = []
    for per_rank in probes:
        t0 = max(int(p[0]) for p in per_rank)
        t1 = min(int(p[1]) for p in per_rank)
        cores = []
        for _, _, starts, lengths in per_rank:
            starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
            keep = (starts + lengths > t0) & (starts < t1)
            cores.append(_Core(starts[keep], lengths[keep], t0))
        t = t0
        while t + work_ns <= t1:
            # calls that end before any core's next gap take `work_ns` exactly: skip them
            whole = (min(c.clear_until(t, t1) for c in cores) - t) // work_ns
            if whole:
                out.append(np.full(whole, work_ns, np.int64))
                t += whole * work_ns
                continue
            end = max(c.time_at(c.progress(t) + work_ns) for c in cores)
            if end > t1:
                break
            out.append(np.array([end - t], np.int64))
            t = end
    return np.concatenate(out) if out else np.empty(0, np.int64)


def tail_ratio(work_us: float, probes, q: float = 99.0) -> float | None:
    """The `q`-th percentile over the median of `replay`ed calls of `work_us` µs: the tail
    ratio the host alone gives such a call. None if the probes fit fewer than `MIN_CALLS`."""
    d = replay(max(1, int(round(work_us * 1e3))), probes)
    if d.size < MIN_CALLS:
        return None
    return float(np.percentile(d, q) / np.median(d))
