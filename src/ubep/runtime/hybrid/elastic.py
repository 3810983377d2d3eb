"""Elastic expert parallelism on the hybrid backend: a lost rank without a restart.

`Buffer(backend="hybrid", elastic=True)` (docs/reliability.md, "Elastic"). While every rank
is active a call runs the hybrid path as it is (shared memory inside each host, messages
between hosts), its network part on a group of its own. A call that fails there (a dead
peer's closed connection, a host-mate's released liveness lock, a deadline) starts the
recovery:

1. the rank *leaves* the hybrid path: it releases its shared-memory liveness lock and breaks
   its connections on the private group, so every peer blocked on it fails at once and
   recovers too (a live rank that is waited for never holds anyone up for a deadline);
2. the survivors agree on who is left through the store, as the torch backend's elastic mode
   does (`torch_elastic.TorchElastic`: heartbeats, one decision, the members' own group);
3. from then on every call runs flat among the survivors, on that group (the torch
   backend's elastic dispatch and combine, whose own recovery covers later deaths). The
   call that failed is redone there. A rank that had already completed it (the others
   failed it, a call behind) first replays it there, so the survivors' rows of every call
   are exact and a dead rank's rows of the failed call are all kept or all dropped.

The hybrid handles of calls before the recovery stay valid: the replayed dispatch's combine
maps the rows onto the replay's handle; an older handle is combined by `_bridge`, a single
exchange of the rows back to their source ranks, summed there in fp32 in slot order.
A replay reads the previous call's inputs where the caller left them: they must not have
been overwritten before the next call returns (what a framework's reuse of its buffers
between calls respects: the next call cannot return before the previous one's rows moved).

Nothing of this runs while nothing fails beyond one bounded wait per call (as the hybrid
path has) and two counter updates. The store's host dying is `StoreHostDiedError`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ubep.elastic import note_combine
from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.options import BufferConfig
from ubep.runtime.torch_backend import TorchBackend
from ubep.runtime.torch_elastic import Redo
from ubep.stats import Stats

#: the tag of the receive a leaving rank posts and abandons (gloo then closes every pair of
#: the private group, which wakes each peer blocked on this rank with an error)
_BREAK_TAG = 0x5EB


class HybridElastic:
    """One rank's elastic state of a hybrid Buffer: the private group of its intact calls,
    the flat torch backend the survivors go on with, and what a recovery replays."""

    def __init__(self, config: BufferConfig, group, buffer_id: int):
        c = config
        self.rank, self.world = c.rank, c.world_size
        ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world)]
        #: the group of the hybrid path's messages and flat calls while every rank is active
        self.net_group = dist.new_group(ranks, timeout=timedelta(seconds=c.timeout_s),
                                        use_local_synchronization=True)
        #: the survivors' path and the recovery (heartbeat, agreement) it carries
        self.flat = TorchBackend(dataclasses.replace(c, backend="torch", hosts=(), elastic=True),
                                 group, buffer_id)
        self.el = self.flat.recovery
        self.membership = self.flat.membership
        self.config = c
        #: True once a recovery (or a drain) moved every call to `flat`
        self.degraded = False
        self._intact: tuple[Callable, Callable] | None = None
        self._leave_host: Callable[[], None] = lambda: None
        self._left = False
        self._break_buf = torch.empty(1, dtype=torch.uint8)
        #: the call number of the latest dispatch that ran the hybrid path (its handle and
        #: older ones are hybrid handles); the latest intact call (kind, inputs, result)
        self._last_intact: int | None = None
        self._prev: tuple | None = None
        #: (hybrid handle, the `DispatchResult` of its dispatch replayed flat)
        self._replayed: tuple[DispatchHandle, DispatchResult] | None = None

    def wrap(self, dispatch: Callable, combine: Callable,
             leave_host: Callable[[], None]) -> tuple[Callable, Callable]:
        """The backend's dispatch and combine made elastic; `leave_host` releases this
        rank's shared-memory liveness lock (the host's ranks then find it gone)."""
        self._intact = (dispatch, combine)
        self._leave_host = leave_host
        return self.dispatch, self.combine

    # -- calls --------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult:
        if not self.degraded:
            self.el.begin()
            try:
                res = self._intact[0](x, topk_idx, topk_weights, call)
            except (ValueError, TypeError):
                raise                       # refused before anything moved
            except Exception as e:          # noqa: BLE001 - a peer lost or late: recover
                self._recover(e)
            else:
                self.el.end()
                self._last_intact = call
                self._prev = ("dispatch", (x, topk_idx, topk_weights, call), res)
                return res
        return self._flat_dispatch(x, topk_idx, topk_weights, call)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                out: torch.Tensor | None = None) -> CombineResult:
        if not self.degraded:
            self.el.begin()
            try:
                res = self._intact[1](expert_out, handle, weighted, out)
            except (ValueError, TypeError):
                raise
            except Exception as e:          # noqa: BLE001 - a peer lost or late: recover
                self._recover(e)
            else:
                self.el.end()
                self._prev = ("combine", (expert_out, handle, weighted), res)
                return res
        rep = self._replayed
        if rep is not None and handle is rep[0]:
            res = self.flat.combine(_onto(expert_out, handle, rep[1], self.config), rep[1].handle,
                                    weighted, out)
            note_combine(handle, self.membership, self.membership.inactive)
        elif self._last_intact is not None and handle.call <= self._last_intact:
            return self._bridge(expert_out, handle, weighted, out)
        else:
            res = self.flat.combine(expert_out, handle, weighted, out)
        return CombineResult(y=res.y, stats=_survivors_stats(res.stats))

    def _flat_dispatch(self, x, topk_idx, topk_weights, call) -> DispatchResult:
        res = self.flat.dispatch(x, self.membership.mask(topk_idx)[0], topk_weights, call)
        out = object.__new__(DispatchResult)        # the same fields, the stats renamed
        out.__dict__.update(res.__dict__)
        out.__dict__["stats"] = _survivors_stats(res.stats)
        return out

    # -- recovery -----------------------------------------------------------------------------
    def _recover(self, cause: BaseException) -> None:
        """Leave the hybrid path, agree on the survivors, and replay the previous call for
        them if this rank had completed the call they failed; calls go flat from now on."""
        self.leave()
        self.el.check_removed()
        try:
            self.el.recover(cause)
        except Redo:
            pass
        self.degraded = True
        if self.el.served and self._prev is not None:
            kind, args, _ = self._prev
            done = self.el.completed        # a replay is not a call of this rank's
            if kind == "dispatch":
                self._replayed = (self._prev[2].handle, self._flat_dispatch(*args))
            else:
                self._bridge(*args, None)
            self.el.completed = done
        self._prev = None

    def leave(self) -> None:
        """Make every peer blocked on this rank's hybrid path fail now (idempotent): release
        the shared-memory liveness lock, and break the private group's connections (a
        receive abandoned at its deadline makes gloo close every pair of the group)."""
        if self._left:
            return
        self._left = True
        self._leave_host()
        pg = self.net_group
        for peer in range(self.world):      # a dead peer's pair fails at once: try each
            if peer == self.rank:
                continue
            try:
                pg.recv([self._break_buf], peer, _BREAK_TAG).wait(timedelta(milliseconds=1))
            except RuntimeError as e:
                if "timed out" in str(e).lower():
                    return                  # gloo closed every pair of the group

    def set_active_ranks(self, mask: np.ndarray) -> None:
        """A planned drain: the remaining ranks agree through the store (`TorchElastic`),
        then leave the hybrid path (the removed rank's waits fail, and it is refused)."""
        self.flat.set_active_ranks(mask)
        if not self.degraded and self.membership.any_inactive:
            self.degraded = True
            self.leave()
            self._prev = None

    def close(self) -> None:
        self.flat.close()

    # -- the combine of a hybrid handle after the recovery --------------------------------------
    def _bridge(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                out: torch.Tensor | None) -> CombineResult:
        """Combine a hybrid `handle` among the survivors: every row goes back to its source
        rank (one exchange), which sums its token's delivered slots in fp32 in slot order
        and rounds once (the oracle's bits). Redone after a recovery as flat calls are."""
        t0 = time.perf_counter()
        while True:
            self.el.begin()
            try:
                y, sent, got = self._bridge_once(expert_out, handle, weighted)
            except Redo:
                continue
            self.el.end()
            break
        note_combine(handle, self.membership, self.membership.inactive)
        if out is not None:
            y = out.copy_(y)
        stats = Stats(op="combine", backend="hybrid", rank=self.rank,
                      total_us=(time.perf_counter() - t0) * 1e6, bytes_sent=sent,
                      bytes_recv=got, extra={"mode": "flat", "elastic": "bridge"})
        return CombineResult(y=y, stats=stats)

    def _bridge_once(self, expert_out: torch.Tensor, handle: DispatchHandle,
                     weighted: bool) -> tuple[torch.Tensor, int, int]:
        c, act, W = self.config, self.membership.active, self.world
        src = handle.recv_src_rank.numpy()
        key = _row_keys(src, handle.recv_src_token.numpy(), handle.recv_src_slot.numpy(), c)
        mine = np.flatnonzero(act[src])
        order = mine[np.argsort(key[mine], kind="stable")]     # by (source, token, slot)
        rows = expert_out[torch.from_numpy(order)].contiguous()
        send = rows.view(torch.uint8).view(len(order), -1)
        in_splits = np.bincount(src[order], minlength=W).tolist()
        # what comes back: my delivered slots, by rank, then (token, slot)
        idx = handle.topk_idx.to(torch.int64).numpy()
        T, K = idx.shape
        dest = np.where(idx >= 0, idx // c.experts_per_rank, 0)
        ok = (idx >= 0) & act[dest]
        flat = np.flatnonzero(ok.reshape(-1))
        by = flat[np.lexsort((flat, dest.reshape(-1)[flat]))]
        out_splits = np.bincount(dest.reshape(-1)[by], minlength=W).tolist()
        rb = c.hidden * expert_out.element_size()
        recv = torch.empty(len(by), rb, dtype=torch.uint8)
        self.el.all_to_all(recv, send, out_splits, in_splits)
        back = recv.view(expert_out.dtype).view(len(by), c.hidden).float()
        tok, slot = torch.from_numpy(by // K), torch.from_numpy(by % K)
        if weighted:
            back = back * handle.topk_weights[tok, slot].float()[:, None]
        acc = torch.zeros(T, c.hidden, dtype=torch.float32)
        for k in range(K):                  # slot order: the oracle's sum, bit for bit
            sel = slot == k
            acc.index_add_(0, tok[sel], back[sel])
        return acc.to(expert_out.dtype), send.numel(), recv.numel()


def _survivors_stats(st: Stats | None) -> Stats | None:
    """A survivors' call's stats (the torch backend's) under this backend's name."""
    if st is None:
        return None
    plain = {f.name: getattr(st, f.name) for f in dataclasses.fields(Stats)}
    extra = {**plain.pop("extra"), "mode": "flat", "elastic": "survivors"}
    return Stats(**{**plain, "backend": "hybrid", "extra": extra})


def _row_keys(src: np.ndarray, tok: np.ndarray, slot: np.ndarray, c: BufferConfig) -> np.ndarray:
    """One int64 per received row, ordered by (source rank, source token, slot)."""
    return (src.astype(np.int64) * c.max_tokens_per_rank + tok) * c.max_top_k + slot


def _onto(expert_out: torch.Tensor, handle: DispatchHandle, replay: DispatchResult,
          c: BufferConfig) -> torch.Tensor:
    """`expert_out`'s rows (in `handle`'s order) laid out as `replay`'s: the replay holds the
    same rows from the sources alive (a subset of the hybrid dispatch's)."""
    have = _row_keys(handle.recv_src_rank.numpy(), handle.recv_src_token.numpy(),
                     handle.recv_src_slot.numpy(), c)
    want = _row_keys(replay.recv_src_rank.numpy(), replay.recv_src_token.numpy(),
                     replay.recv_src_slot.numpy(), c)
    order = np.argsort(have, kind="stable")
    pos = order[np.searchsorted(have[order], want)]
    return expert_out[torch.from_numpy(pos)].contiguous()
