"""make_plan's public face: roles, count ranges, inputs accepted, errors that name arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ubep.plan import Plan, Topology, choose_count_workers, make_plan
from ubep.testing import make_routing

TOPO = Topology.preset("cm384", ranks=16)


def plan(idx=None, **kw):
    if idx is None:
        idx, _ = make_routing(32, 8, 64, seed=3)
    args = dict(topology=TOPO, rank=2, num_experts=64, workers=8)
    args.update(kw)
    return make_plan(idx, **args)


def test_roles_in_each_mode():
    p = plan()
    assert isinstance(p, Plan) and p.mode == "ubep" and p.schedule == "hierarchical"
    assert p.count_workers == choose_count_workers(8, 64, 8, 32) >= 1
    assert p.token_workers == 8 - p.count_workers
    p1 = plan(workers=1)
    assert (p1.count_workers, p1.token_workers, p1.count_dest_ranges) == (0, 1, [])
    pb = plan(mode="bsp", count_workers=3)
    assert (pb.count_workers, pb.token_workers) == (0, 8)
    p3 = plan(count_workers=3)
    assert p3.count_workers == 3 and p3.token_workers == 5
    assert p3.count_dest_ranges == [(0, 5), (5, 10), (10, 16)]


def test_count_ranges_cover_every_destination_once():
    for c in range(1, 20):
        p = plan(workers=c + 1, count_workers=c)
        covered = [r for lo, hi in p.count_dest_ranges for r in range(lo, hi)]
        assert covered == list(range(16)) and len(p.count_dest_ranges) == c


def test_torch_and_numpy_routings_give_the_same_plan():
    idx, _ = make_routing(20, 4, 64, seed=5, kind="partial")
    a, b = plan(idx), plan(idx.numpy().astype(np.int32))
    assert (a.sends == b.sends).all() and (a.window_pos == b.window_pos).all()


@pytest.mark.parametrize("kind", ["unrouted", "one_expert"])
def test_degenerate_routings(kind):
    idx, _ = make_routing(10, 4, 64, kind=kind)
    p = plan(idx, workers=48)
    assert p.num_sends == int((idx >= 0).sum())
    assert sum(len(s) for s in p.worker_sends) == p.num_sends
    empty = plan(torch.empty(0, 8, dtype=torch.int64))
    assert empty.num_sends == 0 and all(len(s) == 0 for s in empty.worker_sends)


def test_plan_of_the_paper_workload():
    idx, _ = make_routing(128, 8, 256, seed=0)
    topo = Topology.preset("cm384", ranks=256)
    p = make_plan(idx, topology=topo, rank=0, num_experts=256, workers=48)
    assert p.num_sends == 1024 and p.token_workers + p.count_workers == 48
    per = p.sends_per_worker()
    assert per.max() - per.min() <= 1
    summary = p.summary()
    assert summary["schedule"] == "hierarchical" and summary["num_sends"] == 1024


@pytest.mark.parametrize("kw, exc, words", [
    (dict(schedule="random"), ValueError, "schedule='random'"),
    (dict(mode="sync"), ValueError, "mode='sync'"),
    (dict(engine="gpu"), ValueError, "engine='gpu'"),
    (dict(rank=16), ValueError, "rank=16"),
    (dict(rank=-1), ValueError, "rank=-1"),
    (dict(num_experts=60), ValueError, "num_experts=60"),
    (dict(workers=0), ValueError, "workers=0"),
    (dict(workers=4, count_workers=4), ValueError, "count_workers=4"),
    (dict(topology="cm384"), TypeError, "topology must be"),
    (dict(workers=2.0), TypeError, "workers must be an int"),
])
def test_bad_arguments_are_named(kw, exc, words):
    with pytest.raises(exc, match=words.replace("(", r"\(")):
        plan(**kw)


@pytest.mark.parametrize("engine", ["numba", "numpy"])
def test_bad_routings_are_named(engine):
    idx, _ = make_routing(4, 2, 64)
    for bad in (64, -2):
        broken = idx.clone()
        broken[1, 1] = bad
        with pytest.raises(ValueError, match=f"expert id {bad}"):
            plan(broken, engine=engine)
    with pytest.raises(ValueError, match="2-D"):
        plan(idx[0], engine=engine)
    with pytest.raises(TypeError, match="integers"):
        plan(idx.float(), engine=engine)
    with pytest.raises(TypeError, match="torch.Tensor or numpy"):
        plan(idx.tolist(), engine=engine)


def test_count_worker_model_trends():
    base = choose_count_workers(48, 256, 8, 128)
    assert 1 <= base <= 47
    assert choose_count_workers(48, 1024, 8, 128) >= base      # more experts, more counters
    assert choose_count_workers(48, 256, 8, 2048) <= base      # more traffic, fewer
    assert choose_count_workers(1, 256, 8, 128) == 0
    assert choose_count_workers(2, 10_000, 1, 1) == 1            # clamped to workers - 1
    assert choose_count_workers(48, 1, 8, 10_000) == 1           # at least one
    with pytest.raises(ValueError, match="workers=0"):
        choose_count_workers(0, 256, 8, 128)
    with pytest.raises(ValueError, match="ranks=0"):
        choose_count_workers(4, 256, 8, 128, ranks=0)


def test_hierarchical_expert_order_is_class_major_and_rotated_past_the_rank():
    topo = Topology.preset("cm384", ranks=32)
    for rank in (0, 5, 31):
        p = plan(np.zeros((1, 1), dtype=np.int64), topology=topo, rank=rank, num_experts=64)
        hop = topo.hop_matrix()[rank][p.expert_order // 2]
        assert (np.diff(hop) <= 0).all()                 # farthest class first
        assert sorted(p.expert_order.tolist()) == list(range(64))
        far = p.expert_order[hop == hop[0]]
        # the far class starts at the first far expert after this rank's own experts
        after = [e for e in range(64) if e >= (rank + 1) * 2 and e in set(far.tolist())]
        assert far[0] == (after[0] if after else far.min())
        balanced = plan(np.zeros((1, 1), dtype=np.int64), topology=topo, rank=rank,
                        num_experts=64, schedule="balanced")
        assert balanced.expert_order.tolist() == list(range(64))   # no remap: the ablation
