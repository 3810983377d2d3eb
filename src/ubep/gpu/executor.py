"""`EmulatedSuperpod`: P expert-parallel ranks on one device, dispatch and combine in Triton."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ubep.errors import BrokenBufferError, UbepError
from ubep.gpu import kernels as K
from ubep.plan import Plan, Tier, Topology, make_plan
from ubep.validate import check_topk_idx

MODES = ("ubep", "bsp")
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_PHASES = {K.ERR_COUNTS: "dispatch counts", K.ERR_ROWS: "dispatch rows",
           K.ERR_COMBINE: "combine rows"}


class SpinLimitError(UbepError, TimeoutError):
    """A kernel program polled a flag `max_spins` times without seeing it set."""

    def __init__(self, rank: int, phase: str, peer: int, missing: int, max_spins: int):
        self.rank, self.phase, self.peer, self.missing = rank, phase, peer, missing
        super().__init__(
            f"emulated rank {rank} gave up in phase {phase!r} after {max_spins} polls: "
            f"{missing} flag(s) not set, the first from rank {peer}")


def device_topology(num_ranks: int, programs_per_rank: int) -> Topology:
    """One device as a fabric: every pair of emulated ranks one hop apart (one tier).

    Only the hop classes matter to the planner; latency and bandwidth are nominal (an
    H200's 4.8 TB/s HBM shared by the ranks), used by no executor here.
    """
    return Topology(
        name="device", num_ranks=num_ranks, workers_per_rank=programs_per_rank,
        atomic_block_bytes=16, flag_bytes=4,
        tiers=(Tier("device", num_ranks, 1000.0, 4800.0 / num_ranks),),
        local_latency_ns=1000.0, local_bandwidth_GBps=4800.0 / num_ranks,
        description="emulated ranks sharing one device's memory")


@dataclass(frozen=True, eq=False)
class Routing:
    """One routing of all P ranks, planned and on the device; reusable across calls.

    Attributes:
        plans: each rank's `ubep.plan.Plan`.
        topk_idx: `[P, T, K]` int32 on the device; `-1` = slot not routed.
        topk_weights: `[P, T, K]` float32 on the device.
        num_recv: rows each rank receives (from the plans; the kernels count them again).
        window_rows: the most rows one rank sends one other rank.
    """

    plans: tuple[Plan, ...]
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_recv: tuple[int, ...]
    window_rows: int
    # kernel arguments: per-rank counts `[P, E]`, the count programs' destination cuts
    # `[C + 1]`, the senders' ranges `[P * S + 1]` into the flat send arrays `[N]`
    cnt: torch.Tensor
    count_dest: torch.Tensor
    send_lo: torch.Tensor
    send_tok: torch.Tensor
    send_slot: torch.Tensor
    send_dst: torch.Tensor
    send_pos: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk_idx.shape[2])


@dataclass(frozen=True, eq=False)
class RankDispatch:
    """What one emulated rank received; the fields of `ubep.DispatchResult` (views)."""

    recv_x: torch.Tensor            # [N, hidden], dtype of x
    recv_weights: torch.Tensor      # [N] float32
    tokens_per_expert: torch.Tensor  # [E / P] int64
    recv_src_rank: torch.Tensor     # [N] int64
    recv_src_token: torch.Tensor    # [N] int64
    recv_src_slot: torch.Tensor     # [N] int64


@dataclass(frozen=True, eq=False)
class GpuDispatch:
    """Every rank's received rows, padded to one device tensor per field.

    Rank r's rows are `recv_x[r, :num_recv[r]]`, expert-major, then by source rank, then
    source token (the order of `ubep.reference`). The tensors are the superpod's buffers:
    valid until its next dispatch.

    Attributes:
        recv_x: `[P, NC, hidden]`, dtype of x.
        recv_weights: `[P, NC]` float32.
        recv_src_rank: `[P, NC]` int32.
        recv_src_token_slot: `[P, NC]` int32, `token * K + slot` on the source.
        tokens_per_expert: `[P, E / P]` int32, counted on the device from the received counts.
        num_recv: rows each rank received.
        routing: the `Routing` dispatched (combine sends rows back along it).
        call: the superpod's call number (combine checks this is its latest dispatch).
    """

    recv_x: torch.Tensor
    recv_weights: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_token_slot: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_recv: tuple[int, ...]
    routing: Routing
    call: int

    def rank(self, r: int) -> RankDispatch:
        """Rank r's result, trimmed to its rows, origins as int64 like `DispatchResult`."""
        n = self.num_recv[r]
        ts = self.recv_src_token_slot[r, :n].to(torch.int64)
        k = self.routing.top_k
        return RankDispatch(
            recv_x=self.recv_x[r, :n], recv_weights=self.recv_weights[r, :n],
            tokens_per_expert=self.tokens_per_expert[r].to(torch.int64),
            recv_src_rank=self.recv_src_rank[r, :n].to(torch.int64),
            recv_src_token=ts // k, recv_src_slot=ts % k)


class EmulatedSuperpod:
    """P expert-parallel ranks in one process on one device, each a set of Triton programs.

    Every rank's buffers live in one device tensor per kind (the device's memory is the
    superpod's unified address space); the same `ubep.plan.Plan` as the other executors tells
    each program what to send where. Experts are placed contiguously: rank r owns experts
    `[r*E/P, (r+1)*E/P)`.

    Modes:
        "ubep": one kernel per call. Dispatch: `count_programs` programs per rank send the
            counts, `send_programs` copy rows into the destinations' windows, setting a flag
            per row, `recv_programs` wait for every source's counts, then move each row to
            its place once its flag holds this call's epoch. No barrier: a receiver starts
            on the rows that have arrived. Combine: `count_programs + send_programs` per
            rank send rows back, `recv_programs` reduce each token once its rows' flags are
            set. All programs of a kernel must be resident at once: `P * (count_programs +
            send_programs + recv_programs)` <= `resident_programs` (checked here).
        "bsp": the barrier-separated baseline: dispatch is four kernels (counts, send,
            offsets, reorder), combine two (send back, reduce); each kernel boundary is the
            global barrier between phases. As in the plan's "bsp" mode every program does
            every phase: the send, reorder, send-back and reduce kernels each run all
            `count_programs + send_programs + recv_programs` programs of every rank, so
            each phase has the whole grid (counts and offsets: one program per rank).

    Arguments:
        num_ranks: emulated ranks P (>= 1).
        num_experts: global experts E, divisible by P.
        hidden: elements per row.
        mode: "ubep" | "bsp".
        device: a CUDA device, or "cpu" under Triton's interpreter; None = CUDA if present.
        count_programs, send_programs, recv_programs: programs per rank in each role
            (mode "bsp": their sum is the programs per rank of every phase).
        schedule: the planner's token-to-program schedule ("static" | "balanced" |
            "hierarchical").
        topology: the fabric the planner sees; None = `device_topology` (one tier).
        resident_programs: programs the device runs at once; None = its SM count (one
            program per SM, always resident), unlimited under the interpreter (which runs
            programs in id order, so no program waits on one that has not run). The single
            kernel hands out roles in arrival order, so it cannot deadlock even past this
            limit; the check keeps every role running side by side, which is the point.
        max_spins: polls of a flag before a program gives up (`SpinLimitError`).
        rows_per_step: rows a program moves per step (a power of two).
        block_hidden: row elements per tile; None = min(next power of two of hidden, 2048).
        num_warps: Triton warps per program (a GPU setting; the interpreter ignores it).
    """

    def __init__(self, num_ranks: int, num_experts: int, hidden: int, *, mode: str = "ubep",
                 device: torch.device | str | None = None, count_programs: int = 1,
                 send_programs: int = 2, recv_programs: int = 1,
                 schedule: str = "hierarchical", topology: Topology | None = None,
                 resident_programs: int | None = None, max_spins: int = 1 << 20,
                 rows_per_step: int = 8, block_hidden: int | None = None, num_warps: int = 8):
        for name, value, least in (("num_ranks", num_ranks, 1), ("num_experts", num_experts, 1),
                                   ("hidden", hidden, 1), ("count_programs", count_programs, 1),
                                   ("send_programs", send_programs, 1),
                                   ("recv_programs", recv_programs, 1),
                                   ("max_spins", max_spins, 1), ("rows_per_step", rows_per_step, 1),
                                   ("num_warps", num_warps, 1)):
            _check_int(name, value, least)
        if num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} must be divisible by "
                             f"num_ranks={num_ranks}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {', '.join(map(repr, MODES))}")
        if rows_per_step & (rows_per_step - 1):
            raise ValueError(f"rows_per_step={rows_per_step} must be a power of two")
        self.device = _resolve_device(device)
        self.num_ranks, self.num_experts, self.hidden = num_ranks, num_experts, hidden
        self.experts_per_rank = num_experts // num_ranks
        self.mode, self.schedule, self.max_spins = mode, schedule, max_spins
        self.count_programs = count_programs
        self.send_programs, self.recv_programs = send_programs, recv_programs
        self.rows_per_step, self.num_warps = rows_per_step, num_warps
        if block_hidden is None:
            block_hidden = min(K.next_pow2(hidden), 2048)
        _check_int("block_hidden", block_hidden, 1)
        if block_hidden & (block_hidden - 1):
            raise ValueError(f"block_hidden={block_hidden} must be a power of two")
        self.block_hidden = block_hidden
        per_rank = count_programs + send_programs + recv_programs
        self.programs_per_rank = per_rank
        workers = count_programs + send_programs if mode == "ubep" else per_rank
        self.topology = topology if topology is not None else device_topology(num_ranks, workers)
        if self.topology.num_ranks != num_ranks:
            raise ValueError(f"topology has {self.topology.num_ranks} ranks; num_ranks="
                             f"{num_ranks} must match")
        self.resident_programs = _resident_programs(self.device, resident_programs)
        self.kernel_programs = num_ranks * per_rank if mode == "ubep" else 0
        if mode == "ubep" and self.resident_programs is not None \
                and self.kernel_programs > self.resident_programs:
            raise ValueError(
                f"mode='ubep' runs all {self.kernel_programs} programs ({num_ranks} ranks x "
                f"{per_rank}) in one kernel, and they must be resident at once; this device "
                f"holds {self.resident_programs} (resident_programs). Use fewer ranks or "
                f"programs per rank, or mode='bsp'")
        self._bp = K.next_pow2(num_ranks)
        self._be = K.next_pow2(self.experts_per_rank)
        dev = self.device
        P, EL = num_ranks, self.experts_per_rank
        self._counts = torch.zeros(P, P, EL, dtype=torch.int32, device=dev)
        self._count_flag = torch.zeros(P, P, dtype=torch.int32, device=dev)
        self._tokens_per_expert = torch.zeros(P, EL, dtype=torch.int32, device=dev)
        self._offsets = torch.zeros(P, self._be * self._bp, dtype=torch.int32, device=dev)
        self._wbases = torch.zeros_like(self._offsets)
        self._err = torch.zeros(max(self.kernel_programs, 1), 4, dtype=torch.int32, device=dev)
        self._win_rows = self._recv_rows = self._comb_rows = 0
        self._word: torch.dtype | None = None
        self._cwin: torch.Tensor | None = None
        # [epoch, programs done, role tickets] of the single-kernel calls; flags start at 0,
        # epochs at 1
        self._state = torch.tensor([1, 0, 0], dtype=torch.int32, device=dev)
        self._calls = 0
        self._last_dispatch = -1
        self._broken: str | None = None

    # -- planning ------------------------------------------------------------------------
    def route(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Routing:
        """Plan every rank's sends for one routing and put the plan on the device.

        Arguments:
            topk_idx: `[P, T, K]` int32/int64; rank s's token t goes to experts
                `topk_idx[s, t]`, distinct per token; `-1` = slot not routed.
            topk_weights: `[P, T, K]` float; the gating weights (combine's weights).
        """
        P, E = self.num_ranks, self.num_experts
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 3 \
                or topk_idx.shape[0] != P:
            raise ValueError(f"topk_idx must be a [num_ranks={P}, num_tokens, top_k] tensor, "
                             f"got {_shape(topk_idx)}")
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights must be a tensor of topk_idx's shape "
                             f"{tuple(topk_idx.shape)}, got {_shape(topk_weights)}")
        if not topk_weights.is_floating_point():
            raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
        idx_host = topk_idx.detach().to("cpu", torch.int64)
        for s in range(P):
            try:
                check_topk_idx(idx_host[s], num_experts=E, num_tokens=None)
            except (ValueError, TypeError) as e:
                raise type(e)(f"rank {s}: {e}") from None
        idx_np = idx_host.numpy()
        ubep = self.mode == "ubep"
        plans = tuple(make_plan(
            idx_np[s], topology=self.topology, rank=s, num_experts=E,
            workers=self.count_programs + self.send_programs if ubep else self.programs_per_rank,
            count_workers=self.count_programs if ubep else None, schedule=self.schedule,
            mode=self.mode) for s in range(P))
        EL = self.experts_per_rank
        tok, slot, dst, pos, lo = [], [], [], [], [np.zeros(1, np.int64)]
        base, window_rows, num_recv = 0, 0, np.zeros(P, np.int64)
        for plan in plans:
            per_dest = plan.send_counts.reshape(P, EL)
            # a source's window at rank d holds its rows for d, expert by expert
            start = (np.cumsum(per_dest, axis=1) - per_dest).reshape(-1)
            tok.append(plan.sends[:, 0])
            slot.append(plan.sends[:, 1])
            dst.append(plan.sends[:, 2])
            pos.append(start[plan.send_experts] + plan.window_pos)
            lo.append(base + plan.worker_offsets[1:])
            base += plan.num_sends
            window_rows = max(window_rows, int(per_dest.sum(axis=1).max(initial=0)))
            num_recv += per_dest.sum(axis=1)
        cuts = plans[0].count_dest_ranges if ubep else [(0, P)]
        count_dest = [c[0] for c in cuts] + [cuts[-1][1]]

        def dev(a, dtype=torch.int32):
            return torch.as_tensor(np.ascontiguousarray(a)).to(self.device, dtype)

        return Routing(
            plans=plans, topk_idx=dev(idx_np),
            topk_weights=topk_weights.detach().to(self.device, torch.float32).contiguous(),
            num_recv=tuple(int(n) for n in num_recv), window_rows=window_rows,
            cnt=dev(np.stack([p.send_counts for p in plans])), count_dest=dev(count_dest),
            send_lo=dev(np.concatenate(lo)), send_tok=dev(np.concatenate(tok)),
            send_slot=dev(np.concatenate(slot)), send_dst=dev(np.concatenate(dst)),
            send_pos=dev(np.concatenate(pos)))

    # -- calls ---------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, routing: Routing, *, check: bool = True) -> GpuDispatch:
        """Send every rank's rows to their experts' ranks.

        Arguments:
            x: `[P, T, hidden]` on the superpod's device, 1-, 2- or 4-byte elements; rank s's
                tokens are `x[s]`.
            routing: from `route` (T and K must match x).
            check: wait for the kernels and raise `SpinLimitError` if a program gave up.
                With False the call returns at once; `check()` reports later.

        Returns:
            A `GpuDispatch`; `result.rank(r)` gives rank r's fields.
        """
        self._check_usable()
        P, H = self.num_ranks, self.hidden
        T = routing.num_tokens
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (P, T, H):
            raise ValueError(f"x must be [num_ranks={P}, num_tokens={T}, hidden={H}] (T from "
                             f"the routing), got {_shape(x)}")
        if x.element_size() not in _WORDS:
            raise TypeError(f"x has {x.element_size()}-byte elements ({x.dtype}); rows are "
                            f"moved as 1-, 2- or 4-byte words")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}; the superpod lives on {self.device}")
        if routing.topk_idx.device != self.device or routing.plans[0].num_ranks != P:
            raise ValueError("routing was made by another superpod; call route() on this one")
        self._reserve(_WORDS[x.element_size()], routing)
        word = self._word
        xw = x.contiguous().view(word)
        call = self._last_dispatch = self._next_call()
        EL, R, NC, S, RV = self.experts_per_rank, self._win_rows, self._recv_rows, \
            self.send_programs, self.recv_programs
        E, K_ = self.num_experts, routing.top_k
        rt, kw = routing, dict(num_warps=self.num_warps)
        tiles = dict(ROWS=self.rows_per_step, BH=self.block_hidden)
        if self.mode == "ubep":
            C = self.count_programs
            K.ubep_dispatch[(P * (C + S + RV),)](
                rt.cnt, rt.count_dest, rt.send_lo, rt.send_tok, rt.send_slot, rt.send_dst,
                rt.send_pos, xw, rt.topk_weights, self._counts, self._count_flag, self._win,
                self._win_w, self._win_ts, self._row_flag, self._recv_x, self._recv_w,
                self._recv_rank, self._recv_ts, self._tokens_per_expert, self._err, self._state,
                P, E, EL, T, K_, R, NC, H, C, S, RV, self.max_spins, BP=self._bp, BE=self._be,
                **tiles, **kw)
        else:
            K.bsp_counts[(P,)](rt.cnt, self._counts, P, E, EL, BP=self._bp, BE=self._be, **kw)
            W = self.programs_per_rank
            K.bsp_send[(P * W,)](rt.send_lo, rt.send_tok, rt.send_slot, rt.send_dst,
                                 rt.send_pos, xw, rt.topk_weights, self._win, self._win_w,
                                 self._win_ts, T, K_, P, R, H, W, **tiles, **kw)
            K.bsp_offsets[(P,)](self._counts, self._offsets, self._wbases,
                                self._tokens_per_expert, P, EL, BP=self._bp, BE=self._be, **kw)
            K.bsp_reorder[(P * W,)](self._offsets, self._wbases, self._tokens_per_expert,
                                    self._win, self._win_w, self._win_ts, self._recv_x,
                                    self._recv_w, self._recv_rank, self._recv_ts, P, EL, R, NC,
                                    H, W, BP=self._bp, BE=self._be, **tiles, **kw)
        if check:
            self.check()
        return GpuDispatch(
            recv_x=self._recv_x.view(x.dtype), recv_weights=self._recv_w,
            recv_src_rank=self._recv_rank, recv_src_token_slot=self._recv_ts,
            tokens_per_expert=self._tokens_per_expert, num_recv=routing.num_recv,
            routing=routing, call=call)

    def combine(self, expert_out: torch.Tensor, dispatched: GpuDispatch, *,
                weighted: bool = True, check: bool = True) -> torch.Tensor:
        """Send expert outputs back to their tokens' ranks and sum them per token.

        Arguments:
            expert_out: `[P, >= max(num_recv), hidden]` bf16/fp16/fp32 on the device; row i
                of rank r is the expert output for `dispatched.recv_x[r, i]`.
            dispatched: this superpod's latest `dispatch` result.
            weighted: multiply each row by its gating weight before summing.
            check: as in `dispatch`.

        Returns:
            `[P, T, hidden]` in `expert_out`'s dtype: for each token the fp32 sum over its
            routed slots, in slot order, of `w * row`; zeros for a token with no slot.
        """
        self._check_usable()
        P, H = self.num_ranks, self.hidden
        rt = dispatched.routing
        if dispatched.call != self._last_dispatch:
            raise ValueError("dispatched is not this superpod's latest dispatch; only that one "
                             "can be combined (its buffers are reused)")
        need = max(dispatched.num_recv, default=0)
        if not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 3 \
                or expert_out.shape[0] != P or expert_out.shape[2] != H \
                or expert_out.shape[1] < need:
            raise ValueError(f"expert_out must be [num_ranks={P}, >= {need}, hidden={H}], got "
                             f"{_shape(expert_out)}")
        if expert_out.dtype not in _FLOATS:
            raise TypeError(f"expert_out must be bf16, fp16 or fp32, got {expert_out.dtype}")
        if expert_out.device != self.device:
            raise ValueError(f"expert_out is on {expert_out.device}; the superpod lives on "
                             f"{self.device}")
        out = expert_out.contiguous()
        T, K_ = rt.num_tokens, rt.top_k
        self._reserve_combine(out.dtype, T * K_)
        cwin = self._cwin.view(out.dtype)
        y = torch.empty(P, T, H, dtype=out.dtype, device=self.device)
        self._next_call()
        EL, NC, RV = self.experts_per_rank, self._recv_rows, self.recv_programs
        S, W = self.count_programs + self.send_programs, self.programs_per_rank
        kw = dict(num_warps=self.num_warps, ROWS=self.rows_per_step, BH=self.block_hidden)
        bk = K.next_pow2(K_)
        if self.mode == "ubep":
            K.ubep_combine[(P * (S + RV),)](
                rt.topk_idx, rt.topk_weights, out, out.shape[1], self._tokens_per_expert,
                self._recv_rank, self._recv_ts, cwin, self._cflag, y, self._err, self._state, P,
                EL, T, K_, NC, H, S, RV, self.max_spins, BE=self._be, BK=bk, WEIGHTED=weighted,
                **kw)
        else:
            K.bsp_send_back[(P * W,)](out, out.shape[1], self._tokens_per_expert,
                                      self._recv_rank, self._recv_ts, cwin, EL, T, K_, NC, H, W,
                                      BE=self._be, **kw)
            K.bsp_reduce[(P * W,)](rt.topk_idx, rt.topk_weights, cwin, y, T, K_, EL, H, W,
                                   BK=bk, WEIGHTED=weighted, **kw)
        if check:
            self.check()
        return y

    def check(self) -> None:
        """Wait for the device; raise `SpinLimitError` if a program gave up polling.

        After that error the superpod is broken (its flags are out of step): make a new one.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        bad = torch.nonzero(self._err[:, 0]).flatten()
        if bad.numel():
            code, rank, peer, missing = self._err[int(bad[0])].tolist()
            self._broken = f"a program gave up polling in {_PHASES.get(code, code)}"
            raise SpinLimitError(rank, _PHASES.get(code, str(code)), peer, missing,
                                 self.max_spins)

    # -- buffers -------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken is not None:
            raise BrokenBufferError(f"this EmulatedSuperpod is broken ({self._broken}); make "
                                    f"a new one")

    def _next_call(self) -> int:
        self._calls += 1
        return self._calls

    def _reserve(self, word: torch.dtype, routing: Routing) -> None:
        """Grow the windows and receive buffers to the routing's needs (powers of two)."""
        P, H, dev = self.num_ranks, self.hidden, self.device
        R = K.next_pow2(routing.window_rows)
        NC = K.next_pow2(max(routing.num_recv, default=0))
        if word != self._word or R > self._win_rows:
            self._win_rows = R = max(R, self._win_rows if word == self._word else 0)
            self._win = torch.empty(P, P, R, H, dtype=word, device=dev)
            self._win_w = torch.empty(P, P, R, dtype=torch.float32, device=dev)
            self._win_ts = torch.empty(P, P, R, dtype=torch.int32, device=dev)
            self._row_flag = torch.zeros(P, P, R, dtype=torch.int32, device=dev)
        if word != self._word or NC > self._recv_rows:
            self._recv_rows = NC = max(NC, self._recv_rows if word == self._word else 0)
            self._recv_x = torch.empty(P, NC, H, dtype=word, device=dev)
            self._recv_w = torch.empty(P, NC, dtype=torch.float32, device=dev)
            self._recv_rank = torch.empty(P, NC, dtype=torch.int32, device=dev)
            self._recv_ts = torch.empty(P, NC, dtype=torch.int32, device=dev)
        self._word = word

    def _reserve_combine(self, dtype: torch.dtype, rows: int) -> None:
        rows = K.next_pow2(rows)
        if self._cwin is None or rows > self._comb_rows or self._cwin.dtype != dtype:
            self._comb_rows = rows = max(rows, self._comb_rows)
            self._cwin = torch.empty(self.num_ranks, rows, self.hidden, dtype=dtype,
                                     device=self.device)
            self._cflag = torch.zeros(self.num_ranks, rows, dtype=torch.int32,
                                      device=self.device)

    def __repr__(self) -> str:
        return (f"EmulatedSuperpod(ranks={self.num_ranks}, experts={self.num_experts}, "
                f"hidden={self.hidden}, mode={self.mode!r}, programs per rank="
                f"{self.count_programs}+{self.send_programs}+{self.recv_programs}, "
                f"device={self.device})")


def _resolve_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device={str(device)!r} must be a CUDA device or 'cpu'")
    if device.type == "cpu" and not K.INTERPRETED:
        raise ValueError("device='cpu' needs Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before ubep.gpu is first imported")
    return device


def _resident_programs(device: torch.device, given: int | None) -> int | None:
    if given is not None:
        return _check_int("resident_programs", given, 1)
    if K.INTERPRETED:
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _shape(t: object) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


__all__ = ["EmulatedSuperpod", "GpuDispatch", "RankDispatch", "Routing", "SpinLimitError",
           "device_topology", "MODES"]
