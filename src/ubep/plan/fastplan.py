"""The planner's fast path: the three schedulers as one Numba-compiled pass (counting sorts).

Why: `make_plan` runs on every dispatch. The numpy path (`schedule.py`) needs ~30 array
calls, a few µs each on a small shared machine, ~100-300 µs per plan here; this path does
the same work in one compiled call over O(T*K + E + H*n) loops (see docs/results/scheduler.md
for both figures). It must produce exactly the numpy path's plan; tests/plan checks that on
random routings, and the numpy path stays the documented, tested reference.
"""

from __future__ import annotations

import numba
import numpy as np

STATIC, BALANCED, HIERARCHICAL = 0, 1, 2


@numba.njit(cache=True, nogil=True)
def plan_kernel(idx, num_experts, experts_per_rank, hop_of_rank, rank_of_expert, kind,
                n, num_hop_classes):  # pragma: no cover - compiled
    """Return (sends [N,3], experts, window_pos, hops, offsets, send_counts, targets, sizes,
    bad): `bad` is an out-of-range expert id found in `idx` (then the rest is empty), or -1.

    `idx` [T, K] int64; `rank_of_expert` [E]: each expert's position in the schedule's
    expert order (hierarchical; ignored otherwise); `kind` STATIC | BALANCED | HIERARCHICAL.
    """
    T, K = idx.shape
    counts = np.zeros(num_experts, np.int64)
    n_sends = 0
    for t in range(T):
        for k in range(K):
            e = idx[t, k]
            if e < -1 or e >= num_experts:
                z = np.zeros((0, 0), np.int64)
                return (z, z[0], z[0], z[0], z[0], counts, z, z, e)
            if e >= 0:
                counts[e] += 1
                n_sends += 1
    # row-major send list with each send's window position (running count per expert)
    tok = np.empty(n_sends, np.int64)
    slot = np.empty(n_sends, np.int64)
    exp = np.empty(n_sends, np.int64)
    wpos = np.empty(n_sends, np.int64)
    seen = np.zeros(num_experts, np.int64)
    i = 0
    for t in range(T):
        for k in range(K):
            e = idx[t, k]
            if e >= 0:
                tok[i], slot[i], exp[i] = t, k, e
                wpos[i] = seen[e]
                seen[e] += 1
                i += 1
    pos = np.empty(n_sends, np.int64)   # final (worker-major) position of each send
    offsets = np.zeros(n + 1, np.int64)
    if kind == STATIC:
        sends_before_token = np.zeros(T + 1, np.int64)
        for i in range(n_sends):
            sends_before_token[tok[i] + 1] += 1
        for t in range(T):
            sends_before_token[t + 1] += sends_before_token[t]
        for j in range(n + 1):
            offsets[j] = sends_before_token[(j * T) // n]
        for i in range(n_sends):
            pos[i] = i
        targets = np.zeros((n, 0), np.int64)
        sizes = np.zeros((n, 0), np.int64)
    elif kind == BALANCED:
        first = np.zeros(num_experts, np.int64)
        acc = 0
        for e in range(num_experts):
            first[e] = acc
            acc += counts[e]
        for i in range(n_sends):
            pos[i] = first[exp[i]] + wpos[i]
        for j in range(n + 1):
            offsets[j] = (j * n_sends) // n
        targets = np.empty((n, 1), np.int64)
        sizes = np.empty((n, 1), np.int64)
        for j in range(n):
            targets[j, 0] = offsets[j]
            sizes[j, 0] = offsets[j + 1] - offsets[j]
    else:
        H = num_hop_classes
        # position of each expert's first send in the class-major sequence S
        order = np.empty(num_experts, np.int64)
        for e in range(num_experts):
            order[rank_of_expert[e]] = e
        first = np.zeros(num_experts, np.int64)
        acc = 0
        for r in range(num_experts):
            e = order[r]
            first[e] = acc
            acc += counts[e]
        per_class = np.zeros(H, np.int64)        # row r = hop class H - 1 - r
        for e in range(num_experts):
            per_class[H - 1 - hop_of_rank[e // experts_per_rank]] += counts[e]
        sizes_rj = np.empty((H, n), np.int64)
        dealt = 0
        for r in range(H):
            base, extra = per_class[r] // n, per_class[r] % n
            first_extra = dealt % n
            for j in range(n):
                sizes_rj[r, j] = base + (1 if (j - first_extra) % n < extra else 0)
            dealt += extra
        for j in range(n):
            s = 0
            for r in range(H):
                s += sizes_rj[r, j]
            offsets[j + 1] = offsets[j] + s
        targets = np.empty((n, H), np.int64)
        sizes = np.empty((n, H), np.int64)
        shift = np.empty(n_sends, np.int64)      # S position -> final position
        row_start = 0
        for r in range(H):
            p = row_start
            for j in range(n):
                land = offsets[j]
                for r2 in range(r):
                    land += sizes_rj[r2, j]
                targets[j, r] = p
                sizes[j, r] = sizes_rj[r, j]
                for q in range(sizes_rj[r, j]):
                    shift[p + q] = land + q
                p += sizes_rj[r, j]
            row_start += per_class[r]
        for i in range(n_sends):
            pos[i] = shift[first[exp[i]] + wpos[i]]
    sends = np.empty((n_sends, 3), np.int64)
    experts = np.empty(n_sends, np.int64)
    window_pos = np.empty(n_sends, np.int64)
    hops = np.empty(n_sends, np.int64)
    for i in range(n_sends):
        p = pos[i]
        d = exp[i] // experts_per_rank
        sends[p, 0], sends[p, 1], sends[p, 2] = tok[i], slot[i], d
        experts[p] = exp[i]
        window_pos[p] = wpos[i]
        hops[p] = hop_of_rank[d]
    return sends, experts, window_pos, hops, offsets, counts, targets, sizes, -1
