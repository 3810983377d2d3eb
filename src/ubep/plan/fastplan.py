"""The compiled planner: every worker's sends from the routing, by one Numba implementation.

`make_plan` calls `plan_kernel`; the shm runtime calls the same pieces per worker, as the
paper's cores do (each computes its own slice, nobody waits for a central plan):

1. `count_experts`: the per-expert send counts of one rank's routing;
2. `class_slices`: every worker's slices, from the per-hop-class totals (hierarchical),
   the total (balanced) or the token ranges (static) — closed form, O(hop classes * n);
3. `map_worker`: where worker j's slices start and end (`quaternary_search` on the prefix
   sums of the counts in the schedule's expert order: which expert, which offset), then
   one pass over the routing that keeps worker j's (token, slot) pairs, in send order
   (hierarchical: its slices interleaved in proportion, `interleave`).

Why compiled: `make_plan` runs on every dispatch, and the runtime's workers run the mapper
on theirs. The numpy path (`schedule.py`) needs ~30 array calls, ~100-300 µs per plan on a
small shared machine; this does the same work in O(T*K + E + H*n) loops per worker (see
docs/results/scheduler.md). It must produce exactly the numpy path's plan; tests/plan
checks that on random routings, and the numpy path stays the documented reference.
"""

from __future__ import annotations

import numba
import numpy as np

STATIC, BALANCED, HIERARCHICAL = 0, 1, 2

_jit = numba.njit(cache=True, nogil=True)


@_jit
def count_experts(idx, counts):  # pragma: no cover - compiled
    """`counts[e]` = slots of `idx` `[T, K]` routed to expert e. Returns an out-of-range id
    found in `idx` (`< -1` or `>= len(counts)`; then `counts` is partial), or -1."""
    num_experts = counts.shape[0]
    for e in range(num_experts):
        counts[e] = 0
    t_n, k_n = idx.shape
    for t in range(t_n):
        for k in range(k_n):
            e = idx[t, k]
            if e < -1 or e >= num_experts:
                return e
            if e >= 0:
                counts[e] += 1
    return -1


@_jit
def count_expert_range(idx, e_lo, e_hi, counts):  # pragma: no cover - compiled
    """`counts[e]` for experts `[e_lo, e_hi)` only (a count worker's share); others untouched."""
    for e in range(e_lo, e_hi):
        counts[e] = 0
    t_n, k_n = idx.shape
    for t in range(t_n):
        for k in range(k_n):
            e = idx[t, k]
            if e >= e_lo and e < e_hi:
                counts[e] += 1


@_jit
def quaternary_search(prefix, target):  # pragma: no cover - compiled
    """`(index, steps)`: the first `index` with `prefix[index] > target` (`len(prefix)` past
    the end), testing three pivots per step at the quarters of the window; the same answer
    and step count as `ubep.plan.search.quaternary_search`, its documented reference."""
    lo, hi = 0, prefix.shape[0] + 1        # window in positions of (0, prefix..., +inf)
    steps = 0
    while hi - lo > 1:
        steps += 1
        gap = hi - lo
        p1 = lo + min(max((gap + 3) // 4, 1), gap - 1)
        p2 = lo + min(max((2 * gap + 3) // 4, 1), gap - 1)
        p3 = lo + min(max((3 * gap + 3) // 4, 1), gap - 1)
        if prefix[p3 - 1] <= target:       # one compare of three pivots on a vector core
            lo = p3
        elif prefix[p2 - 1] <= target:
            lo, hi = p2, p3
        elif prefix[p1 - 1] <= target:
            lo, hi = p1, p2
        else:
            hi = p1
    return hi - 1, steps


@_jit
def static_offsets(idx, n):  # pragma: no cover - compiled
    """`[n + 1]`: static worker j sends the slots of tokens `[j*T/n, (j+1)*T/n)`."""
    t_n, k_n = idx.shape
    before = np.zeros(t_n + 1, np.int64)   # routed slots of tokens < t
    for t in range(t_n):
        c = 0
        for k in range(k_n):
            if idx[t, k] >= 0:
                c += 1
        before[t + 1] = before[t] + c
    offsets = np.empty(n + 1, np.int64)
    for j in range(n + 1):
        offsets[j] = before[(j * t_n) // n]
    return offsets


@_jit
def expert_order(rank_of_expert, kind):  # pragma: no cover - compiled
    """The order in which the slices cut the experts: by `rank_of_expert` (HIERARCHICAL's
    remap), else by id."""
    num_experts = rank_of_expert.shape[0]
    order = np.empty(num_experts, np.int64)
    for e in range(num_experts):
        order[rank_of_expert[e] if kind == HIERARCHICAL else e] = e
    return order


@_jit
def class_slices(counts, experts_per_rank, hop_of_rank, kind, n,
                 num_hop_classes):  # pragma: no cover - compiled
    """Every worker's slices of the sends in the schedule's expert order (BALANCED or
    HIERARCHICAL): `(offsets [n + 1], targets [n, S], sizes [n, S])`, see `Schedule`.

    Hierarchical: one row per hop class, farthest first; row r's `V_r` sends are cut into n
    slices of `floor` or `ceil` of `V_r / n`, the remainders dealt cyclically, continuing
    from row to row; worker j takes slice j of every row.
    """
    num_experts = counts.shape[0]
    offsets = np.zeros(n + 1, np.int64)
    if kind == BALANCED:
        total = 0
        for e in range(num_experts):
            total += counts[e]
        targets = np.empty((n, 1), np.int64)
        sizes = np.empty((n, 1), np.int64)
        for j in range(n + 1):
            offsets[j] = (j * total) // n
        for j in range(n):
            targets[j, 0] = offsets[j]
            sizes[j, 0] = offsets[j + 1] - offsets[j]
        return offsets, targets, sizes
    h_n = num_hop_classes
    per_class = np.zeros(h_n, np.int64)        # row r = hop class H - 1 - r
    for e in range(num_experts):
        per_class[h_n - 1 - hop_of_rank[e // experts_per_rank]] += counts[e]
    targets = np.empty((n, h_n), np.int64)
    sizes = np.empty((n, h_n), np.int64)
    dealt = 0
    row_start = 0
    for r in range(h_n):
        base, extra = per_class[r] // n, per_class[r] % n
        first_extra = dealt % n
        p = row_start
        for j in range(n):
            s = base + (1 if (j - first_extra) % n < extra else 0)
            targets[j, r] = p
            sizes[j, r] = s
            p += s
        dealt += extra
        row_start += per_class[r]
    for j in range(n):
        s = 0
        for r in range(h_n):
            s += sizes[j, r]
        offsets[j + 1] = offsets[j] + s
    return offsets, targets, sizes


@_jit
def _odd_upto(r, c, inv):  # pragma: no cover - compiled
    """How many odd o >= 1 have `o * c <= r` (r >= 0, c >= 1, `inv` = 1.0 / c): `(L + 1) // 2`
    for `L = floor(r / c)`, taken in float64 (off by at most one) and corrected exactly."""
    lim = np.int64(r * inv)
    lim += 1 if (lim + 1) * c <= r else 0
    lim -= 1 if lim * c > r else 0
    return (lim + 1) // 2


@_jit
def interleave(sizes, j, chunk=1):  # pragma: no cover - compiled
    """Worker j's send order: `perm[i]` = where the i-th send of its slices (concatenated
    row by row, farthest class first) goes. The slices are merged `chunk` sends at a time,
    chunk c of a slice's C chunks at `(2c + 1) / (2 C)`, ties to the farther class:
    `ubep.plan.schedule.interleave_keys`, the documented reference, compared exactly.

    Each send's place is computed on its own, not by running the merge (whose picks follow
    the routing, a chain of dependent steps with a mispredicted branch about once per
    send): chunk c of slice a lands after the chunks u of every other slice b with
    `(2u + 1) C_a < (2c + 1) C_b` (`<=` when b is the farther one, which wins ties) —
    the odd numbers `2u + 1 <= (2c + 1) C_b / C_a` (less one for strict; `_odd_upto`), at
    most C_b of them."""
    h_n = sizes.shape[1]
    size = np.empty(h_n, np.int64)         # the non-empty slices, farthest first
    start = np.empty(h_n, np.int64)
    nch = np.empty(h_n, np.int64)          # their chunks
    a_n, m = 0, 0
    for r in range(h_n):
        if sizes[j, r] > 0:
            size[a_n] = sizes[j, r]
            start[a_n] = m
            nch[a_n] = (sizes[j, r] + chunk - 1) // chunk
            a_n += 1
        m += sizes[j, r]
    perm = np.empty(m, np.int64)
    for a in range(a_n):
        s_a, n_a, c_a = start[a], size[a], nch[a]
        inv = 1.0 / c_a
        first = True                       # the first other slice sets, the rest add
        for b in range(a_n):               # b's sends ahead of each of a's (loops of scalars)
            if b == a:
                continue
            n_b, c_b, strict = size[b], nch[b], 1 if b > a else 0
            if chunk == 1:                 # (no integer division in the per-send loop)
                for q in range(n_a):
                    ahead = min(_odd_upto((2 * q + 1) * c_b - strict, c_a, inv), n_b)
                    perm[s_a + q] = (q if first else perm[s_a + q]) + ahead
            else:
                for c in range(c_a):
                    ahead = min(_odd_upto((2 * c + 1) * c_b - strict, c_a, inv) * chunk, n_b)
                    for q in range(c * chunk, min(c * chunk + chunk, n_a)):
                        perm[s_a + q] = (q if first else perm[s_a + q]) + ahead
            first = False
        if first:                          # the only slice: its own order
            for q in range(n_a):
                perm[s_a + q] = q
    return perm


@_jit
def map_worker(idx, counts, experts_per_rank, hop_of_rank, rank_of_expert, kind, n,
               num_hop_classes, j, chunk=1):  # pragma: no cover - compiled
    """Worker j's sends, in its send order: `(sends [m, 3] (token, slot, destination rank),
    experts [m], window_pos [m], hops [m])`.

    `counts` are `count_experts(idx)`; `rank_of_expert[e]`: e's position in the
    hierarchical expert order (ignored for STATIC and BALANCED, whose order is the ids').
    `window_pos` is a send's position among this rank's sends to that expert in token
    order (its row in the receiver's window for this rank and expert).
    """
    t_n, k_n = idx.shape
    num_experts = counts.shape[0]
    # one allocation for the per-expert work arrays (this runs on every dispatch)
    ws = np.zeros((6, num_experts), np.int64)
    lo_e, hi_e, land = ws[0], ws[1], ws[2]   # worker j sends window positions [lo, hi) of e
    order, prefix, seen = ws[3], ws[4], ws[5]  # ... from its list position land[e]
    t_lo, t_hi = 0, t_n
    m = 0
    perm = np.empty(0, np.int64)               # HIERARCHICAL: slice order -> send order
    if kind == STATIC:
        t_lo, t_hi = (j * t_n) // n, ((j + 1) * t_n) // n
        for t in range(t_lo, t_hi):
            for k in range(k_n):
                if idx[t, k] >= 0:
                    m += 1
    else:
        for e in range(num_experts):
            order[rank_of_expert[e] if kind == HIERARCHICAL else e] = e
        acc = 0
        for q in range(num_experts):           # inclusive prefix sums in the schedule's order
            acc += counts[order[q]]
            prefix[q] = acc
        if n == 1:                             # one worker: every slice is its own
            for q in range(num_experts):
                e = order[q]
                hi_e[e], land[e] = counts[e], prefix[q] - counts[e]
            m = acc
            if kind == HIERARCHICAL:           # its slices are the whole hop classes
                sizes = np.zeros((1, num_hop_classes), np.int64)   # farthest first
                for e in range(num_experts):
                    sizes[0, num_hop_classes - 1 - hop_of_rank[e // experts_per_rank]] += (
                        counts[e])
                perm = interleave(sizes, 0, chunk)
        else:
            _, targets, sizes = class_slices(counts, experts_per_rank, hop_of_rank, kind, n,
                                             num_hop_classes)
            for r in range(targets.shape[1]):
                size = sizes[j, r]
                if size == 0:
                    continue
                first, last = targets[j, r], targets[j, r] + size - 1
                q0, _ = quaternary_search(prefix, first)       # expert of my first send
                q1, _ = quaternary_search(prefix, last)        # ... and of my last
                for q in range(q0, q1 + 1):
                    e = order[q]
                    before = prefix[q] - counts[e]
                    a = first - before if q == q0 else 0
                    b = last - before + 1 if q == q1 else counts[e]
                    lo_e[e], hi_e[e], land[e] = a, b, m
                    m += b - a
            if kind == HIERARCHICAL:
                perm = interleave(sizes, j, chunk)
    sends = np.empty((m, 3), np.int64)
    experts = np.empty(m, np.int64)
    window_pos = np.empty(m, np.int64)
    hops = np.empty(m, np.int64)
    i = 0
    for t in range(t_hi):
        for k in range(k_n):
            e = idx[t, k]
            if e < 0:
                continue
            w = seen[e]
            seen[e] = w + 1
            if kind == STATIC:
                if t < t_lo:
                    continue
                p = i
                i += 1
            elif w >= lo_e[e] and w < hi_e[e]:
                p = land[e] + w - lo_e[e]
                if kind == HIERARCHICAL:
                    p = perm[p]
            else:
                continue
            d = e // experts_per_rank
            sends[p, 0] = t
            sends[p, 1] = k
            sends[p, 2] = d
            experts[p] = e
            window_pos[p] = w
            hops[p] = hop_of_rank[d]
    return sends, experts, window_pos, hops


@_jit
def worker_sends(idx, num_experts, experts_per_rank, hop_of_rank, rank_of_expert, kind, n,
                 num_hop_classes, j, chunk=1):  # pragma: no cover - compiled
    """What a runtime worker needs, in one entry: `(counts [E], sends [m, 3], window_pos
    [m])` of `count_experts` and `map_worker`."""
    counts = np.empty(num_experts, np.int64)
    count_experts(idx, counts)
    sends, _, window_pos, _ = map_worker(idx, counts, experts_per_rank, hop_of_rank,
                                         rank_of_expert, kind, n, num_hop_classes, j, chunk)
    return counts, sends, window_pos


@_jit
def plan_kernel(idx, num_experts, experts_per_rank, hop_of_rank, rank_of_expert, kind,
                n, num_hop_classes, chunk=1):  # pragma: no cover - compiled
    """Every worker's sends at once: (sends [N,3], experts, window_pos, hops, offsets,
    send_counts, targets, sizes, bad). `bad` is an out-of-range expert id found in `idx`
    (then the rest is empty), or -1.

    The same slices as `map_worker` for every j (tests/plan pins it), in one pass: each send's
    position in the schedule's expert order is moved to where its slice lands.
    """
    counts = np.zeros(num_experts, np.int64)
    bad = count_experts(idx, counts)
    if bad != -1:
        z = np.zeros((0, 0), np.int64)
        return (z, z[0], z[0], z[0], z[0], counts, z, z, bad)
    t_n, k_n = idx.shape
    n_sends = 0
    for e in range(num_experts):
        n_sends += counts[e]
    # row-major send list with each send's window position (running count per expert)
    tok = np.empty(n_sends, np.int64)
    slot = np.empty(n_sends, np.int64)
    exp = np.empty(n_sends, np.int64)
    wpos = np.empty(n_sends, np.int64)
    seen = np.zeros(num_experts, np.int64)
    i = 0
    for t in range(t_n):
        for k in range(k_n):
            e = idx[t, k]
            if e >= 0:
                tok[i], slot[i], exp[i] = t, k, e
                wpos[i] = seen[e]
                seen[e] += 1
                i += 1
    pos = np.empty(n_sends, np.int64)   # final (worker-major) position of each send
    if kind == STATIC:
        offsets = static_offsets(idx, n)
        targets = np.zeros((n, 0), np.int64)
        sizes = np.zeros((n, 0), np.int64)
        for i in range(n_sends):
            pos[i] = i
    else:
        offsets, targets, sizes = class_slices(counts, experts_per_rank, hop_of_rank, kind, n,
                                               num_hop_classes)
        order = expert_order(rank_of_expert, kind)
        first = np.empty(num_experts, np.int64)   # S position of each expert's first send
        acc = 0
        for q in range(num_experts):
            first[order[q]] = acc
            acc += counts[order[q]]
        shift = np.empty(n_sends, np.int64)      # S position -> final position
        for j in range(n):
            land = offsets[j]
            perm = (interleave(sizes, j, chunk) if kind == HIERARCHICAL
                    else np.empty(0, np.int64))
            for r in range(targets.shape[1]):
                for q in range(sizes[j, r]):
                    i = land - offsets[j] + q
                    shift[targets[j, r] + q] = offsets[j] + (perm[i] if kind == HIERARCHICAL
                                                             else i)
                land += sizes[j, r]
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
