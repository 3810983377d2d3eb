"""Engine invariants: the fast event engine equals the plain one; bytes, workers, phases,
dependencies; a free fabric takes no time; more latency is never faster."""

import numpy as np
import pytest

from ubep.sim import CostParams, simulate
from ubep.sim.core import Event, Simulation

SMALL = dict(ranks=8, tokens_per_rank=16, hidden=512, top_k=4, num_experts=16, workers=4)
TWO_TIER = dict(SMALL, ranks=32, num_experts=32)   # crosses cm384's second switch tier
CASES = [(m, s) for m in ("ubep", "bsp") for s in ("sw", "tff", "dc", "sp")]


@pytest.mark.parametrize("mode,sync", CASES)
def test_fast_engine_equals_event_engine(params, mode, sync):
    kw = dict(TWO_TIER, mode=mode, sync=sync, params=params, seed=3)
    fast, plain = simulate("cm384", **kw).engine, simulate("cm384", exact=True, **kw).engine
    for name in ("row_issue_start", "row_issue_end", "row_complete", "row_visible",
                 "row_proc_end"):
        np.testing.assert_allclose(getattr(fast, name), getattr(plain, name), rtol=0,
                                   atol=1e-9, err_msg=name)
    assert fast.latency_us == pytest.approx(plain.latency_us, abs=1e-9)
    assert fast.latency_us > 0


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_bytes_conserved(params, op):
    r = simulate("cm384", op=op, params=params, **SMALL)
    rows = SMALL["ranks"] * SMALL["tokens_per_rank"] * SMALL["top_k"]
    row_bytes = SMALL["hidden"] * 2
    assert r.payload_bytes == rows * row_bytes
    st = r.all_stats()
    assert sum(s.bytes_sent for s in st) == sum(s.bytes_recv for s in st) == r.payload_bytes
    # tff carries a 32 B flag in every 512 B block: 1024 B rows -> 3 blocks
    assert r.wire_bytes == rows * (row_bytes + 3 * 32)
    assert r.payload_efficiency == pytest.approx(1024 / 1120)


@pytest.mark.parametrize("mode,sync", CASES)
def test_a_worker_never_does_two_things_at_once(params, mode, sync):
    r = simulate("cm384", mode=mode, sync=sync, params=params, **SMALL)
    for rank in range(r.num_ranks):
        ivs = r.worker_intervals(rank)
        assert ivs
        by_worker: dict[int, list] = {}
        for iv in ivs:
            assert iv.end_us > iv.start_us
            by_worker.setdefault(iv.worker, []).append(iv)
        assert set(by_worker) == set(range(r.workers))
        for w, lst in by_worker.items():
            lst.sort(key=lambda iv: iv.start_us)
            for a, b in zip(lst, lst[1:]):
                assert a.end_us <= b.start_us + 1e-9, (rank, w, a, b)


def test_bsp_phases_never_overlap(params):
    r = simulate("cm384", mode="bsp", params=params, **SMALL)
    order = ["launch", "init", "token_send", "flag_count", "cumsum", "reorder"]
    for rank in range(r.num_ranks):
        span: dict[str, tuple[float, float]] = {}
        for iv in r.worker_intervals(rank):
            if iv.name in order:
                lo, hi = span.get(iv.name, (np.inf, -np.inf))
                span[iv.name] = (min(lo, iv.start_us), max(hi, iv.end_us))
        assert list(span) and all(n in span for n in order)
        for a, b in zip(order, order[1:]):
            assert span[a][1] <= span[b][0] + 1e-9, (rank, a, b, span)


@pytest.mark.parametrize("sync", ["sw", "tff", "dc", "sp"])
def test_ubep_respects_every_dependency(params, sync):
    r = simulate("cm384", mode="ubep", sync=sync, params=params, **SMALL)
    e = r.engine
    src, dst = e.extra["src"], e.extra["dst"]
    # a row is visible only after it landed; reordered only once visible and offsets published
    assert np.all(e.row_visible >= e.row_complete - 1e-9)
    assert np.all(e.row_proc_start >= e.row_visible - 1e-9)
    assert np.all(e.row_proc_start >= e.ready_us[dst] - 1e-9)
    # the reordering worker belongs to the receiving rank, and is a token worker
    assert np.all(e.row_proc_lane // r.workers == dst)
    assert np.all(e.row_proc_lane % r.workers >= r.count_workers)
    # offsets are published after every source's counts arrived
    assert np.all(e.ready_us >= e.sync_arrival_us.max(axis=0) - 1e-9)
    assert np.all(e.row_issue_end >= e.row_issue_start)
    assert np.all(e.row_issue_start >= params.launch_us - 1e-9)
    assert np.all(src != -1)


def test_staging_depth_bounds_stores_in_flight(params):
    r = simulate("cm384", mode="ubep", params=params, exact=True, **SMALL)
    e = r.engine
    # in flight at t: issue started <= t < completion; count per sending lane at every start
    starts, comps = e.row_issue_start, e.row_complete
    lanes = _send_lanes(r)
    for ln in np.unique(lanes):
        sel = lanes == ln
        s, c = starts[sel], comps[sel]
        for t in s:
            assert np.count_nonzero((s <= t) & (c > t)) <= 2   # cm384's staging_rows


def _send_lanes(r):
    from ubep.sim.api import prepare
    from ubep.sim.engine import table_from_plans
    from ubep.sim.fabric import Fabric

    prep = prepare("cm384", r.config, ranks=r.num_ranks)
    return table_from_plans(prep.plans, Fabric.of(prep.topology, CostParams()),
                            prep.workers).lane


@pytest.mark.parametrize("mode,sync", CASES)
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_zero_cost_fabric_takes_zero_time(mode, sync, op):
    r = simulate("cm384", mode=mode, sync=sync, op=op, params=CostParams.zero(), **SMALL)
    assert r.latency_us == 0.0
    assert all(v == 0.0 for v in r.phases_us.values())


@pytest.mark.parametrize("mode,sync", [("ubep", "tff"), ("ubep", "sw"), ("bsp", "tff")])
def test_more_latency_or_cost_is_never_faster(params, mode, sync):
    def lat(**ch):
        return simulate("cm384", mode=mode, sync=sync, params=params.with_(**ch), **SMALL
                        ).latency_us
    base = lat()
    for ch in ({"latency_scale": 2.0}, {"latency_scale": 8.0}, {"barrier_us": 20.0},
               {"launch_us": 9.0}, {"stage_bw_GBps": 3.0}, {"flag_issue_us": 0.5},
               {"status_count_us": 2.0}, {"copy_bw_GBps": 5.0}):
        assert lat(**ch) >= base - 1e-9, ch
    scales = [0.0, 0.5, 1.0, 2.0, 4.0]
    lats = [lat(latency_scale=s) for s in scales]
    assert lats == sorted(lats)


def test_deterministic_for_a_seed(params):
    a = simulate("cm384", params=params, seed=5, **SMALL)
    b = simulate("cm384", params=params, seed=5, **SMALL)
    c = simulate("cm384", params=params, seed=6, **SMALL)
    assert a.latency_us == b.latency_us
    np.testing.assert_array_equal(a.engine.row_complete, b.engine.row_complete)
    assert not np.array_equal(a.engine.extra["dst"], c.engine.extra["dst"])


def test_stats_are_ubep_stats(params):
    from ubep.stats import Stats, chrome_trace
    r = simulate("cm384", params=params, **SMALL)
    st = r.stats(0)
    assert isinstance(st, Stats) and st.backend == "sim" and st.op == "dispatch"
    assert st.total_us <= r.latency_us and st.intervals
    tr = chrome_trace(r.all_stats())
    assert len(tr["traceEvents"]) > len(st.intervals)
    with pytest.raises(ValueError, match="rank=99"):
        r.stats(99)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="num_experts=12"):
        simulate("cm384", ranks=8, num_experts=12)
    with pytest.raises(ValueError, match="sync='xx'"):
        simulate("cm384", ranks=8, sync="xx")
    with pytest.raises(ValueError, match="count_workers=4"):
        simulate("cm384", ranks=8, workers=4, count_workers=4)
    with pytest.raises(ValueError, match="sync_batch_rows"):
        CostParams(sync_batch_rows=0)
    with pytest.raises(ValueError, match="barrier_us"):
        CostParams(barrier_us=-1.0)


def test_core_orders_by_time_priority_sequence():
    sim, seen = Simulation(), []
    for name, t, p in [("c", 2.0, 0), ("a", 1.0, 5), ("b", 1.0, 5), ("z", 1.0, -1)]:
        sim.at(t, seen.append, name, priority=p)
    assert sim.run() == 2.0
    assert seen == ["z", "a", "b", "c"]
    ev = Event(sim, "x")
    got = []
    ev.then(lambda: got.append(sim.now))
    ev.succeed()
    assert got == [2.0]
    with pytest.raises(RuntimeError, match="already been triggered"):
        ev.succeed()
    with pytest.raises(ValueError, match="before now"):
        sim.at(1.0, print)


def test_start_jitter_is_seeded_and_bsp_waits_for_the_slowest_rank(params):
    p = params.with_(start_jitter_us=30.0)
    a = simulate("cm384", mode="bsp", params=p, seed=4, **SMALL)
    b = simulate("cm384", mode="bsp", params=p, seed=4, **SMALL)
    base = simulate("cm384", mode="bsp", params=params, seed=4, **SMALL)
    assert a.latency_us == b.latency_us >= base.latency_us
    launch = a.engine.rank_phase_us["launch"]
    assert launch.max() > launch.min() >= params.launch_us       # ranks start apart
    # every rank's flag phase ends after the slowest rank's last worker sent its flags
    e = a.engine
    sent = np.array([max(iv.end_us for iv in a.worker_intervals(r) if iv.name == "token_send")
                     for r in range(a.num_ranks)])
    assert np.all(e.ready_us >= sent.max() + params.barrier_us - 1e-9)


@pytest.mark.parametrize("ranks,experts,workers", [(8, 8, 4), (8, 8, 8), (32, 32, 4),
                                                   (32, 32, 48), (8, 24, 5)])
def test_bsp_counts_its_share_of_the_experts_one_after_another(ranks, experts, workers):
    """As CANN's dispatch kernel: each core counts the pairs of its share of the experts
    (ceil(E / n) for the busiest) before the SyncAll; on a free fabric that is the whole
    dispatch. UBEP has no such step (its count workers count in one pass)."""
    cost = 1.5
    p = CostParams.zero().with_(status_count_us=cost)
    kw = dict(SMALL, ranks=ranks, num_experts=experts, workers=workers)
    bsp = simulate("cm384", mode="bsp", params=p, **kw)
    assert bsp.phases_us["status_count"] == pytest.approx(-(-experts // workers) * cost)
    assert bsp.latency_us == pytest.approx(-(-experts // workers) * cost)
    assert simulate("cm384", mode="ubep", params=p, **kw).latency_us == 0.0
    assert simulate("cm384", mode="bsp", op="combine", params=p, **kw).latency_us == 0.0


@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize("direct", [False, True])
def test_one_worker_and_direct_paths(params, op, direct):
    kw = dict(SMALL, workers=1, op=op, params=params)
    r = simulate("cm384", direct=direct, **kw)
    assert r.count_workers == 0 and r.latency_us > 0
    e = r.engine
    assert np.all(e.row_proc_start >= e.row_visible - 1e-9)
    if op == "dispatch":
        # the one worker sends its counts before its first row
        assert np.all(e.row_issue_start >= params.launch_us + params.phase_fixed_us - 1e-9)
        if direct:   # counts first: no row moves before its rank has every count
            assert np.all(e.row_issue_start >= e.ready_us[e.extra["src"]] - 1e-9)
    assert simulate("cm384", direct=direct, mode="ubep", workers=1, op=op,
                    params=CostParams.zero(), **{k: v for k, v in SMALL.items()
                                                 if k != "workers"}).latency_us == 0.0
    with pytest.raises(ValueError, match="direct=True needs mode='ubep'"):
        simulate("cm384", mode="bsp", direct=True, **SMALL)


def test_ingress_bytes_and_floor_are_reported(params):
    r = simulate("cm384", params=params, routing="hot", hot_experts=2, **SMALL)
    src, dst = r.engine.extra["src"], r.engine.extra["dst"]
    remote = src != dst
    assert r.ingress_bytes.sum() == remote.sum() * r.engine.wire_bytes_per_row
    assert r.ingress_bytes.max() > r.ingress_bytes.mean()          # the hot ranks
    port_GBps = 392 * params.port_bw_scale
    assert r.ingress_floor_us == pytest.approx(r.ingress_bytes.max() / (port_GBps * 1e3))
    assert r.summary()["ingress_floor_us"] == pytest.approx(r.ingress_floor_us, abs=1e-3)


def test_uplink_floor_counts_the_rows_through_each_groups_up_and_downlink(params):
    """Two boards of 16 ranks: every row to the other board passes its board's uplink and the
    other's downlink; the floor is the busier of the two at the uplink's bandwidth."""
    kw = dict(SMALL, ranks=32, num_experts=64)
    r = simulate("cm384", params=params, routing="hot", hot_experts=2, **kw)
    src, dst = r.engine.extra["src"], r.engine.extra["dst"]
    board_s, board_d = src // 16, dst // 16
    cross = board_s != board_d
    rows = max(np.bincount(board_s[cross], minlength=2).max(),
               np.bincount(board_d[cross], minlength=2).max())
    uplink_GBps = params.uplink_bw_scale * 16 * 392 * params.port_bw_scale
    assert r.uplink_floor_us == pytest.approx(
        rows * r.engine.wire_bytes_per_row / (uplink_GBps * 1e3))
    assert r.summary()["uplink_floor_us"] == pytest.approx(r.uplink_floor_us, abs=1e-3)
    # one board: no row crosses the second tier
    assert simulate("cm384", params=params, **SMALL).uplink_floor_us == 0.0
