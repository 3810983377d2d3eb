"""The torch.distributed backend: dispatch and combine as `all_to_all_single` collectives.

Works over any process group (gloo on CPU, NCCL, MPI): rows move with torch ops on the
tensors' own device, so it is the path across hosts and the bulk-synchronous baseline
everyone already has. Three collectives per dispatch+combine: tokens per destination, then
the rows, then the partial sums back.

Bytes across ranks are what a cross-host user pays for, so each token crosses to a rank
once, however many of its experts live there (DeepEP's layout; top-8 of 16 experts on 2
ranks would otherwise send a token ~4 times to each):

* dispatch sends a token's row once to every rank hosting one of its experts, with its
  routing (token index, top-k expert ids and weights) as a few whole rows in front of each
  destination's rows; the receiver expands them into the expert-major per-(token, expert)
  layout `Buffer.dispatch` returns with one gather (`index_select`) - the copy pass;
* combine sums a token's slots on the expert side first (`embedding_bag`, fp32
  accumulation) and returns one partial row per (token, rank); the source sums its <= P
  partials. Partials travel in the expert output's dtype when that is fp32, bf16 or fp16
  (as DeepEP's combine does) and in fp32 for 8-bit outputs. So y is the fp32 sum of the
  slots in a different association than the oracle's slot order, and for 16-bit outputs
  each partial is rounded once more: a few units in the last place of the output dtype at
  most (the tests' tolerance), exact when a token's slots all live on one rank.

The gating weights reach `embedding_bag` in the rows' dtype, split as `hi + lo` (two
16-bit numbers, 16+ significant bits), so the 16-bit path keeps fp32-weight accuracy.
Index bookkeeping is numpy on the host (a numpy op costs about a µs, a torch op several);
send/receive scratch is kept and grown, not allocated per call. `Stats.extra["collectives"]`
lists each collective's bytes to/from every peer: `ubep bench` replays exactly those calls,
bare, as its "raw collectives" line.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ubep.handle import CombineResult, DispatchHandle, new_dispatch_result, new_handle
from ubep.options import BufferConfig
from ubep.stats import Stats

#: partial sums travel in the output dtype for these; in fp32 for everything else
_PARTIAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _TorchState:
    """What combine needs from a dispatch (private to this backend; kept on the handle).

    Expert side: `bag_rows`/`bag_offsets` gather each received token's slots (rows of
    expert_out, in slot order), `bag_weights` their weights; the bags come remote sources
    first (rank order), this rank's own tokens last. Source side: `final_rows`/
    `final_offsets` pick each of this rank's tokens' partials from the combine work buffer
    [partials returned by each remote rank, in rank order | own partials].
    """

    __slots__ = ("bag_rows", "bag_offsets", "bag_weights", "weights_by_dtype", "bag_rows2",
                 "bag_offsets2", "final_rows", "final_offsets", "sent_per_rank", "recv_per_rank",
                 "num_back", "num_own", "num_remote_bags")

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
                 call: int):
        c = self.config
        world, per_rank, me = c.world_size, c.experts_per_rank, c.rank
        num_tokens, top_k = topk_idx.shape
        hidden = x.shape[1]
        row_bytes = hidden * x.element_size()
        device = x.device
        on_cpu = device.type == "cpu"
        meta_words = 1 + 2 * top_k          # token index, top-k expert ids, top-k weight bits
        meta_bytes = 4 * meta_words

        def dev(a: np.ndarray) -> torch.Tensor:   # a host index array where the rows are
            t = torch.from_numpy(a)
            return t if on_cpu else t.to(device)

        t0 = _now_us()
        idx = topk_idx.numpy() if on_cpu else topk_idx.cpu().numpy()
        weights = topk_weights.numpy() if on_cpu else topk_weights.cpu().numpy()
        # hit[t, d]: token t has an expert on rank d (unrouted -1 lands in the extra column)
        hit = np.zeros((num_tokens, world + 1), dtype=bool)
        hit[np.arange(num_tokens)[:, None], idx // per_rank] = True
        hit = hit[:, :world]
        per_dest = np.count_nonzero(hit, axis=0)
        t1 = _now_us()

        counts_in = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_to_all_single(counts_in, dev(per_dest), group=self.group)
        per_src = counts_in.cpu().numpy()
        t2 = _now_us()

        # tokens by destination, then token; each remote destination gets
        # [their routing words, padded to whole rows][their rows]
        dest_of, token_of = np.nonzero(hit.T)
        meta = np.empty((len(token_of), meta_words), dtype=np.int32)
        meta[:, 0] = token_of
        meta[:, 1:1 + top_k] = idx[token_of]
        meta[:, 1 + top_k:] = weights[token_of].view(np.int32)
        meta_u8 = meta.view(np.uint8).reshape(-1)
        meta_rows = [_ceil_div(int(n) * meta_bytes, row_bytes) for n in per_dest]
        send_rows = [0 if d == me or not n else meta_rows[d] + int(n)
                     for d, n in enumerate(per_dest)]
        recv_rows = [0 if s == me or not n else _ceil_div(int(n) * meta_bytes, row_bytes) + int(n)
                     for s, n in enumerate(per_src)]
        xb = x.view(torch.uint8).view(num_tokens, row_bytes)
        send = self._buffer("send", sum(send_rows), row_bytes, device)
        first = np.concatenate(([0], np.cumsum(per_dest)))
        row = 0
        for d in range(world):
            if send_rows[d]:
                f, n, m = int(first[d]), int(per_dest[d]), meta_rows[d]
                send[row:row + m].view(-1)[:n * meta_bytes].copy_(
                    dev(meta_u8[f * meta_bytes:(f + n) * meta_bytes]))
                torch.index_select(xb, 0, dev(token_of[f:f + n]), out=send[row + m:row + m + n])
            row += send_rows[d]
        t3 = _now_us()

        # received rows by source, then this rank's own tokens: one gather reads both
        num_remote = sum(recv_rows)
        n_me = int(per_dest[me])
        own = token_of[first[me]:first[me + 1]]
        work = self._buffer("recv", num_remote + n_me, row_bytes, device)
        dist.all_to_all_single(work[:num_remote], send, recv_rows, send_rows, group=self.group)
        t4 = _now_us()
        if n_me:
            torch.index_select(xb, 0, dev(own), out=work[num_remote:])

        # received tokens ("bags"): remote sources in rank order, this rank's own last
        metas, rows, srcs = [], [], []
        row = 0
        for s in range(world):
            n = int(per_src[s])
            if s == me or not n:
                continue
            m = recv_rows[s] - n
            words = work[row:row + m].view(-1)[:n * meta_bytes]
            words = words.numpy() if on_cpu else words.cpu().numpy()
            metas.append(words.view(np.int32).reshape(n, meta_words))
            rows.append(np.arange(row + m, row + m + n))
            srcs.append(np.full(n, s))
            row += recv_rows[s]
        metas.append(meta[first[me]:first[me + 1]])
        rows.append(np.arange(num_remote, num_remote + n_me))
        srcs.append(np.full(n_me, me))
        bag_meta = np.concatenate(metas) if len(metas) > 1 else metas[0]
        bag_row = np.concatenate(rows) if len(rows) > 1 else rows[0]
        bag_src = np.concatenate(srcs) if len(srcs) > 1 else srcs[0]
        local = bag_meta[:, 1:1 + top_k] - me * per_rank
        bag_of, slot_of = np.nonzero((local >= 0) & (local < per_rank))  # pairs, bag-major
        expert_of = local[bag_of, slot_of]
        src_of = bag_src[bag_of]
        # expert-major, then source rank; the stable sort keeps token (and slot) order
        order = np.argsort(expert_of * world + src_of, kind="stable")
        num_recv = len(order)
        recv_x = torch.index_select(work, 0, dev(bag_row[bag_of[order]]))
        recv_x = recv_x.view(x.dtype).view(num_recv, hidden)
        pair_weight = bag_meta[:, 1 + top_k:].view(np.float32)[bag_of, slot_of]
        origins = np.empty((3, num_recv), dtype=np.int64)
        origins[0] = src_of[order]
        origins[1] = bag_meta[:, 0][bag_of[order]]
        origins[2] = slot_of[order]
        t5 = _now_us()

        # combine: each bag's rows of expert_out in slot order; each own token's partials
        # in the combine work buffer [returned by remote ranks in rank order | own]
        row_of_pair = np.empty(num_recv, dtype=np.int64)
        row_of_pair[order] = np.arange(num_recv)
        num_bags = len(bag_row)
        pairs_per_bag = np.bincount(bag_of, minlength=num_bags)
        bag_offsets = np.zeros(num_bags, dtype=np.int64)
        np.cumsum(pairs_per_bag[:-1], out=bag_offsets[1:])
        num_back = int(per_dest.sum()) - n_me
        base = np.concatenate(([0], np.cumsum(np.where(np.arange(world) == me, 0, per_dest))))
        base[me] = num_back
        tok_of, dst_of = np.nonzero(hit)                    # token-major, then rank
        rank_in_dest = np.cumsum(hit, axis=0)[tok_of, dst_of] - 1
        final_offsets = np.zeros(num_tokens, dtype=np.int64)
        np.cumsum(np.count_nonzero(hit, axis=1)[:-1], out=final_offsets[1:])
        state = _TorchState(
            bag_rows=dev(row_of_pair), bag_offsets=dev(bag_offsets),
            bag_weights=pair_weight, weights_by_dtype={}, bag_rows2=None, bag_offsets2=None,
            final_rows=dev(base[dst_of] + rank_in_dest), final_offsets=dev(final_offsets),
            sent_per_rank=[0 if d == me else int(n) for d, n in enumerate(per_dest)],
            recv_per_rank=[0 if s == me else int(n) for s, n in enumerate(per_src)],
            num_back=num_back, num_own=n_me, num_remote_bags=num_bags - n_me)
        handle = new_handle(self.buffer_id, call, num_tokens, num_recv, hidden, topk_idx,
                            topk_weights, origins, state)
        t6 = _now_us()
        phases = {"layout": t1 - t0 + t6 - t5, "count_exchange": t2 - t1, "pack": t3 - t2,
                  "token_exchange": t4 - t3, "reorder": t5 - t4}
        collectives = [("counts", [8] * world, [8] * world),
                       ("rows", [r * row_bytes for r in send_rows],
                        [r * row_bytes for r in recv_rows])]
        stats = self._stats("dispatch", phases, sum(send_rows) * row_bytes,
                            num_remote * row_bytes, collectives)
        return new_dispatch_result(recv_x, pair_weight[order],
                                   np.bincount(expert_of, minlength=per_rank), handle, stats)

    def _bag_weights(self, st: _TorchState, dtype: torch.dtype, device) -> torch.Tensor:
        """The slots' weights as `embedding_bag` takes them for rows of `dtype`.

        fp32 rows: the weights. 16-bit rows: each weight as `hi, lo` in that dtype (every
        slot row then appears twice in the bag), so the products keep ~16 significant bits
        of the weight instead of 8 (bf16) or 11 (fp16).
        """
        w = st.weights_by_dtype.get(dtype)
        if w is None:
            w32 = torch.from_numpy(st.bag_weights).to(device)
            if dtype == torch.float32:
                w = w32
            else:
                hi = w32.to(dtype)
                w = torch.stack([hi, (w32 - hi.float()).to(dtype)], 1).view(-1)
                if st.bag_rows2 is None:
                    st.bag_rows2 = st.bag_rows.repeat_interleave(2)
                    st.bag_offsets2 = st.bag_offsets * 2
            st.weights_by_dtype[dtype] = w
        return w

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool, out: torch.Tensor | None = None) -> CombineResult:
        st: _TorchState = handle.state
        dtype, device = expert_out.dtype, expert_out.device
        hidden = expert_out.shape[1]
        t0 = _now_us()
        pdtype = dtype if dtype in _PARTIAL_DTYPES else torch.float32
        rows = expert_out if pdtype == dtype else expert_out.to(pdtype)
        # one partial per received token: the sum of its slots here, fp32 accumulation
        if not weighted:
            partial = F.embedding_bag(st.bag_rows, rows, st.bag_offsets, mode="sum")
        elif pdtype == torch.float32:
            partial = F.embedding_bag(st.bag_rows, rows, st.bag_offsets, mode="sum",
                                      per_sample_weights=self._bag_weights(st, pdtype, device))
        else:
            w = self._bag_weights(st, pdtype, device)   # [hi, lo] per slot: each row twice
            partial = F.embedding_bag(st.bag_rows2, rows, st.bag_offsets2, mode="sum",
                                      per_sample_weights=w)
        prow_bytes = hidden * partial.element_size()
        back, own = st.num_back, st.num_own
        work = self._buffer("combine", back + own, prow_bytes, device)
        pb = partial.view(torch.uint8).view(-1, prow_bytes)
        nret = st.num_remote_bags
        if own:
            work[back:].copy_(pb[nret:])
        t1 = _now_us()
        dist.all_to_all_single(work[:back], pb[:nret], st.sent_per_rank, st.recv_per_rank,
                               group=self.group)
        t2 = _now_us()
        y = F.embedding_bag(st.final_rows, work.view(pdtype).view(-1, hidden), st.final_offsets,
                            mode="sum")
        if pdtype != dtype:
            y = y.to(dtype)
        if out is not None:
            y = out.copy_(y)
        t3 = _now_us()
        phases = {"reduce": t1 - t0 + t3 - t2, "token_exchange": t2 - t1}
        collectives = [("partials_back", [n * prow_bytes for n in st.recv_per_rank],
                        [n * prow_bytes for n in st.sent_per_rank])]
        return CombineResult(y=y, stats=self._stats("combine", phases, nret * prow_bytes,
                                                    back * prow_bytes, collectives))

    def close(self) -> None:
        """Drop the scratch buffers; the process group belongs to the caller."""
        self._scratch.clear()
