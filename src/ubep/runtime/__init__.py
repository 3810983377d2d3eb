"""Executors that run dispatch/combine for real, selected by `Buffer(backend=...)`.

Each backend module registers a factory here. A backend is built once per Buffer with the
checked `BufferConfig` and the process group, and receives already-validated tensors:
`x` contiguous, `topk_idx` int64, `topk_weights` float32.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.options import BufferConfig


class Backend(Protocol):
    """What `Buffer` calls. `close()` must be idempotent."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult: ...

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool, out: torch.Tensor | None = None) -> CombineResult:
        """`out`: where y goes (checked by `Buffer`); a backend sums straight into it
        where it can, and returns it as `y`."""

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
