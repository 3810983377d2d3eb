"""Synchronization among the workers of one rank: a counter barrier, a published word."""

from __future__ import annotations

from ubep.runtime.shm.atomics import cpu_pause, fetch_add, load_acquire, store_release
from ubep.runtime.shm.kernels import jit


@jit
def barrier_arrive(addr):
    """Arrive at a worker barrier whose counter lives at `addr`; returns the new count."""
    return fetch_add(addr, 1) + 1


@jit
def poll_at_least(addr, target, spins):
    """Spin until the int64 at `addr` reaches `target`; True if it did."""
    for _ in range(max(spins, 1)):
        if load_acquire(addr) >= target:
            return True
        cpu_pause()
    return False


@jit
def poll_words_at_least(addr, n, target, spins):
    """Spin until each of the `n` int64 words at `addr` reaches `target`; how many have not."""
    left = n
    for _ in range(max(spins, 1)):
        left = 0
        for i in range(n):
            if load_acquire(addr + 8 * i) < target:
                left += 1
        if left == 0:
            return 0
        cpu_pause()
    return left


@jit
def publish(addr, value):
    store_release(addr, value)


