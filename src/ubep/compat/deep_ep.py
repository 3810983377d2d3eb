"""DeepEP's legacy `Buffer` surface over ubep, for code written against `deep_ep.Buffer`.

    from ubep.compat import deep_ep            # instead of `import deep_ep`
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \\
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \\
        buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                        is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=num_tokens_per_expert,
                        topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, _, event = buffer.combine(expert_out, handle)

Same names, arguments, tuples and semantics as DeepEP (checked by re-creating the checks of
DeepEP's `tests/test_intranode.py` and `tests/test_low_latency.py` on CPU ranks):

* normal `dispatch` sends one row per (token, destination rank), received in (source rank,
  token) order; `recv_topk_idx` holds local expert ids, `-1` for the token's experts on other
  ranks (their `recv_topk_weights` are 0); `combine` sums the rows of a token unweighted (and,
  given `topk_weights`, sums those too); a `handle` re-dispatches without `topk_idx`.
* `low_latency_dispatch` returns the padded `[num_local_experts, num_ranks *
  num_max_dispatch_tokens_per_rank, hidden]` layout with per-expert counts, the handle's
  `recv_src_info` and `layout_range`; `low_latency_combine` reduces with weights.

What differs (see docs/deep_ep.md): calls are synchronous on CPU tensors, so `EventOverlap`
is a placeholder whose waits return at once, `async_finish`, `previous_event`,
`allocate_on_comm_stream` and `config` are accepted and change nothing, and the receive hook
does nothing; `num_nvl_bytes`/`num_rdma_bytes`/`num_qps_per_rank` are ignored (ubep sizes its
own memory); `use_logfmt` is accepted and rows travel as bf16 (exact, not the 10-bit
format); `use_ue8m0` is refused. Underneath, each call is one or two ubep `Buffer` calls:
rows through one, the top-k ids, weights and fp8 scales (as int32 words) through a second one
of the same routing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import ubep
from ubep.quant import per_token_cast_to_fp8

topk_idx_t = torch.int64  # DeepEP's `deep_ep.topk_idx_t`


class EventOverlap:
    """DeepEP's event wrapper. ubep's calls return when their data has arrived, so there is
    nothing to wait for: `current_stream_wait()` returns at once, `with event:` does nothing."""

    def __init__(self, event=None, extra_tensors: tuple | None = None) -> None:
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Nothing to wait for (the call was synchronous)."""

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        hook_after_wait()

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc) -> None:
        return None


class Config:
    """DeepEP's kernel tuning config (SMs, chunk sizes): accepted, not used by ubep."""

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs


@dataclass
class _Dispatched:
    """What a normal dispatch's handle carries for combine and cached re-dispatch."""

    route_idx: torch.Tensor          # [T, P] destination ranks of each token, -1 = not sent
    route_w: torch.Tensor            # [T, P] ones (the rank-level routing has no weights)
    rows_handle: object              # the ubep handle of the rows' dispatch
    meta_handle: object | None       # the ubep handle of the top-k/scales words, if sent
    num_recv: int
    top_k: int


@dataclass
class _LowLatency:
    """What a low-latency handle carries: the ubep handle and where each row sits."""

    handle: object
    topk_idx: torch.Tensor
    recv_slot: torch.Tensor          # [N] the top-k slot of each received row at its source
    expert: torch.Tensor             # [N] local expert of each received row
    slot: torch.Tensor               # [N] its position in that expert's padded rows
    shape: tuple[int, int, int]
    combine_buffer: torch.Tensor | None = field(default=None)


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t` `[T, n]` of 4-byte elements as int32 words."""
    return t.contiguous().view(torch.int32)


class Buffer:
    """DeepEP's legacy `Buffer` (normal and low-latency modes) over ubep.

    Arguments (DeepEP's): group (None = the default group), num_nvl_bytes, num_rdma_bytes,
    low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
    explicitly_destroy, enable_shrink: accepted; the byte sizes and QP counts are ignored
    (ubep sizes its memory from its own arguments). `comm` (mpi4py) is not supported.
    ubep's own, keyword-only: `backend` ("torch" by default: nothing preallocated, any call
    size; "shm" or "auto" for the shared-memory runtime on one host), `max_tokens_per_rank`
    (the largest batch any call may pass; sizes shm memory), and any other `ubep.Buffer`
    option (`mode`, `sync`, `workers`, `timeout_s` ...).

    Attributes: rank, group_size, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode.
    """

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup | None = None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, backend: str = "torch",
                 max_tokens_per_rank: int = 4096, **ubep_options) -> None:
        if comm is not None:
            raise ValueError("comm= (mpi4py) is not supported: pass a torch.distributed group")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group first")
        self.group = group
        self.rank, self.group_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._options = dict(ubep_options, backend=backend,
                             max_tokens_per_rank=max_tokens_per_rank)
        self._buffers: dict[tuple, ubep.Buffer] = {}
        self._destroyed = False

    # -- lifecycle ---------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release every ubep Buffer this one made (idempotent)."""
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()
        self._destroyed = True

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _ubep(self, num_experts: int, hidden: int, top_k: int,
              max_tokens: int | None = None) -> ubep.Buffer:
        """The ubep Buffer for rows of `hidden` over `num_experts` (made on first use: the
        same call on every rank, so every rank makes it at the same point)."""
        if self._destroyed:
            raise RuntimeError("cannot use a destroyed Buffer")
        options = dict(self._options)
        if max_tokens is not None:
            options["max_tokens_per_rank"] = max_tokens
        key = (num_experts, hidden, options["max_tokens_per_rank"])
        buf = self._buffers.get(key)
        if buf is None or buf.config.max_top_k < top_k:
            if buf is not None:
                buf.close()
            buf = ubep.Buffer(self.group, num_experts=num_experts, hidden=hidden,
                              max_top_k=max(8, top_k), **options)
            self._buffers[key] = buf
        return buf

    # -- DeepEP's static helpers -------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the FP8 paths (`(x_fp8, scales)`, `use_fp8`) are available."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms={new_num_sms} must be even (as DeepEP)")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of one padded bf16 receive layout (ubep allocates its own memory)."""
        return (num_experts // num_ranks) * num_ranks * num_max_dispatch_tokens_per_rank \
            * hidden * 2

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: ubep's synchronization words carry epochs."""

    # -- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Returns `(num_tokens_per_rank [P] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, P] bool, event)` as DeepEP (None: no RDMA ranks here)."""
        layout = ubep.get_dispatch_layout(topk_idx, num_experts, self.group_size)
        return (layout.tokens_per_rank.to(torch.int32), None,
                layout.tokens_per_expert.to(torch.int32), layout.is_token_in_rank,
                EventOverlap())

    def dispatch(self, x, handle: tuple | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP's `dispatch`: one row per (token, destination rank).

        Arguments: `x` `[T, H]` (any movable dtype) or `(x_fp8, x_scales [T, S] float32)`;
        either `handle` (cached: the layout of that dispatch, no top-k) or the layout
        (`num_tokens_per_rank`, `is_token_in_rank`, `num_tokens_per_expert`) with optional
        `topk_idx`/`topk_weights`; `expert_alignment` rounds the per-expert counts up;
        `num_worst_tokens` pads the outputs to that many rows (and returns an empty list).

        Returns `(recv_x | (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)`; a cached dispatch returns
        `(recv_x, None, None, None, None, event)`.
        """
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        _refuse_grad(x, x_scales, topk_weights)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=) takes no topk_idx/topk_weights")
            state = _state(handle, _Dispatched)
            recv_x = self._ubep(self.group_size, x.shape[1], self.group_size).dispatch(
                x, state.route_idx, state.route_w).recv_x
            if x_scales is not None:
                recv_s = self._ubep(self.group_size, x_scales.shape[1], self.group_size).dispatch(
                    _words(x_scales), state.route_idx, state.route_w).recv_x.view(torch.float32)
                return (recv_x, recv_s), None, None, None, None, EventOverlap()
            return recv_x, None, None, None, None, EventOverlap()
        for name, t in (("num_tokens_per_rank", num_tokens_per_rank),
                        ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert)):
            if t is None:
                raise ValueError(f"{name} is required without handle= (from get_dispatch_layout)")
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("pass topk_idx and topk_weights together")
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment={expert_alignment!r} must be a positive int")
        P, rank, T = self.group_size, self.rank, x.shape[0]
        if tuple(is_token_in_rank.shape) != (T, P):
            raise ValueError(f"is_token_in_rank must be [{T}, {P}], got "
                             f"{tuple(is_token_in_rank.shape)}")
        num_experts = num_tokens_per_expert.numel()
        if num_experts % P:
            raise ValueError(f"num_tokens_per_expert has {num_experts} experts, not divisible "
                             f"by the group size {P}")
        per_rank = num_experts // P

        # counts of every rank: [P, P + E] = (tokens per destination rank, tokens per expert)
        mine = torch.cat([num_tokens_per_rank.to(torch.int64).view(-1),
                          num_tokens_per_expert.to(torch.int64).view(-1)])
        counts = [torch.empty_like(mine) for _ in range(P)]
        dist.all_gather(counts, mine, group=self.group)
        counts = torch.stack(counts)
        rank_prefix_matrix = counts[:, :P].cumsum(0).to(torch.int32)
        per_expert = counts[:, P + rank * per_rank:P + (rank + 1) * per_rank].sum(0)
        aligned = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment

        # rank-level routing: the "experts" of the ubep call are the ranks, so rows arrive
        # once per (token, rank), in (source rank, token) order
        route_idx = torch.where(is_token_in_rank, torch.arange(P).expand(T, P), -1)
        route_w = torch.ones(T, P)
        rows = self._ubep(P, x.shape[1], P).dispatch(x, route_idx, route_w)
        recv_x, n = rows.recv_x, rows.recv_x.shape[0]
        top_k = 0 if topk_idx is None else topk_idx.shape[1]
        recv_topk_idx = recv_topk_weights = recv_s = None
        meta_handle = None
        if topk_idx is not None or x_scales is not None:
            parts = []
            if topk_idx is not None:
                parts += [topk_idx.to(torch.int32), _words(topk_weights.to(torch.float32))]
            if x_scales is not None:
                parts.append(_words(x_scales.to(torch.float32)))
            words = torch.cat(parts, dim=1)
            meta = self._ubep(P, words.shape[1], P).dispatch(words, route_idx, route_w)
            meta_handle, got = meta.handle, meta.recv_x
            if topk_idx is not None:
                local = got[:, :top_k].to(torch.int64) - rank * per_rank
                mine_k = (got[:, :top_k] >= 0) & (local >= 0) & (local < per_rank)
                recv_topk_idx = torch.where(mine_k, local, -1)
                recv_topk_weights = torch.where(
                    mine_k, got[:, top_k:2 * top_k].contiguous().view(torch.float32), 0.0)
            if x_scales is not None:
                recv_s = got[:, 2 * top_k:].contiguous().view(torch.float32)
        num_list = aligned.tolist()
        if num_worst_tokens:
            if num_worst_tokens < n:
                raise ValueError(f"num_worst_tokens={num_worst_tokens} < {n} received rows")
            pad = num_worst_tokens - n
            recv_x = torch.cat([recv_x, recv_x.new_zeros(pad, recv_x.shape[1])])
            if recv_s is not None:
                recv_s = torch.cat([recv_s, recv_s.new_zeros(pad, recv_s.shape[1])])
            if recv_topk_idx is not None:
                recv_topk_idx = torch.cat([recv_topk_idx, recv_topk_idx.new_full((pad, top_k), -1)])
                recv_topk_weights = torch.cat([recv_topk_weights,
                                               recv_topk_weights.new_zeros(pad, top_k)])
            num_list = []
        state = _Dispatched(route_idx, route_w, rows.handle, meta_handle, n, top_k)
        handle = (rank_prefix_matrix, None, None, rows.recv_src_token.to(torch.int32),
                  is_token_in_rank, state)
        out_x = (recv_x, recv_s) if x_scales is not None else recv_x
        return out_x, recv_topk_idx, recv_topk_weights, num_list, handle, EventOverlap()

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None,
                bias=None, config=None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's `combine`: each token's rows summed **without** weights.

        Arguments: `x` `[N, H]` (rows of the dispatch, or `num_worst_tokens` padded rows),
        the dispatch's `handle`, optional `topk_weights` `[N, K]` summed likewise, `bias` (a
        tensor or a pair) added to the result. Returns `(combined_x [T, H],
        combined_topk_weights [T, K] or None, event)`.
        """
        _refuse_grad(x, topk_weights)
        state = _state(handle, _Dispatched)
        P, n = self.group_size, state.num_recv
        y = self._ubep(P, x.shape[1], P).combine(x[:n].contiguous(), state.rows_handle,
                                                 weighted=False)
        for b in (bias if isinstance(bias, tuple) else (bias,)):
            if b is not None:
                y = (y.float() + b.float()).to(y.dtype)
        combined_w = None
        if topk_weights is not None:
            if state.meta_handle is None:
                raise ValueError("combine(topk_weights=...) needs a dispatch with topk_idx")
            width = state.meta_handle.hidden
            words = torch.zeros(n, width, dtype=torch.float32)
            words[:, :state.top_k] = topk_weights[:n].float()
            combined_w = self._ubep(P, width, P).combine(
                words, state.meta_handle, weighted=False)[:, :state.top_k].contiguous()
        return y, combined_w, EventOverlap()

    # -- low-latency mode --------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """DeepEP's `low_latency_dispatch`: rows per (token, expert) in the padded layout.

        Returns `(recv_x, recv_count [E_local] int32, handle, event, hook)`: `recv_x` is
        `[E_local, P * num_max_dispatch_tokens_per_rank, H]` bf16, or with `use_fp8` a pair
        (float8_e4m3fn rows, float32 scales `[E_local, P * T_max, H / 128]`, column-major in
        the last two dims as DeepEP's); expert e's first `recv_count[e]` rows are valid, by
        source rank then token. `handle[0]` is `recv_src_info` (source token of each row),
        `handle[1]` `layout_range` (`begin << 32 | count` per source rank). `hook()` returns
        at once: the data has arrived when this returns.
        """
        _refuse_grad(x)
        if use_ue8m0:
            raise ValueError("use_ue8m0=True (packed UE8M0 scales) is not supported by ubep: "
                             "use float32 scales (use_ue8m0=False)")
        T, H = x.shape
        cap_tokens = num_max_dispatch_tokens_per_rank
        if T > cap_tokens:
            raise ValueError(f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{cap_tokens}")
        P = self.group_size
        per_rank = num_experts // P
        top_k = topk_idx.shape[1]
        buf = self._ubep(num_experts, H, top_k, max_tokens=cap_tokens)
        payload = per_token_cast_to_fp8(x, round_scale=round_scale) if use_fp8 else x
        res = buf.dispatch(payload, topk_idx, torch.ones(T, top_k))
        counts = res.tokens_per_expert
        n = res.recv_x.shape[0]
        expert = torch.repeat_interleave(torch.arange(per_rank), counts, output_size=n)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(n) - starts[expert]
        cap = P * cap_tokens
        recv = res.recv_x.new_zeros(per_rank, cap, H)
        recv.view(torch.uint8)[expert, slot] = res.recv_x.view(torch.uint8)  # any dtype, fp8 too
        src_info = torch.zeros(per_rank, cap, dtype=torch.int32)
        src_info[expert, slot] = res.recv_src_token.to(torch.int32)
        per_source = torch.zeros(per_rank, P, dtype=torch.int64)
        per_source.index_put_((expert, res.recv_src_rank), torch.ones(n, dtype=torch.int64),
                              accumulate=True)
        begin = torch.cumsum(per_source, 1) - per_source
        layout_range = (begin << 32) | per_source
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += counts.to(
                cumulative_local_expert_recv_stats.dtype)
        if use_fp8:
            scales = torch.zeros(per_rank, H // 128, cap).transpose(1, 2)
            scales[expert, slot] = res.recv_x_scales
            recv = (recv, scales)
        state = _LowLatency(res.handle, topk_idx, res.recv_src_slot, expert, slot,
                            (per_rank, cap, H))
        handle = (src_info, layout_range, cap_tokens, H, num_experts, state)
        return recv, counts.to(torch.int32), handle, EventOverlap(), _no_wait

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The `[E_local, P * T_max, H]` bf16 tensor that `low_latency_combine(...,
        zero_copy=True)` reads instead of its `x` (one per handle)."""
        state = _state(handle, _LowLatency)
        if state.combine_buffer is None:
            state.combine_buffer = torch.zeros(state.shape, dtype=torch.bfloat16)
        return state.combine_buffer

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """DeepEP's `low_latency_combine`: `y[t] = sum_k topk_weights[t, k] * row(t, k)`.

        `x` is the padded `[E_local, P * T_max, H]` expert output (or, with `zero_copy`, the
        tensor from `get_next_low_latency_combine_buffer`); `topk_idx` must be the
        dispatch's. Returns `(combined_x [T, H] bf16 (into `out` if given), event, hook)`.
        """
        _refuse_grad(x, topk_weights)
        state = _state(handle, _LowLatency)
        if not torch.equal(topk_idx, state.topk_idx):
            raise ValueError("low_latency_combine: topk_idx differs from the dispatch's")
        src = x
        if zero_copy:
            if state.combine_buffer is None:
                raise ValueError("zero_copy=True needs get_next_low_latency_combine_buffer("
                                 "handle) filled first")
            src = state.combine_buffer
        # The weights are known here, at combine time: they go to the rows first (K floats per
        # token, same routing), each row is scaled in fp32, then summed unweighted.
        P, (per_rank, _, H) = self.group_size, state.shape
        buf = self._ubep(per_rank * P, H, topk_idx.shape[1], max_tokens=handle[2])
        weights = torch.where(topk_idx >= 0, topk_weights.float(), 0.0).contiguous()
        row_w = buf.companion(weights.shape[1]).dispatch(
            weights, topk_idx, torch.ones_like(weights)).recv_x
        row_w = row_w[torch.arange(row_w.shape[0]), state.recv_slot]
        rows = src[state.expert, state.slot].float() * row_w.unsqueeze(1)
        y = buf.combine(rows, state.handle, weighted=False).to(torch.bfloat16)
        if out is not None:
            out.copy_(y)
            y = out
        return y, EventOverlap(), _no_wait


def _refuse_grad(*tensors) -> None:
    """DeepEP's Buffer carries no gradients (frameworks wrap it); neither does this one, and
    it says so instead of dropping them."""
    if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise ValueError("ubep.compat.deep_ep does not carry gradients (as DeepEP's Buffer): "
                         "call it under torch.no_grad() inside your autograd function, or use "
                         "ubep.Buffer, whose dispatch and combine are differentiable")


def _no_wait() -> None:
    """The receive hook: the data is already there."""


def _state(handle, kind):
    if not isinstance(handle, tuple) or not handle or not isinstance(handle[-1], kind):
        what = "dispatch" if kind is _Dispatched else "low_latency_dispatch"
        raise ValueError(f"handle must be the handle returned by this Buffer's {what}")
    return handle[-1]
