"""A call on the worker pool: its shared state (`Call`) and how its workers run (`CallRunner`).

Worker 0 is the calling thread, 1..n-1 are the pool's threads. They share the `Call`: its
epoch, deadline, the first error (the others stop waiting on it) and per-worker intervals
for the stats. In-rank synchronization goes through words of a private array: a barrier
counter (mode "bsp" only) and per-worker flags, each set to a dispatch's epoch by one
worker and awaited by others (mode "ubep": point to point, never all-to-all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ubep.errors import UbepError
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.kernels.local import barrier_arrive, poll_at_least, publish
from ubep.runtime.shm.waits import Cancelled, now_us


@dataclass(eq=False, kw_only=True)
class Call:
    """What the workers of one call share. Paths subclass it with their own per-call data."""

    epoch: int
    deadline: float
    n: int
    barrier_base: int = 0
    error: BaseException | None = None
    #: per worker: (phase, start us, end us, "busy" | "wait")
    iv: list[list[tuple]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.iv:
            self.iv = [[] for _ in range(self.n)]

    def failed(self) -> bool:
        return self.error is not None

    def record(self, j: int, phase: str, start_us: float, kind: str = "busy") -> None:
        """Worker j spent [start_us, now) in `phase`."""
        self.iv[j].append((phase, start_us, now_us(), kind))


class CallRunner:
    """Runs calls on a rank's workers: start, run on the pool, barriers, bounded waits."""

    def __init__(self, ctx: ShmContext):
        self.ctx = ctx
        # [0] barrier counter, [1] unused, [2:] per-worker flags (`publish`, `wait_flag`)
        self._local = np.zeros(2 + 2 * ctx.workers, np.int64)
        self._counter = self._local.ctypes.data
        self.broken = False

    @property
    def barriers(self) -> int:
        """Barrier arrivals so far on this rank (mode "ubep" never adds any)."""
        return int(self._local[0])

    def start(self, call: Call) -> Call:
        """Check that an earlier call left the workers in step; number this call's barriers."""
        if self.broken:
            raise UbepError("an earlier call failed; this backend cannot be reused")
        call.barrier_base = int(self._local[0])
        return call

    def run(self, call: Call, fn: Callable[[int], None]) -> None:
        """Run `fn(j)` on workers j in [0, call.n); the first error is raised once all return."""
        def on_error(e: BaseException) -> None:
            if call.error is None and not isinstance(e, Cancelled):
                call.error = e

        if call.n == 1:
            fn(0)
            return
        try:
            self.ctx.pool.run(fn, call.n, on_error)
        except BaseException:
            if call.error is not None:
                raise call.error from None
            raise
        finally:
            if call.error is not None:
                self.broken = True     # barrier counter out of step: the Buffer is broken

    def wait(self, call: Call, poll: Callable[[int], int], phase: str,
             peers_of: Callable[[], list[int]], detail_of: Callable[[], str] | None = None,
             on_inactive: Callable[[], None] | None = None) -> None:
        """`ShmContext.wait` until the call's deadline, cancelled when a co-worker failed
        (`on_inactive`: see `waits.wait`)."""
        self.ctx.wait(poll, phase, peers_of, detail_of, deadline=call.deadline,
                      failed=call.failed, on_inactive=on_inactive)

    def barrier(self, call: Call, k: int, phase: str) -> None:
        """The k-th barrier (1-based) among this call's workers (mode "bsp")."""
        if call.n == 1:
            return
        addr = self._counter
        barrier_arrive(addr)
        target = call.barrier_base + k * call.n
        self.wait(call, lambda s: 0 if poll_at_least(addr, target, s) else 1,
                  f"{phase}/barrier", lambda: [self.ctx.rank])

    def publish(self, call: Call, flag: int) -> None:
        """Set in-rank flag `flag` (in [0, 2 * workers)) to the call's epoch (release store):
        a point-to-point signal to the workers that `wait_flag` on it."""
        publish(self._counter + 8 * (2 + flag), call.epoch)

    def wait_flag(self, call: Call, flag: int, phase: str) -> None:
        """Wait until `publish(call, flag)` ran on some worker of this rank."""
        addr, epoch = self._counter + 8 * (2 + flag), call.epoch
        self.wait(call, lambda s: 0 if poll_at_least(addr, epoch, s) else 1, phase,
                  lambda: [self.ctx.rank])
