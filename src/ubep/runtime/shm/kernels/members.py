"""Elastic membership words: or a rank's bit into every region, read the drain slots.

`Buffer(elastic=True)` keeps, in the header page of every rank's region, a word whose bit r
says rank r is inactive (`region.H_INACTIVE`). Ranks that learn of a death (or a drain) or
its bit into that word of every region with an atomic `or`: several may learn of one at
once, and no bit may be lost. Reading it is a plain load at the start of a call.
"""

from __future__ import annotations

from numba import carray

from ubep.runtime.shm.atomics import fetch_or, i64_ptr, load_acquire, store_release
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.kernels.slots import send_counts, send_hellos
from ubep.runtime.shm.region import L_COUNT_OFF, L_CW, L_HELLO_OFF, L_WORLD


@jit
def or_into(addrs, bits):
    """Atomic `or` of `bits` into the int64 word at each of `addrs`."""
    for i in range(addrs.shape[0]):
        fetch_or(addrs[i], bits)


@jit
def publish_drain(addrs, mask, gen):
    """Write `[mask, gen]` at each of `addrs`, the generation word release-stored last."""
    for i in range(addrs.shape[0]):
        carray(i64_ptr(addrs[i]), 1)[0] = mask
        store_release(addrs[i] + 8, gen)


@jit
def poll_drain(first, ranks, gen, masks, spins):
    """The drain slots of `ranks` at `first` (16 bytes each, by rank): copy each mask whose
    generation word holds `gen` into `masks[r]`; returns how many ranks lack."""
    left = 0
    for _ in range(max(spins, 1)):
        left = 0
        for i in range(ranks.shape[0]):
            r = ranks[i]
            a = first + 16 * r
            if load_acquire(a + 8) == gen:
                masks[r] = carray(i64_ptr(a), 1)[0]
            else:
                left += 1
        if left == 0:
            return 0
    return left


# -- the two-copy paths: an inactive source's control messages, written on its behalf ------------
# A receiver of the two-copy protocol waits for a count slot (dispatch) and a hello (combine)
# from every source, in its own region. For an inactive source it writes them itself, empty
# (no rows follow), unless the source wrote them for this epoch before it died.
@jit
def proxy_counts(bases, lay, me, epoch, ranks, zeros, elem):
    """Count slots of `ranks` in my region for `epoch`: zero counts, one token worker,
    `elem`, status OK, where the source did not write them."""
    world, cw = lay[L_WORLD], lay[L_CW]
    par = epoch & 1
    for i in range(ranks.shape[0]):
        r = ranks[i]
        slot = bases[me] + lay[L_COUNT_OFF] + (par * world + r) * cw * 8
        if load_acquire(slot + (cw - 1) * 8) != epoch:
            send_counts(bases, lay, r, epoch, zeros, 1, elem, 0, me, me + 1)


@jit
def proxy_hellos(bases, lay, me, epoch, ranks, elem):
    """Combine hellos of `ranks` in my region for `epoch` (as `proxy_counts`)."""
    world = lay[L_WORLD]
    par = epoch & 1
    for i in range(ranks.shape[0]):
        r = ranks[i]
        slot = bases[me] + lay[L_HELLO_OFF] + (par * world + r) * 64
        if load_acquire(slot + 56) != epoch:
            send_hellos(bases, lay, r, epoch, 1, elem, 0, me, me + 1)
