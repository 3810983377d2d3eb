"""How good the schedules are: the paper's min-max objective, its exact optimum on small
instances, and planning speed.

Objective (docs/design.md §2.2): a token worker's cost is the sum of its send times plus the
largest round trip among its sends; a schedule's cost is its most loaded worker's. Here a
send of hop class h takes `latency_h + row_bytes / bandwidth_h` (a worker issues its stores
one after another and each costs about its access latency: the paper's "two-hop stores cost
up to 11.5x a local store") and its round trip is `2 * latency_h`.

Sends of one hop class cost the same, so an assignment is fully described by how many
sends of each class each worker gets; the exact optimum enumerates every such split (the
compositions of each class's count into n parts), vectorized with numpy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cache
from itertools import combinations

import numpy as np

from ubep.plan.planner import make_plan
from ubep.plan.schedule import SCHEDULES
from ubep.plan.topology import Topology


def hop_costs(topo: Topology, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """`(send_ns [H], rtt_ns [H])` per hop class."""
    h = range(topo.num_hop_classes)
    lat = np.array([topo.hop_latency_ns(i) for i in h])
    bw = np.array([topo.hop_bandwidth_GBps(i) for i in h])
    return lat + row_bytes / bw, 2 * lat


def objective(counts: np.ndarray, send_ns: np.ndarray, rtt_ns: np.ndarray) -> float:
    """Cost of an assignment given as `[workers, H]` send counts per worker and hop class."""
    counts = np.asarray(counts)
    busy = counts @ send_ns + np.max(np.where(counts > 0, rtt_ns, 0.0), axis=1, initial=0.0)
    return float(busy.max(initial=0.0))


@cache
def compositions(total: int, parts: int) -> np.ndarray:
    """Every way to write `total` as an ordered sum of `parts` non-negative ints: `[m, parts]`."""
    rows = []
    for bars in combinations(range(total + parts - 1), parts - 1):
        edges = (-1,) + bars + (total + parts - 1,)
        rows.append([edges[i + 1] - edges[i] - 1 for i in range(parts)])
    return np.array(rows, dtype=np.int64).reshape(-1, parts)


def exact_optimum(per_class: np.ndarray, workers: int, send_ns: np.ndarray,
                  rtt_ns: np.ndarray) -> float:
    """The least objective over all splits of `per_class[h]` sends among `workers` workers."""
    busy = np.zeros((1, workers))
    worst_rtt = np.zeros((1, workers))
    for h, v in enumerate(per_class):
        if v == 0:
            continue
        comp = compositions(int(v), workers)                              # [m, n]
        busy = (busy[:, None, :] + comp[None] * send_ns[h]).reshape(-1, workers)
        worst_rtt = np.maximum(worst_rtt[:, None, :],
                               np.where(comp > 0, rtt_ns[h], 0.0)[None]).reshape(-1, workers)
    return float((busy + worst_rtt).max(axis=1).min())


def lower_bound(per_class: np.ndarray, workers: int, send_ns: np.ndarray,
                rtt_ns: np.ndarray) -> float:
    """A bound no schedule beats: the average load plus the nearest round trip, and the
    single most expensive send with its own round trip."""
    present = per_class > 0
    if not present.any():
        return 0.0
    avg = float(per_class @ send_ns) / workers + float(rtt_ns[present].min())
    one = float((send_ns + rtt_ns)[present].max())
    return max(avg, one)


@dataclass(frozen=True)
class QualityRow:
    """Ratios of one schedule's objective to the reference (exact optimum or lower bound)."""

    schedule: str
    mean: float
    p95: float
    worst: float
    share_optimal: float


def _routing(rng: np.random.Generator, tokens: int, top_k: int, experts: int,
             skew: float) -> np.ndarray:
    weights = np.exp(-skew * 8 * np.arange(experts) / max(experts - 1, 1))
    weights = weights[rng.permutation(experts)] / weights.sum()
    return np.stack([rng.choice(experts, size=top_k, replace=False, p=weights)
                     for _ in range(tokens)]).reshape(tokens, top_k)


def small_instance_study(num_instances: int = 300, seed: int = 0, row_bytes: int = 7168,
                         topology: Topology | None = None) -> tuple[list[QualityRow], dict]:
    """Ratio of each schedule to the exact optimum on random instances of <= 12 sends and
    2-4 workers (cm384 layout, 32 ranks, one expert per rank, uniform to skewed routing)."""
    topo = topology or Topology.preset("cm384", ranks=32)
    send_ns, rtt_ns = hop_costs(topo, row_bytes)
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    sizes = []
    for _ in range(num_instances):
        top_k = int(rng.integers(1, 4))
        tokens = int(rng.integers(1, 12 // top_k + 1))
        idx = _routing(rng, tokens, top_k, topo.num_ranks, float(rng.choice([0.0, 0.5, 0.9])))
        workers = int(rng.integers(2, 5))
        rank = int(rng.integers(topo.num_ranks))
        plans = {s: make_plan(idx, topology=topo, rank=rank, num_experts=topo.num_ranks,
                              workers=workers, schedule=s, mode="bsp") for s in SCHEDULES}
        per_class = np.bincount(plans["balanced"].hops, minlength=topo.num_hop_classes)
        best = exact_optimum(per_class, workers, send_ns, rtt_ns)
        sizes.append(int(per_class.sum()))
        for s, p in plans.items():
            ratios[s].append(objective(p.hop_counts(), send_ns, rtt_ns) / best)
    rows = [_row(s, np.array(r)) for s, r in ratios.items()]
    return rows, {"instances": num_instances, "sends_min": min(sizes), "sends_max": max(sizes),
                  "topology": topo.name, "ranks": topo.num_ranks, "row_bytes": row_bytes}


def paper_scale_study(num_instances: int = 50, seed: int = 0, row_bytes: int = 7168,
                      ranks: int = 256, tokens: int = 128, top_k: int = 8,
                      workers: int = 48) -> tuple[list[QualityRow], dict]:
    """Ratio of each schedule to `lower_bound` at the paper's scale (exact is out of reach)."""
    topo = Topology.preset("cm384", ranks=ranks)
    send_ns, rtt_ns = hop_costs(topo, row_bytes)
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    token_workers = 0
    for i in range(num_instances):
        skew = (0.0, 0.5, 0.9)[i % 3]
        idx = _routing(rng, tokens, top_k, ranks, skew)
        rank = int(rng.integers(ranks))
        for s in SCHEDULES:
            p = make_plan(idx, topology=topo, rank=rank, num_experts=ranks, workers=workers,
                          schedule=s)
            token_workers = p.token_workers
            per_class = np.bincount(p.hops, minlength=topo.num_hop_classes)
            bound = lower_bound(per_class, p.token_workers, send_ns, rtt_ns)
            ratios[s].append(objective(p.hop_counts(), send_ns, rtt_ns) / bound)
    rows = [_row(s, np.array(r)) for s, r in ratios.items()]
    return rows, {"instances": num_instances, "ranks": ranks, "tokens": tokens, "top_k": top_k,
                  "workers": workers, "token_workers": token_workers, "row_bytes": row_bytes}


def _row(schedule: str, r: np.ndarray) -> QualityRow:
    return QualityRow(schedule, float(r.mean()), float(np.percentile(r, 95)), float(r.max()),
                      float(np.mean(r <= 1 + 1e-9)))


def planning_times(repeats: int = 7, number: int = 200) -> list[dict]:
    """Per-call planning time (best of `repeats`, thread CPU time and wall) per case."""
    topo = Topology.preset("cm384", ranks=256)
    rng = np.random.default_rng(0)
    out = []
    for tokens, workers in ((128, 48), (16, 8), (2, 4)):
        idx = _routing(rng, tokens, 8, 256, 0.0)
        for engine in ("numba", "numpy"):
            for s in SCHEDULES:
                def call(idx=idx, workers=workers, engine=engine, s=s):
                    return make_plan(idx, topology=topo, rank=3, num_experts=256,
                                     workers=workers, schedule=s, engine=engine)
                call()
                best = {"cpu": math.inf, "wall": math.inf}
                for clock, fn in (("cpu", time.thread_time), ("wall", time.perf_counter)):
                    for _ in range(repeats):
                        t0 = fn()
                        for _ in range(number):
                            call()
                        best[clock] = min(best[clock], (fn() - t0) / number)
                out.append({"tokens": tokens, "top_k": 8, "experts": 256, "workers": workers,
                            "engine": engine, "schedule": s, "cpu_us": best["cpu"] * 1e6,
                            "wall_us": best["wall"] * 1e6})
    return out
