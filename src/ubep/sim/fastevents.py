"""The send stage's event simulation compiled with numba: the semantics of
`ubep.sim.events` (the plain path; tests hold the two equal), with two shortcuts that do
not change any time: a store's completion time is known once it leaves its ingress queue,
so no completion event is queued; and a worker's next step runs inline when it starts
at once (worker steps touch no shared state, so their order at equal times is moot).

Events: ISSUED (a store joins its egress queue; key: row id - N) and INGRESS (it joins the
ingress queue; key: row id), and WORKER resumes (key: -N-1-lane), in a binary heap of
parallel arrays ordered by (time, key); keys are unique, so ties are deterministic.
A 256-rank CM384 dispatch (262k row stores) takes well under a second (see
docs/results/simulator.md); a list-of-tuples heap with five events per store took ~4 s.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _push(ht, hk, ha, n, t, key, a):
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if ht[p] < t or (ht[p] == t and hk[p] < key):
            break
        ht[i] = ht[p]
        hk[i] = hk[p]
        ha[i] = ha[p]
        i = p
    ht[i] = t
    hk[i] = key
    ha[i] = a
    return n + 1


@njit(cache=True)
def _pop(ht, hk, ha, n):
    """Remove the root (read it before calling); returns the new size."""
    n -= 1
    t, key, a = ht[n], hk[n], ha[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (ht[c + 1] < ht[c] or (ht[c + 1] == ht[c] and hk[c + 1] < hk[c])):
            c += 1
        if t < ht[c] or (t == ht[c] and key < hk[c]):
            break
        ht[i] = ht[c]
        hk[i] = hk[c]
        ha[i] = ha[c]
        i = c
    ht[i] = t
    hk[i] = key
    ha[i] = a
    return n


@njit(cache=True)
def _run(lane_ptr, rows, lane_of, pos_of, lane_start, src, dst, hop, port_of_hop, L, svc,
         issue, W, sync, batch, fence_flag_us, checksum_us_per_row, flag_us, n_ports,
         up_svc, up_src, up_dst, n_groups):
    N = src.size
    n_l = lane_start.size
    ST = np.zeros(N)
    IE = np.zeros(N)
    C = np.full(N, np.inf)          # inf: not known yet
    WD = np.full(N, np.nan)
    waiter = np.full(N, -1, dtype=np.int64)   # i of the lane's send waiting for this store
    drain_i = np.full(n_l, -1, dtype=np.int64)
    busy_out = np.zeros(n_ports)
    busy_in = np.zeros(n_ports)
    busy_up = np.zeros(n_groups)
    busy_dn = np.zeros(n_groups)
    cap = N + n_l + 1
    ht = np.zeros(cap)
    hk = np.zeros(cap, dtype=np.int64)
    ha = np.zeros(cap, dtype=np.int64)
    n = 0
    npc = port_of_hop.size
    for ln in range(n_l):
        if lane_ptr[ln + 1] > lane_ptr[ln]:
            n = _push(ht, hk, ha, n, lane_start[ln], -N - 1 - ln, 0)
    while n > 0:
        now, key, a = ht[0], hk[0], ha[0]
        n = _pop(ht, hk, ha, n)
        if key < -N:                        # WORKER resume: lane, send index a
            ln = -N - 1 - key
            i = a
        elif key < 0:                       # ISSUED
            k = key + N
            ln = lane_of[k]
            i = pos_of[k]
            base = lane_ptr[ln]
            cnt = lane_ptr[ln + 1] - base
            IE[k] = now
            if hop[k] == 0:
                C[k] = now + L[k]
                if waiter[k] >= 0:
                    n = _push(ht, hk, ha, n, C[k], -N - 1 - ln, waiter[k])
                    waiter[k] = -1
            else:
                q = src[k] * npc + port_of_hop[hop[k]]
                t = max(now, busy_out[q])   # serialization starts; the head flies (cut-through)
                busy_out[q] = t + svc[k]
                if up_svc[k] > 0:           # the source group's uplink (second switch tier)
                    g = up_src[k]
                    t = max(t, busy_up[g])
                    busy_up[g] = t + up_svc[k]
                n = _push(ht, hk, ha, n, t + L[k], k, 0)
            if sync != 0 and ((i + 1) % batch == 0 or i + 1 == cnt):
                first = i - i % batch
                if sync == 2:               # dc: checksum the batch, then write it
                    WD[k] = now + (i - first + 1) * checksum_us_per_row + flag_us
                    n = _push(ht, hk, ha, n, WD[k], -N - 1 - ln, i + 1)
                    continue
                m = now                     # sw: drain the batch, fence, flag
                for j in range(first, i + 1):
                    m = max(m, C[rows[base + j]])
                if m == np.inf:
                    drain_i[ln] = i
                else:
                    WD[k] = m + fence_flag_us
                    n = _push(ht, hk, ha, n, WD[k], -N - 1 - ln, i + 1)
                continue
            i += 1                          # go on at once (inline worker step)
        else:                               # INGRESS: row `key` joins its ingress queue
            k = key
            q = dst[k] * npc + port_of_hop[hop[k]]
            t = now
            if up_svc[k] > 0:               # the destination group's downlink
                g = up_dst[k]
                t = max(t, busy_dn[g])
                busy_dn[g] = t + up_svc[k]
            t = max(t, busy_in[q]) + svc[k]
            busy_in[q] = t
            C[k] = t
            ln = lane_of[k]
            if waiter[k] >= 0:
                n = _push(ht, hk, ha, n, t, -N - 1 - ln, waiter[k])
                waiter[k] = -1
            d = drain_i[ln]
            if d >= 0:
                base = lane_ptr[ln]
                m = IE[rows[base + d]]
                for j in range(d - d % batch, d + 1):
                    m = max(m, C[rows[base + j]])
                if m < np.inf:
                    drain_i[ln] = -1
                    WD[rows[base + d]] = m + fence_flag_us
                    n = _push(ht, hk, ha, n, m + fence_flag_us, -N - 1 - ln, d + 1)
            continue
        # a worker step of lane ln at send i, time now
        base = lane_ptr[ln]
        if i >= lane_ptr[ln + 1] - base:
            continue
        k = rows[base + i]
        if i >= W:
            kw = rows[base + i - W]
            if C[kw] == np.inf:
                waiter[kw] = i
                continue
            if C[kw] > now:
                n = _push(ht, hk, ha, n, C[kw], -N - 1 - ln, i)
                continue
        ST[k] = now
        n = _push(ht, hk, ha, n, now + issue[k], k - N, 0)
    return ST, IE, C, WD


def send_stage_fast(table, L, svc, port_of_hop, issue, lane_start, W, sp, up_svc, up_src,
                    up_dst):
    """Per row: issue start, issue end, completion, sync write end (NaN if none)."""
    n_l = lane_start.size
    rows = np.lexsort((table.pos, table.lane)).astype(np.int64)
    lane_ptr = np.zeros(n_l + 1, dtype=np.int64)
    lane_ptr[1:] = np.cumsum(np.bincount(table.lane, minlength=n_l))
    sync = {"sw": 1, "dc": 2}.get(sp.sync, 0) if sp.batched else 0
    top = max(int(table.src.max(initial=0)), int(table.dst.max(initial=0))) + 1
    return _run(lane_ptr, rows, table.lane.astype(np.int64), table.pos.astype(np.int64),
                lane_start.astype(np.float64), table.src.astype(np.int64),
                table.dst.astype(np.int64), table.hop.astype(np.int64),
                port_of_hop.astype(np.int64), L.astype(np.float64), svc.astype(np.float64),
                np.asarray(issue, dtype=np.float64), int(W), sync, int(sp.batch),
                float(sp.fence_us + sp.flag_us), float(sp.checksum_us_per_row),
                float(sp.flag_us), top * port_of_hop.size, np.asarray(up_svc, dtype=np.float64),
                np.asarray(up_src, dtype=np.int64), np.asarray(up_dst, dtype=np.int64),
                int(max(up_src.max(initial=0), up_dst.max(initial=0))) + 1)
