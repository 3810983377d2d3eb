"""The tail the host alone gives a call: replay calls that never vary over the gaps it took.

A run's gap probes (`benchmarks.probes.clock_gaps`) record, on every rank's core at once,
when the host took the core away and for how long. Replaying back-to-back calls of a fixed
`work` over that record — each needing `work` of its own core on every rank, each core
stopping while it is away, a call done when the last core is — gives the p99/median a call
of that length would have here if its own code never varied: the floor under the measured
tail. The model is the forgiving one: it ignores gaps shorter than the probe's threshold
and lets each core progress on its own, where a real call's ranks also wait for each
other. The probes run before and after a run's calls, not during them, so the floor is an
estimate of the host at the time (checked by `benchmarks/scripts/bench_fixed_work.py`: fixed
work of a call's length measured 1.96-4.61x where its replay gave 1.96-3.88x).

Pure functions of the probes' records (`time.perf_counter_ns`, CLOCK_MONOTONIC: one clock
for every process on the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

#: calls a replay needs before its p99 means anything
MIN_CALLS = 1000


@njit(cache=True)
def _replay_window(work, t0, t1, starts, lengths, before, own_at, bounds, durations,
                   repeats):  # pragma: no cover - numba
    """`replay` over one probe window, run-length coded: the k-th run is `repeats[k]` calls
    of `durations[k]` ns each. Core c's gaps are `[bounds[c], bounds[c + 1])` of `starts`,
    `lengths`, `before` (its time away before each) and `own_at` (its own time since `t0`
    when each begins), sorted. Returns how many runs it wrote."""
    ncores = bounds.size - 1
    n, t = 0, t0
    while t + work <= t1:
        if n >= durations.size:
            return -1                   # more runs than room: the caller's bound is wrong
        # calls that end before any core's next gap take `work` exactly: skip them
        clear = t1
        for c in range(ncores):
            lo, hi = bounds[c], bounds[c + 1]
            k = lo + np.searchsorted(starts[lo:hi], t, side="right")   # gaps begun by t
            if k > lo and starts[k - 1] + lengths[k - 1] > t:
                clear = t                                              # away at t
            elif k < hi and starts[k] < clear:
                clear = starts[k]
        whole = (clear - t) // work
        if whole:
            durations[n], repeats[n] = work, whole
            n += 1
            t += whole * work
            continue
        end = t
        for c in range(ncores):         # each core: its own time at t, plus `work`, on the clock
            lo, hi = bounds[c], bounds[c + 1]
            k = lo + np.searchsorted(starts[lo:hi], t, side="right")
            away = 0 if k == lo else before[k - 1] + min(lengths[k - 1], t - starts[k - 1])
            own = t - t0 - away + work
            k = lo + np.searchsorted(own_at[lo:hi], own, side="left")  # gaps begun before
            end = max(end, t0 + own + (0 if k == lo else before[k - 1] + lengths[k - 1]))
        if end > t1:
            break
        durations[n], repeats[n] = end - t, 1
        n += 1
        t = end
    return n


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
        for _, _, st, ln in per_rank:
            st, ln = np.asarray(st, np.int64), np.asarray(ln, np.int64)
            keep = (st + ln > t0) & (st < t1)
            order = np.argsort(st[keep])
            st, ln = st[keep][order], ln[keep][order]
            before = np.cumsum(ln) - ln
            cores.append((st, ln, before, st - t0 - before))
        bounds = np.cumsum([0] + [c[0].size for c in cores]).astype(np.int64)
        # a gap lengthens at most the call it begins in and the next: runs <= 4 a gap + 1
        cap = 4 * int(bounds[-1]) + 2
        durations, repeats = np.empty(cap, np.int64), np.empty(cap, np.int64)
        n = _replay_window(work_ns, t0, t1, *(np.concatenate([c[i] for c in cores])
                                              for i in range(4)),
                           bounds, durations, repeats)
        if n < 0:
            raise RuntimeError(f"host_floor: more than {cap} runs of calls over {bounds[-1]} "
                               "gaps")
        out.append(np.repeat(durations[:n], repeats[:n]))
    return np.concatenate(out) if out else np.empty(0, np.int64)


def tail_ratio(work_us: float, probes, q: float = 99.0) -> float | None:
    """The `q`-th percentile over the median of `replay`ed calls of `work_us` µs: the tail
    ratio the host alone gives such a call. None if the probes fit fewer than `MIN_CALLS`."""
    d = replay(max(1, int(round(work_us * 1e3))), probes)
    if d.size < MIN_CALLS:
        return None
    return float(np.percentile(d, q) / np.median(d))
