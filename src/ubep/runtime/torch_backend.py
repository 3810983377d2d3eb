"""The torch.distributed backend: dispatch and combine as `all_to_all_single` collectives.

Works over any process group (gloo on CPU, NCCL, MPI): rows move with torch ops on the
tensors' own device, so it is the path across hosts and the bulk-synchronous baseline
everyone already has. Three collectives per dispatch+combine: per-(rank, expert) counts,
then the rows, then the expert outputs back.

What keeps it near the cost of those collectives (`ubep bench` times the same three calls on
the same bytes, bare, as its "raw collectives" line):

* the index bookkeeping (sorting pairs by expert, offsets, permutations) is a few small
  numpy operations on the host: a torch op costs several µs of dispatch overhead, a numpy op
  about one, and at batch 1 there are dozens of them;
* each row moves by `index_select` on whole rows (one memcpy per row; advanced indexing on a
  uint8 view gathers byte by byte, ~10x slower);
* rows for this rank never enter the collective: dispatch gathers them from a copy of `x`
  next to the received rows, combine from the expert outputs next to the returned rows, so
  one `index_select` reads both;
* a destination's (token, slot, weight) words travel in the same collective as its rows, as a
  few whole rows in front of them, so nothing is concatenated to each row;
* send and receive buffers are kept and grown, not allocated per call;
* combine sums each token's slots as one small batched matrix product per chunk of tokens.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from ubep.handle import (
    CombineResult,
    DispatchHandle,
    DispatchResult,
    new_dispatch_result,
    new_handle,
)
from ubep.options import BufferConfig
from ubep.stats import Stats

_META_WORDS = 3  # int32 token, int32 slot, float32 weight (its bits) per routed row
_META_BYTES = 4 * _META_WORDS
_REDUCE_CHUNK_BYTES = 4 << 20  # combine sums tokens in chunks of this many fp32 slot bytes


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _TorchState:
    """What combine needs from a dispatch (private to this backend; kept on the handle)."""

    __slots__ = ("slot_row", "slot_weight", "rows_per_dest", "rows_per_src", "num_back",
                 "num_own", "num_return", "to_source_major")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class TorchBackend:
    """Dispatch/combine over `torch.distributed.all_to_all_single`."""

    def __init__(self, config: BufferConfig, group, buffer_id: int):
        self.config = config
        self.group = group
        self.buffer_id = buffer_id
        self._scratch: dict[str, torch.Tensor] = {}
        #: the local expert of each (source rank, local expert) block, source-major
        self._block_expert = np.tile(np.arange(config.experts_per_rank), config.world_size)

    def _buffer(self, name: str, rows: int, row_bytes: int, device) -> torch.Tensor:
        """`[rows, row_bytes]` uint8 scratch, reused across calls (grown when too small)."""
        need = rows * row_bytes
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < need or buf.device != device:
            buf = torch.empty(max(need, 1), dtype=torch.uint8, device=device)
            self._scratch[name] = buf
        return buf[:need].view(rows, row_bytes)

    def _stats(self, op: str, phases: dict[str, float], sent: int, recv: int,
               collectives: list) -> Stats:
        c = self.config
        return Stats(op=op, backend="torch", rank=c.rank, total_us=sum(phases.values()),
                     phases_us=phases, bytes_sent=sent, bytes_recv=recv, payload_efficiency=None,
                     extra={"collectives": collectives})

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult:
        c = self.config
        world, per_rank, me, num_experts = c.world_size, c.experts_per_rank, c.rank, c.num_experts
        num_tokens, top_k = topk_idx.shape
        hidden = x.shape[1]
        row_bytes = hidden * x.element_size()
        device = x.device
        on_cpu = device.type == "cpu"

        def dev(a: np.ndarray) -> torch.Tensor:   # a host index array where the rows are
            t = torch.from_numpy(a)
            return t if on_cpu else t.to(device)

        t0 = _now_us()
        # routed (token, slot) pairs in send order: by expert (hence destination), then token
        flat = topk_idx.reshape(-1).cpu().numpy()
        key = np.where(flat >= 0, flat, num_experts)      # unrouted slots sort last
        order = np.argsort(key, kind="stable")
        send_counts = np.bincount(key, minlength=num_experts + 1)[:num_experts]
        t1 = _now_us()

        counts_out = dev(send_counts)
        counts_in = torch.empty_like(counts_out)
        dist.all_to_all_single(counts_in, counts_out, group=self.group)
        recv_counts = counts_in.cpu().numpy().reshape(world, per_rank)  # [source, local expert]
        t2 = _now_us()

        per_dest = send_counts.reshape(world, per_rank).sum(1).tolist()
        per_src = recv_counts.sum(1).tolist()
        num_send = sum(per_dest)
        pos = order[:num_send]
        send_token, send_slot = pos // top_k, pos % top_k
        weights = topk_weights.reshape(-1).cpu().numpy()
        # each remote destination gets [its pairs' (token, slot, weight), padded to whole rows]
        # then [its rows]; this rank's own pairs never enter the collective
        meta = np.empty((num_send, _META_WORDS), dtype=np.int32)
        meta[:, 0], meta[:, 1] = send_token, send_slot
        meta[:, 2] = weights[pos].view(np.int32)
        meta_bytes = meta.reshape(-1).view(np.uint8)
        send_rows = [0 if d == me else _ceil_div(n * _META_BYTES, row_bytes) + n
                     for d, n in enumerate(per_dest)]
        recv_rows = [0 if s == me else _ceil_div(n * _META_BYTES, row_bytes) + n
                     for s, n in enumerate(per_src)]
        xb = x.view(torch.uint8).view(num_tokens, row_bytes)
        send = self._buffer("send", sum(send_rows), row_bytes, device)
        row = first = 0
        for d in range(world):
            n = per_dest[d]
            if d != me and n:
                m = send_rows[d] - n
                send[row:row + m].view(-1)[:n * _META_BYTES].copy_(
                    dev(meta_bytes[first * _META_BYTES:(first + n) * _META_BYTES]))
                torch.index_select(xb, 0, dev(send_token[first:first + n]),
                                   out=send[row + m:row + send_rows[d]])
            row += send_rows[d]
            first += n
        t3 = _now_us()

        # received rows, then this rank's own tokens: one gather reads both
        num_remote = sum(recv_rows)
        work = self._buffer("recv", num_remote + num_tokens, row_bytes, device)
        dist.all_to_all_single(work[:num_remote], send, recv_rows, send_rows, group=self.group)
        t4 = _now_us()

        # pairs as received (source-major, then local expert, then token) -> expert-major
        self_first = sum(per_dest[:me])
        metas, row_of_pair = [], []
        row = 0
        for s in range(world):
            n = per_src[s]
            if s == me:
                if n:
                    work[num_remote:].copy_(xb)
                metas.append(meta[self_first:self_first + n])
                row_of_pair.append(send_token[self_first:self_first + n] + num_remote)
            elif n:
                m = recv_rows[s] - n
                words = work[row:row + m].view(-1)[:n * _META_BYTES].cpu().numpy()
                metas.append(words.view(np.int32).reshape(n, _META_WORDS))
                row_of_pair.append(np.arange(row + m, row + recv_rows[s]))
            row += recv_rows[s]
        meta_in = np.concatenate(metas)
        to_expert_major = np.argsort(np.repeat(self._block_expert, recv_counts.reshape(-1)),
                                     kind="stable")
        num_recv = len(to_expert_major)
        recv_x = torch.index_select(work, 0, dev(np.concatenate(row_of_pair)[to_expert_major]))
        recv_x = recv_x.view(x.dtype).view(num_recv, hidden)
        meta_in = meta_in[to_expert_major]
        origins = np.empty((3, num_recv), dtype=np.int64)
        origins[0] = np.repeat(np.arange(world), per_src)[to_expert_major]
        origins[1], origins[2] = meta_in[:, 0], meta_in[:, 1]
        t5 = _now_us()

        # combine: where each of this rank's slots finds its row in combine's work buffer
        # (returned remote rows in destination order, then own pairs, then a zero row for
        # unrouted slots), its weight (0 if unrouted), and the expert-major rows to send
        # back, source by source with this rank's own last
        n_own = per_dest[me]
        num_back = num_send - n_own
        back_row = np.arange(num_send)
        back_row[self_first + n_own:] -= n_own
        back_row[self_first:self_first + n_own] = np.arange(num_back, num_back + n_own)
        slot_row = np.full(num_tokens * top_k, num_send, dtype=np.int64)
        slot_row[pos] = back_row
        slot_weight = np.zeros(num_tokens * top_k, dtype=np.float32)
        slot_weight[pos] = weights[pos]
        to_source_major = np.empty_like(to_expert_major)
        to_source_major[to_expert_major] = np.arange(num_recv)
        own = sum(per_src[:me])
        to_source_major = np.concatenate([to_source_major[:own],
                                          to_source_major[own + per_src[me]:],
                                          to_source_major[own:own + per_src[me]]])
        state = _TorchState(
            slot_row=dev(slot_row.reshape(num_tokens, top_k)),
            slot_weight=slot_weight.reshape(num_tokens, top_k),
            rows_per_dest=[0 if d == me else n for d, n in enumerate(per_dest)],
            rows_per_src=[0 if s == me else n for s, n in enumerate(per_src)],
            num_back=num_back, num_own=n_own, num_return=num_recv - per_src[me],
            to_source_major=dev(to_source_major))
        handle = new_handle(self.buffer_id, call, num_tokens, num_recv, hidden, topk_idx,
                            topk_weights, origins, state)
        t6 = _now_us()
        phases = {"layout": t1 - t0 + t6 - t5, "count_exchange": t2 - t1, "pack": t3 - t2,
                  "token_exchange": t4 - t3, "reorder": t5 - t4}
        collectives = [("counts", [8 * per_rank] * world, [8 * per_rank] * world),
                       ("rows", [r * row_bytes for r in send_rows],
                        [r * row_bytes for r in recv_rows])]
        stats = self._stats("dispatch", phases, sum(send_rows) * row_bytes,
                            num_remote * row_bytes, collectives)
        tokens_per_expert = torch.from_numpy(recv_counts.sum(0)).to(device)
        return new_dispatch_result(recv_x, meta_in[:, 2].copy().view(np.float32),
                                   tokens_per_expert, handle, stats)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool, out: torch.Tensor | None = None) -> CombineResult:
        st: _TorchState = handle.state
        num_recv, hidden = expert_out.shape
        dtype, device = expert_out.dtype, expert_out.device
        row_bytes = hidden * expert_out.element_size()
        t0 = _now_us()
        # work buffer: [rows returned to this rank | own rows | zero row | rows to send back]
        back, own, nret = st.num_back, st.num_own, st.num_return
        work = self._buffer("combine", back + own + 1 + nret, row_bytes, device)
        raw = expert_out.view(torch.uint8).view(num_recv, row_bytes)
        to_send = work[back + own + 1:]
        torch.index_select(raw, 0, st.to_source_major[:nret], out=to_send)
        torch.index_select(raw, 0, st.to_source_major[nret:], out=work[back:back + own])
        work[back + own].zero_()
        t1 = _now_us()
        dist.all_to_all_single(work[:back], to_send, st.rows_per_dest, st.rows_per_src,
                               group=self.group)
        t2 = _now_us()
        # y[t] = sum over slots k of w[t, k] * row(t, k), in fp32: per chunk of tokens, one
        # gather of their slots' rows and one batched [1, K] x [K, hidden] product (chunks of
        # ~4 MiB of fp32 rows keep the operands in cache); unrouted slots read the zero row
        # with weight 0 (their given weight may be NaN)
        rows = work.view(dtype).view(-1, hidden)
        w = st.slot_weight if weighted else (st.slot_row.cpu().numpy() < back + own)
        w = torch.from_numpy(np.asarray(w, dtype=np.float32)).to(device)
        num_tokens, top_k = st.slot_row.shape
        y = out if out is not None else torch.empty(num_tokens, hidden, dtype=dtype,
                                                    device=device)
        chunk = max(1, _REDUCE_CHUNK_BYTES // (4 * top_k * hidden))
        for t in range(0, num_tokens, chunk):
            e = min(num_tokens, t + chunk)
            slots = rows.index_select(0, st.slot_row[t:e].view(-1)).view(e - t, top_k, hidden)
            y[t:e] = torch.bmm(w[t:e].unsqueeze(1), slots.float()).squeeze(1)
        t3 = _now_us()
        phases = {"pack": t1 - t0, "token_exchange": t2 - t1, "reduce": t3 - t2}
        collectives = [("rows_back", [n * row_bytes for n in st.rows_per_src],
                        [n * row_bytes for n in st.rows_per_dest])]
        return CombineResult(y=y, stats=self._stats("combine", phases, nret * row_bytes,
                                                    back * row_bytes, collectives))

    def close(self) -> None:
        """Drop the scratch buffers; the process group belongs to the caller."""
        self._scratch.clear()
