"""Stats every executor returns: per-phase times, per-worker busy/wait intervals, bytes.

The shm runtime, the torch backend and the simulator fill the same structure, so a plot
or a Chrome/Perfetto trace reads any of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


@dataclass(frozen=True)
class Interval:
    """One worker doing one thing: `kind` is "busy" (moving/computing) or "wait"."""

    rank: int
    worker: int
    name: str
    start_us: float
    end_us: float
    kind: str = "busy"

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class Stats:
    """Timings of one dispatch or combine on one rank (or of a simulated run)."""

    op: str                                   # "dispatch" | "combine"
    backend: str                              # "torch" | "shm" | "sim" ...
    mode: str = ""                            # "ubep" | "bsp" | "" (not applicable)
    sync: str = ""
    schedule: str = ""
    rank: int = 0
    total_us: float = 0.0
    phases_us: dict[str, float] = field(default_factory=dict)
    intervals: list[Interval] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_recv: int = 0
    payload_efficiency: float | None = None   # payload bytes / bytes on the wire
    extra: dict[str, object] = field(default_factory=dict)
    #: row bytes (hidden x element size per row) this rank put on the network between hosts
    #: in this call (hybrid backend; 0 elsewhere); routing metadata is counted in `extra`
    bytes_sent_network: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def busy_us_per_worker(self) -> dict[tuple[int, int], float]:
        """Busy time per (rank, worker)."""
        out: dict[tuple[int, int], float] = {}
        for iv in self.intervals:
            if iv.kind == "busy":
                key = (iv.rank, iv.worker)
                out[key] = out.get(key, 0.0) + iv.duration_us
        return out


class DeferredStats(Stats):
    """A `Stats` whose fields are built on first read, by `build(*args)`.

    A hot path (one dispatch costs tens of microseconds) keeps its raw timestamps and counts
    and defers making the `Stats`, its `Interval`s and dicts until someone reads them. Reads,
    writes, equality, `repr`, `asdict` and pickling behave as for the built `Stats` (a pickle
    or copy is a plain `Stats`).
    """

    @classmethod
    def of(cls, build: Callable[..., Stats], *args) -> DeferredStats:
        """Stats that `build(*args)` will make when first read."""
        st = object.__new__(cls)
        st.__dict__["_pending"] = (build, args)
        return st

    def _materialize(self) -> None:
        pending = self.__dict__.pop("_pending", None)
        if pending is not None:
            build, args = pending
            self.__dict__.update(build(*args).__dict__)

    def _plain(self) -> Stats:
        return Stats(*[getattr(self, n) for n in _STATS_FIELDS])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stats):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in _STATS_FIELDS)

    __hash__ = None   # as Stats (a mutable dataclass)

    def __repr__(self) -> str:
        return repr(self._plain())

    def __reduce__(self):
        return Stats, tuple(getattr(self, n) for n in _STATS_FIELDS)


def _deferred_field(name: str) -> property:
    """A data descriptor for field `name` (it must shadow the class-level defaults)."""

    def get(self: DeferredStats):
        d = self.__dict__
        if name not in d:
            self._materialize()
        return d[name]

    def set(self: DeferredStats, value) -> None:
        self._materialize()
        self.__dict__[name] = value

    return property(get, set, doc=f"`Stats.{name}`, built on first read.")


_STATS_FIELDS = tuple(f.name for f in fields(Stats))
for _name in _STATS_FIELDS:
    setattr(DeferredStats, _name, _deferred_field(_name))
del _name


def chrome_trace(stats: list[Stats]) -> dict:
    """Chrome/Perfetto trace (JSON object format): one process per rank, one track per worker."""
    events: list[dict] = []
    for st in stats:
        for iv in st.intervals:
            events.append({
                "name": iv.name, "cat": f"{st.op},{iv.kind}", "ph": "X",
                "ts": iv.start_us, "dur": max(iv.duration_us, 0.0),
                "pid": iv.rank, "tid": iv.worker,
                "args": {"op": st.op, "mode": st.mode, "sync": st.sync},
            })
    ranks = sorted({iv.rank for st in stats for iv in st.intervals})
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_chrome_trace(stats: list[Stats], path: str | Path) -> Path:
    """Write `chrome_trace(stats)` to `path` (open it in ui.perfetto.dev or chrome://tracing)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(stats)))
    return path
