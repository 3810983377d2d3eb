"""Host-wide flags for the benchmark: a tight cross-process barrier and a flag ping-pong.

The benchmark aligns the start of every timed call on all ranks with a barrier much
tighter than gloo's (~300 µs, with tens of µs of exit skew), measures one flag round
trip between two processes for the copy bound, and one cross-core copy: bytes one rank
just wrote, copied by the other (what moving rows between ranks costs beyond a memcpy of
bytes already in the copying core's cache, which is what the copy bound times). They
spin on int64 words in a shared-memory segment (`ubep.runtime.shm.segments`) mapped by
every rank, read with acquire loads and written with release stores
(`ubep.runtime.shm.atomics`: a plain load in a spin loop is hoisted and never exits).

Every wait spins a bounded number of times in Numba, then returns to Python, which
yields or sleeps briefly and checks a deadline, so two cores shared by many processes
are not starved.
"""

from __future__ import annotations

import os
import time

import numpy as np
from numba import njit

from ubep.bench.systems import page_aligned
from ubep.runtime.shm import segments
from ubep.runtime.shm.atomics import cpu_pause as _pause
from ubep.runtime.shm.atomics import load_acquire as _load_acquire_addr
from ubep.runtime.shm.atomics import store_release as _store_release_addr

_SLOT = 8            # int64 words per slot: one 64-byte cache line per rank's word
_SPINS = 64          # barrier: spin rounds between yields (as `ubep.runtime.shm.waits.SPINS`)
_PING, _PONG = 0, 1  # slots of the ping-pong; barrier slots follow, then the copy probe's
_PAGE = 4096         # the copy probe's bytes start page-aligned after the flag slots
#: how long a wait yields the core before it sleeps, seconds: longer than nearly every gap in
#: which the host takes a core away (on this project's VM those over 200 µs come ~10-30
#: times a second per core, the longest last a few ms), because a rank
#: that sleeps wakes up late (a 20 µs sleep takes ~107 µs on this project's VM: the kernel's
#: default 50 µs timer slack and the VM's own wake-up) and the next timed call waits for it
_YIELD_S = 2e-3


@njit(inline="always")
def _load_acquire(words, idx):
    return _load_acquire_addr(words.ctypes.data + idx * 8)


@njit(inline="always")
def _store_release(words, idx, value):
    _store_release_addr(words.ctypes.data + idx * 8, value)


@njit(nogil=True, cache=True)
def _store(words, idx, value):
    _store_release(words, idx, value)


@njit(nogil=True, cache=True)
def _wait_all_geq(words, first, count, stride, target, max_spins):
    """Spin until words[first + i*stride] >= target for all i < count; False if gave up."""
    for _ in range(max_spins):
        ok = True
        for i in range(count):
            if _load_acquire(words, first + i * stride) < target:
                ok = False
                break
        if ok:
            return True
        _pause()
    return False


@njit(nogil=True, cache=True)
def _ping_pong(words, me_first, rounds, start, max_spins):
    """`rounds` round trips from `start`; the initiator (me_first) pings, the other pongs.

    Returns the number of rounds completed (fewer if a wait gave up after `max_spins`).
    """
    ping, pong = _PING * _SLOT, _PONG * _SLOT
    for r in range(rounds):
        seq = start + r
        if me_first:
            _store_release(words, ping, seq)
            spins = 0
            while _load_acquire(words, pong) < seq:
                _pause()
                spins += 1
                if spins > max_spins:
                    return r
        else:
            spins = 0
            while _load_acquire(words, ping) < seq:
                _pause()
                spins += 1
                if spins > max_spins:
                    return r
            _store_release(words, pong, seq)
    return rounds


def warm_up() -> None:
    """Compile (or load from Numba's cache) the flag kernels: `ubep warm`'s share of them
    (a one-rank bench never runs the ping-pong)."""
    words = np.zeros(_words(2), np.int64)
    _ping_pong(words, True, 0, 1, 1)                  # 0 rounds
    _store(words, 0, 0)
    _wait_all_geq(words, 0, 1, _SLOT, 0, 1)


def _words(world: int) -> int:
    """int64 words of the flag slots: ping, pong, one barrier word per rank, the probe's."""
    return (3 + world) * _SLOT


def _data_at(world: int) -> int:
    """Byte offset of the copy probe's bytes in the segment."""
    return -(-_words(world) * 8 // _PAGE) * _PAGE


class HostSync:
    """A barrier among `world` ranks and a rank-0/rank-1 ping-pong, in one shm segment.

    Rank 0 creates the segment (exclusively, `ubep.runtime.shm.segments`) before the
    others attach; `create` uses the default torch.distributed group to order that.
    `close()` unmaps, and rank 0 unlinks.
    """

    def __init__(self, segment: segments.Segment, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._segment = segment
        self.words = np.frombuffer(segment.buf, dtype=np.int64, count=_words(world))
        self._data = np.frombuffer(segment.buf, dtype=np.uint8, offset=_data_at(world))
        self._epoch = 0       # barrier generation
        self._seq = 0         # ping-pong sequence
        self._copies = 0      # cross-core copy probe's sequence

    @classmethod
    def create(cls, rank: int, world: int, job: str, *, timeout_s: float = 60.0,
               barrier=None, copy_bytes: int = 0) -> HostSync:
        """Make (rank 0) or attach (others) the sync segment of job `job`, with room for
        `cross_core_copy_us` of up to `copy_bytes`.

        `barrier` is a callable that all ranks call twice: after rank 0 created the segment and
        after every rank mapped it (default: `torch.distributed.barrier`). Rank 0 then
        unlinks the name, so nothing is left in /dev/shm however the run ends.
        """
        if barrier is None:
            import torch.distributed as dist
            barrier = dist.barrier
        name = f"{segments.PREFIX}bench_{job}"
        if rank == 0:
            seg = segments.create(name, _data_at(world) + max(copy_bytes, 1))
        try:
            barrier()
            if rank != 0:
                seg = segments.attach(name)
            sync = cls(seg, rank, world, timeout_s)
            barrier()
            return sync
        finally:
            if rank == 0:  # every rank has it mapped (or failed): the name can go
                segments.unlink_name(name)

    def _wait(self, what: str, first: int, count: int, stride: int, target: int) -> None:
        """Spin briefly, then yield for `_YIELD_S`, then sleep 20 µs per round, until the
        deadline.

        The spin is as short as the runtime's own (`waits.SPINS` rounds, ~2 µs): when two
        ranks share a core (more runnable processes than cores), a rank that finished its
        call first waits here while its peer still runs on that core, and spinning 2,000
        rounds (~60 µs) before yielding added that to the peer's measured call; yielding
        hands that core to the peer.
        """
        now = time.perf_counter()
        deadline, sleep_at = now + self.timeout_s, now + _YIELD_S
        while not _wait_all_geq(self.words, first, count, stride, target, _SPINS):
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(f"rank {self.rank}: bench {what} timed out after "
                                   f"{self.timeout_s:g}s (a peer is stuck or gone)")
            if now < sleep_at:
                os.sched_yield()
            else:
                time.sleep(20e-6)

    def barrier(self) -> None:
        """Return once every rank has entered this barrier, every rank awake (exit skew ~1 µs
        when idle).

        Two rounds: a rank that slept in the first (a peer was away for longer than
        `_YIELD_S`) leaves it late, and a call timed from a peer's exit would count that; the
        second, which the others wait out yielding, starts no rank before the last is back.
        """
        base = 2 * _SLOT                       # the barrier slots follow ping and pong
        for _ in range(2):
            self._epoch += 1
            _store(self.words, base + self.rank * _SLOT, self._epoch)
            self._wait("barrier", base, self.world, _SLOT, self._epoch)

    def flag_round_trip_us(self, rounds: int = 200, repeats: int = 25) -> float | None:
        """The best over `repeats` of the mean time of one flag round trip, rank 0 <-> rank 1.

        The best, not the median: the bound needs the round trip when both processes are
        on a core, and on a busy host a repeat during which either was descheduled measures
        the scheduler instead (spins are bounded, then the waiter yields its core).
        Every rank must call it; ranks other than 0 and 1 only take part in the barriers.
        Returns the time on rank 0 and 1, None elsewhere (and None with a single rank).
        """
        if self.world < 2:
            return None
        samples = []
        for _ in range(repeats):
            self.barrier()
            if self.rank > 1:
                continue
            t0 = time.perf_counter()
            deadline = time.monotonic() + self.timeout_s
            done = 0
            while done < rounds:  # a stalled wait returns here to back off; rounds are
                # idempotent to resume (a ping or pong is a store of the round's number)
                step = _ping_pong(self.words, self.rank == 0, rounds - done,
                                  self._seq + 1 + done, 200_000)
                done += step
                if step == 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {self.rank}: flag ping-pong stalled after "
                                           f"{done} of {rounds} round trips")
                    os.sched_yield()
            dt = time.perf_counter() - t0
            self._seq += rounds
            samples.append(dt / rounds * 1e6)
        self.barrier()
        return float(min(samples)) if samples else None

    def cross_core_copy_us(self, nbytes: int, repeats: int = 200) -> tuple[float, float] | None:
        """What copying `nbytes` costs when another core just wrote them, and when they are
        in the copying core's own cache: (peer-written µs, own-cache µs), medians on rank 0.

        Each repeat rank 1 writes the bytes (its cache now holds the lines, modified) and
        raises a flag; rank 0 copies them out, then copies the same count from a buffer it
        has just written itself (the copy bound's case). The first is what any transport
        between two processes on one host pays for the bytes at least once; the gap between
        the two is the coherence traffic, which the copy bound leaves out. Every rank calls
        it; None on ranks other than 0, with one rank, or without room (`create`'s
        `copy_bytes`).
        """
        if self.world < 2 or nbytes <= 0 or nbytes > self._data.size:
            return None
        shared = self._data[:nbytes]
        src, dst = page_aligned(nbytes), page_aligned(nbytes)
        src[:] = 1
        flag = (2 + self.world) * _SLOT
        peer, own = [], []
        for i in range(repeats):
            self.barrier()                       # rank 0 is done reading the last repeat
            self._copies += 1
            if self.rank == 1:
                src[i % nbytes] = i & 0xFF       # new bytes every repeat
                np.copyto(shared, src)
                _store(self.words, flag, self._copies)
            elif self.rank == 0:
                self._wait("cross-core copy", flag, 1, _SLOT, self._copies)
                t0 = time.perf_counter_ns()
                np.copyto(dst, shared)
                t1 = time.perf_counter_ns()
                if dst[i % nbytes] != i & 0xFF:
                    raise RuntimeError("cross-core copy probe: rank 0 read stale bytes")
                np.copyto(src, dst)              # src is now in this core's cache
                t2 = time.perf_counter_ns()
                np.copyto(dst, src)
                t3 = time.perf_counter_ns()
                peer.append(t1 - t0)
                own.append(t3 - t2)
        self.barrier()
        if self.rank != 0:
            return None
        return float(np.median(peer)) / 1e3, float(np.median(own)) / 1e3

    def close(self) -> None:
        """Unmap. Idempotent. (Rank 0 unlinked the name once everyone had mapped it.)"""
        if self._segment is None:
            return
        self.words = self._data = None
        try:
            self._segment.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        self._segment = None
