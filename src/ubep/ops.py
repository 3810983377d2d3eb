"""ubep as PyTorch operators: `torch.ops.ubep.*` with autograd formulas and fake kernels.

`Buffer.dispatch` / `Buffer.combine` route a call here when a gradient must flow (an input
requires grad) or when `torch.compile` traces them; every other eager call keeps the direct
path (a custom-op call costs microseconds that decoding at batch 1 cannot spare).

The operators:

* `ubep::dispatch(buffer, x, topk_idx, topk_weights)` -> `(recv_x, recv_weights,
  tokens_per_expert, recv_src [3, N], handle)`; `N` is data-dependent: the fake kernel makes
  it an unbacked size (`new_dynamic_size`) bounded by the Buffer's capacity.
* `ubep::combine(buffer, expert_out, topk_weights, recv_weights?, handle, weighted)` -> `y`.
* `ubep::redispatch(buffer, x, handle, num_recv)`: `x`'s rows sent where `handle`'s dispatch
  sent its tokens, in the same order (the backward of combine).
* `ubep::combine_slots(buffer, values [N], handle, num_tokens, top_k)` -> `[T, K]`: one
  float per received row back to its (token, slot) (the weight gradients).

A Buffer enters as its integer id, a handle as a small int64 tensor naming a registry entry
(`[buffer id, dispatch call, serial]`). The entry lives as long as that tensor's storage
does: autograd keeps it for the backward, and it goes when the last reference goes.

Gradients (for the ranks together; each formula is a collective every rank runs):

* dispatch: `grad_x = combine(grad_recv_x, weighted=False)` (each row's gradient summed
  back into its token) and `grad_topk_weights[t, k] = grad_recv_weights[row(t, k)]`.
* combine: `grad_row(t, k) = w[t, k] * grad_y[t]` (a re-dispatch of `grad_y`, scaled by
  each row's weight on the receiving side; unscaled if not weighted) and
  `grad_topk_weights[t, k] = <grad_y[t], row(t, k)>`.

A per-row float travels back to its slot as an unweighted combine of rows that hold it in
column `slot` and zeros elsewhere: tokens sum their K rows, each slot lands in its own
column, exactly (one non-zero term per column). That needs `hidden >= top_k`.

Each operator is a collective, declared functional (no side effects in its schema): every
rank compiles the same graph and so runs them in the same order, but a compiled graph may drop
a dispatch whose results are never used; use them (as `EPMoE` does), or call it eagerly.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch
from torch import Tensor

from ubep.handle import DispatchHandle, DispatchResult
from ubep.options import BufferConfig
from ubep.validate import check_combine_inputs, check_dispatch_inputs


class EagerBuffer(Protocol):
    """What the operators need of a `ubep.Buffer` (named here, not imported: the Buffer
    imports this module): its config, its id and its eager bodies."""

    config: BufferConfig

    @property
    def buffer_id(self) -> int: ...

    def dispatch_eager(self, x: Tensor, topk_idx: Tensor,
                       topk_weights: Tensor) -> DispatchResult: ...

    def combine_eager(self, expert_out: Tensor, handle: DispatchHandle,
                      weighted: bool = True, out: Tensor | None = None) -> Tensor: ...


_BUFFERS: weakref.WeakValueDictionary[int, EagerBuffer] = weakref.WeakValueDictionary()
_HANDLES: dict[int, DispatchHandle] = {}
_serials = itertools.count(1)


def register_buffer(buffer: EagerBuffer) -> None:
    """Make `buffer` reachable from the operators by its id (held weakly)."""
    _BUFFERS[buffer.buffer_id] = buffer


def _buffer(buffer_id: int) -> EagerBuffer:
    buf = _BUFFERS.get(buffer_id)
    if buf is None:
        raise RuntimeError(f"ubep Buffer {buffer_id} no longer exists (garbage-collected); "
                           f"keep the Buffer alive while its operators run")
    return buf


def _keep(handle: DispatchHandle) -> Tensor:
    """A handle tensor `[buffer id, call, serial]` that keeps `handle` registered while its
    storage lives."""
    serial = next(_serials)
    key = torch.tensor([handle.buffer_id, handle.call, serial], dtype=torch.int64)
    _HANDLES[serial] = handle
    weakref.finalize(key.untyped_storage(), _HANDLES.pop, serial, None)
    return key


def _handle(key: Tensor) -> DispatchHandle:
    serial = int(key[2])
    h = _HANDLES.get(serial)
    if h is None:
        raise RuntimeError(f"ubep handle {key.tolist()} is not registered (its tensor was "
                           f"copied out of the graph?)")
    return h


# -- the operators ------------------------------------------------------------------------------
@torch.library.custom_op("ubep::dispatch", mutates_args=())
def _dispatch(buffer_id: int, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    buf = _buffer(buffer_id)
    res = buf.dispatch_eager(x.detach(), topk_idx, topk_weights.detach())
    origins = torch.stack([res.recv_src_rank, res.recv_src_token, res.recv_src_slot])
    return (res.recv_x, res.recv_weights.clone(), res.tokens_per_expert.clone(), origins,
            _keep(res.handle))


@_dispatch.register_fake
def _(buffer_id, x, topk_idx, topk_weights):
    c = _buffer(buffer_id).config
    per_rank = c.experts_per_rank
    ctx = torch.library.get_ctx()
    n = ctx.new_dynamic_size(
        min=0, max=c.world_size * c.max_tokens_per_rank * min(c.max_top_k, per_rank))
    return (x.new_empty(n, x.shape[1]), x.new_empty(n, dtype=torch.float32),
            x.new_empty(per_rank, dtype=torch.int64), x.new_empty(3, n, dtype=torch.int64),
            x.new_empty(3, dtype=torch.int64))


@torch.library.custom_op("ubep::combine", mutates_args=())
def _combine(buffer_id: int, expert_out: Tensor, topk_weights: Tensor,
             recv_weights: Tensor | None, handle: Tensor, weighted: bool) -> Tensor:
    return _buffer(buffer_id).combine_eager(expert_out.detach(), _handle(handle), weighted)


@_combine.register_fake
def _(buffer_id, expert_out, topk_weights, recv_weights, handle, weighted):
    return expert_out.new_empty(topk_weights.shape[0], expert_out.shape[1])


@torch.library.custom_op("ubep::redispatch", mutates_args=())
def _redispatch(buffer_id: int, x: Tensor, handle: Tensor, num_recv: int) -> Tensor:
    buf = _buffer(buffer_id)
    h = _handle(handle)
    recv_x = buf.dispatch_eager(x.detach(), h.topk_idx, h.topk_weights).recv_x
    if recv_x.shape[0] != num_recv:  # the routing is the handle's: the rows must be too
        raise RuntimeError(f"re-dispatch received {recv_x.shape[0]} rows, the handle's "
                           f"dispatch {num_recv}")
    return recv_x if recv_x.data_ptr() != x.data_ptr() else recv_x.clone()


@_redispatch.register_fake
def _(buffer_id, x, handle, num_recv):
    return x.new_empty(num_recv, x.shape[1])


@torch.library.custom_op("ubep::combine_slots", mutates_args=())
def _combine_slots(buffer_id: int, values: Tensor, handle: Tensor, num_tokens: int,
                   top_k: int) -> Tensor:
    buf = _buffer(buffer_id)
    h = _handle(handle)
    hidden = buf.config.hidden
    rows = torch.zeros(h.num_recv, hidden, dtype=torch.float32)
    if h.num_recv:
        rows[torch.arange(h.num_recv), h.recv_src_slot] = values.detach().float()
    y = buf.combine_eager(rows, h, False)
    return y[:, :top_k].contiguous()


@_combine_slots.register_fake
def _(buffer_id, values, handle, num_tokens, top_k):
    return values.new_empty(num_tokens, top_k, dtype=torch.float32)


# -- autograd -----------------------------------------------------------------------------------
def _dispatch_setup(ctx, inputs, output) -> None:
    buffer_id, x, topk_idx, topk_weights = inputs
    ctx.buffer_id, ctx.x_dtype = buffer_id, x.dtype
    ctx.num_tokens, ctx.top_k = topk_idx.shape
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(output[4], output[0])
    ctx.set_materialize_grads(False)


def _dispatch_backward(ctx, grad_recv_x, grad_recv_weights, *_):
    handle, recv_x = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[1]:
        if grad_recv_x is None:
            grad_recv_x = torch.zeros_like(recv_x)
        w = torch.empty(ctx.num_tokens, 0)
        grad_x = torch.ops.ubep.combine(ctx.buffer_id, grad_recv_x.contiguous(), w, None,
                                        handle, False).to(ctx.x_dtype)
    if ctx.needs_input_grad[3]:
        if grad_recv_weights is None:
            grad_recv_weights = recv_x.new_zeros(recv_x.shape[0], dtype=torch.float32)
        grad_w = torch.ops.ubep.combine_slots(ctx.buffer_id, grad_recv_weights.contiguous(),
                                              handle, ctx.num_tokens, ctx.top_k)
    return None, grad_x, None, grad_w


def _combine_setup(ctx, inputs, output) -> None:
    buffer_id, expert_out, topk_weights, recv_weights, handle, weighted = inputs
    ctx.buffer_id, ctx.weighted = buffer_id, weighted
    ctx.num_recv = expert_out.shape[0]
    ctx.w_shape = tuple(topk_weights.shape)
    need_w = weighted and ctx.needs_input_grad[2]
    ctx.save_for_backward(handle, recv_weights, expert_out if need_w else None)


def _combine_backward(ctx, grad_y):
    handle, recv_weights, expert_out = ctx.saved_tensors
    need_out, need_w = ctx.needs_input_grad[1], ctx.weighted and ctx.needs_input_grad[2]
    if not (need_out or need_w):
        return None, None, None, None, None, None
    rows = torch.ops.ubep.redispatch(ctx.buffer_id, grad_y.contiguous(), handle, ctx.num_recv)
    grad_out = grad_w = None
    if need_out:
        if ctx.weighted:
            if recv_weights is None:
                recv_weights = _recv_weights(ctx.buffer_id, handle)
            grad_out = (rows.float() * recv_weights.unsqueeze(1)).to(rows.dtype)
        else:
            grad_out = rows
    if need_w:
        values = (rows.float() * expert_out.float()).sum(1)
        grad_w = torch.ops.ubep.combine_slots(ctx.buffer_id, values, handle, *ctx.w_shape)
    return None, grad_out, grad_w, None, None, None


def _recv_weights(buffer_id: int, key: Tensor) -> Tensor:
    """The gating weight of each received row of `key`'s dispatch, fetched again (eager only:
    a handle from the direct path does not carry them). Token t's K weights go out in columns
    0..K-1 of its row; each received row reads its slot's column."""
    buf, h = _buffer(buffer_id), _handle(key)
    top_k = h.topk_idx.shape[1]
    rows = torch.zeros(h.num_tokens, buf.config.hidden, dtype=torch.float32)
    rows[:, :top_k] = h.topk_weights
    got = buf.dispatch_eager(rows, h.topk_idx, h.topk_weights).recv_x
    return got[torch.arange(h.num_recv), h.recv_src_slot]


torch.library.register_autograd("ubep::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("ubep::combine", _combine_backward, setup_context=_combine_setup)


# -- what Buffer calls --------------------------------------------------------------------------
class OpHandle:
    """The handle of a dispatch that ran as `ubep::dispatch` (with autograd or under
    `torch.compile`); `Buffer.combine` takes it like a `DispatchHandle`.

    Attributes: buffer_id, key (the handle tensor), num_tokens, num_recv, hidden, topk_idx,
    topk_weights (as passed, so gradients reach them), recv_weights.
    """

    def __init__(self, buffer_id: int, key: Tensor, topk_idx: Tensor, topk_weights: Tensor,
                 recv_weights: Tensor | None, num_recv, hidden: int):
        self.buffer_id, self.key = buffer_id, key
        self.topk_idx, self.topk_weights, self.recv_weights = topk_idx, topk_weights, recv_weights
        self.num_tokens, self.num_recv, self.hidden = topk_idx.shape[0], num_recv, hidden

    def __repr__(self) -> str:
        return (f"OpHandle(buffer={self.buffer_id}, tokens={self.num_tokens}, "
                f"recv={self.num_recv})")


def check_gradients_possible(buffer: EagerBuffer, top_k: int, weights_need_grad: bool) -> None:
    """Refuse, before any communication, a call whose gradients ubep cannot carry."""
    c = buffer.config
    if c.direct is True:                # "owned" results are the caller's: gradients flow
        raise ValueError(
            "Buffer(direct=True) cannot carry gradients: recv_x is a view of shared memory "
            "that the next dispatch overwrites and only the latest dispatch can be combined; "
            "train with direct='owned' or False (or call under torch.no_grad())")
    if weights_need_grad and top_k > c.hidden:
        raise ValueError(
            f"gradients to topk_weights need hidden >= top_k (each slot's gradient travels in "
            f"its own column), got hidden={c.hidden}, top_k={top_k}")


def dispatch(buffer: EagerBuffer, x: Tensor, topk_idx: Tensor, topk_weights: Tensor,
             ) -> DispatchResult:
    """`Buffer.dispatch` as `ubep::dispatch`: differentiable and traceable."""
    if not torch.compiler.is_compiling():  # eager: the errors of the direct path, first
        c = buffer.config
        _, topk_idx, _ = check_dispatch_inputs(
            x, topk_idx, topk_weights, hidden=c.hidden, num_experts=c.num_experts,
            max_tokens_per_rank=c.max_tokens_per_rank, max_top_k=c.max_top_k)
        check_gradients_possible(buffer, topk_idx.shape[1], topk_weights.requires_grad)
    recv_x, recv_w, tpe, origins, key = torch.ops.ubep.dispatch(
        buffer.buffer_id, x, topk_idx, topk_weights)
    handle = OpHandle(buffer.buffer_id, key, topk_idx, topk_weights, recv_w.detach(),
                      recv_x.shape[0], x.shape[1])
    stats = None if torch.compiler.is_compiling() else buffer.last_stats
    return DispatchResult(recv_x=recv_x, recv_weights=recv_w, tokens_per_expert=tpe,
                          recv_src_rank=origins[0], recv_src_token=origins[1],
                          recv_src_slot=origins[2], handle=handle, stats=stats)


def combine(buffer: EagerBuffer, expert_out: Tensor, handle: OpHandle | DispatchHandle,
            weighted: bool) -> Tensor:
    """`Buffer.combine` as `ubep::combine`: differentiable and traceable."""
    if not torch.compiler.is_compiling():
        check_combine_inputs(expert_out, num_recv=handle.num_recv, hidden=handle.hidden)
    if isinstance(handle, DispatchHandle):  # from the direct eager path: register it now
        if not torch.compiler.is_compiling():
            check_gradients_possible(buffer, handle.topk_idx.shape[1], False)
        handle = OpHandle(buffer.buffer_id, _keep(handle), handle.topk_idx, handle.topk_weights,
                          None, handle.num_recv, handle.hidden)
    return torch.ops.ubep.combine(buffer.buffer_id, expert_out, handle.topk_weights,
                                  handle.recv_weights, handle.key, bool(weighted))
