"""Turn a loaded transformers MoE model into its expert-parallel form on one rank."""

from __future__ import annotations

from torch import nn

from ubep.moe.layer import EPMoE, is_moe_block


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(qualified name, block)` of every MoE block (or EPMoE) in `model`, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, EPMoE) or (is_moe_block(m) and name)]


def ep_layers(model: nn.Module) -> list[EPMoE]:
    """The EPMoE layers of a converted model, in module order."""
    return [m for m in model.modules() if isinstance(m, EPMoE)]


def convert_to_ep(model: nn.Module, buffer) -> nn.Module:
    """Replace every MoE block of `model` with an `EPMoE` holding only this rank's experts.

    Runs on every rank of `buffer`'s group, each with the same weights. Attention, dense
    MLPs, embeddings and routers stay replicated; each block's routed experts are cut to the
    rank's `E / P` (their memory is freed); all blocks dispatch through `buffer`. The model
    is changed in place and returned. Each rank then feeds its own batch (data-parallel
    attention, expert-parallel MoE, as in DeepEP-style decoding); every rank must run the
    same number of forwards, since each MoE layer is a collective.

    Raises ValueError if the model has no MoE block or the Buffer does not fit its blocks.
    """
    blocks = [(n, m) for n, m in moe_blocks(model) if not isinstance(m, EPMoE)]
    if not blocks and not ep_layers(model):
        raise ValueError(f"model ({type(model).__name__}) has no MoE block to convert "
                         f"(looked for a gate and 3-D experts weights)")
    for name, block in blocks:
        hidden = block.experts.gate_up_proj.shape[-1]
        if hidden != buffer.config.hidden:
            raise ValueError(f"{name}: hidden size {hidden} differs from the Buffer's "
                             f"hidden={buffer.config.hidden}")
        top_k = getattr(block.gate, "top_k", None)
        if top_k is not None and top_k > buffer.config.max_top_k:
            raise ValueError(f"{name}: top_k={top_k} exceeds the Buffer's "
                             f"max_top_k={buffer.config.max_top_k}")
        layer = EPMoE(block, rank=buffer.rank, world_size=buffer.world_size, buffer=buffer)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    for layer in ep_layers(model):
        layer.set_buffer(buffer)
    return model


def buffer_for(model: nn.Module, *, max_tokens_per_rank: int, group=None, **options):
    """A `ubep.Buffer` sized for `model`'s MoE blocks (experts, hidden size, top-k).

    `max_tokens_per_rank` is the most tokens one forward passes on a rank (batch x prompt
    length at prefill); `options` go to `Buffer` (backend, mode, sync, timeout_s, ...).
    """
    from ubep.buffer import Buffer

    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"model ({type(model).__name__}) has no MoE block")
    block = blocks[0][1]
    num_experts = (block.num_experts if isinstance(block, EPMoE)
                   else int(block.experts.gate_up_proj.shape[0]))
    options.setdefault("max_top_k", int(block.gate.top_k))
    return Buffer(group, num_experts=num_experts,
                  hidden=int(block.experts.gate_up_proj.shape[-1]),
                  max_tokens_per_rank=max_tokens_per_rank, **options)


def set_buffer(model: nn.Module, buffer) -> None:
    """Make every EPMoE layer of a converted `model` dispatch through `buffer` (e.g. to
    compare backends on the same model)."""
    layers = ep_layers(model)
    if not layers:
        raise ValueError("model has no EPMoE layer: call convert_to_ep first")
    for layer in layers:
        layer.set_buffer(buffer)
