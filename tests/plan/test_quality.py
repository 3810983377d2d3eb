"""The quality study's exact optimum: checked by brute force and by an independent MILP."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ubep.plan import SCHEDULES, Topology, make_plan
from ubep.plan.quality import (
    compositions,
    exact_optimum,
    hop_costs,
    lower_bound,
    objective,
    small_instance_study,
)

TOPO = Topology.preset("cm384", ranks=32)
SEND_NS, RTT_NS = hop_costs(TOPO, 7168)


def brute_force(classes: list[int], workers: int) -> float:
    """Every assignment of every send to a worker."""
    best = np.inf
    for assign in itertools.product(range(workers), repeat=len(classes)):
        counts = np.zeros((workers, TOPO.num_hop_classes), dtype=np.int64)
        for h, j in zip(classes, assign):
            counts[j, h] += 1
        best = min(best, objective(counts, SEND_NS, RTT_NS))
    return best


def milp(per_class: np.ndarray, workers: int) -> float:
    """min z s.t. z >= sum_h n[h,j]*t_h + r_j, r_j >= rtt_h*y[h,j], n[h,j] <= V_h*y[h,j]."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    z = h.addVariable(lb=0)
    terms = []
    for _ in range(workers):
        r = h.addVariable(lb=0)
        load = 0
        for c, v in enumerate(per_class):
            if v == 0:
                continue
            n = h.addIntegral(lb=0, ub=int(v))
            y = h.addBinary()
            h.addConstr(n - int(v) * y <= 0)
            h.addConstr(r - float(RTT_NS[c]) * y >= 0)
            load = load + float(SEND_NS[c]) * n
            terms.append((c, n))
        h.addConstr(z - load - r >= 0)
    for c, v in enumerate(per_class):
        if v:
            h.addConstr(sum(n for cc, n in terms if cc == c) == int(v))
    h.minimize(z)
    return float(h.val(z))


def test_compositions_are_all_splits():
    comp = compositions(4, 3)
    assert comp.shape == (15, 3) and (comp.sum(axis=1) == 4).all()
    assert len({tuple(r) for r in comp.tolist()}) == 15


@pytest.mark.parametrize("seed", range(12))
def test_exact_optimum_matches_brute_force_and_milp(seed):
    rng = np.random.default_rng(seed)
    classes = rng.integers(0, TOPO.num_hop_classes, size=int(rng.integers(1, 8))).tolist()
    workers = int(rng.integers(2, 4))
    per_class = np.bincount(classes, minlength=TOPO.num_hop_classes)
    best = exact_optimum(per_class, workers, SEND_NS, RTT_NS)
    assert best == pytest.approx(brute_force(classes, workers))
    assert best == pytest.approx(milp(per_class, workers), rel=1e-6)
    assert lower_bound(per_class, workers, SEND_NS, RTT_NS) <= best + 1e-9


def test_no_schedule_beats_the_optimum_and_the_study_runs():
    rng = np.random.default_rng(7)
    idx = np.stack([rng.choice(32, 3, replace=False) for _ in range(4)])
    for s in SCHEDULES:
        p = make_plan(idx, topology=TOPO, rank=5, num_experts=32, workers=3, schedule=s,
                      mode="bsp")
        per_class = np.bincount(p.hops, minlength=TOPO.num_hop_classes)
        assert objective(p.hop_counts(), SEND_NS, RTT_NS) >= exact_optimum(
            per_class, 3, SEND_NS, RTT_NS) - 1e-9
    rows, meta = small_instance_study(num_instances=15, seed=1)
    assert [r.schedule for r in rows] == list(SCHEDULES)
    assert all(r.mean >= 1 - 1e-9 and r.worst >= r.mean for r in rows)
    assert meta["sends_max"] <= 12
