"""The schedulers' guarantees, on random routings (incl. heavy skew), 2-4 hop classes,
1-64 workers: docs/design.md §2.2 and issue 5."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_strategies import planning_cases

from ubep.plan import SCHEDULES, make_plan

FIELDS = ("sends", "send_experts", "window_pos", "hops", "worker_offsets", "send_counts",
          "expert_order", "segment_targets", "segment_sizes")
SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def expected_window_pos(idx: np.ndarray, token: int, slot: int) -> int:
    """Rows of one expert are numbered in ascending token order."""
    expert = idx[token, slot]
    return int((idx[:token] == expert).sum())


@SETTINGS
@given(case=planning_cases(), schedule=st.sampled_from(SCHEDULES),
       mode=st.sampled_from(["ubep", "bsp"]))
def test_every_send_is_assigned_once_with_the_right_destination(case, schedule, mode):
    topo, rank, num_experts, idx, workers = case
    plan = make_plan(idx, topology=topo, rank=rank, num_experts=num_experts, workers=workers,
                     schedule=schedule, mode=mode)
    per_rank = num_experts // topo.num_ranks
    routed = {(t, k) for t, k in zip(*np.nonzero(idx >= 0))}
    got = [tuple(r) for w in plan.worker_sends for r in w[:, :2].tolist()]
    assert len(got) == len(routed) == plan.num_sends and set(got) == routed
    assert len(plan.worker_sends) == plan.token_workers
    assert plan.count_workers + plan.token_workers == workers
    for sends, wpos, hops, exps in zip(plan.worker_sends, plan.worker_window_pos,
                                       plan.worker_hops, plan.worker_experts):
        assert sends.dtype == np.int64 and sends.shape[1] == 3
        for (t, k, dest), p, h, e in zip(sends.tolist(), wpos.tolist(), hops.tolist(),
                                         exps.tolist()):
            assert e == idx[t, k] and dest == e // per_rank
            assert h == topo.hop_class(rank, dest)
            assert p == expected_window_pos(idx, t, k)
    assert plan.send_counts.tolist() == np.bincount(idx[idx >= 0],
                                                    minlength=num_experts).tolist()


@SETTINGS
@given(case=planning_cases(), schedule=st.sampled_from(["balanced", "hierarchical"]))
def test_balanced_schedules_give_every_worker_the_same_load(case, schedule):
    topo, rank, num_experts, idx, workers = case
    plan = make_plan(idx, topology=topo, rank=rank, num_experts=num_experts, workers=workers,
                     schedule=schedule)
    per = plan.sends_per_worker()
    assert per.max() - per.min() <= 1


@SETTINGS
@given(case=planning_cases())
def test_hierarchical_spreads_every_hop_class_evenly(case):
    topo, rank, num_experts, idx, workers = case
    plan = make_plan(idx, topology=topo, rank=rank, num_experts=num_experts, workers=workers,
                     schedule="hierarchical")
    n = plan.token_workers
    per_class = np.bincount(plan.hops, minlength=topo.num_hop_classes)
    counts = plan.hop_counts()
    for h in range(topo.num_hop_classes):
        assert counts[:, h].max(initial=0) <= math.ceil(per_class[h] / n)
    # within a worker, every hop class is spread over the send order in proportion: in any
    # prefix of L sends, class h has L * m_h / m of them, give or take (H + 1) / 2
    H = topo.num_hop_classes
    for hops in plan.worker_hops:
        m = hops.shape[0]
        if m == 0:
            continue
        seen = np.cumsum(hops[:, None] == np.arange(H)[None, :], axis=0)   # [m, H]
        want = np.arange(1, m + 1)[:, None] * seen[-1][None, :] / m
        assert np.abs(seen - want).max() <= (H + 1) / 2 + 1e-9


@SETTINGS
@given(case=planning_cases(), chunk=st.sampled_from([2, 3]))
def test_hierarchical_chunks_keep_runs_of_one_class(case, chunk):
    """With send_chunk c, a worker's list is its classes' runs of c sends (a class's last
    run may be shorter), merged in proportion; the multiset of sends is the chunk-1 plan's."""
    topo, rank, num_experts, idx, workers = case
    kw = dict(topology=topo, rank=rank, num_experts=num_experts, workers=workers,
              schedule="hierarchical")
    one, plan = make_plan(idx, **kw), make_plan(idx, send_chunk=chunk, **kw)
    H = topo.num_hop_classes
    for j, hops in enumerate(plan.worker_hops):
        assert sorted(map(tuple, plan.worker_sends[j])) == sorted(map(tuple, one.worker_sends[j]))
        if hops.shape[0] == 0:
            continue
        cut = np.flatnonzero(np.diff(hops)) + 1
        runs = np.split(hops, cut)
        total = np.bincount(hops, minlength=H)
        seen = np.zeros(H, np.int64)
        for r in runs:
            h = int(r[0])
            # a run is whole chunks of its class, ending short only at the class's end
            assert len(r) % chunk == 0 or seen[h] + len(r) == total[h], (j, hops)
            seen[h] += len(r)
        # proportional in chunks: any prefix within chunk * (H + 1) / 2 of its share
        cum = np.cumsum(hops[:, None] == np.arange(H)[None, :], axis=0)
        want = np.arange(1, hops.shape[0] + 1)[:, None] * total[None, :] / hops.shape[0]
        assert np.abs(cum - want).max() <= chunk * (H + 1) / 2 + 1e-9


@SETTINGS
@given(case=planning_cases())
def test_static_workers_own_fixed_token_ranges(case):
    topo, rank, num_experts, idx, workers = case
    plan = make_plan(idx, topology=topo, rank=rank, num_experts=num_experts, workers=workers,
                     schedule="static", mode="bsp")
    n, T = plan.token_workers, idx.shape[0]
    for j, sends in enumerate(plan.worker_sends):
        tokens = sends[:, 0]
        assert ((tokens >= j * T // n) & (tokens < (j + 1) * T // n)).all()
        assert (np.diff(tokens * idx.shape[1] + sends[:, 1]) > 0).all()  # row-major order


@SETTINGS
@given(case=planning_cases(), schedule=st.sampled_from(["balanced", "hierarchical"]))
def test_slice_starts_found_by_quaternary_search_match_the_slices(case, schedule):
    topo, rank, num_experts, idx, workers = case
    plan = make_plan(idx, topology=topo, rank=rank, num_experts=num_experts, workers=workers,
                     schedule=schedule)
    experts, offsets, steps = plan.slice_starts()
    assert steps <= math.ceil(math.log(num_experts + 1, 4) - 1e-9)
    S = plan.segment_sizes.shape[1]
    for j in range(plan.token_workers):
        # slice s of a hierarchical worker holds its sends of hop class H - 1 - s (farthest
        # first), interleaved with the other slices; balanced has one slice
        hops = plan.worker_hops[j]
        for s in range(S):
            size = plan.segment_sizes[j, s]
            mine = (np.flatnonzero(hops == topo.num_hop_classes - 1 - s) if S > 1
                    else np.arange(len(hops)))
            assert mine.shape[0] == size
            if size:
                assert plan.worker_experts[j][mine[0]] == experts[j, s]
                assert plan.worker_window_pos[j][mine[0]] == offsets[j, s]
        assert plan.segment_sizes[j].sum() == len(plan.worker_sends[j])


@SETTINGS
@given(case=planning_cases(), schedule=st.sampled_from(SCHEDULES),
       mode=st.sampled_from(["ubep", "bsp"]), chunk=st.sampled_from([1, 2, 3]))
def test_numba_and_numpy_paths_give_the_same_plan(case, schedule, mode, chunk):
    topo, rank, num_experts, idx, workers = case
    kw = dict(topology=topo, rank=rank, num_experts=num_experts, workers=workers,
              schedule=schedule, mode=mode, send_chunk=chunk)
    a, b = make_plan(idx, engine="numba", **kw), make_plan(idx, engine="numpy", **kw)
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype == np.int64 and x.shape == y.shape and (x == y).all(), f
    assert a.count_dest_ranges == b.count_dest_ranges


@pytest.mark.parametrize("workers", [1, 2, 3, 48])
def test_flat_fabric_hierarchical_is_balanced_slicing(workers):
    from ubep.plan import Topology

    topo = Topology.preset("nvl72", ranks=8)
    idx = np.random.default_rng(1).integers(0, 16, size=(30, 1))
    kw = dict(topology=topo, rank=0, num_experts=16, workers=workers, mode="bsp")
    hier, bal = make_plan(idx, schedule="hierarchical", **kw), make_plan(idx, **kw,
                                                                         schedule="balanced")
    # one remote class plus the local one: per-class slices, same loads as balanced
    assert sorted(hier.sends_per_worker()) == sorted(bal.sends_per_worker())


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.one_of(st.integers(0, 12), st.integers(0, 300_000)), min_size=1,
                      max_size=5),
       chunk=st.integers(1, 4))
def test_compiled_interleave_is_the_reference_merge_at_any_slice_size(sizes, chunk):
    """`fastplan.interleave` places each send by a closed form with a float64 floor; it
    must equal the reference merge by `interleave_keys` (ties: farther class, then in order)
    also at slice sizes far beyond the routings above."""
    from ubep.plan.fastplan import interleave
    from ubep.plan.schedule import interleave_keys

    size = np.array(sizes, np.int64)
    row = np.repeat(np.arange(size.shape[0]), size)
    q = np.arange(row.shape[0]) - np.repeat(np.cumsum(size) - size, size)
    merged = np.lexsort((q, row, interleave_keys(q, size[row], chunk)))
    expected = np.empty_like(merged)
    expected[merged] = np.arange(merged.shape[0])
    assert np.array_equal(interleave(size[None, :], 0, chunk), expected)
