"""The MPI peer: dispatch and combine as a competent MPI programmer would write them.

A comparison point, not a backend of the library. Semantics are those of `ubep.Buffer`
(and `ubep.reference`): dispatch returns the rows routed to this rank's experts,
expert-major, then by source rank, then source token; combine returns each token's fp32
sum over its routed slots (in slot order) of `w * row`, in the expert output's dtype.

The implementation: per-(rank, expert) counts with `Alltoall`; rows (as bytes) and their
(token, slot, weight) with two concurrent `Ialltoallv`; the bookkeeping around them (sorting
the sends by expert, packing, reordering what arrived into expert-major order, scattering
expert outputs back) in a few compiled passes, and the reduction in one (`bag_sums`: fp32,
slot order, one rounding; K torch multiply-adds for other dtypes). Until 2026-12-01 night
the bookkeeping was ~30 numpy calls, 5-8x the peer's own collectives at batch 1. Launch
under MPICH's `mpiexec` (`.venv/bin/mpiexec -n 2 python -m ubep.bench.mpi_peer check DIR`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numba import njit

from ubep.runtime.torch_layout import BAG_WORDS, bag_sums_into, copy_row, source_order


@dataclass
class MpiDispatch:
    """What `MpiPeer.dispatch` returns; the fields mirror `ubep.DispatchResult`."""

    recv_x: torch.Tensor            # [N, hidden], dtype of x
    recv_weights: torch.Tensor      # [N] float32
    tokens_per_expert: torch.Tensor  # [E / P] int64
    recv_src_rank: torch.Tensor     # [N] int64
    recv_src_token: torch.Tensor    # [N] int64
    recv_src_slot: torch.Tensor     # [N] int64
    # for combine
    num_tokens: int
    send_token: np.ndarray          # [S] int64, rows in the order they were sent
    send_weight: np.ndarray         # [S] float32
    send_splits: np.ndarray         # [P] rows sent to each rank
    recv_splits: np.ndarray         # [P] rows received from each rank
    to_expert_major: np.ndarray     # [N] arrival index of each expert-major row
    slot_index: torch.Tensor        # [S] int64, token * K + slot of each sent row
    topk_idx: torch.Tensor          # [T, K] int64, the routing (combine's non-bag dtypes)
    topk_weights: torch.Tensor      # [T, K] float32
    # the rows sent back as bags for the compiled sums: token t's rows (in send order) in
    # slot order are bag_rows[bag_offsets[t]:bag_offsets[t + 1]]
    bag_rows: np.ndarray            # [S] int64
    bag_offsets: np.ndarray         # [T] int64


def _rows(raw: np.ndarray, dtype: torch.dtype, hidden: int) -> torch.Tensor:
    """`[N, row_bytes]` uint8 as `[N, hidden]` of `dtype`, sharing memory when N > 0."""
    if raw.shape[0] == 0:  # torch sees an empty array's strides as 0 and refuses the view
        return torch.empty(0, hidden, dtype=dtype)
    return torch.from_numpy(raw).view(dtype)


@njit(nogil=True, cache=True)
def _pack(xb, idx, weights, num_experts):
    """The sends, in one pass: the routed (token, slot) pairs ordered by expert (hence by
    destination rank), then token (`source_order` of their experts); their rows (`xb`
    `[T, row_bytes]` uint8) and their `(token, slot, weight bits)` int32 words packed in that
    order; per-expert counts; and combine's bags (token t's sent rows in slot order) and each
    pair's flat slot index."""
    num_tokens, top_k = idx.shape
    pair = np.empty(num_tokens * top_k, np.int64)     # routed (t, k) as t * K + k, in order
    expert = np.empty(num_tokens * top_k, np.int64)
    bag_offsets = np.empty(num_tokens, np.int64)
    total = 0
    for t in range(num_tokens):
        bag_offsets[t] = total                          # pair j is sent row bag_rows[j]
        for k in range(top_k):
            if idx[t, k] >= 0:
                pair[total], expert[total] = t * top_k + k, idx[t, k]
                total += 1
    order = source_order(expert[:total], num_experts)
    counts = np.zeros(num_experts, np.int64)
    slot_index = np.empty(total, np.int64)
    bag_rows = np.empty(total, np.int64)
    send_token = np.empty(total, np.int64)
    send_weight = np.empty(total, np.float32)
    meta = np.empty((total, 3), np.int32)
    wbits = send_weight.view(np.int32)
    rb = xb.shape[1]
    rows = np.empty((total, rb), np.uint8)
    flat_x, flat_rows = xb.reshape(-1), rows.reshape(-1)
    for i in range(total):
        j = order[i]
        p = pair[j]
        counts[expert[j]] += 1
        slot_index[i], bag_rows[j], send_token[i] = p, i, p // top_k
        send_weight[i] = weights[p // top_k, p % top_k]
        meta[i, 0], meta[i, 1], meta[i, 2] = p // top_k, p % top_k, wbits[i]
        copy_row(flat_rows, i * rb, flat_x, send_token[i] * rb, rb)
    return send_token, send_weight, counts, rows, meta, slot_index, bag_rows, bag_offsets


@njit(nogil=True, cache=True)
def _unpack(recv, recv_meta, recv_counts, rb):
    """What arrived (`recv` rows of `rb` bytes, flat; `recv_meta` `[N, 3]` int32), source-major
    then expert, into expert-major order, then source, then token: recv_x `[N, rb]`, weights,
    tokens per expert, source rank / token / slot of each row, and each row's arrival index."""
    world, per_rank = recv_counts.shape
    first = np.empty((world, per_rank), np.int64)
    n = 0
    for s in range(world):
        for e in range(per_rank):
            first[s, e] = n
            n += recv_counts[s, e]
    recv_x = np.empty((n, rb), np.uint8)
    weights = np.empty(n, np.float32)
    wbits = weights.view(np.int32)
    tpe = np.zeros(per_rank, np.int64)
    src_rank = np.empty(n, np.int64)
    src_token = np.empty(n, np.int64)
    src_slot = np.empty(n, np.int64)
    arrival = np.empty(n, np.int64)
    out = recv_x.reshape(-1)
    j = 0
    for e in range(per_rank):
        for s in range(world):
            tpe[e] += recv_counts[s, e]
            for i in range(first[s, e], first[s, e] + recv_counts[s, e]):
                copy_row(out, j * rb, recv, i * rb, rb)
                src_rank[j], src_token[j], src_slot[j] = s, recv_meta[i, 0], recv_meta[i, 1]
                wbits[j] = recv_meta[i, 2]
                arrival[j] = i
                j += 1
    return recv_x, weights, tpe, src_rank, src_token, src_slot, arrival


@njit(nogil=True, cache=True)
def _scatter(rows, arrival, out):
    """Row j of `rows` (`[N, rb]` uint8) to row `arrival[j]` of `out`: expert outputs back in
    the order their rows arrived (per source contiguous, as they go back)."""
    rb = rows.shape[1]
    flat_rows, flat_out = rows.reshape(-1), out.reshape(-1)
    for j in range(arrival.shape[0]):
        copy_row(flat_out, arrival[j] * rb, flat_rows, j * rb, rb)


@njit(nogil=True, cache=True)
def counts_displs(rows, unit):
    """Alltoallv's byte counts and displacements for `rows` rows of `unit` bytes per rank,
    and their total."""
    counts = rows * unit
    displs = np.empty_like(counts)
    total = 0
    for r in range(counts.shape[0]):
        displs[r] = total
        total += counts[r]
    return counts, displs, total


@njit(nogil=True, cache=True)
def _per_rank(counts, world):
    """Per-expert counts `[world * per_rank]` summed per rank."""
    per_rank = counts.shape[0] // world
    out = np.zeros(world, np.int64)
    for r in range(world):
        for e in range(per_rank):
            out[r] += counts[r * per_rank + e]
    return out


class MpiPeer:
    """Dispatch/combine over an mpi4py communicator (experts placed contiguously by rank)."""

    def __init__(self, comm, num_experts: int):
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} must be divisible by the "
                             f"communicator size {self.world}")
        self.num_experts = num_experts
        self.per_rank = num_experts // self.world

    def _alltoallv(self, send: np.ndarray, send_rows: np.ndarray, recv_rows: np.ndarray,
                   row_bytes: int, *, blocking: bool = True):
        """Alltoallv of rows of `row_bytes`; the received bytes (and the request if not
        `blocking`: wait on it before reading them)."""
        from mpi4py import MPI

        scount, sdispl, _ = counts_displs(send_rows, row_bytes)
        rcount, rdispl, total = counts_displs(recv_rows, row_bytes)
        recv = np.empty(total, dtype=np.uint8)
        args = ([send.reshape(-1), (scount, sdispl), MPI.BYTE],
                [recv, (rcount, rdispl), MPI.BYTE])
        if blocking:
            self.comm.Alltoallv(*args)
            return recv
        return recv, self.comm.Ialltoallv(*args)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> MpiDispatch:
        """Send each token's row to every rank hosting one of its experts.

        Arguments:
            x: `[T, hidden]`, contiguous, any dtype; moved as bytes.
            topk_idx: `[T, K]` int64, `-1` = slot not routed.
            topk_weights: `[T, K]` float32.
        """
        from mpi4py import MPI

        world, per_rank = self.world, self.per_rank
        num_tokens, top_k = topk_idx.shape
        hidden = x.shape[1]
        row_bytes = hidden * x.element_size()
        xb = x.view(torch.uint8).numpy().reshape(num_tokens, row_bytes)

        (send_token, send_weight, send_counts, rows, meta, slot_index, bag_rows,
         bag_offsets) = _pack(xb, topk_idx.numpy(), topk_weights.numpy(), self.num_experts)
        recv_counts = np.empty_like(send_counts)
        self.comm.Alltoall(send_counts, recv_counts)
        send_splits = _per_rank(send_counts, world)
        recv_splits = _per_rank(recv_counts, world)
        # rows and their (token, slot, weight) travel at once: two nonblocking collectives
        recv, req_rows = self._alltoallv(rows, send_splits, recv_splits, row_bytes,
                                         blocking=False)
        recv_meta, req_meta = self._alltoallv(meta.view(np.uint8), send_splits, recv_splits, 12,
                                              blocking=False)
        MPI.Request.Waitall([req_rows, req_meta])
        recv_x, recv_weights, tpe, src_rank, src_token, src_slot, arrival = _unpack(
            recv, recv_meta.view(np.int32).reshape(-1, 3), recv_counts.reshape(world, per_rank),
            row_bytes)
        return MpiDispatch(
            recv_x=_rows(recv_x, x.dtype, hidden), recv_weights=torch.from_numpy(recv_weights),
            tokens_per_expert=torch.from_numpy(tpe), recv_src_rank=torch.from_numpy(src_rank),
            recv_src_token=torch.from_numpy(src_token), recv_src_slot=torch.from_numpy(src_slot),
            num_tokens=num_tokens, send_token=send_token,
            send_weight=send_weight, send_splits=send_splits, recv_splits=recv_splits,
            to_expert_major=arrival, slot_index=torch.from_numpy(slot_index),
            topk_idx=topk_idx, topk_weights=topk_weights, bag_rows=bag_rows,
            bag_offsets=bag_offsets)

    def combine(self, expert_out: torch.Tensor, d: MpiDispatch,
                weighted: bool = True) -> torch.Tensor:
        """Send expert outputs back to their tokens; `[T, hidden]` fp32-accumulated sums."""
        hidden, dtype = expert_out.shape[1], expert_out.dtype
        row_bytes = hidden * expert_out.element_size()
        outb = expert_out.contiguous().view(torch.uint8).numpy().reshape(-1, row_bytes)
        arrival = np.empty_like(outb)
        _scatter(outb, d.to_expert_major, arrival)  # back to arrival order, per source
        back = self._alltoallv(arrival, d.recv_splits, d.send_splits, row_bytes)
        back = _rows(back.reshape(-1, row_bytes), dtype, hidden)
        if dtype in BAG_WORDS:
            # each token's rows in one compiled pass: fp32 weights and accumulation, slot
            # order, one rounding (`bag_sums`; K torch multiply-adds over [T, hidden] took
            # ~5 ms at batch 128, the whole combine's time)
            return bag_sums_into(back, d.send_weight, weighted, d.bag_rows, d.bag_offsets,
                                 torch.empty(d.num_tokens, hidden, dtype=dtype))
        # rows to token-major [T, K, hidden] (unrouted slots zero), then per slot, in slot
        # order, y += w[:, k] * rows[:, k] in fp32 (one pass over the rows, no fp32 copy)
        num_tokens, top_k = d.topk_idx.shape
        routed = d.topk_idx >= 0
        alloc = torch.empty if len(d.send_token) == num_tokens * top_k else torch.zeros
        slots = alloc(num_tokens * top_k, hidden, dtype=dtype)
        slots.index_copy_(0, d.slot_index, back)
        slots = slots.view(num_tokens, top_k, hidden)
        w = torch.where(routed, d.topk_weights, 0.0) if weighted else routed.to(torch.float32)
        y = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        for k in range(top_k):
            y.addcmul_(slots[:, k], w[:, k:k + 1])
        return y.to(dtype)


# -- `python -m ubep.bench.mpi_peer check OUT_DIR`: one run whose results a test checks ----

def _check(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from ubep.testing import make_routing, make_tokens

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    dtype = getattr(torch, args.dtype)
    peer = MpiPeer(comm, args.experts)
    for routing in args.routing.split(","):
        num_tokens = args.tokens + rank  # unequal T across ranks
        idx, w = make_routing(num_tokens, args.top_k, args.experts, kind=routing,
                              seed=args.seed + rank)
        x = make_tokens(rank, num_tokens, args.hidden, dtype, seed=args.seed)
        d = peer.dispatch(x, idx, w)
        expert_out = (d.recv_x.to(torch.float32) * 0.5 + 1).to(dtype)
        y = peer.combine(expert_out, d)
        torch.save({"x": x, "topk_idx": idx, "topk_weights": w, "recv_x": d.recv_x,
                    "recv_weights": d.recv_weights, "tokens_per_expert": d.tokens_per_expert,
                    "recv_src_rank": d.recv_src_rank, "recv_src_token": d.recv_src_token,
                    "recv_src_slot": d.recv_src_slot, "expert_out": expert_out, "y": y},
                   Path(args.out_dir) / f"{routing}-rank{rank}.pt")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ubep.bench.mpi_peer")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="dispatch+combine per routing; each rank saves "
                                      "<routing>-rank<r>.pt")
    c.add_argument("out_dir")
    c.add_argument("--tokens", type=int, default=5)
    c.add_argument("--hidden", type=int, default=16)
    c.add_argument("--top-k", type=int, default=4)
    c.add_argument("--experts", type=int, default=8)
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--routing", default="uniform", help="comma-separated routing kinds")
    c.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
