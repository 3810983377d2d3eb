"""The control messages: per-expert count slots, combine hellos, sw/dc batch flags.

Each is a small slot in the receiver's region whose last word holds the epoch,
release-stored after the rest; `poll_slots` collects the slots of a range of ranks.
"""

from __future__ import annotations

import numpy as np
from numba import carray

from ubep.runtime.shm.atomics import cpu_pause, i64_ptr, load_acquire, store_release
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.region import (
    L_CBATCH_OFF,
    L_COUNT_OFF,
    L_CW,
    L_DBATCH_OFF,
    L_EL,
    L_HELLO_OFF,
    L_MW,
    L_WORLD,
    SLOT_ELEM,
    SLOT_NTW,
    SLOT_STATUS,
)


@jit
def send_counts(bases, lay, me, epoch, counts, n_tw, elem, status, d_lo, d_hi):
    """Write my per-expert counts (and how many batch flags follow) into ranks [d_lo, d_hi)."""
    world, el, cw = lay[L_WORLD], lay[L_EL], lay[L_CW]
    par = epoch & 1
    for d in range(d_lo, d_hi):
        slot = bases[d] + lay[L_COUNT_OFF] + (par * world + me) * cw * 8
        w = carray(i64_ptr(slot), cw)
        for i in range(el):
            w[i] = counts[d * el + i]
        w[el + SLOT_NTW] = n_tw
        w[el + SLOT_ELEM] = elem
        w[el + SLOT_STATUS] = status
        store_release(slot + (cw - 1) * 8, epoch)



@jit
def write_batch_flags(bases, lay, combine, me, epoch, j, cs):
    """sw/dc: after its rows, worker j tells every rank its batch is complete (+checksum)."""
    world, mw = lay[L_WORLD], lay[L_MW]
    off = lay[L_CBATCH_OFF] if combine else lay[L_DBATCH_OFF]
    par = epoch & 1
    for d in range(world):
        slot = bases[d] + off + ((par * world + me) * mw + j) * 64
        carray(i64_ptr(slot), 1)[0] = cs[d]
        store_release(slot + 56, epoch)


@jit
def poll_slots(addrs, s_lo, s_hi, last, epoch, head, tail, got, spins):
    """Collect the slots `addrs[s]` of ranks [s_lo, s_hi) whose word `last` holds `epoch`:
    their first `head.shape[1]` words into `head[s]`, the next `tail.shape[1]` into
    `tail[s]`; `got[s]` marks ranks read. Spins at most `spins` rounds; returns how many lack.
    """
    nh, nt = head.shape[1], tail.shape[1]
    missing = 0
    for _ in range(max(spins, 1)):
        missing = 0
        for s in range(s_lo, s_hi):
            if got[s]:
                continue
            if load_acquire(addrs[s] + last * 8) == epoch:
                w = carray(i64_ptr(addrs[s]), nh + nt)
                for i in range(nh):
                    head[s, i] = w[i]
                for i in range(nt):
                    tail[s, i] = w[nh + i]
                got[s] = 1
            else:
                missing += 1
        if missing == 0:
            return 0
        cpu_pause()
    return missing


@jit
def poll_counts(base, lay, epoch, s_lo, s_hi, counts, meta, got, spins):
    """Collect the count slots of sources [s_lo, s_hi) that hold `epoch`; return how many lack.

    `counts` `[world, E/P]` and `meta` `[world, 3]` (token workers, dtype, status) receive
    the slots; `got[s]` marks sources already read.
    """
    world, cw = lay[L_WORLD], lay[L_CW]
    addrs = base + lay[L_COUNT_OFF] + ((epoch & 1) * world + np.arange(world)) * cw * 8
    return poll_slots(addrs, s_lo, s_hi, cw - 1, epoch, counts, meta, got, spins)



@jit
def batch_complete(base, lay, combine, epoch, s, n_tw):
    """sw/dc: whether source s's n_tw batch flags hold epoch; returns (done, checksum sum)."""
    world, mw = lay[L_WORLD], lay[L_MW]
    off = lay[L_CBATCH_OFF] if combine else lay[L_DBATCH_OFF]
    par = epoch & 1
    total = np.int64(0)
    for j in range(n_tw):
        slot = base + off + ((par * world + s) * mw + j) * 64
        if load_acquire(slot + 56) != epoch:
            return False, total
        total += carray(i64_ptr(slot), 1)[0]
    return True, total



@jit
def send_hello(bases, lay, me, epoch, n_tw, elem, status):
    """Combine: tell every rank this call started (token workers, dtype, status)."""
    send_hellos(bases, lay, me, epoch, n_tw, elem, status, 0, lay[L_WORLD])


@jit
def send_hellos(bases, lay, me, epoch, n_tw, elem, status, d_lo, d_hi):
    """`send_hello` to ranks [d_lo, d_hi) only (a count worker's share)."""
    world = lay[L_WORLD]
    par = epoch & 1
    for d in range(d_lo, d_hi):
        slot = bases[d] + lay[L_HELLO_OFF] + (par * world + me) * 64
        w = carray(i64_ptr(slot), 8)
        w[SLOT_NTW] = n_tw
        w[SLOT_ELEM] = elem
        w[SLOT_STATUS] = status
        store_release(slot + 56, epoch)


@jit
def poll_hello(base, lay, epoch, meta, got, spins):
    """Collect the combine hellos of `epoch` into `meta` `[world, 3]`; return how many lack."""
    world = lay[L_WORLD]
    addrs = base + lay[L_HELLO_OFF] + ((epoch & 1) * world + np.arange(world)) * 64
    return poll_slots(addrs, 0, world, 7, epoch, meta, meta[:, :0], got, spins)


@jit
def check_meta(meta, elem):
    """0 if every peer's slot is fine, 1 if one aborted, 2 if one uses another dtype."""
    for s in range(meta.shape[0]):
        if meta[s, 2] != 0:
            return 1
    for s in range(meta.shape[0]):
        if meta[s, 1] != elem:
            return 2
    return 0
