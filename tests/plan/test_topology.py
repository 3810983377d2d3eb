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
