"""Input checks shared by every backend: run before any communication, change nothing.

Each failure is a ValueError or TypeError that names the argument, the value and the rule,
so the caller can fix the call and use the same Buffer again.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ubep.native import load_native

#: dtypes whose rows dispatch moves as bytes. Element size at most 4 bytes: the shared-memory
#: windows are sized for it.
MOVABLE_DTYPES = (
    torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.float8_e4m3fn, torch.float8_e5m2,
)
MAX_ELEMENT_BYTES = 4
_MOVABLE = frozenset(MOVABLE_DTYPES)


def check_on_cpu(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor that is not in CPU memory: every executor here reads and writes rows
    by their CPU address (a CUDA pointer would reach CPU kernels; a meta tensor has no data)."""
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on device {t.device}; ubep's executors move CPU tensors only (there is "
            f"no GPU executor yet): pass {name}.cpu()")


def _check_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def check_topk_idx(topk_idx: object, *, num_experts: int, num_tokens: int | None) -> torch.Tensor:
    """Check `topk_idx` `[T, K]` int32/int64 in `[-1, num_experts)`, no repeated expert per row.

    Returns it as contiguous int64.
    """
    idx = _check_tensor("topk_idx", topk_idx, 2)
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {idx.dtype}")
    if num_tokens is not None and idx.shape[0] != num_tokens:
        raise ValueError(
            f"topk_idx has {idx.shape[0]} rows but x has {num_tokens} tokens; they must match")
    if idx.device.type == "meta":
        raise ValueError("topk_idx is a meta tensor (shape only, no values); the routing "
                         "must be a tensor with data")
    if idx.dtype != torch.int64:  # .to() costs µs even when it has nothing to do
        idx = idx.to(torch.int64)
    if not idx.is_contiguous():
        idx = idx.contiguous()
    if idx.numel() and idx.device.type == "cpu":
        code, row, value = _scan_topk(idx.numpy(), num_experts)
    elif idx.numel():  # other devices: the same rules in torch ops
        code, row, value = _scan_topk_torch(idx, num_experts)
    else:
        code = 0
    if code == 1:
        raise ValueError(
            f"topk_idx holds expert id {value}; ids must lie in [-1, {num_experts}) "
            f"(-1 = slot not routed)")
    if code == 2:
        raise ValueError(
            f"topk_idx row {row} names expert {value} twice; each token's experts must be "
            f"distinct")
    return idx


# The compiled id scans live in `ubep.topk_scan` (Numba), imported on the first scan so that
# `import ubep` loads no Numba; that first call binds the compiled functions here in place of
# these two, so every later call goes straight to them.
def _scan_topk(idx: np.ndarray, num_experts: int) -> tuple[int, int, int]:
    """`ubep.topk_scan.scan_topk`: (0, 0, 0) if valid, (1, row, id) out of range, (2, row,
    id) repeated in a row."""
    _bind_scans()
    return _scan_topk(idx, num_experts)


def _topk_ok_at(addr: int, rows: int, cols: int, num_experts: int) -> bool:
    """`ubep.topk_scan.topk_ok_at`: the scan of the int64 `[rows, cols]` at `addr`."""
    _bind_scans()
    return _topk_ok_at(addr, rows, cols, num_experts)


def _bind_scans() -> None:
    global _scan_topk, _topk_ok_at
    from ubep.topk_scan import scan_topk, topk_ok_at

    _scan_topk, _topk_ok_at = scan_topk, topk_ok_at


def _scan_topk_torch(idx: torch.Tensor, num_experts: int) -> tuple[int, int, int]:
    """`_scan_topk` for tensors off the CPU."""
    bad = (idx < -1) | (idx >= num_experts)
    if bool(bad.any()):
        t = int(bad.any(dim=1).nonzero()[0, 0])
        return 1, t, int(idx[t][bad[t]][0])
    s, _ = idx.sort(dim=1)
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if bool(dup.any()):
        t = int(dup.any(dim=1).nonzero()[0, 0])
        return 2, t, int(s[t, 1:][dup[t]][0])
    return 0, 0, 0


def check_dispatch_inputs(x: object, topk_idx: object, topk_weights: object, *, hidden: int,
                          num_experts: int, max_tokens_per_rank: int, max_top_k: int,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check a dispatch call; return `(x, topk_idx int64, topk_weights float32)`, contiguous.

    The common call (CPU tensors, already int64/float32 and contiguous) is recognised with
    attribute reads and one compiled scan and returned as is; any other call takes the full
    check, which converts or raises the error that names the rule.
    """
    if dispatch_inputs_ready(x, topk_idx, topk_weights, hidden, num_experts,
                             max_tokens_per_rank, max_top_k):
        return x, topk_idx, topk_weights
    x, idx, w = _check_dispatch_inputs_full(x, topk_idx, topk_weights, hidden=hidden,
                                       num_experts=num_experts,
                                       max_tokens_per_rank=max_tokens_per_rank,
                                       max_top_k=max_top_k)
    # rows and weights are moved as data (every path reads their memory): a tensor that
    # requires grad is read through a detached view, on every path alike
    return x.detach(), idx, w.detach()


def py_dispatch_inputs_ready(x: object, idx: object, w: object, hidden: int, num_experts: int,
                             max_tokens: int, max_top_k: int) -> bool:
    """True if the full check would accept the call and return the three tensors unchanged.

    `dispatch_inputs_ready` is this function, or its compiled twin when `ubep.native` is
    built (same rules; ~0.2 µs instead of ~4 µs at batch 1).

    Cheap reads only (a torch op costs microseconds here, an attribute a fraction): exact
    dtypes, shapes, CPU, contiguity, then the id scan on the tensor's memory. False means
    "not sure", never "invalid": the full check decides.
    """
    if not (isinstance(x, torch.Tensor) and isinstance(idx, torch.Tensor)
            and isinstance(w, torch.Tensor)):
        return False
    xs, ks = x.shape, idx.shape
    if (len(xs) != 2 or xs[1] != hidden or xs[0] > max_tokens or len(ks) != 2
            or ks[0] != xs[0] or ks[1] > max_top_k or w.shape != ks):
        return False
    if idx.dtype is not torch.int64 or w.dtype is not torch.float32 or x.dtype not in _MOVABLE:
        return False
    if not (x.is_cpu and idx.is_cpu and w.is_cpu and x.is_contiguous()
            and idx.is_contiguous() and w.is_contiguous()):
        return False
    if x.requires_grad or w.requires_grad or xs[1] == 1 or xs[0] == 0:   # see _rows
        return False
    return _topk_ok_at(idx.data_ptr(), ks[0], ks[1], num_experts)


def _check_dispatch_inputs_full(x: object, topk_idx: object, topk_weights: object, *,
                                hidden: int, num_experts: int, max_tokens_per_rank: int,
                                max_top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rule in order, with its error message; converts int32 ids / non-fp32 weights."""
    x = _check_tensor("x", x, 2)
    if x.shape[1] != hidden:
        raise ValueError(f"x has hidden size {x.shape[1]} but the Buffer was built for {hidden}")
    if x.shape[0] > max_tokens_per_rank:
        raise ValueError(
            f"x has {x.shape[0]} tokens, more than max_tokens_per_rank={max_tokens_per_rank}")
    if x.dtype not in MOVABLE_DTYPES:
        raise TypeError(
            f"x has dtype {x.dtype}; dispatch moves rows of "
            f"{', '.join(str(d).removeprefix('torch.') for d in MOVABLE_DTYPES)}")
    w = _check_tensor("topk_weights", topk_weights, 2)
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    devices = {x.device, topk_idx.device, w.device}
    if len(devices) > 1:
        raise ValueError(
            f"x, topk_idx and topk_weights must be on one device, got x on {x.device}, "
            f"topk_idx on {topk_idx.device}, topk_weights on {w.device}")
    check_on_cpu("x", x)
    idx = check_topk_idx(topk_idx, num_experts=num_experts, num_tokens=x.shape[0])
    if idx.shape[1] > max_top_k:
        raise ValueError(
            f"topk_idx has {idx.shape[1]} slots per token, more than max_top_k={max_top_k} "
            f"the Buffer was sized for")
    if tuple(w.shape) != tuple(idx.shape):
        raise ValueError(
            f"topk_weights has shape {tuple(w.shape)}; it must match topk_idx {tuple(idx.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {w.dtype}")
    if w.dtype != torch.float32:
        w = w.to(torch.float32)
    return _rows(x), idx, w.contiguous()


def check_combine_inputs(expert_out: object, *, num_recv: int, hidden: int) -> torch.Tensor:
    """Check a combine call's `expert_out` `[num_recv, hidden]`, floating; return contiguous.

    The common call (right shape and dtype, contiguous) costs a few attribute reads.
    """
    if combine_inputs_ready(expert_out, num_recv, hidden):
        return expert_out
    out = _check_tensor("expert_out", expert_out, 2)
    check_on_cpu("expert_out", out)
    if tuple(out.shape) != (num_recv, hidden):
        raise ValueError(
            f"expert_out has shape {tuple(out.shape)}; the handle's dispatch received "
            f"{num_recv} rows of hidden {hidden}, so it must be ({num_recv}, {hidden})")
    if not out.is_floating_point() or out.element_size() > MAX_ELEMENT_BYTES:
        raise TypeError(
            f"expert_out has dtype {out.dtype}; combine sums rows, so it needs a floating dtype "
            f"of at most {MAX_ELEMENT_BYTES} bytes (bf16, fp16, fp32, fp8)")
    return _rows(out.detach())


def py_combine_inputs_ready(expert_out: object, num_recv: int, hidden: int) -> bool:
    """True if `check_combine_inputs` would return `expert_out` unchanged (attribute reads
    only; False means "not sure": the full check decides). `combine_inputs_ready` is this
    function or its compiled twin (`ubep.native`)."""
    return (isinstance(expert_out, torch.Tensor) and expert_out.shape == (num_recv, hidden)
            and _summable(expert_out.dtype) and expert_out.is_contiguous()
            and not expert_out.requires_grad and expert_out.is_cpu
            and expert_out.stride(-1) == 1)


def fast_checks() -> tuple[Callable[..., bool], Callable[..., bool]]:
    """`(dispatch_inputs_ready, combine_inputs_ready)`: the compiled twins when `ubep.native`
    is built and on (`UBEP_NATIVE` not 0 now), else the Python ones (`Buffer` asks once)."""
    native = load_native()
    if native is None:
        return py_dispatch_inputs_ready, py_combine_inputs_ready
    return native.dispatch_inputs_ready, native.combine_inputs_ready


#: the fast checks the full checks run first, bound at import (each `Buffer` asks
#: `fast_checks()` when it is made); same signatures as the `py_` ones
dispatch_inputs_ready, combine_inputs_ready = fast_checks()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` `[rows, hidden]` in row-major memory with unit element stride, viewable as bytes.

    torch calls a tensor contiguous while a size-1 or empty dimension has any stride (an
    `[n, 1]` transpose, an empty product): such a tensor cannot be viewed as bytes."""
    t = t.contiguous()
    if t.dim() == 2 and t.stride(-1) != 1:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def check_combine_out(out: object, *, num_tokens: int, hidden: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """Check combine's `out` `[T, hidden]`: a tensor of `expert_out`'s dtype and device."""
    out = _check_tensor("out", out, 2)
    if tuple(out.shape) != (num_tokens, hidden):
        raise ValueError(
            f"out has shape {tuple(out.shape)}; the handle's dispatch sent {num_tokens} tokens "
            f"of hidden {hidden}, so it must be ({num_tokens}, {hidden})")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}; combine writes y in expert_out's dtype "
                        f"{dtype}, so out must be {dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}; it must be on expert_out's device {device}")
    return out


_SUMMABLE: dict[torch.dtype, bool] = {}


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range `[lo, hi)` a tensor's elements span in its device's memory (strides
    included; torch strides are never negative); `(0, 0)` when it has no elements."""
    if t.numel() == 0:
        return 0, 0
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _summable(dtype: torch.dtype) -> bool:
    """Whether combine can sum rows of `dtype`: floating, at most 4 bytes (memoized)."""
    ok = _SUMMABLE.get(dtype)
    if ok is None:
        ok = _SUMMABLE[dtype] = dtype.is_floating_point and dtype.itemsize <= MAX_ELEMENT_BYTES
    return ok
