"""End-to-end MoE decoding with expert parallelism over `ubep.Buffer`.

`EPMoE` wraps a transformers MoE block (Qwen3-MoE, DeepSeek-V3) so its routed experts run
split over ranks; `convert_to_ep` does it for a whole model; `build_model` makes small
seeded models of those architectures; `greedy_decode` times every decode step; `ubep.moe.e2e`
runs it on P processes per backend (the `ubep e2e` command).
"""

from ubep.moe.convert import buffer_for, convert_to_ep, ep_layers, moe_blocks, set_buffer
from ubep.moe.decode import DecodeResult, GreedyDecoder, greedy_decode
from ubep.moe.layer import SUPPORTED_BLOCKS, EPMoE, is_moe_block
from ubep.moe.models import ARCHS, SIZES, build_model, make_config, make_prompts

__all__ = [
    "EPMoE", "SUPPORTED_BLOCKS", "is_moe_block", "buffer_for", "convert_to_ep", "ep_layers",
    "moe_blocks", "set_buffer", "DecodeResult", "GreedyDecoder", "greedy_decode", "ARCHS",
    "SIZES", "build_model", "make_config", "make_prompts",
]
