"""A plan, executed naively for every rank at once, reproduces the oracle's dispatch bit for bit.

Each rank's token workers write their rows into the receiver's window for (source rank,
expert) at `window_pos`; the receiver lays windows out expert-major, then by source rank.
This checks the Plan's meaning (destinations, window positions, counts), not a runtime.
"""

from __future__ import annotations

import pytest
import torch

from ubep import reference
from ubep.plan import SCHEDULES, Topology, make_plan
from ubep.testing import make_routing, make_tokens


def execute(plans, xs, num_experts):
    world = len(plans)
    per_rank = num_experts // world
    hidden, dtype = xs[0].shape[1], xs[0].dtype
    windows = {}
    for s, plan in enumerate(plans):
        for e in range(num_experts):
            windows[(s, e)] = torch.full((int(plan.send_counts[e]), hidden), -1, dtype=dtype)
        written = set()
        for sends, wpos, exps in zip(plan.worker_sends, plan.worker_window_pos,
                                     plan.worker_experts):
            for (t, _k, dest), p, e in zip(sends.tolist(), wpos.tolist(), exps.tolist()):
                assert dest == e // per_rank and (e, p) not in written
                written.add((e, p))
                windows[(s, e)][p] = xs[s][t]
        assert len(written) == plan.num_sends
    out = []
    for r in range(world):
        rows = [windows[(s, e)] for e in range(r * per_rank, (r + 1) * per_rank)
                for s in range(world)]
        out.append(torch.cat(rows))
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("world, workers, kind", [(2, 1, "uniform"), (4, 5, "skewed"),
                                                  (3, 48, "partial"), (4, 2, "one_expert")])
def test_plans_reproduce_the_reference_dispatch(schedule, world, workers, kind):
    num_experts, hidden = world * 3, 16
    topo = Topology.preset("cm384", ranks=world)
    idxs = [make_routing(9 + r, 4, num_experts, kind=kind, seed=r)[0] for r in range(world)]
    xs = [make_tokens(r, 9 + r, hidden, torch.bfloat16, seed=r) for r in range(world)]
    ws = [torch.ones(i.shape, dtype=torch.float32) for i in idxs]
    plans = [make_plan(idxs[r], topology=topo, rank=r, num_experts=num_experts,
                       workers=workers, schedule=schedule) for r in range(world)]
    got = execute(plans, xs, num_experts)
    want = reference.dispatch(xs, idxs, ws, num_experts)
    for r in range(world):
        assert got[r].shape == want[r].recv_x.shape
        assert torch.equal(got[r].view(torch.uint8), want[r].recv_x.view(torch.uint8))
