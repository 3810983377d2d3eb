"""Topology: presets, scaling, hop classes, TOML loading and the errors that name bad keys."""

from __future__ import annotations

import numpy as np
import pytest

import ubep
from ubep.plan.hostinfo import HostInfo, discover_host, parse_cpulist
from ubep.plan.topology import PRESETS, Tier, Topology, host_topology

CM384_TOML = """
name = "mini"
num_ranks = 8
workers_per_rank = 4
atomic_block_bytes = 512
flag_bytes = 32
local_latency_ns = 100
local_bandwidth_GBps = 400
[[tiers]]
name = "npu"
ranks_per_group = 2
latency_ns = 218
bandwidth_GBps = 392
[[tiers]]
name = "pod"
latency_ns = 2500
bandwidth_GBps = 392
"""


def brute_hop(topo: Topology, s: int, d: int) -> int:
    if s == d:
        return 0
    for i, t in enumerate(topo.tiers):
        if s // t.ranks_per_group == d // t.ranks_per_group:
            return i + 1
    raise AssertionError("outermost tier must join every pair")


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_its_hop_matrix_matches_hop_class(name):
    topo = Topology.preset(name)
    assert ubep.Topology is Topology and ubep.plan.Topology is Topology
    assert topo.name == name and topo.tiers[-1].ranks_per_group == topo.num_ranks
    n = min(topo.num_ranks, 40)
    hops = topo.hop_matrix()
    assert hops.shape == (topo.num_ranks, topo.num_ranks)
    assert (hops == hops.T).all() and (np.diag(hops) == 0).all()
    for s in range(n):
        for d in range(0, topo.num_ranks, 7):
            assert hops[s, d] == topo.hop_class(s, d) == brute_hop(topo, s, d)


def test_cm384_is_the_paper_machine():
    topo = Topology.preset("cm384")
    assert (topo.num_ranks, topo.workers_per_rank) == (384, 48)
    assert (topo.atomic_block_bytes, topo.flag_bytes) == (512, 32)
    assert [t.ranks_per_group for t in topo.tiers] == [2, 16, 384]
    assert [topo.hop_latency_ns(h) for h in (1, 2, 3)] == [218, 929, 2500]
    assert topo.hop_bandwidth_GBps(3) == 392
    assert topo.num_hop_classes == 4
    # rank 0: itself, the other die, 14 dies on its board, 368 further away
    assert np.bincount(topo.hop_matrix()[0]).tolist() == [1, 1, 14, 368]


def test_scaling_keeps_the_inner_layout():
    topo = Topology.preset("cm384", ranks=64)
    assert topo.num_ranks == 64 and topo.hop_matrix().shape == (64, 64)
    assert np.bincount(topo.hop_matrix()[17]).tolist() == [1, 1, 14, 48]
    assert topo.hop_class(0, 1) == 1 and topo.hop_class(0, 15) == 2
    assert topo.hop_class(0, 16) == 3
    small = Topology.preset("cm384", ranks=2)
    assert small.hop_matrix().tolist() == [[0, 1], [1, 0]]
    assert topo.with_workers(8).workers_per_rank == 8
    assert topo.with_ranks(64) is topo
    assert Topology.preset("ib-cluster", ranks=32).hop_class(7, 8) == 2


def test_resolve_accepts_none_names_paths_and_topologies(tmp_path):
    path = tmp_path / "mini.toml"
    path.write_text(CM384_TOML)
    assert Topology.resolve(None, 3).name == "host"
    assert Topology.resolve(None, 3).num_ranks == 3
    assert Topology.resolve("nvl72", 8).num_ranks == 8
    assert Topology.resolve(str(path), 4).num_ranks == 4
    assert Topology.resolve(path, 8) == Topology.from_toml(path)
    t = Topology.preset("cm384", ranks=16)
    assert Topology.resolve(t, 16) is t
    with pytest.raises(ValueError, match="neither a preset"):
        Topology.resolve("nvl73", 4)
    with pytest.raises(TypeError, match="topology must be"):
        Topology.resolve(3.5, 4)
    with pytest.raises(ValueError, match="preset='x'"):
        Topology.preset("x")


def test_toml_round_trip(tmp_path):
    import tomllib

    topo = Topology.from_dict(tomllib.loads(CM384_TOML))
    assert topo.hop_class(0, 1) == 1 and topo.hop_class(1, 2) == 2
    assert Topology.from_dict(topo.to_dict()) == topo
    assert topo.hop_class_names() == ("local", "npu", "pod")


@pytest.mark.parametrize("edit, key", [
    (("latency_ns = 218", "latency_ns = -1"), "tiers[0].latency_ns"),
    (("latency_ns = 218", "latncy_ns = 218"), "tiers[0].latncy_ns"),
    (("workers_per_rank = 4", "workers_per_rank = 'four'"), "workers_per_rank"),
    (("flag_bytes = 32\n", ""), "flag_bytes"),
    (('name = "pod"\n', 'name = "pod"\nranks_per_group = 4\n'), "tiers[1].ranks_per_group"),
    (("ranks_per_group = 2\n", ""), "tiers[0].ranks_per_group"),
    (("num_ranks = 8", "num_ranks = 8\ncolour = 1"), "colour"),
])
def test_bad_files_name_the_bad_key(tmp_path, edit, key):
    path = tmp_path / "bad.toml"
    path.write_text(CM384_TOML.replace(*edit, 1))
    with pytest.raises(ValueError) as info:
        Topology.from_toml(path)
    assert f"'{key}'" in str(info.value) and str(path) in str(info.value)


def test_structural_errors():
    tiers = (Tier("a", 2, 1.0, 1.0), Tier("b", 3, 1.0, 1.0), Tier("c", 12, 1.0, 1.0))
    with pytest.raises(ValueError, match="multiple of"):
        Topology("x", 12, 1, 64, 8, tiers, 1.0, 1.0)
    with pytest.raises(ValueError, match="flag_bytes"):
        Topology("x", 12, 1, 8, 8, tiers[2:], 1.0, 1.0)
    with pytest.raises(ValueError, match="must join all"):
        Topology("x", 13, 1, 64, 8, tiers[2:], 1.0, 1.0)
    topo = Topology.preset("nvl72")
    with pytest.raises(ValueError, match="dst=72"):
        topo.hop_class(0, 72)
    with pytest.raises(ValueError, match="hop class 2"):
        topo.hop_latency_ns(2)


def test_invalid_toml_syntax_and_missing_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("name = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        Topology.from_toml(path)
    with pytest.raises(ValueError, match="does not exist"):
        Topology.from_toml(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match="cannot be read"):
        Topology.resolve(tmp_path, 4)


def test_host_topology_from_numa_layouts(tmp_path):
    for i, cpus in enumerate(["0-3", "4-5,8"]):
        (tmp_path / f"node{i}").mkdir()
        (tmp_path / f"node{i}" / "cpulist").write_text(cpus + "\n")
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    two = HostInfo(nodes=((0, 1, 2, 3), (4, 5, 6, 7)), num_cores=8)
    topo = host_topology(two, ranks=4)
    assert [t.name for t in topo.tiers] == ["numa", "host"]
    assert topo.hop_class(0, 1) == 1 and topo.hop_class(1, 2) == 2
    assert topo.workers_per_rank == 2 and topo.atomic_block_bytes == 64
    assert host_topology(two).num_ranks == 2
    flat = host_topology(HostInfo(nodes=((0, 1),), num_cores=2), ranks=3)
    assert [t.name for t in flat.tiers] == ["host"] and flat.workers_per_rank == 1
    info = discover_host.__wrapped__(str(tmp_path))
    assert info.num_nodes >= 1 and info.num_cores >= 1
    here = Topology.host()
    assert here.num_ranks == discover_host().num_nodes


def test_pickles_without_its_caches():
    import pickle

    topo = Topology.preset("cm384")
    topo.hop_matrix()
    data = pickle.dumps(topo)
    assert len(data) < 4096           # the 384 x 384 hop matrix is not shipped
    back = pickle.loads(data)
    assert back == topo and (back.hop_matrix() == topo.hop_matrix()).all()


def test_hop_classes_form_a_tree_on_random_fabrics():
    """Hop classes of any fabric: symmetric, 0 only on the diagonal, and ultrametric
    (a detour through a third rank is never nearer), for every scaled size."""
    from hypothesis import given, settings
    from plan_strategies import topologies

    @settings(max_examples=60, deadline=None)
    @given(topo=topologies(max_ranks=30))
    def check(topo):
        for n in (topo.num_ranks, max(1, topo.num_ranks // 2), topo.num_ranks + 5):
            hops = topo.with_ranks(n).hop_matrix()
            assert (hops == hops.T).all() and ((hops == 0) == np.eye(n, dtype=bool)).all()
            # ultrametric: hop(a, c) <= max(hop(a, b), hop(b, c)) for all a, b, c
            assert (hops[:, None, :] <= np.maximum(hops[:, :, None], hops[None, :, :])).all()

    check()


# -- hosts: the "other host" tier ---------------------------------------------------------
CLUSTER_TOML = """
name = "two-by-four"
hosts = 2
ranks_per_host = 4
nic_gbps = 200
nic_latency_us = 3
[intra_host]
name = "box"
workers_per_rank = 4
atomic_block_bytes = 64
flag_bytes = 8
local_latency_ns = 20
local_bandwidth_GBps = 20
[[intra_host.tiers]]
name = "numa"
ranks_per_group = 2
latency_ns = 100
bandwidth_GBps = 10
[[intra_host.tiers]]
name = "host"
latency_ns = 200
bandwidth_GBps = 10
"""


def _two_node_box(ranks: int) -> Topology:
    return host_topology(HostInfo(nodes=((0, 1, 2, 3), (4, 5, 6, 7)), num_cores=8), ranks)


def brute_cluster_hop(hosts, numa: int | None, s: int, d: int, num_classes: int) -> int:
    """The hop class from first principles: self, same NUMA node, same host, other host."""
    if s == d:
        return 0
    hs = next(h for h, g in enumerate(hosts) if s in g)
    hd = next(h for h, g in enumerate(hosts) if d in g)
    if hs != hd:
        return num_classes - 1
    g = hosts[hs]
    if numa is not None and g.index(s) // numa == g.index(d) // numa:
        return 1
    return num_classes - 2


def test_cluster_preset_is_hosts_joined_by_nics():
    topo = Topology.preset("cluster")
    assert topo.hop_class_names() == ("local", "host", "other host")
    assert topo.hosts == (tuple(range(8)), tuple(range(8, 16))) and topo.num_hosts == 2
    assert topo.network_hop_class == 2
    assert topo.hop_bandwidth_GBps(2) == 400 / 8 and topo.hop_latency_ns(2) == 4000
    assert topo.hop_bandwidth_GBps(1) == 160
    assert [topo.host_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    big = Topology.preset("cluster", ranks=32)
    assert big.num_hosts == 4 and big.hosts[3] == tuple(range(24, 32))
    assert np.bincount(big.hop_matrix()[5]).tolist() == [1, 7, 24]


def test_single_host_fabrics_have_one_host():
    for name in ("cm384", "nvl72", "ib-cluster", "host"):
        topo = Topology.preset(name)
        assert topo.hosts == (tuple(range(topo.num_ranks)),) and topo.num_hosts == 1
        assert topo.network_hop_class is None and topo.inside_host() is topo
        assert topo.host_of(topo.num_ranks - 1) == 0


def test_uneven_non_consecutive_hosts():
    inside = _two_node_box(4)
    groups = [[7, 0, 3], [1, 5], [2, 4, 6, 8]]
    topo = Topology.from_hosts(groups, intra_host=inside, nic_gbps=100, nic_latency_us=2.5)
    assert topo.hosts == ((0, 3, 7), (1, 5), (2, 4, 6, 8))
    assert topo.hop_class_names() == ("local", "numa", "host", "other host")
    assert topo.hop_latency_ns(3) == 2500 and topo.hop_bandwidth_GBps(3) == 100 / 8
    hops = topo.hop_matrix()
    for s in range(9):
        assert topo.host_of(s) == next(h for h, g in enumerate(topo.hosts) if s in g)
        for d in range(9):
            want = brute_cluster_hop(topo.hosts, 2, s, d, topo.num_hop_classes)
            assert hops[s, d] == topo.hop_class(s, d) == want
    assert (topo.host_ids() == [topo.host_of(r) for r in range(9)]).all()
    one = topo.inside_host(2)
    assert one.num_ranks == 4 and one.hop_class_names() == ("local", "numa", "host")
    assert one.hop_matrix().tolist() == inside.hop_matrix().tolist()
    assert "3/2/4" in topo.description and "host/[3,2,4]" in str(topo)
    with pytest.raises(ValueError, match="cannot be rescaled"):
        topo.with_ranks(10)
    assert topo.with_ranks(9) is topo and Topology.resolve(topo, 9) is topo
    import pickle

    topo.hop_matrix()
    back = pickle.loads(pickle.dumps(topo))
    assert back == topo and back.hosts == topo.hosts
    assert (back.hop_matrix() == topo.hop_matrix()).all()


def test_cluster_and_from_hosts_agree_and_even_hosts_stay_block_tiers():
    a = Topology.cluster(3, 4, intra_host="nvl72", nic_gbps=400)
    b = Topology.from_hosts([range(0, 4), range(4, 8), range(8, 12)], intra_host="nvl72")
    assert a == b and all(t.groups is None for t in a.tiers)
    assert a.with_ranks(16).num_hosts == 4            # block tiers rescale like any preset
    c = Topology.cluster(ranks_per_host=[2, 3], intra_host="nvl72")
    assert c.hosts == ((0, 1), (2, 3, 4)) and c.tiers[0].groups is not None
    shared = Topology.cluster(2, 4, intra_host="nvl72", nic_gbps=400, nics_per_host=1)
    assert shared.hop_bandwidth_GBps(2) == 400 / 8 / 4     # one NIC shared by 4 ranks
    solo = Topology.cluster(3, 1, intra_host="nvl72")
    assert solo.hosts == ((0,), (1,), (2,)) and solo.hop_class(0, 1) == 2
    one = Topology.cluster(1, 4, intra_host="nvl72")
    assert one.num_hosts == 1 and (one.hop_matrix() < 2).all()


def test_cluster_toml_form_and_round_trips(tmp_path):
    import tomllib

    path = tmp_path / "c.toml"
    path.write_text(CLUSTER_TOML)
    topo = Topology.from_toml(path)
    assert topo.hosts == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.hop_class_names() == ("local", "numa", "host", "other host")
    assert topo.hop_class(0, 1) == 1 and topo.hop_class(0, 2) == 2 and topo.hop_class(0, 4) == 3
    assert topo.hop_bandwidth_GBps(3) == 25 and topo.hop_latency_ns(3) == 3000
    assert Topology.from_dict(topo.to_dict()) == topo
    uneven = tomllib.loads(CLUSTER_TOML.replace("hosts = 2\nranks_per_host = 4",
                                                "host_groups = [[0, 5], [1, 2, 3, 4]]"))
    t2 = Topology.from_dict(uneven)
    assert t2.hosts == ((0, 5), (1, 2, 3, 4)) and t2.num_ranks == 6
    for t in (t2, Topology.from_hosts([[3], [0, 2], [1, 4]], intra_host=_two_node_box(2))):
        back = Topology.from_dict(t.to_dict())
        assert back == t and back.hosts == t.hosts
        assert (back.hop_matrix() == t.hop_matrix()).all()
        out = tmp_path / "back.toml"
        out.write_text(_to_toml(t.to_dict()))
        assert Topology.from_toml(out) == t


def _to_toml(d: dict) -> str:
    """A minimal TOML writer for `Topology.to_dict()` (strings, numbers, int arrays)."""
    def val(v):
        if isinstance(v, str):
            return '"' + v.replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)
    lines = [f"{k} = {val(v)}" for k, v in d.items() if k != "tiers"]
    for t in d["tiers"]:
        lines.append("[[tiers]]")
        lines += [f"{k} = {val(v)}" for k, v in t.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("edit, key", [
    (("nic_gbps = 200", "nic_gbps = 0"), "nic_gbps"),
    (("nic_latency_us = 3\n", ""), "nic_latency_us"),
    (("hosts = 2\n", ""), "hosts"),
    (("ranks_per_host = 4", "ranks_per_host = [4, 0]"), "ranks_per_host"),
    (("ranks_per_host = 4", "ranks_per_host = [4, 4, 4]"), "hosts"),
    (("ranks_per_host = 4", "ranks_per_hots = 4"), "ranks_per_hots"),
    (("hosts = 2\nranks_per_host = 4", "host_groups = [[0, 1], [1, 2]]"), "host_groups"),
    (("hosts = 2\nranks_per_host = 4", "host_groups = [[0, 1], [3]]"), "host_groups"),
    (("hosts = 2\n", "hosts = 2\nhost_groups = [[0]]\n"), "host_groups"),
    (("latency_ns = 200", "latency_ns = -200"), "tiers[1].latency_ns"),
    (("nic_gbps = 200", "nic_gbps = 200\ntiers = []"), "tiers"),
])
def test_bad_cluster_files_name_the_bad_key(tmp_path, edit, key):
    path = tmp_path / "bad.toml"
    text = CLUSTER_TOML.replace(*edit, 1)
    assert text != CLUSTER_TOML
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        Topology.from_toml(path)
    assert f"'{key}'" in str(info.value) and str(path) in str(info.value)


def test_bad_hosts_and_groups_are_named():
    nv = "nvl72"
    with pytest.raises(ValueError, match="key 'intra_host' must be"):
        Topology.from_dict({"name": "c", "hosts": 2, "ranks_per_host": 2, "nic_gbps": 1,
                            "nic_latency_us": 1, "intra_host": 3})
    with pytest.raises(ValueError, match="rank 1 is in two groups"):
        Topology.from_hosts([[0, 1], [1, 2]], intra_host=nv)
    with pytest.raises(ValueError, match="ranks 2 are in no group"):
        Topology.from_hosts([[0, 1], [3]], intra_host=nv)
    with pytest.raises(ValueError, match=r"groups\[1\] must be a non-empty"):
        Topology.from_hosts([[0], []], intra_host=nv)
    with pytest.raises(ValueError, match="ranks are ints"):
        Topology.from_hosts([[0], [-1]], intra_host=nv)
    with pytest.raises(ValueError, match="hosts is None"):
        Topology.cluster(ranks_per_host=4)
    with pytest.raises(ValueError, match="hosts=3 but"):
        Topology.cluster(3, [2, 2])
    with pytest.raises(ValueError, match="nic_gbps=-1"):
        Topology.cluster(2, 2, nic_gbps=-1, intra_host=nv)
    with pytest.raises(TypeError, match="ranks_per_host must be"):
        Topology.cluster(2, "8")
    with pytest.raises(ValueError, match="spans several hosts"):
        Topology.cluster(2, 8, intra_host="cluster")
    with pytest.raises(ValueError, match="intra_host='nvl73'"):
        Topology.cluster(2, 8, intra_host="nvl73")
    tiers = (Tier("other host", 2, 1.0, 1.0), Tier("all", 4, 1.0, 1.0))
    with pytest.raises(ValueError, match="only the outermost"):
        Topology("x", 4, 1, 64, 8, tiers, 1.0, 1.0)
    split = (Tier.of_groups("a", [[0, 2], [1, 3]], 1.0, 1.0), Tier("b", 2, 1.0, 1.0),
             Tier("c", 4, 1.0, 1.0))
    with pytest.raises(ValueError, match="is split between groups"):
        Topology("x", 4, 1, 64, 8, split, 1.0, 1.0)
    bad_size = (Tier("a", 3, 1.0, 1.0, groups=((0, 1), (2, 3))), Tier("b", 4, 1.0, 1.0))
    with pytest.raises(ValueError, match="largest group's size 2"):
        Topology("x", 4, 1, 64, 8, bad_size, 1.0, 1.0)
    topo = Topology.preset("cluster")
    with pytest.raises(ValueError, match="rank=16"):
        topo.host_of(16)
    with pytest.raises(ValueError, match="host=2"):
        topo.inside_host(2)


def test_random_clusters_hop_classes_follow_their_hosts():
    """Any split of ranks into hosts (shuffled, uneven) around an inside of 1-2 tiers:
    hop classes are self / same NUMA group / same host / other host, and the topology
    round-trips through its TOML table."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5),
           numa=st.sampled_from([None, 1, 2]), seed=st.integers(0, 2**32 - 1))
    def check(sizes, numa, seed):
        perm = np.random.default_rng(seed).permutation(sum(sizes)).tolist()
        starts = np.cumsum([0] + sizes)
        groups = [perm[a:b] for a, b in zip(starts[:-1], starts[1:])]
        inner = (Tier("numa", numa, 50.0, 20.0),) if numa else ()
        inside = Topology("box", max(sizes), 2, 64, 8,
                          inner + (Tier("host", max(sizes), 100.0, 10.0),), 20.0, 20.0)
        topo = Topology.from_hosts(groups, intra_host=inside)
        assert topo.hosts == tuple(tuple(sorted(g)) for g in groups)
        hops = topo.hop_matrix()
        n = topo.num_hop_classes
        for s in range(topo.num_ranks):
            for d in range(topo.num_ranks):
                assert hops[s, d] == brute_cluster_hop(topo.hosts, numa, s, d, n)
        assert Topology.from_dict(topo.to_dict()) == topo

    check()
