"""CPU time other processes take while a timing runs (`python -m benchmarks validate-host`).

The bench lock keeps benchmarks apart, but nothing stops a process that does not take it
(a test, a script) from running on the host's two cores during a bench: then the bench's
spinning ranks share their cores and its medians carry scheduler waits the host model does
not have. A load average says little about the seconds a bench runs; this watch says who
ran and for how long. A thread reads `/proc/<pid>/stat` every `period` seconds and adds up
the CPU time of every process that is not this process, one of its descendants (ever seen
as one: an orphaned child stays ours) or in its process group (a finished bench's
forkserver, orphaned before the watch began, still exiting). A
process that starts and ends between two samples is not seen (short-lived ones are missed,
so the figure is a lower bound).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class OtherWork:
    """What processes outside this process's tree ran during a watch."""

    wall_s: float = 0.0
    cpu_s: dict = field(default_factory=dict)     # pid -> CPU seconds during the watch
    names: dict = field(default_factory=dict)     # pid -> command line (shortened)

    @property
    def total_s(self) -> float:
        return sum(self.cpu_s.values())

    @property
    def cores(self) -> float:
        """Cores the other processes kept busy on average during the watch."""
        return self.total_s / self.wall_s if self.wall_s > 0 else 0.0

    def top(self, n: int = 2, min_s: float = 0.05) -> list[tuple[str, float]]:
        """The `n` processes that used the most CPU (at least `min_s`): (command, s)."""
        busy = sorted(self.cpu_s.items(), key=lambda kv: -kv[1])[:n]
        return [(self.names.get(p, str(p)), s) for p, s in busy if s >= min_s]

    def describe(self) -> str:
        top = "; ".join(f"{c} {s:.1f} s" for c, s in self.top())
        return f"other processes {self.cores:.2f} cores over {self.wall_s:.0f} s" + \
            (f" ({top})" if top else "")

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "cores": self.cores,
                "top": [{"cmd": c, "cpu_s": s} for c, s in self.top(5)]}


def _stat(pid: str) -> tuple[int, int, int] | None:
    """(parent pid, process group, CPU ticks: user + system) of `pid`, or None if it is
    gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[1]), int(rest[2]), int(rest[11]) + int(rest[12])


def _cmd(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        if not cmd:
            with open(f"/proc/{pid}/comm") as f:
                cmd = f"[{f.read().strip()}]"
    except OSError:
        return pid
    return cmd[:100] or pid


def _sample(me: int) -> tuple[dict[str, tuple[int, int, int]], set[str]]:
    """({pid: (ppid, pgrp, ticks)} of every process but `me`, its descendants and its
    process group; the pids of those)."""
    procs = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            s = _stat(p)
            if s is not None:
                procs[p] = s
    group = os.getpgid(me)
    mine = {str(me)} | {p for p, (_, g, _) in procs.items() if g == group}
    grew = True
    while grew:                                   # descendants: parents already in `mine`
        grew = False
        for p, (ppid, _, _) in procs.items():
            if p not in mine and str(ppid) in mine:
                mine.add(p)
                grew = True
    return {p: v for p, v in procs.items() if p not in mine}, mine


class CpuWatch:
    """`with CpuWatch() as w: ...` then `w.result`: CPU time of other processes meanwhile."""

    def __init__(self, period: float = 0.25):
        if period <= 0:
            raise ValueError(f"period={period!r} must be > 0 seconds")
        self.period = period
        self.result = OtherWork()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._mine: set[str] = set()     # ever seen in my tree (an orphan stays mine)
        self._t0 = 0.0

    def _take(self, first: bool) -> None:
        others, mine = _sample(os.getpid())
        self._mine |= mine
        for p, (_, _, ticks) in others.items():
            if p in self._mine:
                continue
            if first:
                self._first[p] = ticks
            elif p not in self._first:
                self._first[p] = 0                # started during the watch: all of it
                self.result.names[p] = _cmd(p)
            self._last[p] = ticks
            if p not in self.result.names and ticks > self._first[p]:
                self.result.names[p] = _cmd(p)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._take(False)

    def __enter__(self) -> CpuWatch:
        if not os.path.isdir("/proc"):
            return self                           # no /proc: nothing to watch
        self._t0 = time.monotonic()
        self._take(True)
        self._thread = threading.Thread(target=self._run, name="cpuwatch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._take(False)
        self.result.wall_s = time.monotonic() - self._t0
        self.result.cpu_s = {p: (t - self._first[p]) / _HZ for p, t in self._last.items()
                             if t > self._first[p]}
