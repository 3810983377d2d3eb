"""The host's own gaps and speed, probed on every rank's core around a bench run, and what they
explain of its figures.

`clock_gaps` reads the clock back to back on one core and records every gap longer than a
threshold: the times the host took the core away (other tenants of the VM, interrupts, the
kernel's own work), which any call running then waits out. `loop_speed` times a fixed loop
of Python arithmetic: on a VM whose cores share physical cores with other tenants it runs at
two speeds ~1.8x apart, switching from one second to the next, and a median read in the slow
one is not the code's.

`HostProbes` runs both on every rank at once before and after a run's timed points (the
`probe` of `ubep.bench.run.run_bench`); `host_record` then reads the run with them: where
in each millisecond the gaps bunch (`timer_windows`), which timed calls ran across such a
window, and the tail the host's gaps alone give a call of each row's median (`host_floor`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.host_floor import tail_ratio
from benchmarks.timer_windows import TimerWindows, find_windows, overlaps


@dataclass
class GapLog:
    """What `clock_gaps` saw on one core over one or more probes (ns, `time.perf_counter_ns`,
    one clock for every process on the host).

    Attributes:
        probes: each probe's `(first, last, starts, lengths)`: its first and last clock
            readings, and the start and length of every gap it saw (int64 arrays).
    """

    probes: list[tuple[int, int, np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def starts(self) -> np.ndarray:
        """Every probe's gap starts, in one array (`benchmarks.timer_windows`)."""
        return np.concatenate([p[2] for p in self.probes] or [np.empty(0, np.int64)])


def clock_gaps(seconds: float, min_us: float = 20.0, log: GapLog | None = None) -> list[int]:
    """The gaps longer than `min_us` (ns each) in `seconds` of reading the clock back to back
    on this thread. `log`, if given, gets the probe's span and each gap's start and length."""
    clock, limit = time.perf_counter_ns, int(min_us * 1e3)
    first = last = clock()
    end = first + int(seconds * 1e9)
    gaps, at = [], []
    while last < end:
        now = clock()
        if now - last > limit:
            gaps.append(now - last)
            at.append(last)
        last = now
    if log is not None:
        log.probes.append((first, last, np.asarray(at, np.int64), np.asarray(gaps, np.int64)))
    return gaps


def loop_speed(seconds: float, chunk_s: float = 0.05) -> float:
    """A fixed loop of Python arithmetic on this thread for `seconds`: the median over
    `chunk_s` chunks of loop iterations a microsecond."""
    clock, speeds = time.perf_counter, []
    end = clock() + seconds
    while clock() < end:
        t0, n = clock(), 0
        while clock() - t0 < chunk_s:
            for i in range(2000):
                n += i & 7
        speeds.append(n / (clock() - t0) / 1e6)
    return sorted(speeds)[len(speeds) // 2]


def gaps_per_s(sync, seconds: float = 0.5, log: GapLog | None = None) -> float:
    """Gaps longer than 20 µs a second on this rank's core while every rank of `sync` (a
    `ubep.bench.flags.HostSync`) looks at once (`clock_gaps`, which adds to `log`): how often
    a call that needs every core meets one. Every rank calls it; each returns its own."""
    sync.barrier()
    n = len(clock_gaps(seconds, log=log))
    sync.barrier()
    return n / seconds


@dataclass
class HostProbes:
    """The bench's `probe`: gaps (`clock_gaps`, `gap_s` seconds) and speed (`loop_speed`,
    `loop_s` seconds) on every rank's core at once, at the start and at the end of a run.

    `result()` is `{"gaps": (per second at the start, at the end), "speed": (start, end),
    "gap_log": GapLog}` of this rank.
    """

    gap_s: float = 0.5
    loop_s: float = 0.3
    _gaps: list = field(default_factory=list, init=False, repr=False)
    _speed: list = field(default_factory=list, init=False, repr=False)
    _log: GapLog = field(default_factory=GapLog, init=False, repr=False)

    def _probe(self, sync) -> None:
        self._gaps.append(gaps_per_s(sync, self.gap_s, self._log))
        self._speed.append(loop_speed(self.loop_s))     # every rank at once, as its gaps
        sync.barrier()

    def start(self, sync) -> None:
        self._probe(sync)

    def end(self, sync) -> None:
        self._probe(sync)

    def result(self) -> dict:
        return {"gaps": tuple(self._gaps), "speed": tuple(self._speed), "gap_log": self._log}


@dataclass
class HostRecord:
    """What a run's host probes say, per P (ranks).

    Attributes:
        gaps: P -> per rank, gaps > 20 µs a second on its core (start, end).
        speed: P -> per rank, the fixed loop's iterations a µs (start, end).
        windows: P -> where in each millisecond the gaps every rank saw bunch, or None.
        gap_probes: P -> the gap probes, `[probe][rank]` (`GapLog.probes`): what the host's
            floor under each row's tail is replayed over (`benchmarks.host_floor`).
        in_window: (system, P, hidden, batch) -> [3, iters] bool: the timed iteration's
            dispatch, its combine, either, on some rank ran across a window.
    """

    gaps: dict = field(default_factory=dict)
    speed: dict = field(default_factory=dict)
    windows: dict[int, TimerWindows | None] = field(default_factory=dict)
    gap_probes: dict = field(default_factory=dict)
    in_window: dict = field(default_factory=dict)


def clear_of_windows(t: np.ndarray, hit: np.ndarray | None) -> dict:
    """The iterations clear of the host's timer windows: their share, median and p99 (µs);
    None where the run found no windows or no iteration was clear."""
    if hit is None or hit.all():
        return {"clear_share": None, "clear_median_us": None, "clear_p99_us": None}
    clear = t[~hit]
    return {"clear_share": float(clear.size / t.size),
            "clear_median_us": float(np.median(clear)),
            "clear_p99_us": float(np.percentile(clear, 99))}


def host_record(res) -> HostRecord:
    """Read `res` (a `BenchResult` of a run with `HostProbes`) with its probes, and add to each
    of its rows `host_p99x` (the p99/median the host's gaps alone give a call of the row's
    median) and `clear_share`, `clear_median_us`, `clear_p99_us` (the calls clear of the
    timer windows)."""
    rec = HostRecord()
    for world, per_rank in res.probes.items():
        rec.gaps[world] = [tuple(r["gaps"]) for r in per_rank]
        rec.speed[world] = [tuple(r["speed"]) for r in per_rank]
        logs = [r["gap_log"] for r in per_rank]
        rec.windows[world] = find_windows(np.concatenate([g.starts for g in logs]))
        rec.gap_probes[world] = [list(k) for k in zip(*(g.probes for g in logs))]
    for (name, world, hidden, batch), sp in res.spans.items():
        w = rec.windows.get(world)
        if w is None:
            continue
        lo, hi = sp.min(axis=0), sp.max(axis=0)     # earliest start, latest end over ranks
        d, c = overlaps(lo[0], hi[1], w), overlaps(lo[2], hi[3], w)
        rec.in_window[(name, world, hidden, batch)] = np.vstack([d, c, d | c])
    ops = ("dispatch", "combine", "total")
    for row in res.rows:
        key = (row["system"], row["ranks"], row["hidden"], row["batch"])
        hits = rec.in_window.get(key)
        i = ops.index(row["op"])
        row.update(clear_of_windows(res.samples[key][i], None if hits is None else hits[i]))
        probes = rec.gap_probes.get(row["ranks"])
        row["host_p99x"] = None if probes is None else tail_ratio(row["median_us"], probes)
    return rec


def timer_windows_words(w: TimerWindows | None) -> str:
    """Where the gaps bunch, in words ("" if the run found no windows)."""
    if w is None:
        return ""
    spans = ", ".join(f"{lo / 1e3:.0f}-{hi / 1e3:.0f}" for lo, hi in w.spans)
    return (f" ({100 * w.share_of_gaps:.0f}% of them starting {spans} µs into a "
            f"{w.period_ns / 1e3:.0f} µs period, {100 * w.share_of_time:.0f}% of its time)")
