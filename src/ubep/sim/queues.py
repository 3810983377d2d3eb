"""Vectorised single-server FIFO queues: the fast path's answer to "who waits for whom".

A FIFO server with arrivals a_k (in order) and service times s_k departs item k at
d_k = S_k + max_{j <= k} (a_j - S_{j-1}), where S_k is the cumulative service; a running
maximum per queue does it for every queue at once. `ubep.sim.events` computes the same
thing one event at a time; tests hold the two to each other.
"""

from __future__ import annotations

import numpy as np


def fifo_depart(queue: np.ndarray, arrive: np.ndarray, service: np.ndarray,
                tiebreak: np.ndarray | None = None) -> np.ndarray:
    """Departure time of every item; items of one `queue` id are served in arrival order.

    Arguments:
        queue: `[N]` int, which server each item joins.
        arrive: `[N]` float, arrival times (us).
        service: `[N]` float, service times (us), >= 0.
        tiebreak: `[N]` int, order of equal arrivals (default: item index).
    Returns:
        `[N]` float departure times, in the items' original order.
    """
    n = arrive.size
    if n == 0:
        return np.zeros(0)
    o = np.arange(n) if tiebreak is None else np.argsort(tiebreak, kind="stable")
    o = o[np.argsort(arrive[o], kind="stable")]
    o = o[np.argsort(queue[o], kind="stable")]
    g, a, s = queue[o], arrive[o], service[o]
    cs = np.cumsum(s)
    new = np.ones(n, dtype=bool)
    new[1:] = g[1:] != g[:-1]
    starts = np.flatnonzero(new)
    seg = np.cumsum(new) - 1                       # dense queue index, sorted ascending
    base = np.where(starts > 0, cs[starts - 1], 0.0)[seg]
    S = cs - base                                  # cumulative service within the queue
    x = a - (S - s)
    span = float(x.max() - x.min()) + 1.0
    shift = seg * span                             # later queues sit above earlier ones
    m = np.maximum.accumulate(x + shift) - shift
    out = np.empty(n)
    out[o] = S + m
    return out
