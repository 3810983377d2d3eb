"""The plain, event-by-event send stage in pure Python: the reference for `fastevents`.

Semantics (both engines): a worker issues its sends in order, row k taking `issue[k]`;
send i starts only once send i-W has completed (at most W stores in flight). A remote
store queues FIFO at its source rank's egress port (which then serializes it), flies the
hop latency from the moment its serialization starts (cut-through), queues FIFO at the
destination's ingress port, is serialized there and completes: uncontended, a store
completes its hop latency plus one serialization after it was issued, and holds its
staging slot that long. A store to the outermost tier also passes the uplink of its
source's group and the downlink of its destination's group (FIFO, each shared by every
rank of that group: the second switch tier), when the fabric has one. A local store
completes after the local latency. In sw/dc, the
last send of each batch is followed by the sync write: dc checksums the batch and writes
the checksum; sw first waits until every store of the batch completed (drain), then
fences and writes the flag. Ties run in (time, priority, sequence) order; priorities:
worker steps first, then stores by row id.
"""

from __future__ import annotations

import numpy as np

from ubep.sim.core import Simulation


def send_stage_events(table, L: np.ndarray, svc: np.ndarray, port_of_hop: np.ndarray,
                      issue: np.ndarray, lane_start: np.ndarray, W: int, sp,
                      up_svc: np.ndarray, up_src: np.ndarray, up_dst: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: issue start, issue end, completion, sync write end (NaN if none)."""
    sim = Simulation()
    N = table.src.size
    ST, IE, C = np.zeros(N), np.zeros(N), np.zeros(N)
    WD = np.full(N, np.nan)
    done = np.zeros(N, dtype=bool)
    order = np.lexsort((table.pos, table.lane))
    rows_of: dict[int, list[int]] = {}
    for k in order:
        rows_of.setdefault(int(table.lane[k]), []).append(int(k))
    waiter: dict[int, tuple[int, int]] = {}     # store -> (lane, i) waiting for its window
    draining: dict[int, int] = {}               # lane -> i of the batch's last send
    busy_out: dict[int, float] = {}
    busy_in: dict[int, float] = {}
    busy_up: dict[int, float] = {}
    busy_dn: dict[int, float] = {}
    n_pc = port_of_hop.size
    W_PRIO = -N - 1

    def worker(lane: int, i: int) -> None:
        rows = rows_of[lane]
        if i >= len(rows):
            return
        k = rows[i]
        if i >= W and not done[rows[i - W]]:
            waiter[rows[i - W]] = (lane, i)
            return
        ST[k] = sim.now
        sim.at(sim.now + issue[k], issued, lane, i, priority=k - N)

    def batch_done(rows: list[int], i: int) -> bool:
        return all(done[rows[j]] for j in range(i - i % sp.batch, i + 1))

    def issued(lane: int, i: int) -> None:
        rows = rows_of[lane]
        k = rows[i]
        IE[k] = sim.now
        if table.hop[k] == 0:
            sim.at(sim.now + L[k], complete, k, priority=k)
        else:
            q = int(table.src[k]) * n_pc + int(port_of_hop[table.hop[k]])
            t = max(sim.now, busy_out.get(q, 0.0))
            busy_out[q] = t + svc[k]
            if up_svc[k] > 0:
                g = int(up_src[k])
                t = max(t, busy_up.get(g, 0.0))
                busy_up[g] = t + up_svc[k]
            sim.at(t + L[k], ingress, k, priority=k)
        nxt = sim.now
        if sp.batched and ((i + 1) % sp.batch == 0 or i + 1 == len(rows)):
            if sp.sync == "dc":
                nxt = sim.now + (i % sp.batch + 1) * sp.checksum_us_per_row + sp.flag_us
            elif not batch_done(rows, i):
                draining[lane] = i
                return
            else:
                nxt = sim.now + sp.fence_us + sp.flag_us
            WD[k] = nxt
        sim.at(nxt, worker, lane, i + 1, priority=W_PRIO)

    def ingress(k: int) -> None:
        q = int(table.dst[k]) * n_pc + int(port_of_hop[table.hop[k]])
        t = sim.now
        if up_svc[k] > 0:
            g = int(up_dst[k])
            t = max(t, busy_dn.get(g, 0.0))
            busy_dn[g] = t + up_svc[k]
        t = max(t, busy_in.get(q, 0.0)) + svc[k]
        busy_in[q] = t
        sim.at(t, complete, k, priority=k)

    def complete(k: int) -> None:
        C[k] = sim.now
        done[k] = True
        if k in waiter:
            sim.at(sim.now, worker, *waiter.pop(k), priority=W_PRIO)
        lane = int(table.lane[k])
        i = draining.get(lane)
        if i is not None and batch_done(rows_of[lane], i):
            del draining[lane]
            kk = rows_of[lane][i]
            WD[kk] = sim.now + sp.fence_us + sp.flag_us
            sim.at(WD[kk], worker, lane, i + 1, priority=W_PRIO)

    for lane in sorted(rows_of):
        sim.at(float(lane_start[lane]), worker, lane, 0, priority=W_PRIO)
    sim.run()
    return ST, IE, C, WD
