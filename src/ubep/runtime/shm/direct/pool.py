"""The direct path with a pool of workers (`workers` >= 2): each call split among threads.

`DirectPoolPath` is `DirectPath` whose rows are sent and awaited, and whose tokens are summed,
by the Buffer's worker threads, each a token range or a row range (`call.py`'s `CallRunner`),
in the same protocol and kernels as the one-worker path.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ubep.handle import DispatchResult
from ubep.runtime.shm.call import Call, CallRunner
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.direct import kernels as DK
from ubep.runtime.shm.direct.path import NO_16, ROUNDED, DirectPath, combine_codes
from ubep.runtime.shm.elements import cast_rows
from ubep.runtime.shm.waits import now_us


class DirectPoolPath(DirectPath):
    """`DirectPath` whose calls run on `workers` >= 2 threads."""

    def __init__(self, ctx: ShmContext):
        super().__init__(ctx)
        self.runner = CallRunner(ctx)
        #: elastic: ranks the latest dispatch dropped (died with rows of theirs missing)
        self._pool_dropped: list[int] = []
        self._drop_lock = threading.Lock()

    def _dispatch_rows(self, x, topk_idx, topk_weights, call, t0, t1, epoch, area, roff, keep,
                       tpe, ints, wts, rb, code, deadline, recv_x, dst) -> DispatchResult:
        """The workers send a token range each, then wait for a row range."""
        idx, w = topk_idx.numpy(), topk_weights.numpy()
        pos = np.empty(idx.shape, np.int64)
        n_recv, ivs = self._dispatch_pool(x, idx, w, pos, tpe, ints, wts, rb, code, epoch,
                                          dst, roff, deadline)
        if recv_x is None:
            recv_x = self._lend_area(area, roff, n_recv, x.shape[1], x.dtype)
        res = self._dispatch_result(x, topk_idx, topk_weights, call, epoch, (t0, t1), ivs,
                                    n_recv, tpe, ints, wts, (idx, w, pos, epoch, ints[0]),
                                    recv_x)
        if self._pool_dropped:
            res.__dict__["_dropped"] = self._pool_dropped
        return res

    def _dispatch_pool(self, x, idx, w, pos, tpe, ints, wts, rb, code, epoch, dst, roff,
                       deadline):
        """The workers send a token range each, then wait for a row range: (rows, the
        workers' intervals)."""
        b = self.ctx
        bad = [s for s in range(b.world) if self._tails[s, 0] != code]
        if bad:
            raise self._dtype_error(x.dtype, bad[0])
        n_recv = int(DK.place_rows(self._counts, b.rank, self.el, idx, pos, tpe, ints[0]))
        ints[1, :n_recv] = -1                        # no row decoded yet (`recv_meta`)
        n = b.workers
        cl = self.runner.start(Call(epoch=epoch, deadline=deadline, n=n))
        xa = x.data_ptr()
        t_n = idx.shape[0]
        dropped: list[int] = []

        def work(j: int) -> None:
            a = now_us()
            DK.send_rows_direct(b.bases, self.dlay, epoch, xa, rb, idx, w, pos, self.el,
                                j * t_n // n, (j + 1) * t_n // n, b.rank, dst, ints[1],
                                ints[2], wts, self._tails)
            m = now_us()
            lo, hi = j * n_recv // n, (j + 1) * n_recv // n
            self.runner.wait(cl, lambda s: DK.recv_meta(b.base, self.dlay, epoch, lo, hi,
                                                        ints[1], ints[2], wts, dst, roff, rb, s),
                             "dispatch/rows",
                             lambda: self._missing_sources(epoch, ints[0], lo, hi),
                             on_inactive=lambda: self._drop_rows(ints, n_recv, dropped))
            cl.iv[j].append(("send", a, m, "busy"))
            cl.iv[j].append(("wait_rows", m, now_us(), "wait"))

        self.runner.run(cl, work)
        self._pool_dropped = dropped
        return n_recv, cl.iv

    def _sums(self, handle, expert_out, dest, epoch, code, ecode, lut, es, rb, offset, ptr,
              n_recv, copied, weighted, deadline, begun) -> tuple:
        """The workers sum a token range each (fp32 sums, rounded in the kernel to bf16/fp16,
        fp8 cast after)."""
        b = self.ctx
        dtype, t_n = expert_out.dtype, handle.num_tokens
        idx, w, pos, _, src_rank = handle.state
        if dtype in ROUNDED:                 # rounded in the kernel, token by token
            y, out16 = self._y[:t_n], np.empty((t_n, self.hidden), np.uint16)
        else:
            y, out16 = np.empty((t_n, self.hidden), np.float32), NO_16
        done = np.zeros(t_n, np.uint8)
        ready = self._ready
        if copied:          # only the rows peers read; mine are summed where they lie
            DK.copy_rows_for_peers(self._comb_addr, ptr, rb, src_rank, b.rank, n_recv)
        DK.publish_ready(b.base, self.dlay, epoch, code, offset)
        ready[:] = -1
        t1 = now_us()
        ivs = self._combine_pool(epoch, idx, w, weighted, pos, rb, expert_out, ready, done,
                                 y, out16, ptr if copied else 0, deadline, handle)
        if dtype in ROUNDED:
            out = torch.from_numpy(out16).view(dtype)
        elif dtype == torch.float32:
            out = torch.from_numpy(y)
        else:
            out = cast_rows(y, dtype)
        waiting = -1
        return out, t1, waiting, ivs

    def _reduce(self, b, cl, epoch, cur, w, weighted, pos, rb, expert_out, ready, done, y, out16,
                own, lo, hi, deadline, handle) -> None:
        """Sum tokens [lo, hi) as their ranks publish; bounded wait naming the ranks. `cur`:
        `[routing as numpy, as a tensor]`, shared by the workers (elastic: without dead
        ranks once found)."""
        code, ecode, lut = combine_codes(expert_out.dtype)
        es = expert_out.element_size()
        bad = [-1]                  # a rank that published another dtype

        def poll(s: int) -> int:
            r = DK.reduce_direct(b.bases, self.dlay, epoch, cur[0], w, weighted, pos, self.el,
                                 rb, es, code, ecode, lut, lo, hi, ready, done, y, out16,
                                 b.rank, own, s)
            if r < 0:
                bad[0] = -r - 1
                return 0
            return r

        def drop() -> None:
            with self._drop_lock:
                before = cur[1]
                self._drop_ready(handle, cur, self.dropped)
                if cur[1] is not before:
                    cur[0] = cur[1].numpy()

        self.runner.wait(cl, poll, "combine/rows",
                         lambda: self._reduce_missing(cur[0], ready, done, lo, hi),
                         on_inactive=drop)     # (the call's deadline: `cl`'s)
        if bad[0] >= 0:
            raise self._combine_dtype_error(expert_out.dtype, bad[0])

    def _combine_pool(self, epoch, idx, w, weighted, pos, rb, expert_out, ready, done, y, out16,
                      own, deadline, handle):
        b = self.ctx
        n = b.workers
        cl = self.runner.start(Call(epoch=epoch, deadline=deadline, n=n))
        t_n = idx.shape[0]
        cur = [idx, handle.topk_idx]

        def work(j: int) -> None:
            a = now_us()
            self._reduce(b, cl, epoch, cur, w, weighted, pos, rb, expert_out, ready, done, y,
                         out16, own, j * t_n // n, (j + 1) * t_n // n, deadline, handle)
            cl.iv[j].append(("reduce", a, now_us(), "busy"))

        self.runner.run(cl, work)
        return cl.iv

