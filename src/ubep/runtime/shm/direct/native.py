"""The direct path with `ubep.native`: each call one C++ entry while nothing waits.

`DirectNativePath` is `DirectPath` (one worker) whose dispatch and combine first run the
compiled entries (`ubep.native.direct_dispatch` / `direct_combine`, over this folder's
`entries.py`), which make the same results from the same kernels; a call that must wait goes
on in `DirectPath`'s Python from where the entry stopped (`dispatch_resume`,
`combine_resume`). It also gives `Buffer` the door's words (`door`), with which the whole
common call is one C++ call (`native/door.cpp`).
"""

from __future__ import annotations

import numpy as np
import torch

from ubep.handle import CombineResult, DispatchHandle, DispatchResult, new_combine_result
from ubep.native import layout as L
from ubep.native.layout import DIRECT_DOOR, DW_LAST_CALL, DW_LAST_CODE
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.direct.path import OUT_KIND, DirectPath, combine_codes
from ubep.runtime.shm.protocol import DTYPE_CODES as _CODES
from ubep.runtime.shm.waits import INLINE_SPINS, deadline_after, now_us
from ubep.stats import DeferredStats


class DirectNativePath(DirectPath):
    """`DirectPath` with one worker whose calls run `ubep.native`'s compiled entries."""

    def __init__(self, ctx: ShmContext, native):
        super().__init__(ctx)
        self._native = native
        self._st = self._native_state()
        self._st_addr = self._st.ctypes.data

    #: `ubep_native`'s entries for `door`'s tuple (`Buffer` calls them)
    DOOR_ENTRIES = ("door_dispatch", "door_combine")

    def door(self, lock, limits: tuple[int, int, int, int], buffer_words: np.ndarray,
             resume) -> tuple:
        """What `ubep.native`'s door (`door_dispatch`, `door_combine`) reads to take a
        `Buffer`'s common call whole (`layout.DIRECT_DOOR`): this path's state words and kept
        objects and constants, the Buffer's `lock`, its state words and `limits` its fast
        checks' (hidden, num_experts, max_tokens_per_rank, max_top_k), and `resume`, where a
        call that must wait goes on."""
        return L.door(DIRECT_DOOR, path_words=self._w, buffer_words=buffer_words, lock=lock,
                      resume=resume, cdata=self._area_cdata,
                      uses=self._area_uses, views=self._area_views, codes=_CODES,
                      elems={d: combine_codes(d)[:2] for d in OUT_KIND},
                      dbuild=self._dispatch_stats, cbuild=self._combine_stats,
                      st=self._st_addr, owned=int(self.owned), buffer_id=self.ctx.buffer_id,
                      recv_off=self._recv_off, area=self._area, base=self.ctx.base,
                      comb=self._comb_addr, hidden=limits[0], experts=limits[1],
                      max_tokens=limits[2], max_top_k=limits[3])

    def _native_state(self) -> np.ndarray:
        """The kept state `ubep.native`'s entries read (`entries.py`, `layout`'s `ST_*` words):
        the addresses of this path's arrays (kept alive by it) and the kernels'."""
        from ubep.runtime.shm.direct import entries as EN

        b = self.ctx
        self._lut0 = np.zeros(1, np.float32)
        return L.block(L.ST_LEN, {
            L.ST_BASES: b.bases.ctypes.data, L.ST_WORLD: b.world,
            L.ST_DLAY: self.dlay.ctypes.data, L.ST_DLAY_N: len(self.dlay),
            L.ST_RANK: b.rank, L.ST_EXPERTS: self.num_experts, L.ST_EL: self.el,
            L.ST_COUNTS: self._counts.ctypes.data, L.ST_TAILS: self._tails.ctypes.data,
            L.ST_GOT: self._got.ctypes.data, L.ST_SPINS: INLINE_SPINS,
            L.ST_POS: self._pos_addr, L.ST_HIDDEN: self.hidden,
            L.ST_READY: self._ready.ctypes.data, L.ST_DONE_T: self._done_t.ctypes.data,
            L.ST_Y: self._y_addr, L.ST_DONE_MINE: self._done_mine.ctypes.data,
            L.ST_DONE_FIRST: self._done_first, L.ST_LUT: self._lut0.ctypes.data,
            L.ST_BEGIN: EN.dispatch_begin_c.address, L.ST_ROWS: EN.dispatch_rows_c.address,
            L.ST_COMBINE: EN.combine_begin_c.address})

    def _dispatch_from(self, x, topk_idx, topk_weights, call, t0, epoch, area,
                       roff) -> DispatchResult:
        """The compiled entry where rows land in place; else (and after a wait) as
        `DirectPath` goes on."""
        if self._in_place(area):
            # one C++ entry for the whole call (`ubep.native`); rows land where `recv_x` lies
            # (a lent area, or the recv area with direct=True). Straight-line while nothing
            # waits: every Python call here costs ~1 µs of a ~30 µs dispatch+combine
            dtype = x.dtype
            view = self._area_views.get((area, dtype))
            if view is None:
                view = self._area_view(area, roff, self.hidden, dtype)
            r = self._native.direct_dispatch(self._st_addr, x, topk_idx, topk_weights, epoch,
                                             _CODES[dtype], roff, self.owned, view, call,
                                             self.ctx.buffer_id, t0, self._dispatch_stats)
            if type(r) is not tuple:    # the DispatchResult: every row arrived
                self._w[DW_LAST_CALL], self._w[DW_LAST_CODE] = call, _CODES[dtype]
                return r
            return self.dispatch_resume(r, x, topk_idx, topk_weights, call, t0, epoch, area,
                                        roff)
        return super()._dispatch_from(x, topk_idx, topk_weights, call, t0, epoch, area, roff)

    def dispatch_resume(self, r: tuple, x: torch.Tensor, topk_idx: torch.Tensor,
                        topk_weights: torch.Tensor, call: int, t0: float, epoch: int, area: int,
                        roff: int) -> DispatchResult:
        """The rest of a dispatch whose compiled entry (`direct_dispatch`, here or in
        `ubep.native`'s door) stopped at a wait and returned `r`: the Python path's bounded
        waits from where it stopped."""
        left, n_recv, missing, tpe, ints, wts, state, recv_x, t1 = r
        if not left:
            return self._dispatch_end(x, topk_idx, topk_weights, call, epoch,
                                      deadline_after(t0, self._timeout_s), (t0, t1), roff,
                                      n_recv, missing, tpe, ints, wts, state, recv_x)
        return self._dispatch_py(x, topk_idx, topk_weights, call, t0, epoch, area, roff,
                                 state[5], True)

    def _combine_from(self, handle, expert_out, dest, epoch, code, ecode, lut, es, rb, offset,
                      ptr, n_recv, copied, weighted, t0) -> CombineResult:
        """The compiled entry first (bf16, fp16, fp32 rows), straight-line while nothing
        waits (as dispatch); the rest as `DirectPath` goes on."""
        begun = None
        dtype, t_n = expert_out.dtype, handle.num_tokens
        if dtype in OUT_KIND:
            # one C++ entry (`ubep.native`), straight-line while nothing waits (as dispatch)
            idx_addr, w_addr, k_n, _, pos_addr, _, ints = handle.state
            r = self._native.direct_combine(
                self._st_addr, epoch, code, ecode, offset, ptr, n_recv if copied else 0, ints,
                idx_addr, w_addr, t_n, k_n, weighted, pos_addr,
                self._combine_out(dest, t_n, rb, dtype), OUT_KIND[dtype], t0,
                self._combine_stats if dest is None else None, copied, handle.topk_idx)
            if type(r) is not tuple:    # the CombineResult: all summed, every rank done
                return r
            begun = left, waiting, out, t1 = r
            if not (left or waiting):   # into a caller's `out`
                stats = DeferredStats.of(self._combine_stats, (t0, t1, now_us()), None, copied,
                                         handle.topk_idx, rb, epoch)
                return new_combine_result(out if dest is None or out is dest
                                          else dest.copy_(out), stats)
        return self._combine_rest(handle, expert_out, dest, epoch, code, ecode, lut, es, rb,
                                  offset, ptr, n_recv, copied, weighted, t0, begun)


    def combine_resume(self, r: tuple, expert_out: torch.Tensor, handle: DispatchHandle,
                       weighted: bool, t0: float, epoch: int, offset: int, ptr: int,
                       copied: bool, dest: torch.Tensor | None = None) -> CombineResult:
        """The rest of a combine whose compiled entry, called by `ubep.native`'s door,
        stopped at a wait and returned `r` (`dest`: the caller's contiguous `out`, which the
        entry sums into): the Python path's waits from there."""
        self.dropped = []
        dtype = expert_out.dtype
        code, ecode, lut = combine_codes(dtype)
        es = dtype.itemsize
        return self._combine_rest(handle, expert_out, dest, epoch, code, ecode, lut, es,
                                  self.hidden * es, offset, ptr, handle.num_recv, copied,
                                  weighted, t0, r)

    def _new_out(self, t_n: int, dtype: torch.dtype) -> None:
        """None: the compiled entry makes the output."""
        return None
