"""The simulator's tiny core: a clock and a heap of callbacks keyed on (time, priority, seq).

`seq` is a per-simulation counter, so equal (time, priority) pairs run in scheduling order
and a run is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Simulation:
    """A clock (`now`, microseconds) and a heap of pending callbacks."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[..., Any], tuple]] = []
        self._seq = 0

    def at(self, time: float, fn: Callable[..., Any], *args: Any, priority: int = 0) -> None:
        """Run `fn(*args)` at `time` (not before `now`)."""
        if time < self.now:
            raise ValueError(f"{self}: cannot schedule at {time} before now={self.now}")
        heapq.heappush(self._heap, (time, priority, self._seq, fn, args))
        self._seq += 1

    def run(self) -> float:
        """Run until no callback is pending; returns the final time."""
        while self._heap:
            t, _, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
        return self.now

    def __repr__(self) -> str:
        return f"Simulation(now={self.now}, pending={len(self._heap)})"


class Event:
    """Something that happens once; callbacks added before or after it fires run once."""

    def __init__(self, sim: Simulation, name: str = "event") -> None:
        self.sim, self.name = sim, name
        self.time: float | None = None
        self._waiters: list[Callable[[], Any]] = []

    @property
    def triggered(self) -> bool:
        return self.time is not None

    def succeed(self) -> None:
        if self.time is not None:
            raise RuntimeError(f"{self} has already been triggered")
        self.time = self.sim.now
        waiters, self._waiters = self._waiters, []
        for fn in waiters:
            fn()

    def then(self, fn: Callable[[], Any]) -> None:
        """Call `fn()` when this event fires (now, if it already has)."""
        if self.time is not None:
            fn()
        else:
            self._waiters.append(fn)

    def __repr__(self) -> str:
        return f"Event({self.name!r}, time={self.time})"
