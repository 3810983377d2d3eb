"""Bounded waits: re-enter a poll kernel until it reports nothing missing, backing off.

Every wait of the shm runtime goes through `wait`: it has a deadline (`PeerTimeoutError`
names the waiting rank, the phase and the peers still missing), checks that the peers are
alive (`PeerDiedError`, by the lock every rank holds on its own segment: no process ids,
so ranks in different PID namespaces work), and stops early when another worker of the same
call failed. In an elastic Buffer (`members`) a dead peer is recorded as inactive instead,
and the wait's `on_inactive` lets the path stop waiting for it (`membership.py`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from ubep.errors import PeerDiedError, PeerTimeoutError
from ubep.runtime.shm import segments

#: kernel spin rounds before a poll returns "not ready" to the Python backoff
SPINS = 64
#: spin rounds of the first poll a one-worker call makes inside its own kernel, before any
#: Python wait (~5 µs of `pause` on this project's Xeon host, ~1.6 µs per 64): a peer a few
#: µs of Python behind is then met in the kernel, where entering `wait` and leaving it cost
#: ~3 µs of Python each time (2 ranks, batch 1, in-process A/B against 8 rounds:
#: dispatch+combine median 61.3 -> 60.3 µs owned, 61.8 -> 59.5 direct; batch 8 and 128
#: unchanged)
INLINE_SPINS = 256
#: how long a waiter yields the core between polls before it starts sleeping, seconds: on an
#: idle host the peer is running and answers within microseconds; when threads outnumber
#: cores, sched_yield hands the core to whoever is runnable
YIELD_S = 200e-6
#: how often a waiting worker checks that its peers are alive, seconds
LIVENESS_EVERY_S = 0.005


class Cancelled(Exception):
    """Another worker of this rank failed; stop waiting."""


def now_us() -> float:
    """A monotonic timestamp in microseconds (the unit of `ubep.stats`); `time.perf_counter`'s
    clock, the one deadlines are on."""
    return time.perf_counter_ns() / 1e3


def deadline_after(t0_us: float, timeout_s: float) -> float:
    """The deadline (`time.perf_counter()` seconds) of a call that started at `now_us()` =
    `t0_us`: a call reads the clock once for its stats and its deadline both."""
    return t0_us * 1e-6 + timeout_s


def wait(poll: Callable[[int], int], *, rank: int, segs: Sequence[segments.Segment], phase: str,
         deadline: float, timeout_s: float, peers_of: Callable[[], list[int]],
         detail_of: Callable[[], str] | None = None,
         failed: Callable[[], bool] | None = None, members=None,
         on_inactive: Callable[[], None] | None = None) -> None:
    """Re-enter `poll(spins)` until it returns 0; raise if the deadline passes or a peer dies.

    Spins in the kernel first, then yields the core (for `YIELD_S`), then sleeps 20-100 us per
    round: with more busy threads than cores, backing off is what lets the peer progress.
    While `poll` reports less missing than before (rows are arriving: the peer runs and
    writes), the yield window starts over: a receiver that sleeps while a peer streams rows
    to it wakes up to ~100 us after the last one arrived, which at batch 32 is as long as
    the copy itself. Only a wait that sees nothing move for `YIELD_S` sleeps.
    `peers_of()` names the ranks still missing and `detail_of()` adds to the timeout message;
    `failed()` true (another worker of the call failed) raises `Cancelled`. `deadline` is in
    `time.perf_counter()` seconds (`deadline_after`).

    `members` (a `membership.ShmMembership`, elastic Buffers only): at every liveness probe, a
    dead peer is recorded as inactive instead of raising, ranks other ranks recorded are read
    from the shared word, and `on_inactive()` (the path's: stop waiting for inactive ranks; it
    must be idempotent) runs while some rank is inactive; also first thing if some are.
    """
    left = poll(SPINS)
    if left == 0:
        return
    version = -1
    if members is not None:
        m = members.members
        version = m.version
        if m.any_inactive and on_inactive is not None:
            on_inactive()
            left = poll(SPINS)
            if left == 0:
                return
    n = 0
    now = time.perf_counter()
    yield_until = now + YIELD_S
    next_live = now + LIVENESS_EVERY_S
    while True:
        if failed is not None and failed():
            raise Cancelled()
        if now < yield_until:
            os.sched_yield()                               # let a runnable peer go first
        else:
            n += 1
            time.sleep(min(100e-6, 20e-6 * n))             # then short sleeps
        still = poll(SPINS)
        if still == 0:
            return
        now = time.perf_counter()
        if still < left:                                   # progress: the peer is running
            yield_until, n = now + YIELD_S, 0
        left = still
        if now >= next_live:
            next_live = now + LIVENESS_EVERY_S
            if members is None:
                dead = [r for r, seg in enumerate(segs) if not seg.owner_alive()]
                if dead:
                    raise PeerDiedError(rank, phase, dead)
            else:           # elastic: what others recorded, then my own probe
                if members.stale():
                    members.sync()                # raises if this rank was removed
                members.find_dead()
                m = members.members
                if m.version != version or m.any_inactive:
                    # (again at every probe while a rank is inactive: a removed rank that
                    # still calls may overwrite what `on_inactive` wrote)
                    version = m.version
                    if on_inactive is not None:
                        on_inactive()
                    left = poll(SPINS)
                    if left == 0:
                        return
        if now > deadline:
            if poll(SPINS) == 0:
                return
            raise PeerTimeoutError(rank, phase, peers_of(), timeout_s,
                                   detail_of() if detail_of else "")
