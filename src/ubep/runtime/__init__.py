"""Executors that run dispatch/combine for real, selected by `Buffer(backend=...)`.

Each backend module registers a factory here. A backend is built once per Buffer with the
checked `BufferConfig` and the process group, and receives already-validated tensors:
`x` contiguous, `topk_idx` int64, `topk_weights` float32.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import numpy as np
import torch

from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.options import BufferConfig


class Backend(Protocol):
    """Everything `Buffer` calls on a backend. `close()` must be idempotent.

    A backend class may subclass this protocol to take the defaults below for what it does
    not offer (no door, nothing to resume, no combine buffer, always in step).
    """

    #: False once a call failed after the peers were told of it: a `ValueError` or
    #: `TypeError` raised then leaves the ranks out of step (`Buffer` marks itself broken).
    #: True while every error is raised before anything moved.
    in_step: bool = True
    #: `ubep_native`'s two entries (dispatch, combine) that take `door`'s tuple, when `door`
    #: returns one
    DOOR_ENTRIES: tuple[str, str] = ("", "")
    #: what `Buffer` calls around its door's calls, for a backend that keeps books on its
    #: dispatches (None: nothing): `(dispatched(result), failed(error) -> the error to
    #: raise)`
    door_hooks: tuple | None = None

    #: elastic (`Buffer(elastic=True)`): this rank's `ubep.elastic.Membership`; None where
    #: the backend has no elastic mode or the Buffer is not elastic
    membership: object = None
    #: the backend's shared membership word and the bits of it applied (Buffer compares
    #: them before each call), or None where membership changes inside calls only
    membership_word: tuple | None = None

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult: ...

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool, out: torch.Tensor | None = None) -> CombineResult:
        """`out`: where y goes (checked by `Buffer`); a backend sums straight into it
        where it can, and returns it as `y`."""

    def door(self, lock, limits: tuple[int, int, int, int],
             buffer_words: np.ndarray) -> tuple | None:
        """What `ubep.native`'s door reads to take a `Buffer`'s common call whole (the
        `DOOR_ENTRIES` functions), with `lock` the Buffer's, `limits` its fast checks'
        (hidden, num_experts, max_tokens_per_rank, max_top_k) and `buffer_words` the state
        it shares with its door (`ubep.native.layout`'s BW_* words); None: no door, every
        call goes through `dispatch` and `combine`."""
        return None

    def resume(self, which: str, *args) -> DispatchResult | CombineResult:
        """A door's call that must wait, on in Python from where the compiled entry stopped
        (`which`: the path's `dispatch_resume` or `combine_resume`, `args` as it passes
        them)."""
        raise NotImplementedError(f"{type(self).__name__} has no door calls to resume")

    def combine_buffer(self, handle: DispatchHandle, dtype: torch.dtype | None) -> torch.Tensor:
        """Where to write `handle`'s expert outputs so combine copies nothing
        (`Buffer.get_combine_buffer`, `direct` only)."""
        raise ValueError(f"{type(self).__name__} has no combine buffer (direct only)")

    def sync_membership(self) -> None:
        """Elastic: take in the ranks another rank found dead (the membership word moved)."""

    def set_active_ranks(self, mask) -> None:
        """Elastic: remove the ranks `mask` drops (`Buffer.set_active_ranks`)."""
        raise ValueError(f"{type(self).__name__} is not elastic: set_active_ranks needs "
                         f"Buffer(elastic=True) on a backend that offers it")

    def close(self) -> None: ...


#: backend name -> "module:factory"; a factory takes (config, group, buffer_id).
_BACKENDS: dict[str, str] = {
    "torch": "ubep.runtime.torch_backend:TorchBackend",
    "shm": "ubep.runtime.shm.backend:ShmBackend",
    "hybrid": "ubep.runtime.hybrid:HybridBackend",
}


def backend_names() -> tuple[str, ...]:
    """The `Buffer(backend=...)` names this build can make."""
    return tuple(_BACKENDS)


def make_backend(config: BufferConfig, group, buffer_id: int) -> Backend:
    """Build the backend `config.backend` names; NotImplementedError if it is not built yet."""
    target = _BACKENDS.get(config.backend)
    if target is None:
        raise NotImplementedError(f"backend {config.backend!r} is not built yet")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(config, group, buffer_id)
