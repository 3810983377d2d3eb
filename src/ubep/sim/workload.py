"""Routings the simulator runs: uniform, or uniform with a few hot experts.

Deterministic for a seed; one `[num_ranks, tokens_per_rank, top_k]` int64 array for all
ranks at once, drawn with numpy (the torch generators of `ubep.testing` are per rank and
too slow at 256 ranks).
"""

from __future__ import annotations

import numpy as np

ROUTINGS = ("uniform", "hot")
HOT_WEIGHT = 16.0   # default: a hot expert is this many times likelier to be picked


def make_topk(num_ranks: int, tokens_per_rank: int, top_k: int, num_experts: int, *,
              routing: str = "uniform", hot_experts: int = 0, hot_weight: float = HOT_WEIGHT,
              seed: int = 0) -> np.ndarray:
    """`topk_idx` of every rank, `[num_ranks, tokens_per_rank, top_k]` int64.

    Each token picks `top_k` distinct experts. "uniform": every expert alike. "hot" (or
    `hot_experts > 0`): `hot_experts` experts drawn at random (`hot_expert_ids`) are
    `hot_weight` times likelier (weighted sampling without replacement, Efraimidis-Spirakis
    keys). Expert e lives on rank e // (num_experts // num_ranks).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r} is not one of {ROUTINGS}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if not 0 <= hot_experts <= num_experts:
        raise ValueError(f"hot_experts={hot_experts} must be in [0, num_experts={num_experts}]")
    rng = np.random.default_rng(seed)
    n = num_ranks * tokens_per_rank
    if routing == "hot" or hot_experts > 0:
        hot = rng.choice(num_experts, size=hot_experts, replace=False)
        w = np.ones(num_experts)
        w[hot] = hot_weight
        keys = np.log(rng.random((n, num_experts))) / w   # larger is likelier
        idx = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
    else:
        idx = _distinct_uniform(rng, n, top_k, num_experts)
    return idx.astype(np.int64).reshape(num_ranks, tokens_per_rank, top_k)


def _distinct_uniform(rng: np.random.Generator, n: int, k: int, e: int) -> np.ndarray:
    """`n` rows of `k` distinct uniform draws from `range(e)` (redraw rows with repeats)."""
    if 2 * k > e:   # dense: permutation keys are cheap enough
        return np.argpartition(rng.random((n, e)), k - 1, axis=1)[:, :k]
    idx = rng.integers(0, e, size=(n, k))
    while True:
        s = np.sort(idx, axis=1)
        bad = np.nonzero((s[:, 1:] == s[:, :-1]).any(axis=1))[0]
        if bad.size == 0:
            return idx
        idx[bad] = rng.integers(0, e, size=(bad.size, k))


def hot_expert_ids(num_experts: int, hot_experts: int, seed: int = 0) -> np.ndarray:
    """The experts `make_topk` makes hot for this seed (its first draw), sorted."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_experts, size=hot_experts, replace=False))


def ingress_rows(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """`[num_ranks]` rows each rank receives (expert e lives on rank e // experts per rank)."""
    P = topk.shape[0]
    return np.bincount((topk // (num_experts // P)).ravel(), minlength=P)


def make_group_limited_topk(num_ranks: int, tokens_per_rank: int, top_k: int,
                            num_experts: int, *, groups: int, groups_per_token: int,
                            seed: int = 0) -> np.ndarray:
    """`[num_ranks, tokens_per_rank, top_k]` int64 routing limited to a few expert groups
    per token (DeepSeek-V3's node-limited routing, as DeepEP's internode test draws it):
    uniform random scores; the experts split into `groups` equal groups (one per host);
    each token keeps the `groups_per_token` groups of its highest scores and picks its
    `top_k` best experts among theirs."""
    if num_experts % groups:
        raise ValueError(f"num_experts={num_experts} must be a multiple of groups={groups}")
    if not 1 <= groups_per_token <= groups:
        raise ValueError(f"groups_per_token={groups_per_token} must be in [1, groups={groups}]")
    if top_k > groups_per_token * (num_experts // groups):
        raise ValueError(f"top_k={top_k} must be <= the experts of {groups_per_token} groups")
    rng = np.random.default_rng(seed)
    out = np.empty((num_ranks, tokens_per_rank, top_k), dtype=np.int64)
    for r in range(num_ranks):          # one rank at a time: [tokens, experts] scores
        scores = rng.random((tokens_per_rank, num_experts))
        best = scores.reshape(tokens_per_rank, groups, -1).max(axis=2)
        keep = np.argpartition(-best, groups_per_token - 1, axis=1)[:, :groups_per_token]
        mask = np.zeros((tokens_per_rank, groups), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        scores = np.where(np.repeat(mask, num_experts // groups, axis=1), scores, -1.0)
        out[r] = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    return out
