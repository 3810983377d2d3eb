"""`ShmContext`: what every execution path of a rank reads once the bootstrap is done."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ubep.options import BufferConfig
from ubep.plan.blocks import BlockFormat
from ubep.runtime.shm.segments import Segment
from ubep.runtime.shm.waits import wait
from ubep.runtime.shm.workers import WorkerPool


@dataclass(eq=False)
class ShmContext:
    """One rank's view of the shared regions of a Buffer (built by `ShmBackend`).

    Attributes:
        config: the checked Buffer configuration.
        buffer_id, rank, world: which Buffer, which rank of how many.
        fmt: the block format of `config.sync`.
        workers: threads of this rank that run a call (1: the calling thread only).
        segs: every rank's mapped segment (`owner_alive()`: liveness checks while waiting).
        bases: `[world]` int64, the address of every rank's region in this process.
        base: `bases[rank]`.
        lay: the `region.L_*` layout (identical on every rank).
        dlay: the `region.D_*` layout of the direct areas, or None without `direct=True`.
        region: my region as `[size]` uint8.
        pool: the worker threads (`workers` > 1), else None.
        members: the elastic membership (`membership.ShmMembership`) of a Buffer made with
            `elastic=True`, else None.
    """

    config: BufferConfig
    buffer_id: int
    rank: int
    world: int
    fmt: BlockFormat
    workers: int
    segs: list[Segment]
    bases: np.ndarray
    base: int
    lay: np.ndarray
    dlay: np.ndarray | None
    region: np.ndarray
    pool: WorkerPool | None
    members: Any = None

    def deadline(self) -> float:
        """The deadline (`time.perf_counter()` seconds, as `waits.wait`) of a call that starts
        now."""
        return time.perf_counter() + self.config.timeout_s

    def wait(self, poll: Callable[[int], int], phase: str, peers_of: Callable[[], list[int]],
             detail_of: Callable[[], str] | None = None, *, deadline: float,
             failed: Callable[[], bool] | None = None,
             on_inactive: Callable[[], None] | None = None) -> None:
        """`waits.wait` for this rank (see there); `on_inactive` applies in an elastic
        Buffer only."""
        wait(poll, rank=self.rank, segs=self.segs, phase=phase, deadline=deadline,
             timeout_s=self.config.timeout_s, peers_of=peers_of, detail_of=detail_of,
             failed=failed, members=self.members, on_inactive=on_inactive)
