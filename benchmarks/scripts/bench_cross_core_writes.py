"""What a writer pays for lines another core has just read: one process writes a batch-1
dispatch's bytes (8 rows of 14 KB as window records: 512-byte blocks, 504 bytes of payload and
an 8-byte flag each) into shared memory that a second process, on the other core, reads
between two writes, as a receiver reads its window; then the same writes with no reader.

Ways of writing a record: `loop` (`kernels.records.copy_bytes` per block, the staged path's
way), `memcpy` (libc's, per block, then an `sfence`), `row memcpy` (the row in one memcpy, one
flag after an `sfence`: the direct path's way), `4K blocks` (memcpy per 4 KiB block).

Not a test (pytest does not collect it): it prints its figures.

    .venv/bin/python -m benchmarks bench_cross_core_writes [iterations] [rounds]
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from multiprocessing import get_context

import numpy as np
from numba import njit

from ubep.runtime.shm.atomics import (
    cpu_pause,
    load_acquire,
    memcpy_at,
    store_fence,
    store_release,
)
from ubep.runtime.shm.kernels.records import copy_bytes

ROW, BB, ROWS = 14336, 512, 8
PPB = BB - 8
NB = -(-(ROW + 16) // PPB)
REC = 4 * 4096               # a record's room: its 29 blocks, or four 4 KiB blocks
WAYS = ("loop", "memcpy", "row memcpy", "4K blocks")


@njit(nogil=True)
def write(way, dst, src, epoch):
    """The 8 records at `dst` from the rows at `src`, flags `epoch`, the `way`-th way."""
    for r in range(ROWS):
        base, s = dst + r * REC, src + r * ROW
        if way == 2:
            memcpy_at(base, s, ROW)
            store_fence()
            store_release(base + REC - 8, epoch)
        elif way == 3:
            for b in range(4):
                memcpy_at(base + b * 4096, s + b * 4088, min(4088, ROW - b * 4088))
            store_fence()
            for b in range(4):
                store_release(base + b * 4096 + 4088, epoch)
        else:
            for b in range(NB):
                n = min(PPB, ROW - b * PPB)
                if way == 0:
                    copy_bytes(base + b * BB, s + b * PPB, n)
                else:
                    memcpy_at(base + b * BB, s + b * PPB, n)
                    store_fence()
                store_release(base + b * BB + BB - 8, epoch)


@njit(nogil=True)
def _read(ctl, mem, iters):
    """The reader: after write `it`, a load of every line, then `it` back to the writer."""
    acc = 0
    for it in range(1, iters + 1):
        while load_acquire(ctl) != it:
            cpu_pause()
        for i in range(0, mem.shape[0], 64):
            acc += mem[i]
        store_release(ctl + 64, it)
    return acc


@njit(nogil=True)
def _wait(addr, v):
    while load_acquire(addr) != v:
        cpu_pause()


@njit(nogil=True)
def _put(addr, v):
    store_release(addr, v)


def _reader(buf: np.ndarray, iters: int) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    _read(buf.ctypes.data, buf[4096:4096 + ROWS * REC], iters)


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    src = np.random.default_rng(0).integers(0, 256, ROWS * ROW, dtype=np.uint8)
    # shared with the forked reader, anonymous: nothing in /dev/shm to clean up
    mem = mmap.mmap(-1, 4096 + ROWS * REC, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    fork = get_context("fork")
    res: dict[str, list[float]] = {}
    try:
        buf = np.frombuffer(mem, np.uint8)
        ctl, dst = buf.ctypes.data, buf.ctypes.data + 4096
        for way in range(len(WAYS)):
            write(way, dst, src.ctypes.data, 1)       # compiled before anything is timed
        _read(ctl, buf[4096:], 0)                     # and before the fork (numba in a
        _wait(ctl, 0)                                 # forked child can deadlock)
        _put(ctl + 128, 0)
        for _ in range(rounds):
            for way, name in enumerate(WAYS):
                buf[:4096] = 0
                p = fork.Process(target=_reader, args=(buf, iters))
                p.start()
                ts = []
                for it in range(1, iters + 1):
                    _wait(ctl + 64, it - 1)
                    t0 = time.perf_counter_ns()
                    write(way, dst, src.ctypes.data, it)
                    ts.append(time.perf_counter_ns() - t0)
                    _put(ctl, it)
                p.join()
                res.setdefault(name, []).append(float(np.median(ts[200:])) / 1e3)
        for way, name in enumerate(WAYS):
            ts = []
            for it in range(500):
                t0 = time.perf_counter_ns()
                write(way, dst, src.ctypes.data, it)
                ts.append(time.perf_counter_ns() - t0)
            res[f"{name}, no reader"] = [float(np.median(ts[100:])) / 1e3]
        del buf
    finally:
        mem.close()
    print(f"{ROWS} rows of {ROW} bytes as {NB}-block records, median µs per write of all "
          f"({iters} writes a round, rounds alternate):")
    for name, v in res.items():
        print(f"  {name:22s}", " ".join(f"{x:6.1f}" for x in v))


if __name__ == "__main__":
    sys.exit(main())
