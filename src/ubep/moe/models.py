"""Small models of real MoE architectures, built from their transformers config classes.

No checkpoint can be downloaded here, so `build_model` makes a Qwen3-MoE or DeepSeek-V3
causal LM from its own config class with seeded random weights: every rank that calls it
with the same arguments holds bit-identical weights. A real checkpoint loads the same way
and is then converted with `ubep.moe.convert_to_ep`:

    model = Qwen3MoeForCausalLM.from_pretrained("Qwen/Qwen3-30B-A3B", dtype=torch.bfloat16)
    convert_to_ep(model, buffer)      # every rank; keeps this rank's experts only

(each rank reads the full checkpoint and drops the other ranks' experts; a loader that reads
only the local expert shards would save memory, but changes nothing downstream).
"""

from __future__ import annotations

import torch

ARCHS = ("qwen3", "deepseek")
SIZES = ("tiny", "small")

# Per (arch, size): config keyword arguments. "small" follows the issue (hidden 512; Qwen3:
# 8 layers, 32 experts, top-8; DeepSeek-V3: 4 layers, 32 routed + 1 shared, top-8, with
# group-limited routing over 4 groups). "tiny" is for the tests: 16 experts, top-4, so that
# P = 2 and P = 4 both split the experts evenly, and a forward takes milliseconds on one core.
# initializer_range is larger than the 0.02 of real checkpoints so that the experts' output
# changes the residual stream by a visible amount (the tests then check something).
_CONFIGS: dict[tuple[str, str], dict] = {
    ("qwen3", "tiny"): dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        max_position_embeddings=256, initializer_range=0.1),
    ("qwen3", "small"): dict(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=32, num_experts_per_tok=8, norm_topk_prob=True,
        max_position_embeddings=1024, initializer_range=0.05),
    ("deepseek", "tiny"): dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, max_position_embeddings=256, initializer_range=0.1),
    ("deepseek", "small"): dict(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8,
        num_key_value_heads=8, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=8,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=64, max_position_embeddings=1024, initializer_range=0.05),
}


def _check(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {', '.join(map(repr, ARCHS))}")
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {', '.join(map(repr, SIZES))}")


def make_config(arch: str, size: str = "tiny", **overrides):
    """The transformers config of a small `arch` model ("qwen3" | "deepseek"), `size` preset.

    `overrides` replace preset fields (e.g. `num_hidden_layers=2`).
    """
    _check(arch, size)
    kwargs = {**_CONFIGS[(arch, size)], **overrides}
    if arch == "qwen3":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**kwargs)
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**kwargs)


def build_model(arch: str, size: str = "tiny", *, seed: int = 0,
                dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A `Qwen3MoeForCausalLM` or `DeepseekV3ForCausalLM` with seeded random weights, in eval.

    The same (arch, size, seed, overrides) gives bit-identical weights in every process. For
    DeepSeek-V3 the routers' `e_score_correction_bias` (zero after init) is filled with seeded
    noise, as a trained checkpoint has, so that the biased top-k path is exercised.
    """
    config = make_config(arch, size, **overrides)
    if arch == "qwen3":
        from transformers import Qwen3MoeForCausalLM as cls
    else:
        from transformers import DeepseekV3ForCausalLM as cls
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape) * 0.05)
    return model.to(dtype).eval()


def make_prompts(vocab_size: int, batch: int, prompt_len: int, *, seed: int = 0,
                 rank: int = 0) -> torch.Tensor:
    """`[batch, prompt_len]` int64 token ids, seeded per (seed, rank): each rank its own batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=g)
