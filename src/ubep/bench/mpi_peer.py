"""The MPI peer: dispatch and combine as a competent MPI programmer would write them.

A comparison point, not a backend of the library. Semantics are those of `ubep.Buffer`
(and `ubep.reference`): dispatch returns the rows routed to this rank's experts,
expert-major, then by source rank, then source token; combine returns each token's fp32
sum over its routed slots (in slot order) of `w * row`, in the expert output's dtype.

The implementation: per-(rank, expert) counts with `Alltoall`; rows (as bytes) and their
(token, slot, weight) with two concurrent `Ialltoallv`; the reordering into expert-major
order with numpy indexing, and the reduction in one compiled pass (`bag_sums`: fp32, slot
order, one rounding; K torch multiply-adds for other dtypes). Launch
under MPICH's `mpiexec` (`.venv/bin/mpiexec -n 2 python -m ubep.bench.mpi_peer check DIR`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ubep.runtime.torch_layout import BAG_WORDS, bag_sums_into, bags_by_token


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
    send_slot: np.ndarray           # [S] int64
    send_weight: np.ndarray         # [S] float32
    send_splits: np.ndarray         # [P] rows sent to each rank
    recv_splits: np.ndarray         # [P] rows received from each rank
    to_expert_major: np.ndarray     # [N] arrival index of each expert-major row
    slot_index: torch.Tensor        # [S] int64, token * K + slot of each sent row
    slot_weights: torch.Tensor      # [T, K] float32, 0 where not routed
    slot_routed: torch.Tensor       # [T, K] float32, 1 where routed, else 0
    # the rows sent back as bags for the compiled sums: token t's rows (in send order) in
    # slot order are bag_rows[bag_offsets[t]:bag_offsets[t + 1]]
    bag_rows: np.ndarray            # [S] int64
    bag_offsets: np.ndarray         # [T] int64


def _rows(raw: np.ndarray, dtype: torch.dtype, hidden: int) -> torch.Tensor:
    """`[N, row_bytes]` uint8 as `[N, hidden]` of `dtype`, sharing memory when N > 0."""
    if raw.shape[0] == 0:  # torch sees an empty array's strides as 0 and refuses the view
        return torch.empty(0, hidden, dtype=dtype)
    return torch.from_numpy(raw).view(dtype)


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

        recv = np.empty(int(recv_rows.sum()) * row_bytes, dtype=np.uint8)
        scount, rcount = send_rows * row_bytes, recv_rows * row_bytes
        sdispl = np.concatenate(([0], np.cumsum(scount)[:-1]))
        rdispl = np.concatenate(([0], np.cumsum(rcount)[:-1]))
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
        flat = topk_idx.numpy().reshape(-1)

        # (token, slot) pairs ordered by expert (hence by destination rank), then token
        routed = topk_idx >= 0
        pos = np.flatnonzero(flat >= 0)
        order = np.argsort(flat[pos], kind="stable")
        pos = pos[order]
        expert = flat[pos]
        send_token, send_slot = pos // top_k, pos % top_k
        send_weight = topk_weights.numpy().reshape(-1)[pos]
        send_counts = np.bincount(expert, minlength=self.num_experts).astype(np.int64)

        recv_counts = np.empty_like(send_counts)
        self.comm.Alltoall(send_counts, recv_counts)
        recv_counts = recv_counts.reshape(world, per_rank)   # [source rank, local expert]
        send_splits = send_counts.reshape(world, per_rank).sum(1)
        recv_splits = recv_counts.sum(1)

        rows = np.take(xb, send_token, axis=0)
        meta = np.empty((len(pos), 3), dtype=np.int32)
        meta[:, 0], meta[:, 1] = send_token, send_slot
        meta[:, 2] = send_weight.view(np.int32)
        # rows and their (token, slot, weight) travel at once: two nonblocking collectives
        recv, req_rows = self._alltoallv(rows, send_splits, recv_splits, row_bytes,
                                         blocking=False)
        recv_meta, req_meta = self._alltoallv(meta.view(np.uint8), send_splits, recv_splits, 12,
                                              blocking=False)
        MPI.Request.Waitall([req_rows, req_meta])

        # arrival order: source-major, then (expert, token); a stable sort by local expert
        # makes it expert-major, then source, then token
        label = np.repeat(np.tile(np.arange(per_rank), world), recv_counts.reshape(-1))
        to_expert_major = np.argsort(label, kind="stable")
        num_recv = len(to_expert_major)
        recv_x = np.take(recv.reshape(num_recv, row_bytes), to_expert_major, axis=0)
        recv_meta = np.take(recv_meta.view(np.int32).reshape(num_recv, 3), to_expert_major,
                            axis=0)
        src_rank = np.repeat(np.arange(world), recv_splits)[to_expert_major]
        bag_rows, bag_offsets = bags_by_token(send_token, send_slot, num_tokens)
        return MpiDispatch(
            recv_x=_rows(recv_x, x.dtype, hidden),
            recv_weights=torch.from_numpy(recv_meta[:, 2].copy().view(np.float32)),
            tokens_per_expert=torch.from_numpy(recv_counts.sum(0)),
            recv_src_rank=torch.from_numpy(src_rank.astype(np.int64)),
            recv_src_token=torch.from_numpy(recv_meta[:, 0].astype(np.int64)),
            recv_src_slot=torch.from_numpy(recv_meta[:, 1].astype(np.int64)),
            num_tokens=num_tokens, send_token=send_token, send_slot=send_slot,
            send_weight=send_weight, send_splits=send_splits, recv_splits=recv_splits,
            to_expert_major=to_expert_major, slot_index=torch.from_numpy(pos),
            slot_weights=torch.where(routed, topk_weights, 0.0),
            slot_routed=routed.to(torch.float32), bag_rows=bag_rows, bag_offsets=bag_offsets)

    def combine(self, expert_out: torch.Tensor, d: MpiDispatch,
                weighted: bool = True) -> torch.Tensor:
        """Send expert outputs back to their tokens; `[T, hidden]` fp32-accumulated sums."""
        hidden, dtype = expert_out.shape[1], expert_out.dtype
        row_bytes = hidden * expert_out.element_size()
        outb = expert_out.contiguous().view(torch.uint8).numpy().reshape(-1, row_bytes)
        arrival = np.empty_like(outb)
        arrival[d.to_expert_major] = outb       # back to arrival order, per source contiguous
        back = self._alltoallv(arrival, d.recv_splits, d.send_splits, row_bytes)
        back = _rows(back.reshape(-1, row_bytes), dtype, hidden)
        if dtype in BAG_WORDS:
            # each token's rows in one compiled pass: fp32 weights and accumulation, slot
            # order, one rounding (`bag_sums`; K torch multiply-adds over [T, hidden] took
            # ~5 ms at batch 128, the whole combine's time)
            return bag_sums_into(back, d.send_weight, weighted, d.bag_rows, d.bag_offsets,
                                 torch.empty(d.slot_weights.shape[0], hidden, dtype=dtype))
        # rows to token-major [T, K, hidden] (unrouted slots zero), then per slot, in slot
        # order, y += w[:, k] * rows[:, k] in fp32 (one pass over the rows, no fp32 copy)
        num_tokens, top_k = d.slot_weights.shape
        alloc = torch.empty if len(d.send_token) == num_tokens * top_k else torch.zeros
        slots = alloc(num_tokens * top_k, hidden, dtype=dtype)
        slots.index_copy_(0, d.slot_index, back)
        slots = slots.view(num_tokens, top_k, hidden)
        w = d.slot_weights if weighted else d.slot_routed
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
