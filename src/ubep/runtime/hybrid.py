"""`HybridBackend`: expert parallelism across hosts, shared memory inside each.

The two-level exchange production EP libraries run between nodes (DeepEP's normal kernels:
RDMA once per node, then NVLink), with a host's shared memory as the near tier and
`torch.distributed` (gloo, MPI) on the user's group as the far one:

dispatch: split the routing by host (`plan.hosts`) -> one small all-to-all of counts (every
    rank learns every rank's token count and how many rows it will receive) -> the rows
    for other hosts go out in one all-to-all, each token once per host that holds one of
    its experts, with its routing restricted to that host; *while they travel* this rank's
    tokens for its own host's experts move through shared memory (the shm backend's
    one-copy path, `direct="owned"`) -> the rows received as a host's entry are forwarded
    to their expert ranks through shared memory -> both arrivals are laid out expert-major
    by (source rank, source token), as every backend returns them.
combine: the forwarded rows' expert outputs are summed per (token, host) on this host
    through shared memory and go back in one all-to-all (one partial row per token and
    host); while they travel, this rank's own tokens' rows on this host are summed the
    same way -> the token's rank adds the partials in fp32 in host order, rounds once.

Rounding contract: each host's partial is the fp32 sum of the token's slots on that host in
slot order, rounded to the output dtype (fp32 for 8-bit outputs), as DeepEP's combine and
ubep's torch backend send them: half the bytes of fp32 partials. The token's rank sums the
partials in fp32 in ascending host order and rounds once to the output dtype
(`ubep.reference.combine_partials` with `group_of_rank` = the host of each rank computes the
same bits). A token whose experts all live on one host gets the oracle's bits exactly.

The network part is all-to-alls on the caller's group (ranks of one host exchange nothing
there); every network wait has the Buffer's deadline.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ubep.errors import PeerDiedError, PeerTimeoutError, UbepError
from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.options import BufferConfig
from ubep.plan.hosts import HostLayout, merge_order, split_routing
from ubep.runtime.hosts import discover_hosts
from ubep.runtime.torch_backend import all_to_all
from ubep.stats import Stats

__all__ = ["HybridBackend", "PARTIAL_DTYPES"]

#: combine partials travel in the output dtype for these, in fp32 for the rest (8-bit)
PARTIAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: how long a network wait yields the core before it sleeps between polls, seconds
_YIELD_S = 2e-3


def _bytes(rows: torch.Tensor, rb: int) -> torch.Tensor:
    """`rows` `[n, hidden]` as `[n, rb]` uint8."""
    return rows.contiguous().view(torch.uint8).view(-1, rb)


@dataclass(frozen=True)
class _Sent:
    """What one dispatch sent over the network and received as an entry: combine's map."""

    tokens: tuple[np.ndarray, ...]      # per host: my tokens sent there (ascending)
    send_counts: np.ndarray             # [W] rows I sent to each rank
    recv_counts: np.ndarray             # [W] rows I received from each rank
    recv_vtokens: np.ndarray            # [sum recv_counts]: virtual token of each received row


@dataclass(frozen=True)
class _HybridState:
    """A dispatch's handle state: the two shm dispatches and where their rows went."""

    local: DispatchHandle               # the shm dispatch of this rank's own tokens
    forwarded: DispatchHandle           # the shm dispatch of the rows received as entry
    pos_local: torch.Tensor             # [n_local] int64: final row of each local row
    pos_forwarded: torch.Tensor         # [n_forwarded] int64
    sent: _Sent


class HybridBackend:
    """Dispatch/combine across hosts: shm inside a host, all-to-all between hosts."""

    def __init__(self, config: BufferConfig, group, buffer_id: int):
        from ubep.runtime.shm.backend import ShmBackend

        c = config
        self.config = c
        self.buffer_id = buffer_id
        self.rank, self.world = c.rank, c.world_size
        self._pg = group if group is not None else dist.group.WORLD
        hosts = c.hosts or discover_hosts(group, rank=c.rank, world=c.world_size,
                                          timeout_s=c.timeout_s)
        self.layout = lay = HostLayout.of(hosts, c.num_experts)
        self.host = int(lay.host_of_rank[self.rank])
        self.host_ranks = np.asarray(lay.hosts[self.host], np.int64)
        #: False once a call failed after peers were involved (`Buffer` then refuses reuse)
        self.in_step = True
        self._closed = False
        # the shared-memory part: the host's ranks as one shm group, one-copy owned path,
        # sized for this host's largest forwarded dispatch
        members = [dist.get_global_rank(group, int(r)) if group is not None else int(r)
                   for r in self.host_ranks]
        self._host_group = dist.new_group(members, use_local_synchronization=True)
        most = max(lay.max_virtual_tokens_on(self.host, c.max_tokens_per_rank),
                   c.max_tokens_per_rank)
        shm_cfg = dataclasses.replace(
            c, rank=int(lay.local_index[self.rank]), world_size=len(self.host_ranks),
            num_experts=lay.host_experts(self.host), max_tokens_per_rank=most,
            backend="shm", requested_backend="shm", direct="owned", mode="ubep",
            topology=None, hosts=(), backend_reason="the hybrid backend's shared-memory part")
        self._shm = ShmBackend(shm_cfg, self._host_group, buffer_id)
        self._shm_calls = 0
        #: the remote sources whose tokens this rank forwards, and every entry of its host's
        self._sources = lay.sources(self.rank)
        self._entries = {int(e): lay.sources(int(e)) for e in self.host_ranks}

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The group ranks of each host, as this backend found them."""
        return self.layout.hosts

    # -- the network part --------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, recv: torch.Tensor, send_splits: list[int],
                  recv_splits: list[int], phase: str):
        """Start an all-to-all on the group; `_finish` it."""
        try:
            return all_to_all(self._pg, recv, send, recv_splits, send_splits, async_op=True)
        except RuntimeError as e:
            raise self._network_error(phase, e) from e

    def _finish(self, work, phase: str, t_end: float) -> None:
        """Wait for `work` until `t_end` (perf_counter s): yield first, then sleep briefly."""
        if work is None:
            return
        t_yield = time.perf_counter() + _YIELD_S
        nap = 20e-6
        while not work.is_completed():
            now = time.perf_counter()
            if now > t_end:
                self.in_step = False
                raise PeerTimeoutError(self.rank, phase, self._remote_ranks(),
                                       self.config.timeout_s,
                                       "a rank on another host did not join the exchange")
            if now < t_yield:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)
        try:
            work.wait()
        except RuntimeError as e:
            raise self._network_error(phase, e) from e

    def _remote_ranks(self) -> list[int]:
        return [r for r in range(self.world) if r not in set(self.host_ranks.tolist())]

    def _network_error(self, phase: str, e: BaseException) -> UbepError:
        self.in_step = False
        text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        gone = ("closed", "reset", "broken pipe", "connection", "eof")
        if any(g in text.lower() for g in gone):
            err = PeerDiedError(self.rank, phase, self._remote_ranks())
            err.args = (f"{err.args[0]} (one of them: the exchange between hosts failed: "
                        f"{text})",)
            return err
        return UbepError(f"rank {self.rank} in phase {phase!r}: the exchange between hosts "
                         f"failed: {text}")

    def _shm_call(self, fn, phase: str, *args):
        """A call of the shm part; its errors name global ranks."""
        try:
            return fn(*args)
        except (PeerDiedError, PeerTimeoutError) as e:
            self.in_step = False
            peers = [int(self.host_ranks[p]) for p in e.peers if p < len(self.host_ranks)]
            if isinstance(e, PeerDiedError):
                raise PeerDiedError(self.rank, f"{phase}: {e.phase}", peers) from e
            raise PeerTimeoutError(self.rank, f"{phase}: {e.phase}", peers, e.timeout_s) from e
        except BaseException:
            self.in_step = self.in_step and self._shm.in_step
            raise

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult:
        if self._closed:
            raise RuntimeError("cannot dispatch after close")
        c, lay, W = self.config, self.layout, self.world
        t0 = time.perf_counter()
        t_end = t0 + c.timeout_s
        T, K = topk_idx.shape
        rb = c.hidden * x.element_size()
        mb = 4 * (1 + 2 * K)        # per forwarded row: token, K host expert ids, K weights
        split = split_routing(lay, self.rank, topk_idx.numpy())
        send_counts = np.zeros(W, np.int64)
        for h, toks in enumerate(split.tokens):
            if len(toks):
                send_counts[lay.entry[self.rank, h]] = len(toks)

        # counts: every rank's token count and the rows each sends me
        head = torch.from_numpy(np.stack([np.full(W, T, np.int64), send_counts], axis=1))
        heads = torch.empty(W, 2, dtype=torch.int64)
        self._finish(self._exchange(head, heads, [1] * W, [1] * W, "dispatch/network counts"),
                     "dispatch/network counts", t_end)
        t_counts = time.perf_counter()
        num_tokens, recv_counts = heads[:, 0].numpy(), heads[:, 1].numpy()

        # rows (+ their routing) to other hosts' entries, in flight while the local part runs
        send = self._pack(x, topk_weights, split, send_counts, rb, mb)
        recv = torch.empty(int(recv_counts.sum()) * (rb + mb), dtype=torch.uint8)
        work = self._exchange(send, recv, (send_counts * (rb + mb)).tolist(),
                              (recv_counts * (rb + mb)).tolist(), "dispatch/network rows")
        t_sent = time.perf_counter()
        local = self._shm_dispatch(x, torch.from_numpy(split.local_idx), topk_weights,
                                   "dispatch/shm local")
        t_local = time.perf_counter()
        self._finish(work, "dispatch/network rows", t_end)
        t_net = time.perf_counter()

        # forward what arrived to its expert ranks on this host
        xf, idxf, wf, vtok = self._unpack(recv, recv_counts, num_tokens, x.dtype, rb, mb, K)
        fwd = self._shm_dispatch(xf, idxf, wf, "dispatch/shm forwarded")
        t_fwd = time.perf_counter()
        merged = self._merge(x, topk_idx, topk_weights, call, local, fwd, num_tokens,
                             _Sent(split.tokens, send_counts, recv_counts, vtok))
        t_end_ = time.perf_counter()
        phases = {"network counts": t_counts - t0, "pack": t_sent - t_counts,
                  "shm local": t_local - t_sent, "network wait": t_net - t_local,
                  "shm forwarded": t_fwd - t_net, "merge": t_end_ - t_fwd}
        phases = {k: v * 1e6 for k, v in phases.items()}
        phases["network"] = phases["network counts"] + phases["network wait"]
        phases["shm"] = phases["shm local"] + phases["shm forwarded"]
        sent_rows = int(send_counts.sum())
        stats = Stats(op="dispatch", backend="hybrid", mode="ubep", sync=c.sync,
                      schedule="static", rank=self.rank, total_us=(t_end_ - t0) * 1e6,
                      phases_us=phases, bytes_sent=sent_rows * rb, bytes_recv=recv.numel(),
                      bytes_sent_network=sent_rows * rb,
                      extra={"network_meta_bytes": sent_rows * mb + 16 * (W - 1),
                             "rows_sent_per_host": [len(t) for t in split.tokens],
                             "rows_forwarded": int(recv_counts.sum()),
                             "hosts": [list(h) for h in lay.hosts]})
        return DispatchResult(*merged, stats=stats)

    def _shm_dispatch(self, x, idx, w, phase: str) -> DispatchResult:
        self._shm_calls += 1
        return self._shm_call(self._shm.dispatch, phase, x, idx, w, self._shm_calls)

    def _pack(self, x: torch.Tensor, w: torch.Tensor, split, send_counts: np.ndarray,
              rb: int, mb: int) -> torch.Tensor:
        """The send buffer: per destination rank (ascending), its rows, then their routing."""
        lay = self.layout
        total = int(send_counts.sum())
        out = torch.empty(total * (rb + mb), dtype=torch.uint8)
        if not total:
            return out
        xb = x.view(torch.uint8).view(x.shape[0], rb)
        wn = w.numpy()
        at = 0
        for d in np.flatnonzero(send_counts):
            h = int(lay.host_of_rank[d])
            toks, ridx = split.tokens[h], split.remote_idx[h]
            n = len(toks)
            rows = out[at:at + n * rb].view(n, rb)
            torch.index_select(xb, 0, torch.from_numpy(toks), out=rows)
            meta = out[at + n * rb:at + n * (rb + mb)].numpy().view(np.int32).reshape(n, -1)
            k = ridx.shape[1]
            meta[:, 0] = toks
            meta[:, 1:1 + k] = ridx
            meta[:, 1 + k:] = wn[toks].view(np.int32)
            at += n * (rb + mb)
        return out

    def _unpack(self, recv: torch.Tensor, recv_counts: np.ndarray, num_tokens: np.ndarray,
                dtype: torch.dtype, rb: int, mb: int, K: int):
        """The forwarded dispatch's inputs: virtual tokens of every source, in source order
        (token t of source s is virtual token offset[s] + t; tokens not sent stay unrouted)."""
        offsets = self.layout.vtoken_offsets(self.rank, num_tokens)
        tv = sum(int(num_tokens[s]) for s in self._sources)
        hidden = self.config.hidden
        xf = torch.empty(tv, hidden, dtype=dtype)
        idxf = torch.full((tv, K), -1, dtype=torch.int64)
        wf = torch.zeros(tv, K, dtype=torch.float32)
        vtok = np.empty(int(recv_counts.sum()), np.int64)
        xfb, idn, wfn = xf.view(torch.uint8).view(tv, rb), idxf.numpy(), wf.numpy()
        at = row = 0
        for s in np.flatnonzero(recv_counts):
            n = int(recv_counts[s])
            meta = recv[at + n * rb:at + n * (rb + mb)].numpy().view(np.int32).reshape(n, -1)
            v = offsets[int(s)] + meta[:, 0].astype(np.int64)
            vt = torch.from_numpy(v)
            xfb.index_copy_(0, vt, recv[at:at + n * rb].view(n, rb))
            idn[v] = meta[:, 1:1 + K]
            wfn[v] = meta[:, 1 + K:].view(np.float32)
            vtok[row:row + n] = v
            at += n * (rb + mb)
            row += n
        return xf, idxf, wf, vtok

    def _origins(self, res: DispatchResult, forwarded: bool,
                 num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global source rank, source token) of each row of an shm dispatch's result."""
        src = res.recv_src_rank.numpy()
        tok = res.recv_src_token.numpy()
        if not forwarded:
            return self.host_ranks[src], tok
        out_src = np.empty_like(src)
        out_tok = np.empty_like(tok)
        for i, e in enumerate(self.host_ranks):
            rows = np.flatnonzero(src == i)
            if not len(rows):
                continue
            sources = np.asarray(self._entries[int(e)], np.int64)
            starts = np.cumsum(np.concatenate([[0], num_tokens[sources]]))[:-1]
            which = np.searchsorted(starts, tok[rows], side="right") - 1
            out_src[rows] = sources[which]
            out_tok[rows] = tok[rows] - starts[which]
        return out_src, out_tok

    def _merge(self, x, topk_idx, topk_weights, call, local: DispatchResult,
               fwd: DispatchResult, num_tokens: np.ndarray, sent: _Sent) -> tuple:
        """The two shm results laid out expert-major by (source rank, source token): the
        `DispatchResult` fields up to `handle`, in order."""
        c, W = self.config, self.world
        epr = c.experts_per_rank
        tmax = c.max_tokens_per_rank
        keys, parts = [], []
        for res, forwarded in ((local, False), (fwd, True)):
            src, tok = self._origins(res, forwarded, num_tokens)
            expert = np.repeat(np.arange(epr), res.tokens_per_expert.numpy())
            keys.append((expert * W + src) * tmax + tok)
            parts.append((src, tok, res.recv_src_slot.numpy()))
        pos = merge_order(keys[0], keys[1])
        n_l = len(keys[0])
        n = len(pos)
        pos_l, pos_f = torch.from_numpy(pos[:n_l]), torch.from_numpy(pos[n_l:])
        recv_x = torch.empty(n, c.hidden, dtype=x.dtype)
        rb = c.hidden * x.element_size()
        xb = recv_x.view(torch.uint8).view(n, rb)       # rows as bytes: any dtype
        xb.index_copy_(0, pos_l, _bytes(local.recv_x, rb))
        xb.index_copy_(0, pos_f, _bytes(fwd.recv_x, rb))
        recv_w = torch.empty(n, dtype=torch.float32)
        recv_w.index_copy_(0, pos_l, local.recv_weights)
        recv_w.index_copy_(0, pos_f, fwd.recv_weights)
        origins = np.empty((3, n), np.int64)
        for p, (src, tok, slot) in zip((pos[:n_l], pos[n_l:]), parts):
            origins[0, p], origins[1, p], origins[2, p] = src, tok, slot
        src_rank, src_token, src_slot = (torch.from_numpy(o) for o in origins)
        tpe = local.tokens_per_expert + fwd.tokens_per_expert
        state = _HybridState(local.handle, fwd.handle, pos_l, pos_f, sent)
        handle = DispatchHandle(buffer_id=self.buffer_id, call=call, num_tokens=x.shape[0],
                                num_recv=n, hidden=c.hidden, topk_idx=topk_idx,
                                topk_weights=topk_weights, recv_src_rank=src_rank,
                                recv_src_token=src_token, recv_src_slot=src_slot, state=state)
        return recv_x, recv_w, tpe, src_rank, src_token, src_slot, handle

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                out: torch.Tensor | None = None) -> CombineResult:
        if self._closed:
            raise RuntimeError("cannot combine after close")
        st: _HybridState = handle.state
        sent = st.sent
        c = self.config
        t0 = time.perf_counter()
        t_end = t0 + c.timeout_s
        pdtype = expert_out.dtype if expert_out.dtype in PARTIAL_DTYPES else torch.float32
        rows = expert_out if expert_out.dtype == pdtype else expert_out.to(pdtype)
        prb = c.hidden * pdtype.itemsize
        # the forwarded rows first: their partials are what the network waits for
        yf = self._shm_call(self._shm.combine, "combine/shm forwarded",
                            rows.index_select(0, st.pos_forwarded), st.forwarded, weighted).y
        t_fwd = time.perf_counter()
        send = torch.empty(int(sent.recv_counts.sum()), c.hidden, dtype=pdtype)
        if len(sent.recv_vtokens):
            torch.index_select(yf, 0, torch.from_numpy(sent.recv_vtokens), out=send)
        recv = torch.empty(int(sent.send_counts.sum()), c.hidden, dtype=pdtype)
        work = self._exchange(send.view(torch.uint8).view(-1), recv.view(torch.uint8).view(-1),
                              (sent.recv_counts * prb).tolist(),
                              (sent.send_counts * prb).tolist(), "combine/network")
        t_sent = time.perf_counter()
        yl = self._shm_call(self._shm.combine, "combine/shm local",
                            rows.index_select(0, st.pos_local), st.local, weighted).y
        t_local = time.perf_counter()
        self._finish(work, "combine/network", t_end)
        t_net = time.perf_counter()
        # the partials in host order, fp32, one rounding
        acc = torch.zeros(handle.num_tokens, c.hidden, dtype=torch.float32)
        at = 0
        for h, toks in enumerate(sent.tokens):
            if h == self.host:
                acc += yl
            elif len(toks):
                n = len(toks)
                acc.index_add_(0, torch.from_numpy(toks), recv[at:at + n].to(torch.float32))
                at += n
        y = acc.to(expert_out.dtype) if out is None else out.copy_(acc)
        t_done = time.perf_counter()
        phases = {"shm forwarded": t_fwd - t0, "pack": t_sent - t_fwd,
                  "shm local": t_local - t_sent, "network wait": t_net - t_local,
                  "sum": t_done - t_net}
        phases = {k: v * 1e6 for k, v in phases.items()}
        phases["network"] = phases["network wait"]
        phases["shm"] = phases["shm forwarded"] + phases["shm local"]
        stats = Stats(op="combine", backend="hybrid", mode="ubep", sync=c.sync,
                      schedule="static", rank=self.rank, total_us=(t_done - t0) * 1e6,
                      phases_us=phases, bytes_sent=send.numel() * pdtype.itemsize,
                      bytes_recv=recv.numel() * pdtype.itemsize,
                      bytes_sent_network=send.numel() * pdtype.itemsize,
                      extra={"partial_dtype": str(pdtype).removeprefix("torch.")})
        return CombineResult(y=y, stats=stats)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the shared-memory part (idempotent). The host group stays with
        torch.distributed (destroyed with the default group)."""
        if self._closed:
            return
        self._closed = True
        self._shm.close()
