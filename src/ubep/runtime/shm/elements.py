"""How combine reads and writes elements: fp32 sums from any movable float dtype, and back."""

from __future__ import annotations

import numpy as np
import torch

from ubep.runtime.shm.kernels.combine import (
    ELEM_BF16,
    ELEM_F16,
    ELEM_F32,
    ELEM_LUT8,
    f32_to_bf16,
    f32_to_f16,
)

_LUTS: dict[torch.dtype, np.ndarray] = {}


def combine_elem(dtype: torch.dtype) -> tuple[int, np.ndarray]:
    """(element code, fp32 lookup table) for summing rows of `dtype` in `reduce_tokens`."""
    if dtype == torch.float32:
        return ELEM_F32, np.zeros(1, np.float32)
    if dtype == torch.bfloat16:
        return ELEM_BF16, np.zeros(1, np.float32)
    if dtype == torch.float16:
        return ELEM_F16, np.zeros(1, np.float32)
    if dtype.itemsize != 1:
        raise TypeError(f"combine has no element conversion for {dtype}")
    lut = _LUTS.get(dtype)
    if lut is None:             # the fp8 formats: every bit pattern's value
        bits = torch.arange(256, dtype=torch.int16).to(torch.uint8)
        lut = _LUTS[dtype] = bits.view(dtype).to(torch.float32).numpy().copy()
    return ELEM_LUT8, lut


def cast_rows(y: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 sums `y` as a tensor of `dtype`, single-threaded (see `f32_to_bf16`,
    `f32_to_f16`)."""
    if dtype == torch.float32:
        return torch.from_numpy(y)
    if dtype == torch.bfloat16:
        bits = np.empty(y.shape, np.uint16)
        f32_to_bf16(y, bits)
        return torch.from_numpy(bits).view(torch.bfloat16)
    if dtype == torch.float16:
        bits = np.empty(y.shape, np.uint16)
        f32_to_f16(y, bits)
        return torch.from_numpy(bits).view(torch.float16)
    return torch.from_numpy(y).to(dtype)                # fp8: rare, small
