"""The direct (one-copy) variant of the shm runtime: `Buffer(backend="shm", direct=True)`.

The paper's mechanism copies each row twice: into a window at its destination, then into
place once the offsets are known. When counts are cheap to exchange (ranks of one host),
exchange them first and every row's final place is known to its sender:

dispatch: publish my per-expert counts -> read every rank's (the only wait before data)
    -> copy each row straight into its destination's expert-major output, then release its
    meta word {token, slot, weight, epoch} -> wait for my N rows' meta words.
combine:  publish where my expert outputs lie (in place if `expert_out` is `recv_x` or the
    tensor of `get_combine_buffer`, else after one local copy) -> sum each of my tokens by
    reading its rows where they lie, as soon as their ranks have published.

So dispatch copies each row once and combine reads it once. The price: `recv_x` is a view of
this Buffer's shared memory, valid until its next dispatch (as DeepEP's low-latency mode),
and each rank needs room for the rows it could receive.

Why reuse is safe with one buffer per area: a rank publishes its counts of call e+1 only after
its combine of call e returned, and nobody writes rows, metas or ready words of e+1 before it
has every rank's counts of e+1. Count slots alternate by epoch parity (a rank can be one
count ahead of a peer that still reads).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.runtime.shm import direct_kernels as DK
from ubep.runtime.shm.region import D_AREA, D_COMB_OFF, D_MAXR, D_META_OFF, D_RECV_OFF
from ubep.stats import Interval, Stats
from ubep.validate import MOVABLE_DTYPES

_CODES = {d: i for i, d in enumerate(MOVABLE_DTYPES)}


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


class DirectPath:
    """Dispatch and combine of one `ShmBackend` with rows written straight to their place."""

    def __init__(self, backend, dlay: np.ndarray, region: np.ndarray):
        self.b = backend
        self.dlay = dlay
        c = backend.config
        self.el = c.experts_per_rank
        self.num_experts = c.num_experts
        self.hidden = c.hidden
        w = backend.world
        self._counts = np.zeros((w, c.num_experts), np.int64)
        self._elems = np.zeros(w, np.int64)
        self._got = np.zeros(w, np.int8)
        self._src_rank = np.zeros(max(int(dlay[D_MAXR]), 1), np.int64)
        area = int(dlay[D_AREA])
        self._region = region
        self._recv_addr = backend.base + int(dlay[D_RECV_OFF])
        self._comb_addr = backend.base + int(dlay[D_COMB_OFF])
        self._recv_u8 = torch.from_numpy(region[int(dlay[D_RECV_OFF]):][:area])
        self._comb_u8 = torch.from_numpy(region[int(dlay[D_COMB_OFF]):][:area])
        self._epoch = 0
        self._c_epoch = 0
        self._last_call = 0
        self._last_dtype = torch.bfloat16

    # -- views of my areas -------------------------------------------------------------------
    def _view(self, area: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        return area[:n * self.hidden * dtype.itemsize].view(dtype).view(n, self.hidden)

    def combine_buffer(self, handle: DispatchHandle, dtype: torch.dtype | None) -> torch.Tensor:
        """`[N, hidden]` of `dtype` (None: the dispatched rows' dtype) in my shared memory:
        expert outputs written here are read in place by combine. Valid until the next
        dispatch."""
        dtype = dtype or self._last_dtype
        if handle.call != self._last_call:
            raise ValueError("get_combine_buffer: the handle is not from this Buffer's latest "
                             "dispatch; with direct=True only the latest one can be combined")
        if dtype not in MOVABLE_DTYPES or not dtype.is_floating_point:
            raise TypeError(f"dtype {dtype} cannot be combined; use a floating dtype of at "
                            f"most 4 bytes")
        return self._view(self._comb_u8, handle.num_recv, dtype)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int, t0: float) -> DispatchResult:
        b = self.b
        idx = topk_idx.numpy()
        w = topk_weights.numpy()
        code = _CODES[x.dtype]
        self._epoch += 1
        epoch = self._epoch
        deadline = time.monotonic() + b.config.timeout_s
        DK.publish_counts(b.base, self.dlay, epoch, idx, self.num_experts, code)
        counts, elems, got = self._counts, self._elems, self._got
        got[:] = 0
        b._wait(None, lambda s: DK.gather_counts(b.bases, self.dlay, epoch, counts, elems, got,
                                                 s),
                "dispatch/counts", lambda: [s for s in range(b.world) if not got[s]],
                deadline=deadline)
        wrong = {s: str(MOVABLE_DTYPES[int(elems[s])]) for s in range(b.world)
                 if elems[s] != code}
        if wrong:
            from ubep.runtime.shm.backend import ShmProtocolError
            raise ShmProtocolError(
                f"rank {b.rank} dispatches {x.dtype} rows but rank(s) {wrong} use another "
                f"dtype; every rank must pass the same dtype")
        t1 = _now_us()
        pos = np.empty(idx.shape, np.int64)
        tpe = np.empty(self.el, np.int64)
        n_recv = int(DK.place_rows(counts, b.rank, self.el, idx, pos, tpe, self._src_rank))
        ints = np.empty((3, n_recv), np.int64)
        ints[0] = self._src_rank[:n_recv]
        wts = np.empty(n_recv, np.float32)
        rb = x.shape[1] * x.element_size()
        n = b.workers
        cl = b._start(epoch, n)
        cl.deadline = deadline
        xa = x.data_ptr()
        t_n = idx.shape[0]

        def work(j: int) -> None:
            a = _now_us()
            DK.send_rows_direct(b.bases, self.dlay, epoch, xa, rb, idx, w, pos, self.el,
                                j * t_n // n, (j + 1) * t_n // n)
            m = _now_us()
            lo, hi = j * n_recv // n, (j + 1) * n_recv // n
            b._wait(cl, lambda s: DK.recv_meta(b.base, self.dlay, epoch, lo, hi, ints[1],
                                               ints[2], wts, s),
                    "dispatch/rows", lambda: self._missing_sources(epoch, lo, hi))
            cl.iv[j].append(("send", a, m, "busy"))
            cl.iv[j].append(("wait_rows", m, _now_us(), "wait"))

        b._run(cl, work)
        self._last_call, self._last_dtype = call, x.dtype
        t2 = _now_us()
        recv_x = self._view(self._recv_u8, n_recv, x.dtype)
        src_rank, src_tok, src_slot = torch.from_numpy(ints).unbind(0)
        handle = DispatchHandle(
            buffer_id=b.buffer_id, call=call, num_tokens=t_n, num_recv=n_recv,
            hidden=x.shape[1], topk_idx=topk_idx, topk_weights=topk_weights,
            recv_src_rank=src_rank, recv_src_token=src_tok, recv_src_slot=src_slot,
            state=(idx, w, pos, epoch))
        sent = int(np.count_nonzero(idx >= 0))
        ivs = [Interval(b.rank, 0, "counts", t0, t1, "wait")]
        ivs += [Interval(b.rank, j, *iv) for j, ivj in enumerate(cl.iv) for iv in ivj]
        stats = Stats(op="dispatch", backend="shm", mode="ubep-direct", sync="row-flag",
                      schedule="static", rank=b.rank, total_us=t2 - t0,
                      phases_us={"counts": t1 - t0, "send_recv": t2 - t1},
                      intervals=ivs, bytes_sent=sent * (rb + 16), bytes_recv=n_recv * (rb + 16),
                      payload_efficiency=rb / (rb + 16),
                      extra={"epoch": epoch, "workers": n, "direct": True})
        return DispatchResult(
            recv_x=recv_x, recv_weights=torch.from_numpy(wts),
            tokens_per_expert=torch.from_numpy(tpe), recv_src_rank=src_rank,
            recv_src_token=src_tok, recv_src_slot=src_slot, handle=handle, stats=stats)

    def _missing_sources(self, epoch: int, lo: int, hi: int) -> list[int]:
        """Ranks some of whose rows in [lo, hi) have not arrived (for the timeout message)."""
        meta = self._region[int(self.dlay[D_META_OFF]):][:16 * hi].view(np.int64)
        ep = epoch & 0x7FFFFFFF
        return sorted({int(self._src_rank[i]) for i in range(lo, hi)
                       if int(meta[2 * i + 1]) >> 32 != ep})

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                t0: float) -> CombineResult:
        from ubep.runtime.shm.backend import ShmProtocolError, _cast_rows, _combine_elem

        b = self.b
        if handle.call != self._last_call:
            raise ValueError("handle is not from this Buffer's latest dispatch; with "
                             "direct=True only the latest dispatch can be combined (its rows "
                             "live in the Buffer until the next one)")
        idx, w, pos, _ = handle.state
        dtype = expert_out.dtype
        es = expert_out.element_size()
        rb = self.hidden * es
        n_recv = handle.num_recv
        self._c_epoch += 1
        epoch = self._c_epoch
        deadline = time.monotonic() + b.config.timeout_s
        ptr = expert_out.data_ptr()
        copied = n_recv > 0 and ptr not in (self._recv_addr, self._comb_addr)
        if copied:                                      # else: peers read it in place
            DK.copy_local(self._comb_addr, ptr, n_recv * rb)
        offset = (self._comb_addr if copied or not n_recv else ptr) - b.base
        t1 = _now_us()
        code = _CODES[dtype]
        DK.publish_ready(b.base, self.dlay, epoch, code, offset)
        ecode, lut = _combine_elem(dtype)
        t_n = idx.shape[0]
        y = np.zeros((t_n, self.hidden), np.float32)
        done = np.zeros(t_n, np.uint8)
        ready = np.full(b.world, -1, np.int64)
        n = b.workers
        cl = b._start(epoch, n)
        cl.deadline = deadline
        weighted = bool(weighted)

        def work(j: int) -> None:
            a = _now_us()
            lo, hi = j * t_n // n, (j + 1) * t_n // n
            bad = [-1]                  # a rank that published another dtype

            def poll(s: int) -> int:
                r = DK.reduce_direct(b.bases, self.dlay, epoch, idx, w, weighted, pos, self.el,
                                     rb, es, code, ecode, lut, lo, hi, ready, done, y, s)
                if r < 0:
                    bad[0] = -r - 1
                    return 0
                return r

            b._wait(cl, poll, "combine/rows",
                    lambda: sorted({int(e) // self.el for t in range(lo, hi) if not done[t]
                                    for e in idx[t] if e >= 0 and ready[int(e) // self.el] < 0}))
            if bad[0] >= 0:
                raise ShmProtocolError(
                    f"rank {b.rank} combines {dtype} rows but rank {bad[0]} published another "
                    f"dtype; every rank must pass the same dtype")
            cl.iv[j].append(("reduce", a, _now_us(), "busy"))

        b._run(cl, work)
        out = _cast_rows(y, dtype)
        t2 = _now_us()
        ivs = [Interval(b.rank, 0, "copy_in" if copied else "publish", t0, t1)]
        ivs += [Interval(b.rank, j, *iv) for j, ivj in enumerate(cl.iv) for iv in ivj]
        stats = Stats(op="combine", backend="shm", mode="ubep-direct", sync="row-flag",
                      schedule="static", rank=b.rank, total_us=t2 - t0,
                      phases_us={"copy_in" if copied else "publish": t1 - t0, "reduce": t2 - t1},
                      intervals=ivs, bytes_sent=0,
                      bytes_recv=int(np.count_nonzero(idx >= 0)) * rb, payload_efficiency=1.0,
                      extra={"epoch": epoch, "workers": n, "direct": True, "in_place": not copied})
        return CombineResult(y=out, stats=stats)
