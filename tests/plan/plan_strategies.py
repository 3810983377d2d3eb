"""Hypothesis strategies shared by the plan tests: fabrics with 2-4 hop classes (block tiers,
or clusters of uneven, shuffled hosts), routings."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ubep.plan.topology import Tier, Topology


@st.composite
def topologies(draw, max_ranks: int = 24) -> Topology:
    """A fabric with 2-4 hop classes (1-3 tiers) of nested groups."""
    num_tiers = draw(st.integers(1, 3))
    sizes, size = [], 1
    for _ in range(num_tiers - 1):
        size *= draw(st.integers(2, 3))
        sizes.append(size)
    num_ranks = draw(st.integers(max(2, size), max_ranks))
    tiers = tuple(Tier(f"t{i}", rpg, latency_ns=100.0 * (i + 2), bandwidth_GBps=100.0)
                  for i, rpg in enumerate(sizes + [num_ranks]))
    return Topology("prop", num_ranks, 4, 512, 32, tiers, 100.0, 400.0)


@st.composite
def clusters(draw, max_ranks: int = 24) -> Topology:
    """Hosts of uneven sizes holding shuffled ranks, around an inside of 1-2 tiers: hop
    classes local, (numa,) host, other host."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5).filter(
        lambda s: 2 <= sum(s) <= max_ranks))
    perm = draw(st.permutations(range(sum(sizes))))
    starts = np.cumsum([0] + sizes)
    groups = [list(perm[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    numa = draw(st.sampled_from([None, 2]))
    inner = (Tier("numa", numa, 150.0, 100.0),) if numa else ()
    inside = Topology("box", max(sizes), 4, 512, 32,
                      inner + (Tier("host", max(sizes), 300.0, 100.0),), 100.0, 400.0)
    return Topology.from_hosts(groups, intra_host=inside, nic_gbps=100.0,
                               nic_latency_us=draw(st.sampled_from([0.5, 4.0])))


def routing(rng: np.random.Generator, num_tokens: int, top_k: int, num_experts: int,
            skew: float, holes: float) -> np.ndarray:
    """`[T, K]` int64, distinct experts per row; `skew` in [0, 1) concentrates them on a
    few hot experts (heavy skew near 1); `holes` is the share of -1 slots."""
    k = min(top_k, num_experts)
    weights = np.exp(-skew * 12 * np.arange(num_experts) / max(num_experts - 1, 1))
    weights = weights[rng.permutation(num_experts)]
    weights /= weights.sum()
    idx = np.full((num_tokens, top_k), -1, dtype=np.int64)
    for t in range(num_tokens):
        idx[t, :k] = rng.choice(num_experts, size=k, replace=False, p=weights)
    idx[rng.random(idx.shape) < holes] = -1
    return idx


@st.composite
def planning_cases(draw):
    """(topology, rank, num_experts, topk_idx, workers)."""
    topo = draw(st.one_of(topologies(), clusters()))
    experts_per_rank = draw(st.integers(1, 4))
    num_experts = topo.num_ranks * experts_per_rank
    num_tokens = draw(st.integers(0, 48))
    top_k = draw(st.integers(1, 8))
    skew = draw(st.sampled_from([0.0, 0.5, 0.95]))
    holes = draw(st.sampled_from([0.0, 0.0, 0.3]))
    seed = draw(st.integers(0, 2**32 - 1))
    idx = routing(np.random.default_rng(seed), num_tokens, top_k, num_experts, skew, holes)
    rank = draw(st.integers(0, topo.num_ranks - 1))
    workers = draw(st.integers(1, 64))
    return topo, rank, num_experts, idx, workers
