"""What dispatch returns: `DispatchResult` and the `DispatchHandle` that combine needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
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

    def __getattr__(self, name: str):
        """Row origins left as numpy by `new_handle` become tensors on first read; `masked`
        is all False until an elastic Buffer sets it."""
        return _made_on_read(self, name, _from_origins)


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
        recv_x_scales: `[N, S]` float32, the scales of `recv_x`'s rows when `x` was a tuple
            `(x, x_scales)`; else None.
        masked: `[T, K]` bool; True where slot (t, k) was not delivered because its expert's
            rank is inactive (`Buffer(elastic=True)`: dead, or removed by `set_active_ranks`);
            all False when nothing was masked (and always without elastic). `-1` slots are
            False. Combine does not sum masked slots.
    """

    recv_x: torch.Tensor
    recv_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_token: torch.Tensor
    recv_src_slot: torch.Tensor
    handle: DispatchHandle
    stats: Stats | None = None
    recv_x_scales: torch.Tensor | None = None

    def __getattr__(self, name: str):
        """`recv_weights`, `tokens_per_expert` and the row origins left out by
        `new_dispatch_result` are made on first read (the origins are the handle's tensors,
        as with the constructor)."""
        return _made_on_read(self, name, _from_weights_or_handle)


@dataclass(frozen=True, eq=False)
class CombineResult:
    """What a backend's combine returns to `Buffer.combine` (which hands users `y` alone)."""

    y: torch.Tensor                 # [T, hidden], dtype of expert_out
    stats: Stats | None = None


# -- fast constructors for hot paths -------------------------------------------------------------
# A frozen dataclass's __init__ sets each field through object.__setattr__ (~0.3 µs a field on a
# slow host) and each tensor made from numpy costs ~1.5 µs. These fill the instance dict
# directly (the objects stay frozen to their users) and leave the fields users rarely read
# (row origins, per-row weights) as numpy arrays, made into tensors sharing that memory on
# first read. Nothing else changes: same attributes, same values, same memory. `ubep.native`'s
# direct entries make these objects the same way, by these field names (`native/direct.cpp`,
# `Results`; tests/test_native.py compares the two makers).
_new = object.__new__
_ORIGIN_ROWS = {"recv_src_rank": 0, "recv_src_token": 1, "recv_src_slot": 2}


def _made_on_read(obj: object, name: str, make) -> Any:
    """`make(instance dict, name)` stored as field `name`; AttributeError if it has none."""
    d = obj.__dict__
    value = make(d, name)
    if value is None:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    d[name] = value
    return value


def _no_mask(d: dict) -> torch.Tensor:
    """`masked` where nothing was masked: all False, the routing's shape."""
    idx = d["handle"].topk_idx if "handle" in d else d["topk_idx"]
    return torch.zeros(idx.shape, dtype=torch.bool)


def _from_origins(d: dict, name: str) -> torch.Tensor | None:
    if name == "masked":
        return _no_mask(d)
    row = _ORIGIN_ROWS.get(name)
    origins = d.get("_origins")
    return None if row is None or origins is None else torch.from_numpy(origins[row])


def _from_weights_or_handle(d: dict, name: str) -> torch.Tensor | None:
    if name == "masked":
        return _no_mask(d)
    if name == "recv_weights" and "_weights" in d:
        return torch.from_numpy(d["_weights"])
    if name == "tokens_per_expert" and "_tpe" in d:
        return torch.from_numpy(d["_tpe"])
    if name in _ORIGIN_ROWS and "handle" in d:
        return getattr(d["handle"], name)
    return None


def new_handle(buffer_id: int, call: int, num_tokens: int, num_recv: int, hidden: int,
               topk_idx: torch.Tensor, topk_weights: torch.Tensor, origins: np.ndarray,
               state: Any) -> DispatchHandle:
    """A `DispatchHandle` whose `recv_src_rank/token/slot` are the rows of `origins` (`[3, N]`
    int64 numpy), made into tensors on first read."""
    h = _new(DispatchHandle)
    h.__dict__.update(buffer_id=buffer_id, call=call, num_tokens=num_tokens, num_recv=num_recv,
                      hidden=hidden, topk_idx=topk_idx, topk_weights=topk_weights,
                      _origins=origins, state=state)
    return h


def new_dispatch_result(recv_x: torch.Tensor, recv_weights: np.ndarray,
                        tokens_per_expert: torch.Tensor | np.ndarray, handle: DispatchHandle,
                        stats: Stats | None) -> DispatchResult:
    """A `DispatchResult` whose `recv_weights` (float32 numpy here), row origins (the
    handle's) and `tokens_per_expert` when given as int64 numpy are made into tensors on
    first read."""
    r = _new(DispatchResult)
    if type(tokens_per_expert) is np.ndarray:
        r.__dict__.update(recv_x=recv_x, _weights=recv_weights, _tpe=tokens_per_expert,
                          handle=handle, stats=stats)
    else:
        r.__dict__.update(recv_x=recv_x, _weights=recv_weights,
                          tokens_per_expert=tokens_per_expert, handle=handle, stats=stats)
    return r


def new_combine_result(y: torch.Tensor, stats: Stats | None) -> CombineResult:
    """`CombineResult(y=y, stats=stats)` without the per-field setattr."""
    r = _new(CombineResult)
    r.__dict__.update(y=y, stats=stats)
    return r


def rerouted(handle: DispatchHandle, topk_idx: torch.Tensor, state: Any) -> DispatchHandle:
    """A copy of `handle` whose combine uses routing `topk_idx` and backend state `state`
    (an elastic Buffer's: the routing without inactive ranks' slots); same row origins."""
    h = _new(DispatchHandle)
    h.__dict__.update(handle.__dict__)
    h.__dict__.update(topk_idx=topk_idx, state=state)
    h.__dict__.pop("masked", None)
    return h
