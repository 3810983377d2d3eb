"""`UbepPrepareAndFinalize`: vLLM's modular-kernel prepare (dispatch) and finalize (combine)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

import ubep
from ubep.integrations.vllm.placement import local_to_global, ubep_ids_of_global

#: vLLM experts whose kernels index weights by `topk_ids` directly and ignore `expert_map`
#: (vLLM 0.32.0's CPU experts): they are handed local slots instead of global ids
_LOCAL_ID_MODULES = ("vllm.model_executor.layers.fused_moe.experts.cpu_moe",
                     "vllm.model_executor.layers.fused_moe.experts.cpu_int4_moe")


def experts_take_local_ids(experts: object) -> bool:
    """Whether `experts` index their weights by the ids they get rather than via expert_map."""
    supports = getattr(experts, "supports_expert_map", None)
    if callable(supports) and not supports():
        return True
    return type(experts).__module__ in _LOCAL_ID_MODULES


class UbepPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """Dispatch and combine of one MoE layer through a `ubep.Buffer` (standard format).

    `prepare()` sends each (token, expert) pair's row to the rank that holds the expert in
    vLLM's `expert_map` (linear, round-robin or an EPLB placement) and hands the experts the
    received rows expert-major, one row per pair: `topk_ids` `[N, 1]` (the global id, or the
    local slot for experts that ignore `expert_map`), `topk_weights` `[N, 1]` (the row's
    gating weight) and the per-expert row counts. Activations are quantized after the move,
    on the receiving rank, as vLLM's DeepEP high-throughput path does for non-block
    quantization; static scales pass through unchanged.

    `finalize()` combines the expert outputs into vLLM's `output` (`Buffer.combine(out=)`)
    with vLLM's weight-and-reduce rule: experts that already weighted their rows
    (`TopKWeightAndReduceNoOP`) are summed as they are; for the rest (delegate or contiguous)
    ubep applies each row's gating weight in the fp32 sum; weights already applied on the
    input (`apply_router_weight_on_input`) are not applied again.

    Arguments:
        buffer: the `ubep.Buffer` of this layer's shape, over the EP group.
        group: the EP group's process group (the Buffer's), to share expert maps.

    Attributes:
        buffer, num_dispatches (prepare calls so far), num_combines (finalize calls),
        dispatch_s / combine_s (seconds spent in `Buffer.dispatch` / `Buffer.combine`).
    """

    def __init__(self, buffer: ubep.Buffer, group) -> None:
        super().__init__()
        self.buffer = buffer
        self.group = group
        self._handle = None
        self.num_dispatches = self.num_combines = 0
        self.dispatch_s = self.combine_s = 0.0
        self._local_ids = False
        self._map_seen: torch.Tensor | None = None
        self._ubep_of_global: torch.Tensor | None = None
        self._global_of_local: torch.Tensor | None = None

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        self._local_ids = experts_take_local_ids(fused_experts)

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return self.buffer.world_size

    def output_is_reduced(self) -> bool:
        return True

    # -- expert placement --------------------------------------------------------------
    def _placement(self, expert_map: torch.Tensor | None, num_experts: int) -> None:
        """Refresh the global -> ubep id table when this rank's expert_map changed.

        The table needs every rank's map, gathered over the EP group; vLLM changes maps
        (EPLB) on all ranks in the same step, so every rank gathers in the same call.
        """
        if expert_map is None:  # no EP map: vLLM's linear placement
            if self._ubep_of_global is None:
                self._ubep_of_global = torch.arange(num_experts)
                per = num_experts // self.buffer.world_size
                self._global_of_local = torch.arange(per) + self.buffer.rank * per
            return
        local_map = expert_map.detach().to("cpu", torch.int64)
        if self._map_seen is not None and torch.equal(local_map, self._map_seen):
            return
        maps = [torch.empty_like(local_map) for _ in range(self.buffer.world_size)]
        dist.all_gather(maps, local_map, group=self.group)
        table = ubep_ids_of_global(torch.stack(maps))
        if table.numel() != self.buffer.num_experts:
            raise ValueError(f"vLLM's expert_map covers {table.numel()} experts but the ubep "
                             f"Buffer was built for {self.buffer.num_experts}")
        self._ubep_of_global = table
        self._global_of_local = local_to_global(local_map)
        self._map_seen = local_map

    # -- prepare / finalize -------------------------------------------------------------
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool = False,
    ) -> mk.PrepareResultType:
        if apply_router_weight_on_input:
            if topk_ids.size(1) != 1:
                raise ValueError("apply_router_weight_on_input needs top-k 1, got "
                                 f"{topk_ids.size(1)}")
            a1 = a1 * topk_weights.to(a1.dtype)
        self._placement(expert_map, num_experts)
        ids = topk_ids.to(torch.int64)
        ubep_idx = torch.where(ids >= 0, self._ubep_of_global[ids.clamp(min=0)], -1)
        t0 = time.perf_counter()
        res = self.buffer.dispatch(a1, ubep_idx, topk_weights)
        self.dispatch_s += time.perf_counter() - t0
        self._handle = res.handle
        self.num_dispatches += 1
        counts = res.tokens_per_expert
        local = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        expert_ids = local if self._local_ids else self._global_of_local[local]
        expert_topk_ids = expert_ids.view(-1, 1).to(topk_ids.dtype)
        expert_topk_weights = res.recv_weights.view(-1, 1).to(topk_weights.dtype)
        meta = mk.ExpertTokensMetadata.make_from_list(counts.tolist(), device=a1.device)
        expert_x, expert_x_scale = res.recv_x, None
        if quant_config.quant_dtype is not None and not defer_input_quant \
                and expert_x.numel():
            expert_x, expert_x_scale = moe_kernel_quantize_input(
                expert_x, quant_config.a1_scale, quant_dtype=quant_config.quant_dtype,
                per_act_token_quant=quant_config.per_act_token_quant,
                block_shape=quant_config.block_shape,
                is_scale_swizzled=quant_config.is_scale_swizzled)
        return expert_x, expert_x_scale, meta, expert_topk_ids, expert_topk_weights

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        if self._handle is None:
            raise RuntimeError("finalize before prepare: no dispatch to combine")
        handle, self._handle = self._handle, None
        if isinstance(weight_and_reduce_impl, TopKWeightAndReduceNoOP):
            weighted = False            # the experts weighted (and reduced) their rows
        elif isinstance(weight_and_reduce_impl,
                        (TopKWeightAndReduceDelegate, TopKWeightAndReduceContiguous)):
            weighted = not apply_router_weight_on_input
        else:
            raise NotImplementedError(
                f"ubep's combine does not apply {type(weight_and_reduce_impl).__name__}; it "
                f"sums rows one per (token, expert), weighted or not")
        rows = fused_expert_output.reshape(handle.num_recv, handle.hidden)
        t0 = time.perf_counter()
        self.buffer.combine(rows, handle, weighted=weighted, out=output)
        self.combine_s += time.perf_counter() - t0
        self.num_combines += 1
