"""The oracle: dispatch and combine for all ranks at once, in one process, in plain torch.

Written for clarity, not speed. It defines what every executor must produce:

* dispatch on rank r returns the rows routed to r's experts, expert-major: local expert 0
  first; within an expert ordered by source rank, then source token index. A token routed to
  two experts of one rank appears once per expert. Rows are moved, not computed, so every
  executor must match bit for bit.
* combine on source rank s returns, for each token t, the fp32 sum over t's routed slots k
  (in slot order) of `w[t, k] * row(t, k)` (`weighted=False`: of `row(t, k)`), cast to the
  dtype of the expert output. Tokens with no routed slot get zeros. The shm backend matches
  this bit for bit.
* `combine_partials` is the contract of a combine that sums where the experts are first: per
  (token, group of ranks) a partial sum, rounded, then the partials summed at the source.
  The torch backend follows it with a group per rank; a multi-host one with a group per host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: the output dtypes partial sums travel in; partials of any other output (8-bit) are fp32
PARTIAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ReferenceDispatch:
    """What rank `rank` receives: the fields of `ubep.DispatchResult`, plus the slot."""

    recv_x: torch.Tensor            # [N, hidden], dtype of x
    recv_weights: torch.Tensor      # [N] float32
    tokens_per_expert: torch.Tensor  # [E / P] int64
    recv_src_rank: torch.Tensor     # [N] int64
    recv_src_token: torch.Tensor    # [N] int64
    recv_src_slot: torch.Tensor     # [N] int64, the top-k slot k of (token, expert)


def dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor],
             topk_weights: list[torch.Tensor], num_experts: int) -> list[ReferenceDispatch]:
    """Dispatch for every rank at once. `xs[s]` is `[T_s, hidden]`, `topk_idxs[s]` `[T_s, K]`."""
    world = len(xs)
    per_rank = num_experts // world
    out = []
    for r in range(world):
        rows, weights, src_rank, src_token, src_slot = [], [], [], [], []
        counts = torch.zeros(per_rank, dtype=torch.int64)
        for local in range(per_rank):
            expert = r * per_rank + local
            for s in range(world):
                # nonzero() walks row-major: ascending token index, one slot per token
                t, k = (topk_idxs[s].to(torch.int64) == expert).nonzero(as_tuple=True)
                rows.append(xs[s][t])
                weights.append(topk_weights[s][t, k].to(torch.float32))
                src_rank.append(torch.full_like(t, s))
                src_token.append(t)
                src_slot.append(k)
                counts[local] += t.numel()
        hidden, dtype = xs[r].shape[1], xs[r].dtype
        def cat(ts, dt):
            return (torch.cat(ts) if ts else torch.empty(0, dtype=dt))
        out.append(ReferenceDispatch(
            recv_x=torch.cat(rows) if rows else torch.empty(0, hidden, dtype=dtype),
            recv_weights=cat(weights, torch.float32),
            tokens_per_expert=counts,
            recv_src_rank=cat(src_rank, torch.int64),
            recv_src_token=cat(src_token, torch.int64),
            recv_src_slot=cat(src_slot, torch.int64),
        ))
    return out


def _landed(dispatched: list[ReferenceDispatch]) -> dict[tuple[int, int, int], tuple[int, int]]:
    """Where each (source rank, token, slot) row landed: (destination rank, row index)."""
    landed = {}
    for r, d in enumerate(dispatched):
        keys = zip(d.recv_src_rank.tolist(), d.recv_src_token.tolist(), d.recv_src_slot.tolist())
        for i, key in enumerate(keys):
            landed[key] = (r, i)
    return landed


def combine(expert_outs: list[torch.Tensor], dispatched: list[ReferenceDispatch],
            topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
            weighted: bool = True) -> list[torch.Tensor]:
    """Combine for every rank at once.

    `expert_outs[r]` is `[N_r, hidden]`, row i being the expert output for
    `dispatched[r]`'s row i. Returns `y[s]` `[T_s, hidden]` in `expert_outs`' dtype.
    """
    world = len(expert_outs)
    hidden = expert_outs[0].shape[1]
    dtype = expert_outs[0].dtype
    landed = _landed(dispatched)
    ys = []
    for s in range(world):
        idx = topk_idxs[s].to(torch.int64).tolist()
        w = topk_weights[s].to(torch.float32)
        y = torch.zeros(len(idx), hidden, dtype=torch.float32)
        for t, experts in enumerate(idx):
            acc = torch.zeros(hidden, dtype=torch.float32)
            for k, expert in enumerate(experts):
                if expert < 0:
                    continue
                r, i = landed[(s, t, k)]
                row = expert_outs[r][i].to(torch.float32)
                acc = acc + (w[t, k] * row if weighted else row)
            y[t] = acc
        ys.append(y.to(dtype))
    return ys


def combine_partials(expert_outs: list[torch.Tensor], dispatched: list[ReferenceDispatch],
                     topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
                     weighted: bool = True, *, group_of_rank: Sequence[int] | None = None,
                     partial_dtype: torch.dtype | None = None,
                     bf16_ties_away: bool = False) -> list[torch.Tensor]:
    """Combine for every rank at once, summed per group of ranks first; arguments and result
    as `combine`'s.

    For each token t and each group g holding some of t's routed slots (`group_of_rank[r]`
    for the rank r its row landed on; None: every rank its own group): the partial, the fp32
    sum over those slots, in slot order, of `w[t, k] * row(t, k)`, rounded once to
    `partial_dtype` (to nearest even); then `y[t]` = the fp32 sum of t's partials in
    ascending group order, from 0.0, rounded once to the output dtype (`Tensor.to`; with
    `bf16_ties_away` a bf16 output rounds to nearest with ties away from zero, as torch's
    `embedding_bag` rounds its sums on CPU). `partial_dtype` None: the output dtype if it is
    one of `PARTIAL_DTYPES`, else fp32. A token with no routed slot gets zeros.

    One group holding all of a token's slots gives `combine`'s bits for it.
    """
    world = len(expert_outs)
    groups = list(range(world)) if group_of_rank is None else list(group_of_rank)
    if len(groups) != world:
        raise ValueError(f"group_of_rank has {len(groups)} entries for {world} ranks")
    hidden = expert_outs[0].shape[1]
    dtype = expert_outs[0].dtype
    if partial_dtype is None:
        partial_dtype = dtype if dtype in PARTIAL_DTYPES else torch.float32
    landed = _landed(dispatched)
    ys = []
    for s in range(world):
        idx = topk_idxs[s].to(torch.int64).tolist()
        w = topk_weights[s].to(torch.float32)
        y = torch.zeros(len(idx), hidden, dtype=torch.float32)
        for t, experts in enumerate(idx):
            partials: dict[int, torch.Tensor] = {}
            for k, expert in enumerate(experts):
                if expert < 0:
                    continue
                r, i = landed[(s, t, k)]
                row = expert_outs[r][i].to(torch.float32)
                acc = partials.get(groups[r], torch.zeros(hidden, dtype=torch.float32))
                partials[groups[r]] = acc + (w[t, k] * row if weighted else row)
            acc = torch.zeros(hidden, dtype=torch.float32)
            for g in sorted(partials):
                acc = acc + partials[g].to(partial_dtype).to(torch.float32)
            y[t] = acc
        if dtype == torch.bfloat16 and bf16_ties_away:
            ys.append(_bf16_ties_away(y))
        else:
            ys.append(y.to(dtype))
    return ys


def _bf16_ties_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to bf16: to nearest, ties away from zero (NaN stays NaN)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = (((bits + 0x8000) >> 16) & 0xFFFF).to(torch.int32)
    out = torch.where(x.isnan(), torch.full_like(out, 0x7FC0), out)
    return out.to(torch.int16).view(torch.bfloat16)


def masked_routing(topk_idxs: list[torch.Tensor], active: torch.Tensor,
                   num_experts: int) -> list[torch.Tensor]:
    """What an elastic Buffer (`Buffer(elastic=True)`) delivers, as a routing for the oracle:
    every slot on an inactive rank's experts is -1, and an inactive rank sends nothing (all
    its slots -1). `active` is `[world]` bool."""
    per_rank = num_experts // len(topk_idxs)
    off = ~active.to(torch.bool).repeat_interleave(per_rank)
    out = []
    for s, idx in enumerate(topk_idxs):
        idx = idx.to(torch.int64)
        dead = (idx >= 0) & (off[idx.clamp(min=0)] | (not bool(active[s])))
        out.append(idx.masked_fill(dead, -1))
    return out
