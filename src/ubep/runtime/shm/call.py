"""A call on the worker pool: its shared state (`Call`) and how its workers run (`CallRunner`).

Worker 0 is the calling thread, 1..n-1 are the pool's threads. They share the `Call`: its
epoch, deadline, the first error (the others stop waiting on it) and per-worker intervals
for the stats. In-rank synchronization goes through two words of a private array: a
barrier counter (mode "bsp" only) and the published epoch of the offsets (mode "ubep").
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
        self._local = np.zeros(16, np.int64)       # [0] barrier counter, [1] published epoch
        self._counter = self._local.ctypes.data
        self._published = self._counter + 8
        self.broken = False

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
             peers_of: Callable[[], list[int]], detail_of: Callable[[], str] | None = None
             ) -> None:
        """`ShmContext.wait` until the call's deadline, cancelled when a co-worker failed."""
        self.ctx.wait(poll, phase, peers_of, detail_of, deadline=call.deadline,
                      failed=call.failed)

    def barrier(self, call: Call, k: int, phase: str) -> None:
        """The k-th barrier (1-based) among this call's workers (mode "bsp")."""
        if call.n == 1:
            return
        addr = self._counter
        barrier_arrive(addr)
        target = call.barrier_base + k * call.n
        self.wait(call, lambda s: 0 if poll_at_least(addr, target, s) else 1,
                  f"{phase}/barrier", lambda: [self.ctx.rank])

    def publish(self, call: Call) -> None:
        """Tell this rank's workers that the call's offsets are ready (release store)."""
        publish(self._published, call.epoch)

    def wait_published(self, call: Call, phase: str) -> None:
        """Wait until `publish(call)` ran on some worker of this rank."""
        addr, epoch = self._published, call.epoch
        self.wait(call, lambda s: 0 if poll_at_least(addr, epoch, s) else 1, phase,
                  lambda: [self.ctx.rank])
