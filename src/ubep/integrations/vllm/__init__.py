"""ubep as vLLM's expert-parallel all2all backend (an out-of-tree `vllm.general_plugins` plugin).

With ubep installed next to vLLM, `all2all_backend="ubep"` (`--all2all-backend ubep`) makes
every MoE layer of a data-parallel + expert-parallel deployment move its tokens through one
`ubep.Buffer` per layer shape:

* `UbepAll2AllManager` (`manager.py`): vLLM's `All2AllManagerBase` for the EP group; caches a
  Buffer per (max tokens per DP rank, hidden, EP size, global experts, top-k), `destroy()`
  closes them.
* `UbepPrepareAndFinalize` (`prepare_finalize.py`): vLLM's modular-kernel
  `FusedMoEPrepareAndFinalizeModular`; `prepare()` dispatches, `finalize()` combines into
  vLLM's output tensor.
* `register()` (the entry point; `patch.py`): admits "ubep" in vLLM's closed list of
  all2all backends, makes the CPU communicator build the ubep manager instead of its
  allgather/reduce-scatter fallback, and routes vLLM's prepare/finalize factory to ubep.
* `engine.py`: tiny seeded Qwen3-MoE checkpoints and DP/EP engine runs (test, benchmark).

This package imports without vLLM; `register()`, the classes and `engine` runs need it.
"""

from __future__ import annotations

#: the value of vLLM's `all2all_backend` that selects ubep
BACKEND_NAME = "ubep"


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: install the ubep backend (idempotent)."""
    from ubep.integrations.vllm.patch import install

    install()


__all__ = ["BACKEND_NAME", "register"]
