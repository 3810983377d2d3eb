"""Quantized rows with scales: fp8 casts per (token, 128 channels) and their dispatch.

`per_token_cast_to_fp8` / `per_token_cast_back` follow DeepEP's convention (one float32
scale per token and block of 128 channels, `amax / 448` for e4m3; `round_scale` rounds the
scale up to a power of two). `Buffer.dispatch((x_fp8, x_scales), ...)` moves each row's scales
with it: the scales go in a second pass of the same routing through a companion Buffer of
width `S` (`Buffer.companion`: made on first use, on every rank at the same call, closed with
its Buffer); one fused pass would need a row format with a scale tail in the runtime.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ubep.handle import DispatchResult


class ScaledDispatcher(Protocol):
    """What `dispatch_with_scales` needs of a `ubep.Buffer` (named here, not imported: the
    Buffer imports this module)."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchResult: ...

    def companion(self, width: int) -> ScaledDispatcher: ...

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128


def per_token_cast_to_fp8(x: torch.Tensor, *, round_scale: bool = False,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[T, H]` (H divisible by 128) -> `(x_fp8 [T, H] float8_e4m3fn, scales [T, H/128]
    float32)` with `x ~= x_fp8 * scale` per block of 128 channels."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"x must be [T, H] with H divisible by {BLOCK}, got {tuple(x.shape)}")
    t, h = x.shape
    blocks = x.float().view(t, h // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    scales = amax / FP8_MAX
    if round_scale:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    x_fp8 = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h)
    return x_fp8, scales


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `per_token_cast_to_fp8`: `[T, H]` of `dtype`."""
    t, h = x_fp8.shape
    blocks = x_fp8.float().view(t, h // BLOCK, BLOCK) * scales.float().unsqueeze(2)
    return blocks.view(t, h).to(dtype)


def _check_scaled(x: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    if len(x) != 2 or not all(isinstance(t, torch.Tensor) for t in x):
        raise TypeError("x as a tuple must be (x, x_scales), two tensors")
    rows, scales = x
    if scales.dim() != 2 or rows.dim() != 2 or scales.shape[0] != rows.shape[0]:
        raise ValueError(f"x_scales must be [T, S] with T = x's tokens, got x "
                         f"{tuple(rows.shape)}, x_scales {tuple(scales.shape)}")
    if scales.dtype != torch.float32:
        raise TypeError(f"x_scales must be float32, got {scales.dtype}")
    if scales.shape[1] < 1:
        raise ValueError("x_scales must hold at least one scale per token")
    return rows, scales.contiguous()


def dispatch_with_scales(buffer: ScaledDispatcher, x: tuple, topk_idx,
                         topk_weights) -> DispatchResult:
    """`buffer.dispatch((rows, scales), ...)`: rows through `buffer`, scales along the same
    routing; the result's `handle` is the rows' (combine as usual)."""
    rows, scales = _check_scaled(x)
    res = buffer.dispatch(rows, topk_idx, topk_weights)
    got = buffer.companion(scales.shape[1]).dispatch(scales, topk_idx, topk_weights)
    return DispatchResult(
        recv_x=res.recv_x, recv_weights=res.recv_weights,
        tokens_per_expert=res.tokens_per_expert, recv_src_rank=res.recv_src_rank,
        recv_src_token=res.recv_src_token, recv_src_slot=res.recv_src_slot,
        handle=res.handle, stats=res.stats, recv_x_scales=got.recv_x)
