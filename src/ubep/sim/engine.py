"""Executes every rank's plan on the fabric model: BSP phases or UBEP roles.

The row stores of every worker of every rank run through one event simulation (numba,
`fastevents`; `events` is its plain-Python twin): each worker stages rows through the
topology's `staging_rows` buffer slots; a slot is taken when the worker starts copying a
row into it and freed when that row's store completed (hop latency plus serialization,
after the FIFO queues of the shared egress and ingress ports). So a worker with far
destinations is slower than one with near ones whatever the ports do, and all workers
together are no faster than the ports. Everything else is vectorised over ranks and
workers with numpy: phases, barriers, flags, counts and the reordering (a FIFO queue per
worker, `queues`), per mode:

* bsp: init | token_send | status count | SyncAll | flag+count | flag verify | SyncAll |
  cumsum | reorder, every worker of a rank in the same phase, ranks coupled through the
  flags. As CANN's dispatch kernel: each core counts the rank's pairs for its share of the
  experts, one expert after another (`status_count_us` each), before the SyncAll; the
  flags are then verified with one vector pass after the last arrives;
* ubep: count workers count, store one count word per destination (pipelined), wait for
  the last source's counts (polling overlaps the arrivals: one vector pass after the last),
  split the prefix sum (CalCumSum) among themselves and publish; token workers send, then
  reorder each received row once it is visible (per the sync variant) and the offsets are
  published. The count path is computed with `ubep.plan.costmodel`'s functions, the same
  ones the planner minimises (Eq. 4), from `count_costs` of these constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ubep.plan import costmodel
from ubep.plan.costmodel import CountCosts
from ubep.sim.fabric import Fabric, time_us, wire_layout
from ubep.sim.params import CostParams
from ubep.sim.queues import fifo_depart


@dataclass(frozen=True)
class SendTable:
    """All row stores of one operation, flat over every rank (one entry per row)."""

    src: np.ndarray      # [N] sending rank
    dst: np.ndarray      # [N] receiving rank
    hop: np.ndarray      # [N] hop class
    lane: np.ndarray     # [N] sending worker lane (rank * workers + worker)
    pos: np.ndarray      # [N] index in that worker's send list
    lane_len: np.ndarray  # [P * workers] sends per lane (0 for count workers)
    workers: int          # workers per rank
    first_sender: np.ndarray  # [P] worker id of each rank's first sending worker


def table_from_plans(plans: list, fabric: Fabric, workers: int) -> SendTable:
    """Flatten the token workers' send lists of every rank's `ubep.plan.Plan`."""
    P = len(plans)
    first = np.zeros(P, dtype=np.int64)
    dests: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    lane_ids: list[np.ndarray] = []
    for r, plan in enumerate(plans):
        nc, nt = int(plan.count_workers), int(plan.token_workers)
        first[r] = nc
        if nc + nt > workers:
            raise ValueError(f"plan of rank {r} uses {nc} count + {nt} token workers, "
                             f"more than workers={workers}")
        dests.append(np.asarray(plan.sends)[:, 2])
        lens.append(np.diff(np.asarray(plan.worker_offsets)))
        lane_ids.append(np.arange(r * workers + nc, r * workers + nc + nt, dtype=np.int64))
    lens_a = np.concatenate(lens).astype(np.int64)
    ids = np.concatenate(lane_ids)
    lane_len = np.zeros(P * workers, dtype=np.int64)
    lane_len[ids] = lens_a
    lane = np.repeat(ids, lens_a)
    starts = np.cumsum(lens_a) - lens_a
    pos = np.arange(lane.size, dtype=np.int64) - np.repeat(starts, lens_a)
    d_ = np.concatenate(dests).astype(np.int64)
    s_ = lane // workers
    return SendTable(src=s_, dst=d_, hop=fabric.hop[s_, d_], lane=lane, pos=pos,
                     lane_len=lane_len, workers=workers, first_sender=first)


def combine_table(dispatch: SendTable, fabric: Fabric) -> SendTable:
    """The combine's stores: every dispatched row goes back; a rank's rows (in the
    dispatch's receive order) are cut into equal contiguous slices over all its workers."""
    P, n = fabric.num_ranks, dispatch.workers
    o = np.lexsort((dispatch.pos, dispatch.lane, dispatch.dst))   # receive order per rank
    src, dst = dispatch.dst[o], dispatch.src[o]
    counts = np.bincount(src, minlength=P)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    k = np.arange(src.size) - start[src]                          # index within the rank
    worker = (k * n) // np.maximum(counts[src], 1)
    lane = src * n + worker
    lane_start = np.zeros(P * n + 1, dtype=np.int64)
    np.add.at(lane_start, lane + 1, 1)
    lane_len = lane_start[1:].copy()
    pos = np.arange(src.size) - np.cumsum(lane_start)[:-1][lane]
    return SendTable(src=src, dst=dst, hop=fabric.hop[src, dst], lane=lane, pos=pos,
                     lane_len=lane_len, workers=n, first_sender=np.zeros(P, dtype=np.int64))


@dataclass
class EngineOutput:
    """What one operation did: per-rank end times, per-worker intervals, per-row trace."""

    latency_us: float
    rank_end_us: np.ndarray                     # [P]
    phases_us: dict[str, float]                 # critical path pieces of the slowest rank
    rank_phase_us: dict[str, np.ndarray]        # name -> [P] duration per rank
    # per-worker intervals, flat: rank, worker, name, start, end, busy(1)/wait(0)
    iv_rank: np.ndarray
    iv_worker: np.ndarray
    iv_name: np.ndarray                         # object array of str
    iv_start: np.ndarray
    iv_end: np.ndarray
    iv_busy: np.ndarray
    # per row (indexed like the SendTable)
    row_issue_start: np.ndarray
    row_issue_end: np.ndarray
    row_complete: np.ndarray
    row_visible: np.ndarray
    row_proc_start: np.ndarray
    row_proc_end: np.ndarray
    row_proc_lane: np.ndarray
    # synchronisation arrivals, for dependency checks
    ready_us: np.ndarray                        # [P] offsets published (ubep) / t4 (bsp)
    sync_arrival_us: np.ndarray                 # [P, P] flag/count from s arrives at d
    wire_bytes_per_row: int
    blocks_per_row: int
    extra: dict = field(default_factory=dict)


class _Intervals:
    """Accumulates interval columns; kept as arrays (Stats objects are built on demand)."""

    def __init__(self) -> None:
        self.cols: list[tuple] = []

    def add(self, rank, worker, name: str, start, end, busy: bool) -> None:
        rank, worker, start, end = np.broadcast_arrays(
            np.asarray(rank), np.asarray(worker), np.asarray(start, dtype=float),
            np.asarray(end, dtype=float))
        keep = end > start
        if keep.any():
            self.cols.append((rank[keep], worker[keep], name, start[keep], end[keep], busy))

    def arrays(self):
        if not self.cols:
            z = np.zeros(0)
            return z.astype(np.int64), z.astype(np.int64), z.astype(object), z, z, z.astype(bool)
        r = np.concatenate([c[0] for c in self.cols]).astype(np.int64)
        w = np.concatenate([c[1] for c in self.cols]).astype(np.int64)
        nm = np.concatenate([np.full(c[0].size, c[2], dtype=object) for c in self.cols])
        s = np.concatenate([c[3] for c in self.cols])
        e = np.concatenate([c[4] for c in self.cols])
        b = np.concatenate([np.full(c[0].size, c[5]) for c in self.cols])
        return r, w, nm, s, e, b


def send_stage(table: SendTable, fabric: Fabric, params: CostParams, *, lane_start: np.ndarray,
               issue_us: float, wire_bytes: int, sync: str, blocks: int,
               exact: bool = False, cache: dict | None = None) -> dict[str, np.ndarray]:
    """Token-sending of every worker: issue, window, sync writes, ports, latency, visibility.

    Returns per row `issue_start`, `issue_end`, `complete`, `visible`; per lane `issue_done`
    (the worker may move on) and `complete_done` (its last store landed). `exact` runs the
    plain Python event engine instead of its numba twin. `cache` (a dict the caller owns)
    keeps results across calls that differ only in constants the send stage ignores
    (calibration); a common start time is a shift, so it is not part of the key.
    """
    L = fabric.latency_us[table.hop]
    svc = fabric.service_us(wire_bytes, table.hop)
    sp = SyncCosts.of(params, sync, blocks)
    W = int(fabric.staging_rows)
    if exact:
        from ubep.sim.events import send_stage_events as stage
    else:
        from ubep.sim.fastevents import send_stage_fast as stage
    # A common start time is a pure shift: simulate from 0 and add it, so that results do
    # not depend on whether a cache served them (float rounding could flip FIFO ties).
    t0 = float(lane_start[0]) if lane_start.size else 0.0
    shift = bool(np.all(lane_start == t0))
    start = np.zeros_like(lane_start, dtype=float) if shift else lane_start
    issue = np.full(L.size, issue_us)
    key = (id(table), exact, issue_us, W, sp, fabric.latency_us.tobytes(),
           fabric.port_bw_GBps.tobytes(), fabric.uplink_bw_GBps, wire_bytes)
    if cache is not None and shift and key in cache:
        out = cache[key][1]
    else:
        g = fabric.group_of_rank
        g = np.zeros(fabric.num_ranks, dtype=np.int64) if g is None else g
        out = stage(table, L, svc, fabric.port_of_hop, issue, start, W, sp,
                    fabric.uplink_us(wire_bytes, table.hop), g[table.src], g[table.dst])
        if cache is not None and shift:
            cache[key] = (table, out)
    st, ie, comp, wd = (a + t0 for a in out) if shift else out
    vis = _visibility(table, sp, comp, wd, L)
    issue_done = lane_start.astype(float).copy()
    np.maximum.at(issue_done, table.lane, np.maximum(ie, np.nan_to_num(wd, nan=-np.inf)))
    complete_done = lane_start.astype(float).copy()
    np.maximum.at(complete_done, table.lane, comp)
    return {"issue_start": st, "issue_end": ie, "complete": comp, "visible": vis,
            "issue_done": issue_done, "complete_done": complete_done}


@dataclass(frozen=True)
class SyncCosts:
    """What a sync variant costs the sending worker and the receiver, in us.

    tff/sp: the row's own bytes tell the receiver (a check per block). sw: after each batch
    of `batch` rows the worker drains its window, fences and writes a flag; the batch is
    visible when the flag lands. dc: after each batch the worker checksums it and writes
    the checksum (no drain); visible once checksum and rows landed and were verified.
    """

    sync: str
    batch: int
    detect_us: float          # receiver, per row (tff/sp)
    fence_us: float           # sw, sender, per batch (after the drain)
    flag_us: float            # sw flag / dc checksum store issue
    checksum_us_per_row: float  # dc: sender per row of the batch, and receiver per row
    poll_us: float            # sw: receiver reads the flag

    @staticmethod
    def of(params: CostParams, sync: str, blocks: int) -> SyncCosts:
        return SyncCosts(sync=sync, batch=int(params.sync_batch_rows),
                         detect_us=blocks * params.detect_ns_per_block * 1e-3,
                         fence_us=params.fence_us, flag_us=params.flag_issue_us,
                         checksum_us_per_row=blocks * params.checksum_ns_per_block * 1e-3,
                         poll_us=params.poll_us)

    @property
    def batched(self) -> bool:
        return self.sync in ("sw", "dc")

    def write_done(self, issue_end: float, batch_complete: float, rows: int) -> float:
        """When the worker has written the batch's flag (sw) or checksum (dc)."""
        if self.sync == "sw":
            return max(issue_end, batch_complete) + self.fence_us + self.flag_us
        return issue_end + rows * self.checksum_us_per_row + self.flag_us


def _visibility(table: SendTable, sp: SyncCosts, comp: np.ndarray, wd: np.ndarray,
                L: np.ndarray) -> np.ndarray:
    """When the receiver knows each row is there."""
    if not sp.batched or table.src.size == 0:
        return comp + sp.detect_us
    batch = table.pos // sp.batch
    nb = int(batch.max()) + 1
    key = table.lane * nb + batch
    size = table.lane_len.size * nb
    bcomp = np.full(size, -np.inf)
    np.maximum.at(bcomp, key, comp)
    bL = np.zeros(size)
    np.maximum.at(bL, key, L)
    bwd = np.full(size, -np.inf)
    closes = ~np.isnan(wd)
    bwd[key[closes]] = wd[closes]
    brows = np.bincount(key, minlength=size)
    if sp.sync == "sw":
        bvis = bwd + bL + sp.poll_us
    else:
        bvis = np.maximum(bcomp, bwd + bL) + brows * sp.checksum_us_per_row
    return bvis[key]


def _fan_out(P: int, senders: int, per_store_us: float, start: np.ndarray, fabric: Fabric
             ) -> tuple[np.ndarray, np.ndarray]:
    """`senders` workers of each rank write one small store to every rank (round robin).

    Returns `(local_done [P], arrival [P, P])` (arrival[s, d]: the store from s lands on d).
    """
    d = np.arange(P)
    k = d // senders + 1                      # position of d in its worker's list
    arrival = start[:, None] + k[None, :] * per_store_us + fabric.latency_us[fabric.hop]
    return start + math.ceil(P / senders) * per_store_us, arrival


def wire_bytes_of(row_bytes: int, mode: str, sync: str, fabric: Fabric) -> tuple[int, int]:
    """`(blocks, wire_bytes)` of one row as `run` sends it (bsp sends plain rows)."""
    eff = "sw" if mode == "bsp" else sync
    return wire_layout(row_bytes, "tff" if eff == "tff" else "raw", fabric.block_bytes,
                       fabric.flag_bytes)


def count_costs(params: CostParams, fabric: Fabric, wire_bytes: int,
                row_bytes: int | None = None, experts_per_rank: int = 1) -> CountCosts:
    """The unit costs of Eq. 4 (`ubep.plan.costmodel`) implied by these constants on this
    fabric, for rows of `wire_bytes` under uniform routing: what the planner minimises and
    what `run` executes for the count path.

    A token worker's row costs its staging slot time (staging copy + hop latency +
    serialization, averaged over destinations) divided by the staging depth, and never less
    than the staging copy itself; the rank's port passes its remote share of the rows; a
    received row costs a token worker its reorder copy (`row_bytes`, default the payload of
    `wire_bytes`). CalCumSum reads every source's counts for this rank's `experts_per_rank`
    experts from the window — one atomic block per source, as the counts were written —
    through the core at `copy_bw_GBps`, and adds them up: per count entry, its share of
    that block's read plus `cumsum_ns_per_entry`.
    """
    P = fabric.num_ranks
    hop = fabric.hop
    lat = fabric.latency_us[hop]
    ser = fabric.service_us(wire_bytes, hop)
    stage = time_us(wire_bytes, params.stage_bw_GBps)
    slot = float(np.mean(stage + lat + ser)) if P else 0.0
    row = max(stage, slot / fabric.staging_rows)
    port_row = 0.0
    for port in np.unique(fabric.port_of_hop[1:]) if fabric.port_of_hop.size > 1 else []:
        on = (hop > 0) & (fabric.port_of_hop[hop] == port)
        if on.any():
            port_row = max(port_row, float(np.sum(np.where(on, ser, 0.0))) / (P * P))
    return CountCosts(pair_us=params.count_ns_per_pair * 1e-3, store_us=params.flag_issue_us,
                      flight_us=float(lat.max(initial=0.0)), scan_us=params.poll_us,
                      scan_entry_us=params.scan_ns_per_entry * 1e-3,
                      cumsum_entry_us=params.cumsum_ns_per_entry * 1e-3 + time_us(
                          fabric.block_bytes / max(experts_per_rank, 1), params.copy_bw_GBps),
                      merge_us=params.signal_us, publish_us=params.signal_us,
                      row_us=row, port_row_us=port_row,
                      reorder_row_us=time_us(wire_bytes if row_bytes is None else row_bytes,
                                             params.copy_bw_GBps))


def start_offsets(num_ranks: int, jitter_us: float, seed: int) -> np.ndarray:
    """Per-rank start delay, uniform in [0, jitter_us) from `seed` (zeros when 0)."""
    if jitter_us <= 0:
        return np.zeros(num_ranks)
    return np.random.default_rng([seed, 0x5EED]).random(num_ranks) * jitter_us


def run(op: str, mode: str, sync: str, table: SendTable, fabric: Fabric, params: CostParams, *,
        row_bytes: int, tokens_per_rank: int, top_k: int, num_experts: int,
        count_workers: int, exact: bool = False, cache: dict | None = None,
        seed: int = 0, direct: bool = False) -> EngineOutput:
    """Simulate one dispatch or combine of every rank; see the module docstring.

    `direct` (ubep): the shm runtime's one-copy variant: dispatch exchanges the counts
    first, then every row goes straight to its final place (no reorder); combine reads
    each row where it lies once its rank published (no send-back copy)."""
    P, n = fabric.num_ranks, table.workers
    ivs = _Intervals()
    ranks = np.arange(P)
    lane_rank = np.repeat(ranks, n)
    lane_worker = np.tile(np.arange(n), P)
    eff_sync = "sw" if mode == "bsp" else sync
    blocks, wire = wire_bytes_of(row_bytes, mode, sync, fabric)
    issue_us = time_us(wire, params.stage_bw_GBps)
    e_local = max(1, num_experts // P)
    cc = count_costs(params, fabric, wire, row_bytes, e_local)
    row_copy_us = time_us(row_bytes, params.copy_bw_GBps) + (
        blocks * params.rearm_ns_per_block * 1e-3 if eff_sync == "sp" and mode == "ubep" else 0)
    recv_rows = np.bincount(table.dst, minlength=P)
    t0 = params.launch_us + start_offsets(P, params.start_jitter_us, seed)
    phase: dict[str, np.ndarray] = {"launch": t0.copy()}
    ivs.add(lane_rank, lane_worker, "launch", 0.0, t0[lane_rank], False)
    # the bsp flag phase and the ubep count path both end in one vector pass over the
    # received flag/count words after the last one landed (polling overlaps the arrivals)
    scan = costmodel.scan_us(num_experts, cc)

    if mode == "bsp":
        t1 = t0 + params.phase_fixed_us
        ivs.add(lane_rank, lane_worker, "init", t0[lane_rank], t1[lane_rank], True)
        ss = send_stage(table, fabric, params, lane_start=t1[lane_rank], issue_us=issue_us,
                        wire_bytes=wire, sync="tff", blocks=blocks, exact=exact, cache=cache)
        lane_done = ss["complete_done"]                   # BSP waits for completion (fence)
        tok_end = t1.copy()
        np.maximum.at(tok_end, lane_rank, lane_done)
        # each core counts its share of the experts' pairs (CANN: a contiguous split of the
        # experts over the cores, one vector pass each), then the SyncAll
        my_experts = num_experts // n + (lane_worker < num_experts % n)
        status_end = lane_done + (my_experts * params.status_count_us if op == "dispatch"
                                  else 0.0)
        send_end = t1.copy()
        np.maximum.at(send_end, lane_rank, status_end)
        ivs.add(lane_rank, lane_worker, "token_send", t1[lane_rank], lane_done, True)
        ivs.add(lane_rank, lane_worker, "status_count", lane_done, status_end, True)
        ivs.add(lane_rank, lane_worker, "barrier_wait", status_end, send_end[lane_rank], False)
        t2 = send_end + params.barrier_us
        ivs.add(lane_rank, lane_worker, "syncall", send_end[lane_rank], t2[lane_rank], False)
        fs = t2 + params.phase_fixed_us
        local_done, arrival = _fan_out(P, n, params.flag_issue_us, fs, fabric)
        my_flags = (P - lane_worker + n - 1) // n      # destinations of worker w: w, w+n, ...
        ivs.add(lane_rank, lane_worker, "flag_count", t2[lane_rank],
                fs[lane_rank] + my_flags * params.flag_issue_us, True)
        verify_start = fs[lane_rank] + my_flags * params.flag_issue_us
        t3 = np.maximum(local_done, arrival.max(axis=0)) + scan
        ivs.add(lane_rank, lane_worker, "flag_verify", verify_start, t3[lane_rank], False)
        t4 = t3 + params.barrier_us
        ivs.add(lane_rank, lane_worker, "syncall", t3[lane_rank], t4[lane_rank], False)
        if op == "dispatch":
            t5 = t4 + params.phase_fixed_us + P * e_local * cc.cumsum_entry_us / n
            ivs.add(lane_rank, lane_worker, "cumsum", t4[lane_rank], t5[lane_rank], True)
        else:
            t5 = t4.copy()
        rows = recv_rows[lane_rank] // n + (lane_worker < recv_rows[lane_rank] % n)
        lane_end = t5[lane_rank] + rows * row_copy_us
        name = "reorder" if op == "dispatch" else "reduce"
        ivs.add(lane_rank, lane_worker, name, t5[lane_rank], lane_end, True)
        rank_end = t5 + np.ceil(recv_rows / n) * row_copy_us
        # rows are processed after the second barrier, by worker (k mod n) in receive order
        o = np.lexsort((np.arange(table.dst.size), table.dst))
        k = np.empty(table.dst.size, dtype=np.int64)
        grp_start = np.concatenate([[0], np.cumsum(recv_rows)[:-1]])
        k[o] = np.arange(table.dst.size) - grp_start[table.dst[o]]
        p_lane = table.dst * n + k % n
        p_start = t5[table.dst] + (k // n) * row_copy_us
        p_end = p_start + row_copy_us
        phase.update(init=t1 - t0, token_send=tok_end - t1, syncall=t2 - send_end + t4 - t3,
                     flag_count=local_done - t2, flag_verify=t3 - local_done)
        if op == "dispatch":
            phase.update(status_count=send_end - tok_end, cumsum=t5 - t4)
        phase[name] = rank_end - t5
        ready, sync_arr = t4, arrival
        ss_vis = ss["complete"]
    else:
        nc = count_workers if op == "dispatch" else 0
        single = op == "dispatch" and nc == 0 and n == 1   # counts, then rows, on one worker
        if op == "dispatch" and nc < 1 and not single:
            raise ValueError(f"count_workers={nc}: ubep mode needs at least one count worker "
                             f"(or workers=1)")
        t_start = t0 + params.phase_fixed_us
        send_start = t_start.copy()
        if op == "dispatch":
            c = max(nc, 1)
            count_end = t_start + costmodel.count_us(c, top_k, tokens_per_rank, cc)
            local_done, arrival = _fan_out(P, c, cc.store_us, count_end, fabric)
            got = arrival.max(axis=0)
            wait_end = np.maximum(local_done, got) + scan
            cs_end = wait_end + costmodel.cumsum_us(c, num_experts, cc)
            ready = cs_end + cc.publish_us
            if single:
                send_start = local_done
            if direct:     # every row's final place is known before the first row moves
                send_start = ready + params.signal_us
        else:
            ready = t_start.copy()
            arrival = np.zeros((P, P))
            if direct:     # each rank reads its rows once their ranks published where they lie
                send_start = t_start + fabric.latency_us[fabric.hop].max(axis=0)
        ss = send_stage(table, fabric, params, lane_start=send_start[lane_rank],
                        issue_us=issue_us, wire_bytes=wire, sync=eff_sync, blocks=blocks,
                        exact=exact, cache=cache)
        if single and not direct:   # the one worker polls for the counts after its rows
            own = send_start.copy()
            np.maximum.at(own, lane_rank, ss["issue_done"])
            wait_end = np.maximum(own, got) + scan
            cs_end = wait_end + costmodel.cumsum_us(1, num_experts, cc)
            ready = cs_end + cc.publish_us
        if op == "dispatch":
            cr = lane_rank[lane_worker < nc]
            cw = lane_worker[lane_worker < nc]
            mine = (P - cw + c - 1) // c
            ivs.add(cr, cw, "count", t0[cr], count_end[cr], True)
            ivs.add(cr, cw, "send_counts", count_end[cr],
                    count_end[cr] + mine * cc.store_us, True)
            ivs.add(cr, cw, "count_wait", count_end[cr] + mine * cc.store_us,
                    wait_end[cr], False)
            ivs.add(cr, cw, "cumsum", wait_end[cr], cs_end[cr], True)
            ivs.add(cr, cw, "publish", cs_end[cr], ready[cr], True)
            phase.update(count=count_end - t0, send_counts=local_done - count_end,
                         count_wait=wait_end - local_done, cumsum=cs_end - wait_end,
                         publish=ready - cs_end)
        if direct:
            row_copy_us = 0.0      # rows land in place (dispatch) / are summed as read (combine)
        is_token = lane_worker >= (nc if op == "dispatch" else 0)
        lane_done = ss["issue_done"]
        tr, tw = lane_rank[is_token], lane_worker[is_token]
        ivs.add(tr, tw, "token_send", send_start[tr], lane_done[is_token], True)
        # reorder (dispatch) / reduce (combine) by the receiving rank's token workers
        n_tok = n - (nc if op == "dispatch" else 0)
        first = nc if op == "dispatch" else 0
        proc_start_lane = np.maximum(lane_done, ready[lane_rank] + params.signal_us)
        vis = ss["visible"]
        o = np.lexsort((np.arange(vis.size), vis, table.dst))
        k = np.empty(vis.size, dtype=np.int64)
        grp_start = np.concatenate([[0], np.cumsum(recv_rows)[:-1]])
        k[o] = np.arange(vis.size) - grp_start[table.dst[o]]
        p_lane = table.dst * n + first + k % n_tok
        arrive = np.maximum(vis, proc_start_lane[p_lane])
        p_end = fifo_depart(p_lane, arrive, np.full(vis.size, row_copy_us))
        p_start = p_end - row_copy_us
        lane_end = np.where(is_token, proc_start_lane, 0.0)
        np.maximum.at(lane_end, p_lane, p_end)
        name = "reorder" if op == "dispatch" else "reduce"
        ivs.add(tr, tw, "offset_wait", lane_done[is_token], proc_start_lane[is_token], False)
        ivs.add(tr, tw, name, proc_start_lane[is_token], lane_end[is_token], True)
        rank_end = np.maximum(ready, 0.0)
        np.maximum.at(rank_end, lane_rank, lane_end)
        send_end = t_start.copy()
        np.maximum.at(send_end, lane_rank, np.where(is_token, lane_done, 0.0))
        phase.update(token_send=send_end - t_start, **{name: rank_end - send_end})
        sync_arr = arrival
        ss_vis = vis
    r_, w_, nm, s_, e_, b_ = ivs.arrays()
    crit = int(np.argmax(rank_end))
    return EngineOutput(
        latency_us=float(rank_end.max(initial=0.0)), rank_end_us=rank_end,
        phases_us={k: float(v[crit]) for k, v in phase.items()}, rank_phase_us=phase,
        iv_rank=r_, iv_worker=w_, iv_name=nm, iv_start=s_, iv_end=e_, iv_busy=b_,
        row_issue_start=ss["issue_start"], row_issue_end=ss["issue_end"],
        row_complete=ss["complete"], row_visible=ss_vis, row_proc_start=p_start,
        row_proc_end=p_end, row_proc_lane=p_lane, ready_us=ready, sync_arrival_us=sync_arr,
        wire_bytes_per_row=wire, blocks_per_row=blocks,
        extra={"critical_rank": crit})
