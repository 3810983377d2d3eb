"""`EPMoE`: a transformers MoE block whose routed experts run with expert parallelism.

Built from an existing block (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`, DeepSeek-V3's
`DeepseekV3MoE`), it reuses the block's own router (`gate`), its own experts module (cut
down to this rank's experts) and its shared experts; the only new code is the EP split:
route -> `Buffer.dispatch` -> grouped SwiGLU over the expert-major rows -> `Buffer.combine`.
"""

from __future__ import annotations

import time

import torch
from torch import nn

#: MoE block classes this layer is tested with (transformers >= 5: experts as 3-D tensors).
SUPPORTED_BLOCKS = ("Qwen3MoeSparseMoeBlock", "DeepseekV3MoE")


def is_moe_block(module: nn.Module) -> bool:
    """Whether `module` is a block EPMoE can take over: a supported class name, or one with a
    router `gate` and an `experts` module holding 3-D `gate_up_proj` / `down_proj` weights."""
    if type(module).__name__ in SUPPORTED_BLOCKS:
        return True
    experts = getattr(module, "experts", None)
    return (isinstance(getattr(module, "gate", None), nn.Module)
            and isinstance(experts, nn.Module)
            and getattr(getattr(experts, "gate_up_proj", None), "dim", lambda: 0)() == 3
            and getattr(getattr(experts, "down_proj", None), "dim", lambda: 0)() == 3)


class EPMoE(nn.Module):
    """An MoE block whose routed experts are split over the ranks of a `ubep.Buffer`.

    Rank r keeps experts `[r*E/P, (r+1)*E/P)` (the Buffer's placement); the router and the
    shared experts are replicated. `forward` takes the block's input and returns its output,
    so the layer drops into the model where the block was.

    Arguments:
        block: the transformers MoE block; its `experts` module is cut down in place to the
            local experts (the other experts' weights are freed), its `gate` is reused.
        rank, world_size: this rank and the number of ranks (E must be divisible by it).
        buffer: the `ubep.Buffer` to dispatch through; may be set later with `set_buffer`.

    Attributes:
        gate, experts, shared_experts (or None): the block's modules.
        num_experts, num_local_experts, top_k, rank, world_size, buffer.
        comm_s, experts_s, calls: wall time spent in dispatch+combine and in the local
            experts, and forwards since the last `reset_timers()`.
    """

    def __init__(self, block: nn.Module, *, rank: int, world_size: int, buffer=None):
        super().__init__()
        if not is_moe_block(block):
            raise TypeError(
                f"block must be an MoE block with `gate` and 3-D `experts` weights "
                f"({', '.join(SUPPORTED_BLOCKS)}), got {type(block).__name__}")
        experts = block.experts
        num_experts = int(experts.gate_up_proj.shape[0])
        if world_size < 1 or num_experts % world_size:
            raise ValueError(f"world_size={world_size} must divide the block's "
                             f"{num_experts} experts")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, {world_size})")
        per_rank = num_experts // world_size
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        # cut every per-expert tensor (weights, and biases where the module has them) to the
        # local range; clone so the full tensors' storage is freed
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.dim() >= 1 and param.shape[0] == num_experts:
                setattr(experts, name, nn.Parameter(param.data[lo:hi].clone(),
                                                    requires_grad=param.requires_grad))
        experts.num_experts = per_rank
        self.gate = block.gate
        self.experts = experts
        self.shared_experts = getattr(block, "shared_experts", None)
        self.block_type = type(block).__name__
        self.num_experts = num_experts
        self.num_local_experts = per_rank
        self.top_k = int(getattr(block.gate, "top_k", 0)) or None
        self.rank, self.world_size = rank, world_size
        self.buffer = None
        if buffer is not None:
            self.set_buffer(buffer)
        self.reset_timers()

    def set_buffer(self, buffer) -> None:
        """Dispatch through `buffer` from now on (it must match this layer's split)."""
        if buffer.world_size != self.world_size or buffer.rank != self.rank:
            raise ValueError(f"buffer is rank {buffer.rank} of {buffer.world_size} but this "
                             f"layer was split for rank {self.rank} of {self.world_size}")
        if buffer.num_experts != self.num_experts:
            raise ValueError(f"buffer has num_experts={buffer.num_experts}, the block has "
                             f"{self.num_experts}")
        self.buffer = buffer

    def reset_timers(self) -> None:
        self.comm_s = 0.0
        self.experts_s = 0.0
        self.calls = 0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.buffer is None:
            raise RuntimeError("EPMoE has no Buffer: call set_buffer(buffer) first")
        # under torch.compile: no timers (host clocks are not traceable) and no branch on the
        # data-dependent row count; the experts module must be traceable too (transformers'
        # experts_implementation="grouped_mm" or "batched_mm")
        compiling = torch.compiler.is_compiling()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        # the block's own router: (logits, top-k weights, top-k expert ids)
        _, topk_weights, topk_idx = self.gate(x)
        t0 = 0.0 if compiling else time.perf_counter()
        res = self.buffer.dispatch(x, topk_idx, topk_weights)
        t1 = 0.0 if compiling else time.perf_counter()
        num_recv = res.recv_x.shape[0]
        if compiling or num_recv:
            # one slot per received row: its local expert, weight 1 (combine weights);
            # the block's experts module runs them as a grouped SwiGLU
            dev = res.recv_x.device
            local_ids = torch.repeat_interleave(
                torch.arange(self.num_local_experts, device=dev),
                res.tokens_per_expert.to(dev), output_size=num_recv).unsqueeze(1)
            ones = torch.ones(num_recv, 1, dtype=res.recv_x.dtype, device=dev)
            expert_out = self.experts(res.recv_x, local_ids, ones)
        else:
            expert_out = res.recv_x.new_zeros(0, shape[-1])
        t2 = 0.0 if compiling else time.perf_counter()
        y = self.buffer.combine(expert_out.to(x.dtype), res.handle, weighted=True)
        if not compiling:
            t3 = time.perf_counter()
            self.comm_s += (t1 - t0) + (t3 - t2)
            self.experts_s += t2 - t1
            self.calls += 1
        y = y.view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden_states)
        return y

    def extra_repr(self) -> str:
        return (f"{self.block_type}, experts {self.rank * self.num_local_experts}.."
                f"{(self.rank + 1) * self.num_local_experts - 1} of {self.num_experts}, "
                f"rank {self.rank}/{self.world_size}")
