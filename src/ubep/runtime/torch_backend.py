"""The torch.distributed backend: dispatch and combine as `all_to_all_single` collectives.

Works over any process group (gloo on CPU, NCCL, MPI), so it is the path across hosts and
the bulk-synchronous baseline everyone already has. Dispatch costs two collectives (per
(rank, expert) counts, then rows with their origin packed behind the payload); combine one.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.options import BufferConfig
from ubep.stats import Stats

_META_BYTES = 12  # int32 token, int32 slot, float32 weight behind each row's payload


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


class TorchBackend:
    """Dispatch/combine over `torch.distributed.all_to_all_single`."""

    def __init__(self, config: BufferConfig, group, buffer_id: int):
        self.config = config
        self.group = group
        self.buffer_id = buffer_id

    def _stats(self, op: str, phases: dict[str, float], sent: int, recv: int) -> Stats:
        c = self.config
        return Stats(op=op, backend="torch", rank=c.rank, total_us=sum(phases.values()),
                     phases_us=phases, bytes_sent=sent, bytes_recv=recv, payload_efficiency=None)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult:
        c = self.config
        world, per_rank = c.world_size, c.experts_per_rank
        num_tokens, top_k = topk_idx.shape
        t0 = _now_us()

        # (token, slot) pairs in send order: by expert (hence destination), then token
        flat = topk_idx.reshape(-1)
        pos = (flat >= 0).nonzero().squeeze(1)
        expert = flat[pos]
        order = torch.argsort(expert, stable=True)
        pos, expert = pos[order], expert[order]
        send_token, send_slot = pos // top_k, pos % top_k
        send_counts = torch.bincount(expert, minlength=c.num_experts).to(torch.int64)
        send_splits = send_counts.view(world, per_rank).sum(1)
        t1 = _now_us()

        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_counts = recv_counts.view(world, per_rank)  # [source rank, local expert]
        recv_splits = recv_counts.sum(1)
        t2 = _now_us()

        row_bytes = x.shape[1] * x.element_size()
        meta = torch.stack([send_token.to(torch.int32), send_slot.to(torch.int32),
                            topk_weights.reshape(-1)[pos].view(torch.int32)], dim=1)
        send = torch.cat([x.view(torch.uint8).reshape(num_tokens, row_bytes)[send_token],
                          meta.view(torch.uint8).reshape(-1, _META_BYTES)], dim=1)
        recv = send.new_empty(int(recv_splits.sum()), row_bytes + _META_BYTES)
        dist.all_to_all_single(recv, send, recv_splits.tolist(), send_splits.tolist(),
                               group=self.group)
        t3 = _now_us()

        # received: source-major, then (expert, token); stable sort by expert -> expert-major
        label = torch.arange(per_rank).repeat(world)
        to_expert_major = torch.argsort(
            torch.repeat_interleave(label, recv_counts.reshape(-1)), stable=True)
        recv = recv[to_expert_major]
        recv_x = recv[:, :row_bytes].contiguous().view(x.dtype).reshape(-1, x.shape[1])
        meta = recv[:, row_bytes:].contiguous().view(torch.int32)
        recv_src_rank = torch.repeat_interleave(torch.arange(world), recv_splits)[to_expert_major]
        t4 = _now_us()

        handle = DispatchHandle(
            buffer_id=self.buffer_id, call=call, num_tokens=num_tokens,
            num_recv=recv_x.shape[0], hidden=x.shape[1], topk_idx=topk_idx,
            topk_weights=topk_weights, recv_src_rank=recv_src_rank,
            recv_src_token=meta[:, 0].to(torch.int64), recv_src_slot=meta[:, 1].to(torch.int64),
            state=(send_token, send_slot, send_splits, recv_splits, to_expert_major),
        )
        phases = {"layout": t1 - t0, "count_exchange": t2 - t1, "token_exchange": t3 - t2,
                  "reorder": t4 - t3}
        return DispatchResult(
            recv_x=recv_x, recv_weights=meta[:, 2].view(torch.float32).clone(),
            tokens_per_expert=recv_counts.sum(0), recv_src_rank=recv_src_rank,
            recv_src_token=handle.recv_src_token, recv_src_slot=handle.recv_src_slot,
            handle=handle,
            stats=self._stats("dispatch", phases, send.numel(), recv.numel()),
        )

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool) -> CombineResult:
        send_token, send_slot, send_splits, recv_splits, to_expert_major = handle.state
        hidden, dtype = expert_out.shape[1], expert_out.dtype
        t0 = _now_us()
        # back to the order the rows arrived in, so each source gets its own send order back
        rows = torch.empty_like(expert_out)
        rows[to_expert_major] = expert_out
        row_bytes = hidden * expert_out.element_size()
        send = rows.view(torch.uint8).reshape(-1, row_bytes)
        back = send.new_empty(send_token.numel(), row_bytes)
        dist.all_to_all_single(back, send, send_splits.tolist(), recv_splits.tolist(),
                               group=self.group)
        t1 = _now_us()
        back = back.view(dtype).reshape(-1, hidden)
        num_tokens, top_k = handle.topk_idx.shape
        # rows to their (token, slot) place, then one batched [1, K] x [K, hidden] product per
        # token in fp32; unrouted slots hold zeros with weight 0 (their weight may be NaN)
        slots = back.new_zeros(num_tokens * top_k, hidden)
        slots[send_token * top_k + send_slot] = back
        routed = handle.topk_idx >= 0
        w = torch.where(routed, handle.topk_weights, 0.0) if weighted else routed.float()
        y = torch.bmm(w.unsqueeze(1), slots.view(num_tokens, top_k, hidden).float()).squeeze(1)
        t2 = _now_us()
        phases = {"token_exchange": t1 - t0, "reduce": t2 - t1}
        return CombineResult(y=y.to(dtype),
                             stats=self._stats("combine", phases, send.numel(), back.numel()))

    def close(self) -> None:
        """Nothing to release: the process group belongs to the caller."""
