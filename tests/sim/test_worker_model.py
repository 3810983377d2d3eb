"""The worker model from first principles: a worker stages `staging_rows` rows at a time and
a remote store holds its slot for the hop latency plus its serialization; ports are shared.
Also the count path: the engine runs the cost model's formulas, and the cost model's
count-worker choice is the brute-force optimum of them (Eq. 4)."""

from dataclasses import replace

import numpy as np
import pytest

from ubep.plan import costmodel
from ubep.plan.topology import Tier, Topology
from ubep.sim import CostParams, simulate
from ubep.sim.engine import SendTable, count_costs, send_stage
from ubep.sim.fabric import Fabric

LAT_NS, ROW = 2500.0, 7616           # cm384's two-hop latency; a 7168 B row with TFF flags


def _fabric(depth: int, bw_GBps: float, workers: int = 1) -> Fabric:
    topo = Topology(name="pair", num_ranks=2, workers_per_rank=workers, atomic_block_bytes=512,
                    flag_bytes=32, tiers=(Tier("far", 2, LAT_NS, bw_GBps),),
                    local_latency_ns=200.0, local_bandwidth_GBps=bw_GBps, staging_rows=depth)
    return Fabric.of(topo, CostParams.zero().with_(latency_scale=1.0, port_bw_scale=1.0))


def _one_way(rows_per_worker: int, workers: int) -> SendTable:
    """`workers` workers of rank 0, each sending `rows_per_worker` rows to rank 1."""
    n = rows_per_worker * workers
    lane = np.repeat(np.arange(workers), rows_per_worker)
    lane_len = np.zeros(2 * workers, dtype=np.int64)
    lane_len[:workers] = rows_per_worker
    return SendTable(src=np.zeros(n, dtype=np.int64), dst=np.ones(n, dtype=np.int64),
                     hop=np.ones(n, dtype=np.int64), lane=lane.astype(np.int64),
                     pos=np.tile(np.arange(rows_per_worker), workers).astype(np.int64),
                     lane_len=lane_len, workers=workers,
                     first_sender=np.zeros(2, dtype=np.int64))


def _send_time(fab: Fabric, table: SendTable, exact: bool = False) -> float:
    out = send_stage(table, fab, CostParams.zero(), lane_start=np.zeros(fab.num_ranks *
                     table.workers), issue_us=0.0, wire_bytes=ROW, sync="tff", blocks=16,
                     exact=exact)
    return float(out["complete"].max())


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("exact", [False, True])
def test_one_worker_is_latency_bound_below_port_bandwidth(depth, exact):
    k, bw = 64, 392.0
    fab = _fabric(depth, bw)
    slot = LAT_NS * 1e-3 + ROW / (bw * 1e3)          # hop latency + serialization, us
    t = _send_time(fab, _one_way(k, 1), exact)
    assert t == pytest.approx(k * slot / depth, rel=0.03)


@pytest.mark.parametrize("depth", [1, 2])
def test_many_workers_are_port_bound(depth):
    bw, workers, k = 50.0, 64, 16                    # 64 workers could push far more than 50 GB/s
    fab = _fabric(depth, bw, workers)
    t = _send_time(fab, _one_way(k, workers))
    port = workers * k * ROW / (bw * 1e3)
    assert t == pytest.approx(port + LAT_NS * 1e-3, rel=0.02)
    assert t < workers * k * (LAT_NS * 1e-3) / depth / workers * 100   # far from serial


def test_more_workers_never_slower_and_more_latency_never_faster():
    rows = 256
    for depth in (1, 2):
        times = []
        for w in (1, 2, 4, 8, 16, 32):
            fab = _fabric(depth, 196.0, w)
            times.append(_send_time(fab, _one_way(rows // w, w)))
        assert times == sorted(times, reverse=True), times
    small = dict(ranks=16, tokens_per_rank=32, hidden=1024, top_k=4, mode="bsp",
                 schedule="static")
    p = CostParams(port_bw_scale=0.5)
    ts = [simulate("cm384", workers=w, params=p, **small).phases_us["token_send"]
          for w in (4, 8, 16, 32)]
    assert all(a >= b - 1e-9 for a, b in zip(ts, ts[1:])), ts
    lats = [simulate("cm384", workers=8, params=p.with_(latency_scale=s), **small
                     ).phases_us["token_send"] for s in (0.5, 1.0, 2.0, 4.0)]
    assert lats == sorted(lats), lats


def test_a_deeper_staging_buffer_is_never_slower():
    small = dict(ranks=16, tokens_per_rank=32, hidden=1024, top_k=4, mode="ubep", workers=8)
    base = Topology.preset("cm384", ranks=16)
    t = [simulate(replace(base, staging_rows=d), **small).phases_us["token_send"]
         for d in (1, 2, 4)]
    assert t == sorted(t, reverse=True), t


CASES = [(16, 128, 16), (64, 128, 64), (256, 128, 256), (256, 8, 256), (64, 16, 256)]


@pytest.mark.parametrize("ranks,batch,experts", CASES)
def test_count_worker_choice_is_the_brute_force_optimum_of_the_simulators_formulas(
        ranks, batch, experts):
    from ubep.sim.api import SimConfig, model_count_workers, prepare
    from ubep.sim.engine import wire_bytes_of
    from ubep.sim.params import calibrated

    params = calibrated("cm384")
    cfg = SimConfig(tokens_per_rank=batch, num_experts=experts, bytes_per_element=1,
                    count_workers=1)
    prep = prepare("cm384", cfg, ranks=ranks)
    fab = Fabric.of(prep.topology, params)
    cc = count_costs(params, fab, wire_bytes_of(7168, "ubep", "tff", fab)[1], 7168,
                     experts // ranks)
    kw = dict(num_experts=experts, top_k=8, num_tokens=batch)
    brute = [max(costmodel.t_count(c, ranks=ranks, costs=cc, **kw),
                 costmodel.t_token(48 - c, top_k=8, num_tokens=batch, costs=cc))
             for c in range(1, 48)]
    best = 1 + int(np.argmin(brute))
    assert model_count_workers(prep.topology, cfg, experts, 48, params) == best
    assert prep.count_workers == 1
    assert simulate("cm384", ranks=ranks, tokens_per_rank=batch, num_experts=experts,
                    bytes_per_element=1).count_workers == best


@pytest.mark.parametrize("c", [1, 3, 8])
def test_engine_runs_the_cost_models_count_path(c):
    """Uniform fabric, every rank alike: the engine's offsets are published when the cost
    model's T_count says (up to the position of the farthest rank in the store order)."""
    params = CostParams(port_bw_scale=0.5, flag_issue_us=0.2)
    r = simulate("cm384", ranks=64, tokens_per_rank=32, bytes_per_element=1, count_workers=c,
                 params=params)
    e = r.engine
    fab = Fabric.of(Topology.preset("cm384", ranks=64), params)
    cc = count_costs(params, fab, e.wire_bytes_per_row)
    t_start = params.launch_us + params.phase_fixed_us
    predicted = t_start + costmodel.t_count(c, ranks=64, num_experts=64, top_k=8, num_tokens=32,
                                            costs=cc)
    assert e.ready_us.max() <= predicted + 1e-9
    assert e.ready_us.max() >= predicted - cc.store_us - 1e-9


def test_send_chunk_follows_the_bound_that_applies():
    """The hierarchical interleaving step is the staging depth when a worker's hop latency
    bounds the sending (here: ports and uplinks unlimited), 1 when the port does (the
    calibrated cm384 at 48 workers); an explicit `send_chunk` wins."""
    import math

    from ubep.sim.api import SimConfig, prepare
    from ubep.sim.params import calibrated

    cfg = SimConfig(tokens_per_rank=16, bytes_per_element=1, num_experts=64)
    free_ports = calibrated().with_(uplink_bw_scale=0.0, port_bw_scale=math.inf)
    plan = prepare("cm384", cfg, ranks=32, params=free_ports).plans[0]
    hops = plan.worker_hops[0]
    runs = np.split(hops, np.flatnonzero(np.diff(hops)) + 1)
    assert all(len(r) % 2 == 0 for r in runs[:-1])          # rounds of the 2-slot ring
    one = prepare("cm384", cfg, ranks=32).plans[0]
    assert one.worker_hops[0].tolist() != hops.tolist()      # per-row interleave
    forced = prepare("cm384", replace(cfg, send_chunk=2), ranks=32).plans[0]
    assert forced.worker_hops[0].tolist() == hops.tolist()


def test_hierarchical_wins_when_sending_is_latency_bound():
    """The paper's premise (Fig. 9): when each worker's hop latency bounds its sending, a
    schedule that gives every worker the same mix of hop classes has the smallest maximum
    per-worker Token-Sending time, under skew too."""
    import math

    from ubep.sim.params import calibrated

    p = calibrated().with_(uplink_bw_scale=0.0, port_bw_scale=math.inf)
    worst = {}
    for s in ("static", "balanced", "hierarchical"):
        r = simulate("cm384", ranks=32, num_experts=128, tokens_per_rank=64, workers=16,
                     schedule=s, hot_experts=4, hot_weight=3.0, bytes_per_element=1,
                     params=p)
        e = r.engine
        sel = e.iv_name == "token_send"
        worst[s] = float((e.iv_end[sel] - e.iv_start[sel]).max())
    assert worst["hierarchical"] < 0.8 * min(worst["static"], worst["balanced"]), worst
