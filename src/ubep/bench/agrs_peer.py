"""The AgRs peer: expert parallelism as vLLM's CPU path does it (all-gather, reduce-scatter).

vLLM's `AgRsAll2AllManager` (the one its CPU communicator picks with
`enable_expert_parallel`) does not exchange rows per expert: dispatch all-gathers every
rank's tokens and routing, so every rank holds every token; each rank runs its local experts
on the tokens routed to them; combine sums each token's local-expert outputs (weighted) on
every rank and reduce-scatters the `[all tokens, hidden]` partial sums, so each rank gets its
own tokens' sums. It moves every token to every rank whatever the routing, and sums in the
output dtype across ranks, as vLLM does.

A comparison point, not a backend of the library. To be oracle-checked like every system,
dispatch ends with the rows routed to this rank's experts laid out as `ubep.Buffer` returns
them (expert-major, then source rank, then token): the gather a grouped expert GEMM needs,
which vLLM's fused MoE does inside the expert kernel. The collectives run on the default
process group (gloo here); one all-gather carries rows and routing packed together, one
reduce-scatter brings the sums back. Both wait as torch's `wait()` does (blocking), as
vLLM's communicator calls them; the torch backend polls its all-to-alls instead
(`ubep.runtime.torch_backend.wait`), which would not help here: gloo completes a
reduce-scatter inside `wait()` (its `Work` never reports completion before), so a poll
would only spin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from numba import njit

from ubep.runtime.shm.outputs import OutputPool
from ubep.runtime.torch_layout import (
    BAG_WORDS,
    bag_sums_into,
    bags_by_token,
    copy_row,
    source_order,
)

_SUMMED_AS_IS = (torch.float32, torch.bfloat16, torch.float16)


@njit(nogil=True, cache=True)
def _gather_rows(src, stride, rows, rb, out):
    """The first `rb` bytes of row `rows[i]` of `src` (flat, `stride` bytes a row) into row i
    of `out` (flat, `rb` bytes a row), by memcpy: the expert-major layout in one pass, as the
    torch backend gathers recv_x (a strided `index_select` of the packed rows took ~3x),
    source by source (`torch_layout.source_order`)."""
    n_src = 0
    for i in range(rows.shape[0]):
        n_src = max(n_src, rows[i] + 1)
    for i in source_order(rows, n_src):
        copy_row(out, i * rb, src, rows[i] * stride, rb)


@dataclass
class AgRsDispatch:
    """What `AgRsPeer.dispatch` returns; the first fields mirror `ubep.DispatchResult`."""

    recv_x: torch.Tensor             # [N, hidden], expert-major
    recv_weights: torch.Tensor       # [N] float32
    tokens_per_expert: torch.Tensor  # [E / P] int64
    recv_src_rank: torch.Tensor      # [N] int64
    recv_src_token: torch.Tensor     # [N] int64
    recv_src_slot: torch.Tensor      # [N] int64
    # for combine: per gathered token (rank-major, padded to max_tokens) and slot, the row of
    # expert_out holding its output (N = a zero row: not routed to this rank), and its weight
    slot_row: torch.Tensor           # [K, P * max_tokens] int64
    slot_weight: torch.Tensor        # [P * max_tokens, K] float32
    # the same as bags for the compiled sums: gathered token j's rows of expert_out in slot
    # order are bag_rows[bag_offsets[j]:bag_offsets[j + 1]]
    bag_rows: np.ndarray             # [N] int64
    bag_offsets: np.ndarray          # [P * max_tokens] int64
    num_tokens: int
    max_tokens: int


class AgRsPeer:
    """Dispatch/combine by all-gather and reduce-scatter over a torch.distributed group."""

    def __init__(self, num_experts: int, group=None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} must be divisible by the group size "
                             f"{self.world}")
        self.num_experts = num_experts
        self.per_rank = num_experts // self.world
        #: scratch kept across calls (send, gathered and partial-sum buffers by name and
        #: shape) and the pool the returned tensors come from, as a serving engine keeps its
        #: workspaces: fresh 14 MB tensors per call fault every page (`OutputPool`)
        self._scratch: dict[tuple, torch.Tensor] = {}
        self._pool = OutputPool()

    def _kept(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, rows, cols, dtype)
        t = self._scratch.get(key)
        if t is None:
            if len(self._scratch) > 16:
                self._scratch.clear()
            t = self._scratch[key] = torch.empty(rows, cols, dtype=dtype)
        return t

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 max_tokens: int) -> AgRsDispatch:
        """All-gather tokens and routing, then lay out this rank's experts' rows.

        Arguments:
            x: `[T, hidden]`, contiguous, any dtype (moved as bytes).
            topk_idx: `[T, K]` int64, `-1` = not routed. topk_weights: `[T, K]` float32.
            max_tokens: the largest T of any rank (vLLM knows every rank's T before the
                layer); every rank's block is padded to it.
        """
        world, per_rank, me = self.world, self.per_rank, self.rank
        num_tokens, top_k = topk_idx.shape
        hidden = x.shape[1]
        row_bytes = hidden * x.element_size()
        packed = row_bytes + 12 * top_k                  # row, K ids (int64), K weights (f32)
        send = self._kept("send", max_tokens, packed, torch.uint8)
        send[:num_tokens, :row_bytes] = x.view(torch.uint8).view(num_tokens, row_bytes)
        route = send[:, row_bytes:]
        route[:num_tokens, :8 * top_k] = topk_idx.view(torch.uint8).view(num_tokens, 8 * top_k)
        route[:num_tokens, 8 * top_k:] = topk_weights.view(torch.uint8).view(num_tokens,
                                                                             4 * top_k)
        route[num_tokens:, :8 * top_k] = 255             # padding tokens: ids -1
        gathered = self._kept("gathered", world * max_tokens, packed, torch.uint8)
        dist.all_gather_single(gathered, send, group=self.group)

        g = gathered.numpy()
        ids = np.ascontiguousarray(g[:, row_bytes:row_bytes + 8 * top_k]).view(np.int64)
        weights = np.ascontiguousarray(g[:, row_bytes + 8 * top_k:]).view(np.float32)
        local = ids - me * per_rank
        tok, slot = np.nonzero((local >= 0) & (local < per_rank))
        expert = local[tok, slot]
        order = np.argsort(expert * (world * max_tokens) + tok, kind="stable")
        tok, slot, expert = tok[order], slot[order], expert[order]
        num_recv = len(tok)
        recv_x = self._pool.empty(num_recv, row_bytes, torch.uint8)
        _gather_rows(g.reshape(-1), packed, tok, row_bytes, recv_x.numpy().reshape(-1))
        slot_row = np.full((world * max_tokens, top_k), num_recv, dtype=np.int64)
        slot_row[tok, slot] = np.arange(num_recv)
        slot_weight = np.zeros((world * max_tokens, top_k), dtype=np.float32)
        slot_weight[tok, slot] = weights[tok, slot]
        bag_rows, bag_offsets = bags_by_token(tok, slot, world * max_tokens)
        return AgRsDispatch(
            recv_x=recv_x.view(x.dtype).view(num_recv, hidden),
            recv_weights=torch.from_numpy(weights[tok, slot]),
            tokens_per_expert=torch.from_numpy(np.bincount(expert, minlength=per_rank)),
            recv_src_rank=torch.from_numpy(tok // max_tokens),
            recv_src_token=torch.from_numpy(tok % max_tokens),
            recv_src_slot=torch.from_numpy(slot),
            slot_row=torch.from_numpy(slot_row.T.copy()),
            slot_weight=torch.from_numpy(slot_weight), bag_rows=bag_rows,
            bag_offsets=bag_offsets, num_tokens=num_tokens, max_tokens=max_tokens)

    def combine(self, expert_out: torch.Tensor, d: AgRsDispatch,
                weighted: bool = True) -> torch.Tensor:
        """Each gathered token's weighted sum over this rank's experts, reduce-scattered.

        Returns `[T, hidden]` in `expert_out.dtype`: this rank's tokens' sums over all ranks.
        """
        hidden, dtype = expert_out.shape[1], expert_out.dtype
        if dtype in BAG_WORDS and expert_out.is_cpu and expert_out.is_contiguous():
            # one pass over the rows, as a fused MoE kernel sums a token's experts in its
            # epilogue (`bag_sums`: fp32 weights and accumulation, slot order, one rounding)
            partial = bag_sums_into(expert_out, d.recv_weights.numpy(), weighted, d.bag_rows,
                                    d.bag_offsets,
                                    self._kept("partial", d.slot_weight.shape[0], hidden, dtype))
        else:
            rows = torch.cat([expert_out, expert_out.new_zeros(1, hidden)])
            w = d.slot_weight if weighted else (d.slot_row.T < expert_out.shape[0]).float()
            acc = torch.zeros(d.slot_weight.shape[0], hidden, dtype=torch.float32)
            for k in range(d.slot_row.shape[0]):
                r = rows.index_select(0, d.slot_row[k])
                acc.addcmul_(r if dtype in _SUMMED_AS_IS else r.float(), w[:, k:k + 1])
            partial = acc.to(dtype)
        out = self._pool.empty(d.max_tokens, hidden, dtype)
        dist.reduce_scatter_single(out, partial, group=self.group)
        return out[:d.num_tokens]
