"""`UbepAll2AllManager`: vLLM's all2all manager for the EP group, one `ubep.Buffer` per shape."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

import ubep

#: extra `ubep.Buffer` arguments as a JSON object, e.g. '{"backend": "torch", "workers": 1}'
BUFFER_KWARGS_ENV = "UBEP_VLLM_BUFFER"

#: vLLM's ranks can be out of step for long stretches (one compiling, one prefilling), so a
#: Buffer's waits get more slack here than ubep's default
DEFAULT_TIMEOUT_S = 600.0

logger = logging.getLogger(__name__)


class UbepAll2AllManager(All2AllManagerBase):
    """All2all through ubep for one EP group (cf. vLLM's DeepEP managers).

    `get_handle(kwargs)` returns the `ubep.Buffer` for one layer shape, made on first use
    (a collective: every EP rank builds its layers in the same order) and cached. Buffers
    run on the EP group's CPU (gloo) process group with `backend="auto"`: on one host the
    one-copy shm path with results the caller owns (`direct="owned"`, or `"torch"` where
    `/dev/shm` has no room), across hosts `"hybrid"` (shared memory inside each host, each
    token over the network once per host); the choice is logged. `UBEP_VLLM_BUFFER` (a JSON
    object) overrides any `ubep.Buffer` argument. Tokens move
    inside the MoE modular kernel (`UbepPrepareAndFinalize`), so the manager's own
    gather-style `dispatch`/`combine` (used only by MoE methods without a modular kernel) are
    not provided.
    """

    def __init__(self, cpu_group, tcp_store_group=None):
        super().__init__(cpu_group, tcp_store_group)
        self._buffers: dict[tuple, ubep.Buffer] = {}
        self._lock = threading.Lock()

    def buffer_kwargs(self) -> dict[str, Any]:
        """The `ubep.Buffer` arguments every layer shape shares (defaults, then the env)."""
        kwargs: dict[str, Any] = {"backend": "auto", "timeout_s": DEFAULT_TIMEOUT_S}
        raw = os.environ.get(BUFFER_KWARGS_ENV)
        if raw:
            try:
                extra = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{BUFFER_KWARGS_ENV}={raw!r} must be a JSON object of "
                                 f"ubep.Buffer arguments: {e}") from e
            if not isinstance(extra, dict):
                raise ValueError(f"{BUFFER_KWARGS_ENV}={raw!r} must be a JSON object")
            kwargs.update(extra)
        return kwargs

    def get_handle(self, kwargs: dict[str, Any]) -> ubep.Buffer:
        """The Buffer for one layer shape.

        Arguments (keys of `kwargs`): `max_num_tokens_per_dp_rank`, `token_hidden_size`,
        `num_ep_ranks`, `num_global_experts`, `max_top_k`.
        """
        key = (int(kwargs["max_num_tokens_per_dp_rank"]), int(kwargs["token_hidden_size"]),
               int(kwargs["num_ep_ranks"]), int(kwargs["num_global_experts"]),
               int(kwargs["max_top_k"]))
        max_tokens, hidden, num_ranks, num_experts, top_k = key
        if num_ranks != self.world_size:
            raise ValueError(f"num_ep_ranks={num_ranks} but this EP group has "
                             f"{self.world_size} ranks")
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.closed:
                buf = ubep.Buffer(self.cpu_group, num_experts=num_experts, hidden=hidden,
                                  max_tokens_per_rank=max_tokens, max_top_k=top_k,
                                  **self.buffer_kwargs())
                self._buffers[key] = buf
                logger.info("ubep Buffer %s: backend %s (%s)", key, buf.config.backend,
                            buf.config.backend_reason)
            return buf

    def dispatch_router_logits(self, *args, **kwargs):
        raise NotImplementedError(
            "all2all_backend='ubep' moves tokens inside the MoE modular kernel "
            "(UbepPrepareAndFinalize); this MoE method has no modular kernel")

    def dispatch(self, *args, **kwargs):
        raise NotImplementedError(
            "all2all_backend='ubep' moves tokens inside the MoE modular kernel "
            "(UbepPrepareAndFinalize); this MoE method has no modular kernel")

    def combine(self, *args, **kwargs):
        raise NotImplementedError(
            "all2all_backend='ubep' moves tokens inside the MoE modular kernel "
            "(UbepPrepareAndFinalize); this MoE method has no modular kernel")

    def destroy(self) -> None:
        """Close every cached Buffer (shared memory, worker threads). Idempotent."""
        with self._lock:
            buffers, self._buffers = list(self._buffers.values()), {}
        for buf in buffers:
            buf.close()
