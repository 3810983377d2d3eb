"""What dispatch returns: `DispatchResult` and the `DispatchHandle` that combine needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ubep.stats import Stats


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """Opaque to users: how to send the expert outputs of one dispatch back.

    Holds the source side's routing (to weight and sum) and the receive side's row origins.
    `state` is private to the backend that made it. A handle is valid for the Buffer that
    made it; the shm backend also requires it to come from that Buffer's latest dispatch.
    """

    buffer_id: int
    call: int                       # the dispatch's sequence number on this Buffer
    num_tokens: int                 # T on this rank
    num_recv: int                   # N rows received on this rank
    hidden: int
    topk_idx: torch.Tensor          # [T, K] int64, this rank's routing
    topk_weights: torch.Tensor      # [T, K] float32
    recv_src_rank: torch.Tensor     # [N] int64
    recv_src_token: torch.Tensor    # [N] int64
    recv_src_slot: torch.Tensor     # [N] int64
    state: Any = field(default=None, repr=False)


@dataclass(frozen=True, eq=False)
class DispatchResult:
    """The rows this rank's experts must process, expert-major.

    Attributes:
        recv_x: `[N, hidden]`, dtype of `x`; local expert 0's rows first, then expert 1's ...;
            within an expert ordered by source rank, then source token index.
        recv_weights: `[N]`, float32; the gating weight of each row's (token, expert).
        tokens_per_expert: `[num_experts // world]`, int64; rows per local expert (sums to N),
            ready for a grouped GEMM.
        recv_src_rank: `[N]`, int64; the rank the row came from.
        recv_src_token: `[N]`, int64; the row's token index on its source rank.
        recv_src_slot: `[N]`, int64; the top-k slot of (token, expert) on its source rank.
        handle: pass to `Buffer.combine` to send the expert outputs back.
        stats: `ubep.Stats` with per-phase times and per-worker intervals, or None.
    """

    recv_x: torch.Tensor
    recv_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_token: torch.Tensor
    recv_src_slot: torch.Tensor
    handle: DispatchHandle
    stats: Stats | None = None


@dataclass(frozen=True, eq=False)
class CombineResult:
    """What a backend's combine returns to `Buffer.combine` (which hands users `y` alone)."""

    y: torch.Tensor                 # [T, hidden], dtype of expert_out
    stats: Stats | None = None
