"""The sync variants without the runtime around them: a one-way message latency per format.

`ubep bench --sync-sweep` times whole dispatches, where this host's per-call costs (Python,
planning, thread hand-offs: hundreds of µs) hide differences of a microsecond. This
ping-pong isolates what the variants change: rank 0 writes a message of `payload` bytes into
rank 1's window in one block format (`ubep.plan.blocks`), rank 1 detects its arrival the
way that variant does, copies it out and answers with the same message; the one-way
latency is half the round trip, timed per round with the CPU cycle counter.

What each variant costs here, as the runtime does it (every block's last word last, with a
release store; acquire loads; our own copy loops):

* sw:  full blocks, then a flag word; the receiver waits for the flag, then copies.
* tff: blocks of `block_bytes - 8` payload + an epoch flag; the receiver waits block by block
       (more blocks for the same payload: 504/512).
* dc:  full blocks, a checksum word and the epoch word; the receiver waits for the epoch,
       recomputes the checksum from every block's marker, then copies.
* sp:  full blocks; the receiver waits until each marker differs from the sentinel, copies
       the block, then re-arms the marker (one more store per block).
"""

from __future__ import annotations

import os
import platform
import time

import llvmlite.ir as ir
import numpy as np
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ubep.plan.blocks import MARKER_BYTES, SENTINEL_I64, BlockFormat
from ubep.runtime.shm import segments
from ubep.runtime.shm.atomics import cpu_pause, i64_ptr, load_acquire, store_release
from ubep.runtime.shm.kernels.records import mix
from ubep.runtime.shm.region import FMT_CODES

_SLOT_BYTES = 64          # sw flag / dc checksum + epoch, one cache line
_IS_X86 = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def _cycles(typingctx):
    """`llvm.readcyclecounter` (rdtsc on x86)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen


_jit = njit(nogil=True, cache=True)


@_jit
def _send(win, slot, fmt, bb, src, nwords, epoch):
    """Write `nwords` int64 words of `src` XOR `epoch` as blocks at `win`, each block's last
    word last (XOR: every round's message differs, and LLVM cannot turn the loop into a
    memcpy, whose store order is undefined)."""
    bw = bb // 8
    pw = bw - 1 if fmt == 1 else bw          # payload words per block
    nb = max(1, (nwords + pw - 1) // pw)
    cs = np.int64(0)
    for b in range(nb):
        blk = win + b * bb
        d = carray(i64_ptr(blk), bw)
        p0 = b * pw
        body = min(nwords - p0, bw - 1)       # words before the last word of the block
        for i in range(body):
            d[i] = src[p0 + i] ^ epoch
        if fmt == 1:
            store_release(blk + bb - 8, epoch)
        else:
            m = src[p0 + bw - 1] ^ epoch if p0 + bw - 1 < nwords else np.int64(0)
            store_release(blk + bb - 8, m)
            cs += mix(m, b)
    if fmt == 0:
        store_release(slot + 56, epoch)
    elif fmt == 2:
        carray(i64_ptr(slot), 1)[0] = cs
        store_release(slot + 56, epoch)


@_jit
def _recv(win, slot, fmt, bb, dst, nwords, epoch, max_spins):
    """Wait for and copy out a message written by `_send`; False if a wait gave up."""
    bw = bb // 8
    pw = bw - 1 if fmt == 1 else bw
    nb = max(1, (nwords + pw - 1) // pw)
    if fmt == 0 or fmt == 2:
        spins = 0
        while True:
            if load_acquire(slot + 56) == epoch:
                if fmt == 0:
                    break
                cs = np.int64(0)
                for b in range(nb):
                    cs += mix(load_acquire(win + b * bb + bb - 8), b)
                if cs == carray(i64_ptr(slot), 1)[0]:
                    break
            cpu_pause()
            spins += 1
            if spins > max_spins:
                return False
    for b in range(nb):
        blk = win + b * bb
        if fmt == 1 or fmt == 3:
            spins = 0
            while True:
                v = load_acquire(blk + bb - 8)
                if (fmt == 1 and v == epoch) or (fmt == 3 and v != SENTINEL_I64):
                    break
                cpu_pause()
                spins += 1
                if spins > max_spins:
                    return False
        s = carray(i64_ptr(blk), bw)
        p0 = b * pw
        n = min(nwords - p0, pw)
        for i in range(n):
            dst[p0 + i] = s[i]
        if fmt == 3:
            store_release(blk + bb - 8, SENTINEL_I64)     # re-arm after consuming
    return True


@_jit
def _pingpong(out_win, out_slot, in_win, in_slot, fmt, bb, src, dst, nwords, initiator,
              rounds, epoch0, max_spins, stamps):
    """`rounds` round trips (epochs epoch0, epoch0 + 1 ...); the initiator records each one's
    cycles in `stamps`. Returns the rounds completed (fewer if a wait gave up); `dst` holds
    the last message received (`src` XOR the last epoch)."""
    for r in range(rounds):
        e = epoch0 + r
        if initiator:
            t0 = _cycles()
            _send(out_win, out_slot, fmt, bb, src, nwords, e)
            if not _recv(in_win, in_slot, fmt, bb, dst, nwords, e, max_spins):
                return r
            stamps[r] = _cycles() - t0
        else:
            if not _recv(in_win, in_slot, fmt, bb, dst, nwords, e, max_spins):
                return r
            _send(out_win, out_slot, fmt, bb, src, nwords, e)
    return rounds


@_jit
def _now_cycles():
    return _cycles()


def cycles_per_us(interval_s: float = 0.05) -> float:
    """The cycle counter's rate (constant on x86 with constant_tsc), measured over a sleep."""
    c0, t0 = _now_cycles(), time.perf_counter_ns()
    time.sleep(interval_s)
    c1, t1 = _now_cycles(), time.perf_counter_ns()
    return (c1 - c0) / ((t1 - t0) / 1e3)


class _Windows:
    """Per variant and direction one window (blocks) and one slot, in one shm segment."""

    def __init__(self, job: str, rank: int, syncs, block_bytes: int, max_payload: int):
        import torch.distributed as dist

        self.fmts = {v: BlockFormat(v, block_bytes) for v in syncs}
        self.win_bytes = max(f.wire_bytes(max_payload) for f in self.fmts.values())
        self.stride = self.win_bytes + _SLOT_BYTES
        nbytes = len(syncs) * 2 * self.stride
        self.syncs = tuple(syncs)
        name = f"{segments.PREFIX}syncpp_{job}"
        if rank == 0:
            self._segment = segments.create(name, nbytes)
        try:
            dist.barrier()
            if rank != 0:
                self._segment = segments.attach(name)
            self.words = np.frombuffer(self._segment.buf, dtype=np.int64)
            self.base = self.words.ctypes.data
            if rank == 0 and "sp" in self.fmts:      # arm every marker word of sp's windows
                for d in (0, 1):
                    first = self.addr("sp", d) - self.base
                    for b in range(self.win_bytes // block_bytes):
                        self.words[(first + (b + 1) * block_bytes) // 8 - 1] = SENTINEL_I64
            dist.barrier()
        finally:
            if rank == 0:
                segments.unlink_name(name)  # both ranks have it mapped, or the setup failed

    def addr(self, sync: str, direction: int) -> int:
        """Window address of `sync` for messages of direction 0 (0 -> 1) or 1 (1 -> 0)."""
        return self.base + (self.syncs.index(sync) * 2 + direction) * self.stride

    def close(self) -> None:
        self.words = None
        self._segment.close()


def pingpong_rank(rank: int, world: int, payloads, syncs, block_bytes: int, rounds: int,
                  repeats: int, timeout_s: float = 30.0) -> dict:
    """Rank 0 <-> rank 1 ping-pong of every (payload, variant), interleaved, `repeats` runs of
    `rounds` round trips after one warm-up run; every delivered message is compared with what
    was sent. Returns on rank 0 `{"samples": {(payload, sync): one-way µs per round},
    "cycles_per_us": float}`; {} on rank 1."""
    from ubep.bench.flags import HostSync

    if world != 2:
        raise ValueError(f"world={world}: the ping-pong runs on exactly 2 ranks")
    job = os.environ.get("UBEP_JOB_ID", f"pp{os.getpid()}")
    sync = HostSync.create(rank, world, job + "-pp", timeout_s=timeout_s)
    wins = _Windows(job, rank, syncs, block_bytes, max(payloads))
    rng = np.random.default_rng(7)
    src = rng.integers(-(1 << 62), 1 << 62, max(payloads) // 8 + 1, dtype=np.int64)
    src[src == SENTINEL_I64] = 1                    # never the sp sentinel
    dst = np.zeros_like(src)
    epochs = {v: 1 for v in syncs}
    samples: dict = {}
    rate = cycles_per_us() if _IS_X86 else 0.0
    max_spins = 200_000_000                         # pause ~ 10-140 cycles: seconds
    bad = [p for p in payloads if p % MARKER_BYTES]
    if bad:
        raise ValueError(f"payloads {bad} must be multiples of {MARKER_BYTES} bytes")
    # every run visits every (payload, variant), in an order rotated per run, so that the
    # load of a shared host drifts over all points alike
    points = [(p, v) for p in payloads for v in syncs]
    try:
        for run in range(repeats + 1):
            k = (run * 7) % len(points)
            for payload, v in points[k:] + points[:k]:
                nwords = payload // 8
                stamps = np.zeros(rounds, np.int64)
                out_d, in_d = (0, 1) if rank == 0 else (1, 0)
                sync.barrier()
                t0 = time.perf_counter_ns()
                done = _pingpong(wins.addr(v, out_d), wins.addr(v, out_d) + wins.win_bytes,
                                 wins.addr(v, in_d), wins.addr(v, in_d) + wins.win_bytes,
                                 FMT_CODES[v], block_bytes, src, dst, nwords, rank == 0, rounds,
                                 epochs[v], max_spins, stamps)
                t1 = time.perf_counter_ns()
                if done != rounds:
                    raise TimeoutError(f"rank {rank}: {v} ping-pong stuck at round {done} "
                                       f"of {rounds} ({payload} B)")
                epochs[v] += rounds
                if not np.array_equal(dst[:nwords], src[:nwords] ^ (epochs[v] - 1)):
                    raise ValueError(f"rank {rank}: {v} ping-pong delivered wrong bytes "
                                     f"({payload} B)")
                if rank == 0 and run > 0:
                    if rate > 0:
                        one_way = stamps / rate / 2
                    else:                 # no cycle counter: the run's mean, per round
                        one_way = np.full(rounds, (t1 - t0) / 1e3 / rounds / 2)
                    samples.setdefault((payload, v), []).append(one_way)
    finally:
        wins.close()
        sync.close()
    if rank != 0:
        return {}
    return {"samples": {k: np.concatenate(v) for k, v in samples.items()},
            "cycles_per_us": rate}
