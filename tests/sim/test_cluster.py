"""The cluster model (`ubep.sim.cluster`): its counts against a brute-force count of the same
routing, the orderings the mechanisms imply, and the cost model's monotonicity."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.cli import main
from ubep.plan.topology import Topology
from ubep.sim.cluster import (
    ClusterConfig,
    combine_traffic,
    dispatch_traffic,
    op_cost,
    predict,
    sweep,
)
from ubep.sim.cluster.cost import Stage, pipeline_us
from ubep.sim.cluster.policy import relay_rank
from ubep.sim.cluster.reference import load_deepep
from ubep.sim.workload import make_group_limited_topk

INSIDE = Topology.preset("cluster").inside_host()
SMALL = dict(tokens_per_rank=24, hidden=64, top_k=4, intra_host="nvl72")


def random_topk(rng, ranks: int, tokens: int, k: int, experts: int, holes: float = 0.2):
    idx = np.argsort(rng.random((ranks, tokens, experts)), axis=2)[:, :, :k]
    idx[rng.random(idx.shape) < holes] = -1
    return idx.astype(np.int64)


def brute_counts(topk, topo: Topology, experts: int) -> dict[str, np.ndarray]:
    """Per source rank, the rows each policy puts on the network, by definition."""
    P = topo.num_ranks
    epr = experts // P
    host = [next(h for h, g in enumerate(topo.hosts) if r in g) for r in range(P)]
    out = {p: np.zeros(P, dtype=np.int64) for p in ("flat", "hybrid", "per-expert")}
    fwd = np.zeros(P, dtype=np.int64)        # hybrid: rows a host receives for its ranks
    for s in range(P):
        for t in range(topk.shape[1]):
            experts_t = [int(e) for e in topk[s, t] if e >= 0]
            ranks = {e // epr for e in experts_t}
            out["flat"][s] += sum(host[d] != host[s] for d in ranks)
            out["hybrid"][s] += len({host[d] for d in ranks} - {host[s]})
            out["per-expert"][s] += sum(host[e // epr] != host[s] for e in experts_t)
            fwd[s] += sum(host[d] != host[s] for d in ranks)
    out["forwarded"] = fwd
    return out


@pytest.mark.parametrize("groups", [
    [[0, 1, 2, 3], [4, 5, 6, 7]],
    [[5, 0, 9], [1, 2, 3, 4], [6, 7, 8], [10]],
    [[0], [1], [2]],
    [list(range(6))],
])
def test_network_rows_match_a_brute_force_count(groups):
    topo = Topology.from_hosts(groups, intra_host=INSIDE)
    P = topo.num_ranks
    experts = 3 * P
    topk = random_topk(np.random.default_rng(P), P, 30, min(5, experts), experts)
    want = brute_counts(topk, topo, experts)
    for policy in ("flat", "hybrid", "per-expert"):
        d = dispatch_traffic(topk, topo, experts, policy)
        assert d.net_rows_sent().tolist() == want[policy].tolist(), policy
        c = combine_traffic(d)
        assert c.net_rows_received().tolist() == want[policy].tolist()   # rows come back
        assert (c.net == d.net.T).all()
        # nothing crosses the network inside a host, nothing stays off the network across
        same = topo.host_ids()[:, None] == topo.host_ids()[None, :]
        assert not d.net[same].any() and not d.host_fabric_rows()[~same].any()
    hy = dispatch_traffic(topk, topo, experts, "hybrid")
    # every network row lands on the sender's relay of that host, which forwards one copy per
    # expert rank of that host (keeping its own)
    for s in range(P):
        for q in np.flatnonzero(hy.net[s]):
            assert q == relay_rank(topo, s, topo.host_of(int(q)))
    assert hy.relay.sum() + hy.relay_local.sum() == want["forwarded"].sum()


def test_expected_bytes_of_uniform_routing_follow_from_combinatorics():
    """Uniform top-k of E experts over H hosts x R ranks: a token reaches another host with
    probability 1 - C(E - E/H, k) / C(E, k), another rank with 1 - C(E - E/P, k) / C(E, k)."""
    cfg = ClusterConfig(hosts=4, ranks_per_host=4, tokens_per_rank=512, num_experts=64,
                        top_k=8, hidden=16, intra_host="nvl72")
    rows = {r.policy: r for r in sweep(cfg, hosts=(4,)) if r.op == "dispatch"}
    E, k, H, P = 64, 8, 4, 16

    def miss(n):
        return math.comb(E - n, k) / math.comb(E, k)
    hybrid = 512 * (H - 1) * (1 - miss(E // H))
    flat = 512 * (P - P // H) * (1 - miss(E // P))
    assert rows["hybrid"].net_rows_per_rank == pytest.approx(hybrid, rel=0.03)
    assert rows["flat"].net_rows_per_rank == pytest.approx(flat, rel=0.03)
    assert rows["hybrid"].net_bytes_per_rank == rows["hybrid"].net_rows_per_rank * 16 * 2


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       k=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_hybrid_never_moves_more_than_flat_nor_flat_more_than_per_expert(sizes, k, seed):
    rng = np.random.default_rng(seed)
    perm = rng.permutation(sum(sizes)).tolist()
    starts = np.cumsum([0] + sizes)
    topo = Topology.from_hosts([perm[a:b] for a, b in zip(starts[:-1], starts[1:])],
                               intra_host=INSIDE)
    experts = 2 * topo.num_ranks
    topk = random_topk(rng, topo.num_ranks, 12, min(k, experts), experts)
    sent = {p: dispatch_traffic(topk, topo, experts, p).net_rows_sent()
            for p in ("flat", "hybrid", "per-expert")}
    assert (sent["hybrid"] <= sent["flat"]).all() and (sent["flat"] <= sent["per-expert"]).all()
    if topo.num_hosts == 1:
        assert not any(v.any() for v in sent.values())


def test_one_host_moves_nothing_over_the_network():
    cfg = ClusterConfig(hosts=1, ranks_per_host=4, num_experts=16, **SMALL)
    for policy in ("flat", "hybrid"):
        d, c = predict(cfg, policy)
        for r in (d, c):
            assert r.net_bytes_per_rank == 0 and r.net_bytes_per_host == 0
            assert r.network_us == 0 and r.latency_us > 0 and r.host_bytes_per_rank > 0
    flat, hybrid = predict(cfg, "flat"), predict(cfg, "hybrid")
    assert [r.latency_us for r in flat] == [r.latency_us for r in hybrid]


def test_latency_is_at_least_the_busiest_nic_and_grows_with_bytes():
    base = ClusterConfig(hosts=3, ranks_per_host=2, num_experts=12, **SMALL)
    topo = base.topology()
    nic = topo.hop_bandwidth_GBps(topo.network_hop_class) * 1e3      # bytes per us
    for policy in ("flat", "hybrid", "per-expert"):
        last = None
        for hidden in (16, 64, 256, 1024, 4096):
            d, c = predict(ClusterConfig(**{**base.to_dict(), "hidden": hidden}), policy)
            floor = d.net_bytes_per_rank_max / nic + topo.hop_latency_ns(2) / 1e3
            assert d.latency_us >= floor
            if last is not None:
                assert d.latency_us >= last[0] and c.latency_us >= last[1]
            last = (d.latency_us, c.latency_us)
        slow = ClusterConfig(**{**base.to_dict(), "nic_gbps": 100.0})
        fast = ClusterConfig(**{**base.to_dict(), "nic_gbps": 800.0})
        assert predict(slow, policy)[0].latency_us > predict(fast, policy)[0].latency_us


def test_a_shared_nic_carries_its_hosts_bytes():
    """One NIC per host: a host's rows leave through one link, so the network phase is at
    least the busiest host's bytes at the NIC's rate (and the policies' time ratio follows
    their bytes when the network dominates)."""
    cfg = ClusterConfig(hosts=2, ranks_per_host=4, num_experts=32, nic_gbps=1.0,
                        nics_per_host=1, tokens_per_rank=64, hidden=1024, top_k=8,
                        intra_host="nvl72")
    rows = {p: predict(cfg, p)[0] for p in ("flat", "hybrid")}
    for r in rows.values():
        assert r.network_us >= r.net_bytes_per_host / (1.0 / 8 * 1e3)
    bytes_ratio = rows["flat"].net_bytes_per_host / rows["hybrid"].net_bytes_per_host
    time_ratio = rows["flat"].latency_us / rows["hybrid"].latency_us
    assert time_ratio == pytest.approx(bytes_ratio, rel=0.05)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 100), st.floats(0, 1)), min_size=1,
                max_size=4))
def test_pipeline_is_between_its_busiest_stage_and_running_stages_one_after_another(raw):
    stages = [Stage(lat, tot, min(item, tot)) for lat, tot, item in raw]
    t = pipeline_us(stages)
    live = [s for s in stages if s.total_us > 0]
    if not live:
        assert t == 0
        return
    assert t >= max(s.total_us for s in live) + sum(s.latency_us for s in live) - 1e-9
    assert t <= sum(s.total_us + s.latency_us for s in live) + 1e-9


def test_cost_model_prices_more_rows_higher():
    topo = Topology.cluster(2, 3, intra_host=INSIDE)
    topk = random_topk(np.random.default_rng(1), 6, 20, 4, 12, holes=0.0)
    fewer = topk.copy()
    fewer[:, ::2] = -1
    for policy in ("flat", "hybrid"):
        many = dispatch_traffic(topk, topo, 12, policy)
        few = dispatch_traffic(fewer, topo, 12, policy)
        for a, b in ((many, few), (combine_traffic(many), combine_traffic(few))):
            assert op_cost(a, topo, row_bytes=4096).total_us >= \
                op_cost(b, topo, row_bytes=4096).total_us


def test_group_limited_routing_keeps_each_token_on_few_hosts():
    topk = make_group_limited_topk(4, 200, 8, 64, groups=8, groups_per_token=3, seed=2)
    hosts = topk // 8
    assert max(len(set(row)) for row in hosts.reshape(-1, 8).tolist()) <= 3
    assert all(len(set(row)) == 8 for row in topk.reshape(-1, 8).tolist())
    with pytest.raises(ValueError, match="groups_per_token=9"):
        make_group_limited_topk(1, 1, 8, 64, groups=8, groups_per_token=9)


@pytest.mark.parametrize("kw, name", [
    (dict(hosts=0), "hosts"), (dict(num_experts=100), "num_experts=100"),
    (dict(nic_gbps=-1.0), "nic_gbps"), (dict(routing="zipf"), "routing"),
    (dict(max_hosts_per_token=3), "max_hosts_per_token"), (dict(intra_host=""), "intra_host"),
])
def test_bad_configs_name_the_field(kw, name):
    with pytest.raises((ValueError, TypeError), match=name):
        ClusterConfig(**kw)


def test_policy_errors_name_the_argument():
    topo = Topology.cluster(2, 2, intra_host=INSIDE)
    topk = np.zeros((4, 2, 1), dtype=np.int64)
    with pytest.raises(ValueError, match="policy='ring'"):
        dispatch_traffic(topk, topo, 8, "ring")
    with pytest.raises(ValueError, match="topk must be"):
        dispatch_traffic(topk[:3], topo, 8, "flat")


def test_deepep_reference_is_shipped_with_its_source():
    ref = load_deepep()
    for table in ("normal", "low_latency", "v2"):
        assert "source" in ref[table] and ref[table]["source"]
    ll = ref["low_latency"]
    assert len(ll["ep"]) == len(ll["dispatch_us"]) == len(ll["combine_us"])
    assert len(ref["normal"]["ep"]) == len(ref["normal"]["dispatch_GBps"])


def test_cli_writes_the_tables(tmp_path, capsys):
    argv = ["simulate", "--cluster", "--hosts", "1,2", "--ranks-per-host", "2",
            "--num-experts", "8", "--tokens-per-rank", "16", "--hidden", "64",
            "--intra-host", "nvl72", "--no-reference", "--cluster-out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hybrid vs flat" in out
    with (tmp_path / "cluster.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["hosts"], r["policy"], r["op"]) for r in rows} == {
        (h, p, o) for h in ("1", "2") for p in ("flat", "hybrid")
        for o in ("dispatch", "combine")}
    assert (tmp_path / "report.md").read_text().count("|") > 10
    assert main(argv[:3] + ["0,x"] + argv[4:]) == 2
    assert "--hosts" in capsys.readouterr().out
