"""The planner on a cluster (hosts joined by the network): the hierarchical schedule spreads
each worker's share over same-host and "other host" sends, the balanced one does not."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ubep.plan import WorkerMapper, make_plan
from ubep.plan.topology import NETWORK_TIER, Topology
from ubep.sim.workload import make_topk


def _case(topo: Topology, rank: int, experts: int = 256, tokens: int = 128, seed: int = 0):
    idx = make_topk(topo.num_ranks, tokens, 8, experts, seed=seed)[rank]
    return idx, experts


@pytest.mark.parametrize("hosts", [2, 4])
def test_hierarchical_balances_other_host_sends_over_workers(hosts):
    topo = Topology.preset("cluster", ranks=8 * hosts)
    net = topo.network_hop_class
    assert topo.hop_class_names()[net] == NETWORK_TIER
    for rank in (0, 8 * hosts - 3):
        idx, experts = _case(topo, rank)
        plan = make_plan(idx, topology=topo, rank=rank, num_experts=experts, workers=20,
                         schedule="hierarchical")
        n = plan.token_workers
        counts = plan.hop_counts()                       # [workers, hop classes]
        total = np.bincount(plan.hops, minlength=topo.num_hop_classes)
        # every send's class is its destination's: same host or other host
        for sends, hops in zip(plan.worker_sends, plan.worker_hops):
            dest_host = topo.host_ids()[sends[:, 2]]
            assert ((hops == net) == (dest_host != topo.host_of(rank))).all()
        for h in range(topo.num_hop_classes):
            assert counts[:, h].max() <= math.ceil(total[h] / n)
            assert counts[:, h].min() >= total[h] // n
        # a worker's share mixes both: same-host and other-host sends for every worker
        assert (counts[:, net] > 0).all() and (counts[:, 1] + counts[:, 0] > 0).all()
        # the balanced slicing (no remap) gives some workers only one kind
        flat = make_plan(idx, topology=topo, rank=rank, num_experts=experts, workers=20,
                         schedule="balanced").hop_counts()
        assert np.ptp(flat[:, net]) > np.ptp(counts[:, net])


def test_uneven_hosts_plan_and_worker_mapper_agree():
    topo = Topology.from_hosts([[5, 0, 9], [1, 2, 3, 4], [6, 7, 8]],
                               intra_host=Topology.preset("cluster").inside_host())
    experts = 3 * topo.num_ranks
    for rank in range(topo.num_ranks):
        idx, _ = _case(topo, rank, experts=experts, tokens=40, seed=3)
        central = make_plan(idx, topology=topo, rank=rank, num_experts=experts, workers=5,
                            schedule="hierarchical", mode="bsp", engine="numpy")
        mapper = WorkerMapper.of(topo, rank, experts, "hierarchical")
        for j in range(5):
            sends, _, _, hops = mapper.map(np.ascontiguousarray(idx), 5, j)
            assert (sends == central.worker_sends[j]).all()
            assert (hops == [topo.hop_class(rank, int(d)) for d in sends[:, 2]]).all()
