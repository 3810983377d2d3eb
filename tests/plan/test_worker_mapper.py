"""The per-worker mapper (what each runtime worker computes on its own) equals the central
plan, on random routings with 2-4 hop classes and 1-64 workers; its compiled quaternary
search equals the documented numpy one, step for step."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_strategies import planning_cases

from ubep.plan import SCHEDULES, WorkerMapper, make_plan
from ubep.plan.fastplan import quaternary_search as compiled_search
from ubep.plan.search import quaternary_search

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(case=planning_cases(), schedule=st.sampled_from(SCHEDULES),
       chunk=st.sampled_from([1, 2, 3]))
def test_every_workers_own_slice_equals_its_part_of_the_central_plan(case, schedule, chunk):
    topo, rank, num_experts, idx, workers = case
    kw = dict(topology=topo, rank=rank, num_experts=num_experts, workers=workers,
              schedule=schedule, mode="bsp",     # bsp: every worker is a token worker
              send_chunk=chunk)
    central = make_plan(idx, engine="numpy", **kw)
    assert central.token_workers == workers
    mapper = WorkerMapper.of(topo, rank, num_experts, schedule, send_chunk=chunk)
    idx = np.ascontiguousarray(idx, np.int64)
    for j in range(workers):
        sends, experts, window_pos, hops = mapper.map(idx, workers, j)
        assert (sends == central.worker_sends[j]).all() and sends.shape[1] == 3
        assert (experts == central.worker_experts[j]).all()
        assert (window_pos == central.worker_window_pos[j]).all()
        assert (hops == central.worker_hops[j]).all()


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=600), data=st.data())
def test_compiled_search_takes_the_same_steps_as_the_reference(counts, data):
    prefix = np.cumsum(np.array(counts, np.int64))
    target = data.draw(st.integers(0, int(prefix[-1]) + 2))
    assert compiled_search(prefix, target) == quaternary_search(prefix, target)


def test_mapping_rows_back_by_source_rank_covers_each_row_once():
    """Combine's schedule: rows labelled by source rank, one "expert" per rank."""
    from ubep.plan import Topology

    topo = Topology.resolve("cm384", 32)
    mapper = WorkerMapper.of(topo, 5, topo.num_ranks, "hierarchical")
    src = np.random.default_rng(1).integers(0, 32, size=(500, 1))
    parts = [mapper.map(src, 3, j) for j in range(3)]
    rows = np.concatenate([p[0][:, 0] for p in parts])
    assert sorted(rows.tolist()) == list(range(500))
    farthest = max(int(p[3].max()) for p in parts)
    far = [int((p[3] == farthest).sum()) for p in parts]      # far rows spread evenly
    assert max(far) - min(far) <= 1 and sum(far) > 0
