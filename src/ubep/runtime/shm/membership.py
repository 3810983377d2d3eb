"""Elastic membership on shared memory: how the ranks of one host agree on who is active.

`Buffer(elastic=True)` (docs/reliability.md, "Elastic"). Each rank's region holds, in its
header page, a word whose bit r says that rank r is inactive (`region.H_INACTIVE`). A rank
that finds a peer dead (its waits probe liveness when a wait is slow, `waits.py`) ors the
peer's bit into that word of every region, atomically; `set_active_ranks` does the same for
the ranks it removes. Every rank reads its own word at the start of each call (a plain load:
nothing costs more while nothing fails) and in every slow wait, and applies what is new to
its `ubep.elastic.Membership`.

Agreement needs no extra message: every call waits for a message of the same call from every
active rank (dispatch's counts, combine's hellos or done words), so a rank that died before a
call is found by every survivor in that call's first wait, before any row moves that
depends on it; the paths (`direct/`, `staged/`, `pool/`) skip it from then on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ubep.elastic import Membership
from ubep.errors import RankRemovedError
from ubep.runtime.shm.kernels import members as KM
from ubep.runtime.shm.region import H_DRAIN_OFF, H_INACTIVE, H_REMOVED
from ubep.runtime.shm.segments import Segment

#: `Membership.why` of a rank this rank found dead, or learned of from the shared word
DIED = "died"
REMOVED = "removed by set_active_ranks"


class ShmMembership:
    """One rank's end of the shared membership words of an elastic shm Buffer."""

    def __init__(self, members: Membership, region: np.ndarray, bases: np.ndarray,
                 segs: list[Segment]):
        self.members = members
        self.rank = members.rank
        self._word = region[H_INACTIVE:H_INACTIVE + 16].view(np.int64)   # inactive, removed
        #: what `Buffer` reads before every call, as cheap as Python reads: my region's word
        #: (an int64 memoryview) and the bits applied so far (a one-element list)
        self.word = memoryview(region[H_INACTIVE:H_INACTIVE + 8]).cast("q")
        self.applied = [0]
        self._inactive_addrs = np.ascontiguousarray(bases + H_INACTIVE)
        self._removed_addrs = np.ascontiguousarray(bases + H_REMOVED)
        self._drain_first = int(bases[self.rank]) + H_DRAIN_OFF
        self._drain_addrs = np.ascontiguousarray(bases + H_DRAIN_OFF + 16 * self.rank)
        self._segs = segs
        self._lock = threading.RLock()
        self.drains = 0                   # set_active_ranks calls so far (the generation)

    # -- reading ------------------------------------------------------------------------------
    def stale(self) -> bool:
        """Whether my region's word holds bits `members` does not know yet (one load)."""
        return self.word[0] != self.applied[0]

    def sync(self) -> list[int]:
        """Apply the word's new bits to `members`; the ranks that became inactive. Raises
        `RankRemovedError` if this rank's own bit is set."""
        with self._lock:
            word = int(self._word[0])
            new_bits = word & ~self.applied[0]
            self.applied[0] = word
            if not new_bits:
                return []
            removed = int(self._word[1])
            new = [r for r in range(self.members.world) if new_bits >> r & 1]
            for r in new:
                self.members.remove([r], REMOVED if removed >> r & 1 else DIED)
        if self.members.removed_me():
            raise RankRemovedError(self.rank, self.members.why.get(self.rank, DIED))
        return new

    # -- writing ------------------------------------------------------------------------------
    def record(self, ranks, *, removed: bool = False) -> None:
        """Tell every rank (my region included) that `ranks` are inactive."""
        bits = 0
        for r in ranks:
            bits |= 1 << int(r)
        if not bits:
            return
        if removed:
            KM.or_into(self._removed_addrs, bits)
        KM.or_into(self._inactive_addrs, bits)
        self.sync()

    def find_dead(self) -> list[int]:
        """Probe the active peers' liveness; record and return those found dead."""
        act = self.members.active
        dead = [r for r, seg in enumerate(self._segs)
                if r != self.rank and act[r] and not seg.owner_alive()]
        if dead:
            self.record(dead)
        return dead

    # -- set_active_ranks ---------------------------------------------------------------------
    def agree_drain(self, mask: np.ndarray, timeout_s: float,
                    wait: Callable[..., None]) -> None:
        """The remaining ranks' agreement on a drain `mask` (`[world]` bool, True = stays):
        each writes its mask into every remaining rank's region and waits (bounded, with
        liveness: a rank that dies meanwhile is dropped from the wait) for the others'; all
        must pass the same mask, else the same ValueError on every one of them. Then the
        removed ranks are recorded."""
        self.drains += 1
        gen = self.drains
        bits = sum(1 << r for r in range(mask.shape[0]) if mask[r])
        stay = np.flatnonzero(mask & self.members.active).astype(np.int64)
        KM.publish_drain(np.ascontiguousarray(self._drain_addrs[stay]), np.int64(bits), gen)
        got = np.zeros(mask.shape[0], np.int64)

        def poll(spins: int) -> int:
            live = np.flatnonzero(mask & self.members.active).astype(np.int64)
            return KM.poll_drain(self._drain_first, live, gen, got, spins)

        wait(poll, "set_active_ranks",
             lambda: [int(r) for r in np.flatnonzero(mask & self.members.active)
                      if got[r] != bits])
        # compared on the ranks alive now: a rank that some knew dead before (and left out of
        # their mask) is dead for every rank by the time it compares
        self.find_dead()
        alive = sum(1 << r for r in range(mask.shape[0]) if self.members.active[r])
        live = np.flatnonzero(mask & self.members.active)
        other = {int(r): int(got[r]) for r in live if int(got[r]) & alive != bits & alive}
        if other:
            def ranks_of(b: int) -> list[int]:
                return [r for r in range(mask.shape[0]) if b >> r & 1]

            seen = {self.rank: bits, **other}
            detail = "; ".join(f"rank {r} keeps {ranks_of(b)}" for r, b in sorted(seen.items()))
            raise ValueError(f"set_active_ranks: the remaining ranks passed different masks "
                             f"({detail}); every rank that stays must pass the same mask")
        gone = [r for r in range(mask.shape[0]) if not mask[r] and self.members.active[r]]
        self.record(gone, removed=True)

