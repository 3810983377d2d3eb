"""What `register()` changes in vLLM so that `all2all_backend="ubep"` works (idempotent).

vLLM 0.32.0 has no registry for all2all backends, so three of its closed choices are
widened, each leaving every other backend's path untouched:

1. `ParallelConfig.all2all_backend` is a closed `Literal`: "ubep" is added and the pydantic
   validator rebuilt (the CLI's `--all2all-backend` choices follow the same annotation).
2. `CpuCommunicator` builds `AgRsAll2AllManager` for any backend it does not know (with a
   warning), and that manager's `all_gatherv` is not implemented on CPU; for "ubep" the EP
   group's communicator gets `UbepAll2AllManager` instead.
3. `maybe_make_prepare_finalize` (vLLM's prepare/finalize factory, imported by name into the
   MoE kernel oracles) returns `UbepPrepareAndFinalize` for "ubep" when the layer uses
   all2all kernels (expert parallel with data parallel > 1).

And one vLLM bug is worked around: each worker loads plugins right before scanning every
loaded module's namespace for Triton kernels (`vllm/triton_utils/dispatcher.py`,
`_rebind_kernels`); the scan calls `vars(value).get(...)` and crashes on llvmlite's
`llvmlite.binding.ffi.lib`, whose `__dict__` is not a dict (`AttributeError:
'_lib_fn_wrapper' object has no attribute 'get'`). Any process that has imported numba
(ubep does) hits it; the scan now runs with that one object set aside.
"""

from __future__ import annotations

import inspect
import sys
from typing import Literal, get_args

from ubep.integrations.vllm import BACKEND_NAME

_installed = False


def install() -> None:
    """Apply the changes once per process (vLLM may load plugins several times)."""
    global _installed
    if _installed:
        return
    _admit_backend_name()
    _tolerate_llvmlite_in_kernel_scan()
    _patch_cpu_communicator()
    _patch_prepare_finalize_factory()
    _installed = True


def _admit_backend_name() -> None:
    import pydantic
    from vllm.config import ParallelConfig
    from vllm.config import parallel as parallel_module

    names = get_args(parallel_module.All2AllBackend)
    if BACKEND_NAME in names:
        return
    widened = Literal[names + (BACKEND_NAME,)]
    parallel_module.All2AllBackend = widened
    ParallelConfig.__annotations__["all2all_backend"] = widened
    ParallelConfig.__dataclass_fields__["all2all_backend"].type = widened
    pydantic.dataclasses.rebuild_dataclass(ParallelConfig, force=True)


def _tolerate_llvmlite_in_kernel_scan() -> None:
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    original = getattr(dispatcher, "_rebind_kernels", None)
    if original is None or getattr(original, "_ubep", False):
        return

    def _rebind_kernels(*args, **kwargs):
        ffi = sys.modules.get("llvmlite.binding.ffi")
        lib = ffi.__dict__.pop("lib", None) if ffi is not None else None
        try:
            return original(*args, **kwargs)
        finally:
            if lib is not None:
                ffi.lib = lib

    _rebind_kernels._ubep = True
    _rebind_kernels.__wrapped__ = original
    dispatcher._rebind_kernels = _rebind_kernels


def _configured_backend() -> str | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else config.parallel_config.all2all_backend


def _patch_cpu_communicator() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    original = CpuCommunicator.__init__
    if getattr(original, "_ubep", False):
        return

    def __init__(self, cpu_group, device=None, device_group=None, unique_name="",
                 use_all2all=False):
        is_ep = unique_name.split(":")[0] == "ep"
        if not (use_all2all and is_ep and _configured_backend() == BACKEND_NAME):
            original(self, cpu_group, device, device_group, unique_name,
                     use_all2all=use_all2all)
            return
        # no fallback manager: build the communicator without one, then add ubep's
        original(self, cpu_group, device, device_group, unique_name, use_all2all=False)
        from ubep.integrations.vllm.manager import UbepAll2AllManager

        self.use_all2all = True
        self.all2all_manager = UbepAll2AllManager(self.cpu_group)

    original_destroy = CpuCommunicator.destroy

    def destroy(self):
        """Close ubep's Buffers too (the CPU communicator's own destroy does nothing)."""
        from ubep.integrations.vllm.manager import UbepAll2AllManager

        if isinstance(getattr(self, "all2all_manager", None), UbepAll2AllManager):
            self.all2all_manager.destroy()
        original_destroy(self)

    __init__._ubep = True
    __init__.__wrapped__ = original
    CpuCommunicator.__init__ = __init__
    CpuCommunicator.destroy = destroy


def _patch_prepare_finalize_factory() -> None:
    from vllm.model_executor.layers.fused_moe import all2all_utils

    original = all2all_utils.maybe_make_prepare_finalize
    if getattr(original, "_ubep", False):
        return
    signature = inspect.signature(original)

    def maybe_make_prepare_finalize(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        moe = bound.arguments["moe"]
        parallel = moe.moe_parallel_config
        if parallel.all2all_backend != BACKEND_NAME or not parallel.use_all2all_kernels:
            return original(*args, **kwargs)
        return make_prepare_finalize(moe, bound.arguments["all2all_manager"],
                                     bound.arguments["use_monolithic"])

    maybe_make_prepare_finalize._ubep = True
    maybe_make_prepare_finalize.__wrapped__ = original
    # modules that already imported the factory by name hold the original: rebind them too
    # (read each module's __dict__: a lazy module's __getattr__ would import on a miss)
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("maybe_make_prepare_finalize") is original:
            module.maybe_make_prepare_finalize = maybe_make_prepare_finalize


def make_prepare_finalize(moe, all2all_manager=None, use_monolithic: bool = False):
    """`UbepPrepareAndFinalize` for a layer's `FusedMoEConfig`, on the EP group's Buffer."""
    from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager

    from ubep.integrations.vllm.manager import UbepAll2AllManager
    from ubep.integrations.vllm.prepare_finalize import UbepPrepareAndFinalize

    if use_monolithic:
        raise NotImplementedError(
            "all2all_backend='ubep' needs modular experts (they route with topk ids); this "
            "layer's experts are monolithic (they route inside the kernel)")
    manager = all2all_manager if all2all_manager is not None else get_ep_all2all_manager()
    if not isinstance(manager, UbepAll2AllManager):
        raise RuntimeError(f"all2all_backend='ubep' but the EP group's all2all manager is "
                           f"{type(manager).__name__}; is the ubep plugin loaded in this "
                           f"process (VLLM_PLUGINS)?")
    buffer = manager.get_handle(dict(
        max_num_tokens_per_dp_rank=moe.max_num_tokens, token_hidden_size=moe.hidden_dim,
        num_ep_ranks=manager.world_size, num_global_experts=moe.num_experts,
        max_top_k=moe.experts_per_token))
    return UbepPrepareAndFinalize(buffer, manager.cpu_group)
