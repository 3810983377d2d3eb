"""`HybridBackend`: expert parallelism across hosts, shared memory inside each.

The two-level exchange production EP libraries run between nodes (DeepEP's normal kernels:
RDMA once per node, then NVLink), with a host's shared memory as the near tier and
`torch.distributed` on the user's group (gloo, MPI) as the far one. Follow a call:

dispatch: split the routing by host (`plan.hosts.split_routing`) -> post the messages to
    each other host's entry rank (`network.py`): the tokens with an expert there, each once,
    with their routing restricted to that host, in up to `CHUNKS` messages -> *while those
    travel*, this rank's tokens for its own host's experts move through shared memory (the
    shm backend's one-copy `direct="owned"` path, on the host's ranks) -> each chunk this
    rank received as an entry is forwarded to its expert ranks through shared memory as
    soon as it arrived (the later chunks still travelling), their origins in `origins.py`'s
    tables -> all arrivals are laid out expert-major by (source rank, source token), as
    every backend returns them (one gather of the received rows).
combine: chunk by chunk, the forwarded rows' expert outputs are summed per (token, host)
    through shared memory and go back at once, one partial row per token and host; while
    they travel, this rank's own tokens' rows on this host are summed the same way -> the
    token's rank adds the partials in fp32 in host order and rounds once.

Modes, as DeepEP has a low-latency and a normal mode, picked per call alike on every rank
from what every rank knows alike: the previous call's largest batch of any rank (dispatch
messages carry their sender's batch, the host's ranks publish what they heard beside the
origin tables; in flat mode the torch backend's count exchange carries the largest count
one rank sent one peer) and, above `FLAT_BYTES`, the dispatch + combine times the ranks
measured in each mode (carried the same way; `modes.py` decides):

* "flat": the call goes straight to the expert ranks over the group as the torch backend
  sends it (two phases instead of four), each token once per rank -- always at small
  batches (at most `FLAT_BYTES`: bytes are cheap and every phase is a round of waiting),
  and above where it measured cheaper (a fast link, where the hierarchical exchange's
  extra copies cost more than its fewer bytes save);
* "split": two shared-memory exchanges per step, so the near tier works while the far one
  moves bytes, the far one in chunks (the largest batch had more than `SPLIT_BYTES` of
  bf16 rows; a chunk per `SPLIT_BYTES`, up to `CHUNKS`);
* "joint": the rank's own tokens ride in the forwarded exchange (one exchange per step,
  after the network): at medium batches there is little to hide and each exchange is a
  rendezvous of the host's ranks.

Rounding contract: a host's partial is the fp32 sum of the token's slots on that host in
slot order, rounded to the output dtype (fp32 for 8-bit outputs) -- what crosses the network,
as DeepEP's combine and ubep's torch backend send them, half the bytes of fp32 partials; the
token's rank sums the partials in fp32 in ascending host order and rounds once. A token whose
experts all live on one host gets the oracle's bits; otherwise the result is within
0.5 ulp(y) + 0.5 * sum_h ulp(partial_h) of the oracle's fp32 sum (docs/multihost.md).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ubep.errors import PeerDiedError, PeerTimeoutError
from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.options import BufferConfig
from ubep.plan.hosts import HostLayout, merge_order, split_routing
from ubep.runtime import Backend
from ubep.runtime.hosts import discover_hosts
from ubep.runtime.hybrid.elastic import HybridElastic
from ubep.runtime.hybrid.modes import ModePicker, bucket
from ubep.runtime.hybrid.network import Exchange, network_error, post
from ubep.runtime.hybrid.origins import OriginTables
from ubep.runtime.shm.outputs import OutputPool
from ubep.runtime.torch_backend import PARTIAL_DTYPES, TorchBackend
from ubep.stats import Stats

__all__ = ["HybridBackend", "PARTIAL_DTYPES", "FLAT_BYTES", "SPLIT_BYTES"]

#: the previous call's largest batch on one rank, as bf16 rows of `hidden` (whatever the
#: dtype: every rank must decide alike), picks the mode: "flat" up to FLAT_BYTES (~9 rows of
#: 7168; at batch 8, 2 emulated hosts x 2 ranks, the joint exchange took 1.7x the flat
#: one's time); above, flat where the ranks measured it cheaper (`modes.py`), else "joint"
#: up to SPLIT_BYTES (~18 rows), "split" beyond, where moving the local rows during the
#: network transfer saves more than one more rendezvous of the host's ranks costs
FLAT_BYTES = 128 << 10
SPLIT_BYTES = 256 << 10
#: split mode: the rows between hosts travel in up to CHUNKS messages per peer (one per
#: SPLIT_BYTES of the largest batch), each forwarded through shared memory as soon as it
#: arrived while the next ones travel; combine sends each chunk's partials as soon as they
#: are summed (a pipeline, as DeepEP's normal kernels forward while RDMA chunks arrive)
CHUNKS = 4
#: bytes before a dispatch message's rows: row count, the sender's batch, its flat and
#: hierarchical costs (`modes.ModePicker.shared`)
_HEADER = 32
_clock = time.perf_counter


def _words(rows: torch.Tensor) -> torch.Tensor:
    """`rows` `[n, m]` as `[n, w]` of the widest integer word dividing a row's bytes:
    gathers and scatters of rows then move words, not bytes (~8x faster for uint8)."""
    b = rows.contiguous().view(torch.uint8)     # [n, row bytes]
    for dtype in (torch.int64, torch.int32, torch.int16):
        if b.shape[1] % dtype.itemsize == 0:
            return b.view(dtype)
    return b


@dataclass(frozen=True)
class _Part:
    """One shared-memory dispatch of a call: its handle and where its rows went."""

    handle: DispatchHandle
    pos: torch.Tensor                   # [n] int64: the final row of each of its rows


@dataclass(frozen=True)
class _HybridState:
    """A dispatch's handle state: combine's map back."""

    parts: tuple[_Part, ...]            # split: (local, forwarded chunks...); joint: (both,)
    joint: bool
    tokens: tuple[np.ndarray, ...]      # per host: my tokens sent there (ascending)
    recv_rows: tuple[dict[int, int], ...]   # per chunk, per source rank: rows received
    cost: list                          # [the call's batch bucket, dispatch seconds]


class HybridBackend(Backend):
    """Dispatch/combine across hosts: shm inside a host, point-to-point between hosts (the
    Buffer's door is the flat torch backend's, open while small batches run flat)."""

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
        #: peers on other hosts: the entries I send to (host -> rank), the sources I forward
        self._entries = {h: int(lay.entry[self.rank, h]) for h in range(lay.num_hosts)
                         if h != self.host}
        self._sources = lay.sources(self.rank)
        #: `[W]` bool: the ranks on other hosts (a flat call's network peers)
        self._far = lay.host_of_rank != self.host
        tmax = c.max_tokens_per_rank
        # a rank's shm dispatch carries at most its own tokens and its sources' (joint mode)
        most = (1 + max(len(lay.sources(int(r))) for r in self.host_ranks)) * tmax
        members = [int(r) if group is None else dist.get_global_rank(group, int(r))
                   for r in self.host_ranks]
        self._host_group = dist.new_group(members, use_local_synchronization=True)
        shm_cfg = dataclasses.replace(
            c, rank=int(lay.local_index[self.rank]), world_size=len(self.host_ranks),
            num_experts=lay.host_experts(self.host), max_tokens_per_rank=most,
            backend="shm", requested_backend="shm", direct="owned", mode="ubep",
            topology=None, hosts=(), backend_reason="the hybrid backend's shared-memory part",
            elastic=False)
        self._shm = ShmBackend(shm_cfg, self._host_group, buffer_id)
        try:
            self._origins = OriginTables(self._host_group, rank=shm_cfg.rank,
                                         world=shm_cfg.world_size, capacity=most,
                                         buffer_id=buffer_id, timeout_s=c.timeout_s,
                                         chunks=CHUNKS)
        except BaseException:
            self._shm.close()
            raise
        #: recv_x and y on kept memory (no page faults per call); scratch kept and grown
        self._pool = OutputPool()
        self._scratch: dict[object, torch.Tensor] = {}
        self._calls = 0
        self._shm_calls = 0
        #: elastic (`elastic.py`): the calls wrapped, the network on a group of its own
        self._elastic = None
        if c.elastic:
            try:
                self._elastic = HybridElastic(c, group, buffer_id)
            except BaseException:
                self._origins.close()
                self._shm.close()
                raise
            self._pg = self._elastic.net_group
            self.membership = self._elastic.membership
            self.dispatch, self.combine = self._elastic.wrap(self.dispatch, self.combine,
                                                             self._shm.leave)
        #: small batches: the flat exchange, the torch backend's, on the same group
        self._flat = TorchBackend(dataclasses.replace(c, backend="torch", hosts=(),
                                                      elastic=False),
                                  group if self._elastic is None else self._pg, buffer_id,
                                  restate=self)
        self._mode = "joint"        # the first call's (then the last call's batch picks)
        self._flat.shut_door(True)
        self._chunks = 1            # split mode's chunks per peer (picked with the mode)
        #: flat or hierarchical above FLAT_BYTES: from the costs the ranks measured
        self._picker = ModePicker()
        #: the largest count to one peer of a small flat call (`_after_flat`'s rule)
        self._small_most = FLAT_BYTES // (c.hidden * 2)
        #: a flat dispatch's (bucket, seconds; None: the door's, not timed)
        self._flat_t: tuple[int, float | None] = (0, 0.0)

    def set_active_ranks(self, mask: np.ndarray) -> None:
        """Elastic: remove the ranks `mask` drops (`HybridElastic.set_active_ranks`)."""
        if self._elastic is None:
            Backend.set_active_ranks(self, mask)
        self._elastic.set_active_ranks(mask)

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The group ranks of each host, as this backend found them."""
        return self.layout.hosts

    # -- pieces ------------------------------------------------------------------------------
    def _post(self, phase: str, sends: dict, recvs: dict, tag: int = 0) -> Exchange:
        try:
            return post(Exchange(self.rank, phase, self.config.timeout_s), self._pg, sends,
                        recvs, tag)
        except BaseException:
            self.in_step = False
            raise

    def _post_into(self, ex: Exchange, sends: dict, recvs: dict, tag: int) -> None:
        """Post more messages into the exchange `ex` (finished together)."""
        try:
            post(ex, self._pg, sends, recvs, tag)
        except BaseException:
            self.in_step = False
            raise

    def _finish(self, ex: Exchange, deadline: float) -> None:
        try:
            ex.finish(deadline, _clock)
        except BaseException:
            self.in_step = False
            raise

    def _shm_call(self, fn, phase: str, *args):
        """A call of the shm part; its errors name global ranks and this phase."""
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

    def _kept(self, key, nbytes: int) -> torch.Tensor:
        """`nbytes` of uint8 scratch kept across calls under `key` (grown when short): large
        fresh tensors cost a page fault per 4 KiB on every call."""
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._scratch[key] = torch.empty(max(nbytes, 64), dtype=torch.uint8)
        return buf[:nbytes]

    def _mode_for(self, batch: int) -> str:
        """The next call's mode after a call whose largest batch on one rank was `batch`
        (and, for "split", its chunks per peer in `_chunks`)."""
        nbytes = batch * self.config.hidden * 2
        self._chunks = min(CHUNKS, max(1, nbytes // SPLIT_BYTES))
        return "flat" if nbytes <= FLAT_BYTES else "joint" if nbytes <= SPLIT_BYTES else "split"

    def _inbox(self, chunks: int) -> list[dict[int, torch.Tensor]]:
        """Per chunk, per source: a receive buffer for the largest chunk it could send."""
        c = self.config
        rows = -(-c.max_tokens_per_rank // chunks)
        cap = _HEADER + rows * (4 * c.hidden + 4 * (1 + 2 * c.max_top_k))
        return [{s: self._kept(("inbox", s, k), cap) for s in self._sources}
                for k in range(chunks)]

    def _shm_dispatch(self, x, idx, w, phase: str) -> DispatchResult:
        self._shm_calls += 1
        return self._shm_call(self._shm.dispatch, phase, x, idx, w, self._shm_calls)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult:
        if self._closed:
            raise RuntimeError("cannot dispatch after close")
        if self._mode == "flat":
            return self._flat_dispatch(x, topk_idx, topk_weights, call)
        c = self.config
        t0 = _clock()
        deadline = t0 + c.timeout_s
        T, K = topk_idx.shape
        rb = c.hidden * x.element_size()
        mb = 4 * (1 + 2 * K)        # per row sent: token, K host expert ids, K weights
        self._calls += 1
        parity, joint = self._calls & 1, self._mode == "joint"
        chunks = 1 if joint else self._chunks
        split = split_routing(self.layout, self.rank, topk_idx.numpy())
        head = (T, *self._picker.shared())
        inbox = self._inbox(chunks)
        nets, sends = [], {}
        for k in range(chunks):     # every chunk posted now: gloo sends them in order
            out = {}
            for h, e in self._entries.items():
                n = len(split.tokens[h])
                lo, hi = n * k // chunks, n * (k + 1) // chunks
                out[e] = self._pack((e, k), head, x, topk_weights, split.tokens[h][lo:hi],
                                    split.remote_idx[h][lo:hi], rb, mb)
                sends[e] = sends.get(e, 0) + out[e].numel()
            nets.append(self._post("dispatch/network", out, inbox[k], k))
        t_posted = _clock()
        local_idx = torch.from_numpy(split.local_idx)
        if not joint:       # my tokens for this host's experts move while the rows travel
            local = self._shm_dispatch(x, local_idx, topk_weights, "dispatch/shm local")
        t_local = _clock()
        own = (x, local_idx, topk_weights) if joint else None
        results = [] if joint else [(local, None)]
        recv_rows, t_wait, t_net, t_shm_local = [], 0.0, t_local, t_local - t_posted
        for k in range(chunks):
            self._finish(nets[k], deadline)
            t_net = _clock()
            slot = parity * CHUNKS + k
            xf, idxf, wf, rows, heard = self._unpack(inbox[k], own, x.dtype, rb, mb, K, slot)
            t_wait += t_net - t_local
            if k == 0:      # the largest batch and costs I know of (mine, my sources'),
                # before the dispatch that shows them
                self._origins.write_words(parity, tuple(map(max, head, heard)))
            results.append((self._shm_dispatch(xf, idxf, wf, "dispatch/shm forwarded"), slot))
            recv_rows.append(rows)
            t_local = _clock()
        t_fwd = t_local
        # every remote rank told one rank of this host its batch and costs: the host's
        # ranks' largest is every rank's largest, so the next call's mode is the same
        # everywhere
        most, flat_us, hier_us = self._origins.max_words(parity)
        nbytes = most * c.hidden * 2
        flat = self._picker.after_hier(bucket(most), nbytes <= FLAT_BYTES, flat_us, hier_us,
                                       call)
        self._set_mode("flat" if flat else self._mode_for(most), call)
        cost = [bucket(most), 0.0]
        merged = self._merge(x, topk_idx, topk_weights, call, results, joint,
                             split.tokens, tuple(recv_rows), cost)
        t_end = _clock()
        cost[1] = t_end - t0
        us = 1e6
        phases = {"pack": (t_posted - t0) * us, "shm local": t_shm_local * us,
                  "network wait": t_wait * us,
                  "shm forwarded": (t_fwd - t_posted - t_wait - t_shm_local) * us,
                  "merge": (t_end - t_fwd) * us}
        phases["network"] = phases["network wait"]
        phases["shm"] = phases["shm local"] + phases["shm forwarded"]
        rows_out = sum(len(split.tokens[h]) for h in self._entries)
        got = {}
        for rows in recv_rows:
            for src, m in rows.items():
                got[src] = got.get(src, 0) + m
        stats = Stats(op="dispatch", backend="hybrid", mode="ubep", sync=c.sync,
                      schedule="static", rank=self.rank, total_us=(t_end - t0) * us,
                      phases_us=phases, bytes_sent=sum(sends.values()),
                      bytes_recv=sum(got.values()) * (rb + mb) + _HEADER * len(got) * chunks,
                      bytes_sent_network=rows_out * rb,
                      extra={"network_meta_bytes": rows_out * mb + _HEADER * len(sends) * chunks,
                             "mode": "joint" if joint else "split", "chunks": chunks,
                             "rows_sent_per_host": [len(t) for t in split.tokens],
                             "rows_forwarded": int(sum(got.values())),
                             "messages": _messages(
                                 sends,
                                 {s: _HEADER * chunks + m * (rb + mb) for s, m in got.items()})})
        return DispatchResult(*merged, stats=stats)

    def _pack(self, key: tuple, head: tuple, x: torch.Tensor, w: torch.Tensor,
              toks: np.ndarray, ridx: np.ndarray, rb: int, mb: int) -> torch.Tensor:
        """One dispatch message (`key`: peer, chunk): the row count, `head` (the sender's
        batch and costs), the rows, then their routing (in kept scratch: the send is waited
        for before the call returns)."""
        n = len(toks)
        out = self._kept(("send", *key), _HEADER + n * (rb + mb))
        out[:_HEADER].numpy().view(np.int64)[:] = (n, *head)
        if n:
            rows = out[_HEADER:_HEADER + n * rb].view(n, rb)
            torch.index_select(_words(x), 0, torch.from_numpy(toks), out=_words(rows))
            meta = out[_HEADER + n * rb:].numpy().view(np.int32).reshape(n, -1)
            k = ridx.shape[1]
            meta[:, 0] = toks
            meta[:, 1:1 + k] = ridx
            meta[:, 1 + k:] = w.numpy()[toks].view(np.int32)
        return out

    def _unpack(self, inbox: dict, own: tuple | None, dtype: torch.dtype, rb: int, mb: int,
                K: int, slot: int):
        """The forwarded dispatch's inputs and the rows received from each source.

        Virtual token v: this rank's own tokens first when `own` = (x, host routing,
        weights) rides along (joint mode), then the rows received, sources in rank order.
        Their origins go in my table `slot`. The rows of a single source, alone, are
        dispatched where they arrived. Also returns the largest batch and costs the sources
        reported."""
        heads = {s: buf[:_HEADER].view(torch.int64).tolist() for s, buf in inbox.items()}
        counts = {s: h[0] for s, h in heads.items()}
        heard = tuple(max((h[i] for h in heads.values()), default=0) for i in (1, 2, 3))
        t_own = 0 if own is None else own[0].shape[0]
        n = t_own + sum(counts.values())
        hidden = self.config.hidden
        full = [s for s, m in counts.items() if m]
        if own is None and len(full) == 1:
            xf = inbox[full[0]][_HEADER:_HEADER + n * rb].view(dtype).view(n, hidden)
        else:
            xf = self._kept("xf", n * rb).view(dtype).view(n, hidden)
        idxf = torch.empty(n, K, dtype=torch.int64)
        wf = torch.empty(n, K, dtype=torch.float32)
        src = np.empty(n, np.int64)
        tok = np.empty(n, np.int64)
        idn, wfn = idxf.numpy(), wf.numpy()
        copy = xf.data_ptr() != inbox[full[0]].data_ptr() + _HEADER if full else True
        if t_own:
            _words(xf)[:t_own] = _words(own[0])
            idxf[:t_own] = own[1]
            wf[:t_own] = own[2]
            src[:t_own] = self.rank
            tok[:t_own] = np.arange(t_own)
        at = t_own
        for s in full:
            m, buf = counts[s], inbox[s]
            if copy:
                _words(xf)[at:at + m] = _words(buf[_HEADER:_HEADER + m * rb].view(m, rb))
            meta = buf[_HEADER + m * rb:_HEADER + m * (rb + mb)].numpy().view(np.int32)
            meta = meta.reshape(m, -1)
            idn[at:at + m] = meta[:, 1:1 + K]
            wfn[at:at + m] = meta[:, 1 + K:].view(np.float32)
            src[at:at + m] = s
            tok[at:at + m] = meta[:, 0]
            at += m
        self._origins.write(slot, src, tok)
        return xf, idxf, wf, counts, heard

    def _origins_of(self, res: DispatchResult,
                    slot: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(global source rank, source token) of each row of an shm dispatch's result (its
        origins in table `slot`; None: the rows came from this host's ranks)."""
        sender = res.recv_src_rank.numpy()
        vtok = res.recv_src_token.numpy()
        if slot is None:
            return self.host_ranks[sender], vtok
        src, tok = np.empty_like(vtok), np.empty_like(vtok)
        for e in np.unique(sender):
            rows = sender == e
            src[rows], tok[rows] = self._origins.read(int(e), slot, vtok[rows])
        return src, tok

    def _merge(self, x, topk_idx, topk_weights, call, results: list, joint: bool,
               tokens: tuple, recv_rows: tuple, cost: list) -> tuple:
        """The shm results laid out expert-major by (source rank, source token): the
        `DispatchResult` fields up to `handle`, in order."""
        c, W = self.config, self.world
        epr = c.experts_per_rank
        tmax = c.max_tokens_per_rank
        keys, origins_of = [], []
        for res, slot in results:
            src, tok = self._origins_of(res, slot)
            expert = np.repeat(np.arange(epr), res.tokens_per_expert.numpy())
            keys.append((expert * W + src) * tmax + tok)
            origins_of.append((src, tok))
        pos = merge_order(*keys)
        n = len(pos)
        recv_x = self._pool.empty(n, c.hidden, x.dtype)
        out = _words(recv_x).numpy()
        recv_w = np.empty(n, np.float32)
        origins = np.empty((3, n), np.int64)
        parts, at = [], 0
        for (res, _), (src, tok) in zip(results, origins_of):
            p = pos[at:at + len(src)]
            at += len(src)
            out[p] = _words(res.recv_x).numpy()
            recv_w[p] = res.recv_weights.numpy()
            origins[0, p], origins[1, p], origins[2, p] = src, tok, res.recv_src_slot.numpy()
            parts.append(_Part(res.handle, torch.from_numpy(p)))
        src_rank, src_token, src_slot = (torch.from_numpy(o) for o in origins)
        tpe = sum(res.tokens_per_expert for res, _ in results)
        state = _HybridState(tuple(parts), joint, tokens, recv_rows, cost)
        handle = DispatchHandle(buffer_id=self.buffer_id, call=call, num_tokens=x.shape[0],
                                num_recv=n, hidden=c.hidden, topk_idx=topk_idx,
                                topk_weights=topk_weights, recv_src_rank=src_rank,
                                recv_src_token=src_token, recv_src_slot=src_slot, state=state)
        return (recv_x, torch.from_numpy(recv_w), tpe, src_rank, src_token, src_slot, handle)

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                out: torch.Tensor | None = None) -> CombineResult:
        if self._closed:
            raise RuntimeError("cannot combine after close")
        if type(handle.state) is not _HybridState:
            return self._flat_combine(expert_out, handle, weighted, out)
        st: _HybridState = handle.state
        c = self.config
        t0 = _clock()
        deadline = t0 + c.timeout_s
        T = handle.num_tokens
        pdtype = _partial_dtype(expert_out.dtype)
        rows = expert_out if expert_out.dtype == pdtype else expert_out.to(pdtype)
        joint, chunks = st.joint, len(st.recv_rows)
        # what comes back: one partial row per token I sent to each other host, per chunk
        size = pdtype.itemsize * c.hidden
        inbox = []
        for k in range(chunks):
            got = {}
            for h, e in self._entries.items():
                n = len(st.tokens[h])
                m = n * (k + 1) // chunks - n * k // chunks
                got[e] = self._kept(("partials", e, k), m * size).view(pdtype).view(
                    -1, c.hidden)
            inbox.append(got)
        # the forwarded rows first, chunk by chunk: their partials are what the network
        # waits for, each chunk's sent while the next is summed
        net = self._post("combine/network", {}, inbox[0], 0)
        for k in range(1, chunks):
            self._post_into(net, {}, inbox[k], k)
        sends, kept = {}, []
        for k in range(chunks):
            yf = self._shm_combine(rows, st.parts[len(st.parts) - chunks + k], weighted,
                                   "combine/shm forwarded")
            kept.append(yf)
            msgs, at = {}, T if joint else 0
            for s, m in st.recv_rows[k].items():
                msgs[s] = yf[at:at + m]
                sends[s] = sends.get(s, 0) + m
                at += m
            self._post_into(net, msgs, {}, k)
        t_posted = _clock()
        yl = (kept[0][:T] if joint else
              self._shm_combine(rows, st.parts[0], weighted, "combine/shm local"))
        t_local = _clock()
        self._finish(net, deadline)
        t_net = _clock()
        # the partials in host order, fp32, one rounding
        acc = self._kept("acc", T * c.hidden * 4).view(torch.float32).view(T, c.hidden)
        acc.zero_()
        for h, toks in enumerate(st.tokens):
            if h == self.host:
                acc += yl
            elif len(toks):
                n = len(toks)
                for k in range(chunks):
                    part = inbox[k][self._entries[h]]
                    if part.dtype != torch.float32:     # index_add_ takes its own dtype only
                        part = self._kept("part32", part.numel() * 4).view(
                            torch.float32).view(part.shape).copy_(part)
                    lo, hi = n * k // chunks, n * (k + 1) // chunks
                    acc.index_add_(0, torch.from_numpy(toks[lo:hi]), part)
        y = (self._pool.empty(T, c.hidden, expert_out.dtype) if out is None else out).copy_(acc)
        t_end = _clock()
        self._picker.record(st.cost[0], False, (st.cost[1] + t_end - t0) * 1e6)
        us = 1e6
        phases = {"shm forwarded": (t_posted - t0) * us, "shm local": (t_local - t_posted) * us,
                  "network wait": (t_net - t_local) * us, "sum": (t_end - t_net) * us}
        phases["network"] = phases["network wait"]
        phases["shm"] = phases["shm forwarded"] + phases["shm local"]
        nbytes = sum(sends.values()) * size
        stats = Stats(op="combine", backend="hybrid", mode="ubep", sync=c.sync,
                      schedule="static", rank=self.rank, total_us=(t_end - t0) * us,
                      phases_us=phases, bytes_sent=nbytes,
                      bytes_recv=sum(len(t) for t in st.tokens) * size,
                      bytes_sent_network=nbytes,
                      extra={"partial_dtype": str(pdtype).removeprefix("torch."),
                             "mode": "joint" if joint else "split", "chunks": chunks,
                             "messages": _messages(
                                 {p: m * size for p, m in sends.items()},
                                 {e: len(st.tokens[h]) * size
                                  for h, e in self._entries.items()})})
        return CombineResult(y=y, stats=stats)

    # -- flat mode ---------------------------------------------------------------------------
    def _flat_dispatch(self, x, topk_idx, topk_weights, call) -> DispatchResult:
        """The torch backend's dispatch (its compiled path), its stats in this backend's
        terms, made when first read: a batch-1 call costs what the torch backend's does."""
        t0 = _clock()
        try:
            res = self._flat.dispatch(x, topk_idx, topk_weights, call)
        except (ValueError, TypeError):
            raise                           # refused before anything moved
        except BaseException as e:
            self.in_step = False
            raise network_error(self.rank, "dispatch/flat", self._others(), e,
                                self.config.timeout_s) from e
        self._after_flat(res, call)
        self._flat_t = (self._picker.bucket, _clock() - t0)
        return res

    def _after_flat(self, res: DispatchResult, call: int) -> None:
        """After a flat dispatch (through `dispatch` or the Buffer's door): the next call's
        mode (its stats are this backend's already: the torch backend's `restate`)."""
        # the largest count any rank sent one peer: every rank's headers say the same
        most = self._flat.last_global_max
        small = most <= self._small_most
        flat = self._picker.after_flat(bucket(most), small, call)
        self._set_mode("flat" if flat else self._mode_for(most), call)

    def _set_mode(self, mode: str, call: int) -> None:
        """The mode of the call after `call`; the Buffer's door (the flat torch backend's)
        takes the flat calls whose costs the ranks need not measure (`ModePicker.untimed`):
        small batches, and most of a run where flat measured cheaper."""
        self._mode = mode
        self._flat.shut_door(mode != "flat" or not self._picker.untimed(call + 1))

    # -- the Buffer's door: the flat torch backend's, while small batches run flat -----------
    DOOR_ENTRIES = TorchBackend.DOOR_ENTRIES

    def door(self, lock, limits: tuple[int, int, int, int],
             buffer_words: np.ndarray) -> tuple | None:
        """The flat torch backend's door (`TorchBackend.door`), shut while the next call is
        not a small flat one; None with elastic (its calls are wrapped)."""
        if self._elastic is not None:
            return None
        return self._flat.door(lock, limits, buffer_words)

    @property
    def door_hooks(self) -> tuple:
        """After a door call: the next mode and this backend's stats; errors named as
        `dispatch`'s (`Backend.door_hooks`)."""
        return self._door_dispatched, self._door_error

    def _door_dispatched(self, res: DispatchResult) -> None:
        # past a small batch, or a chosen run (its count to the next re-measurement): the
        # next mode
        if self._flat.last_global_max > self._small_most or not self._picker.small_run:
            self._after_flat(res, res.handle.call)
            self._flat_t = (self._picker.bucket, None)      # (a door call: not timed)

    def flat_dispatch_stats(self, st: Stats, handle: DispatchHandle, row_bytes: int) -> Stats:
        """A flat dispatch's stats: the torch backend's `st`, with its network row bytes,
        one row per (token, rank on another host holding one of its experts), and the rest
        of what crossed the network as metadata."""
        st = _plain(st)
        row = _far_rows(handle.state.sent_per_rank, self._far) * row_bytes
        wire = sum(s[p] for _, s, _ in st.extra.get("collectives", ())
                   for p in np.flatnonzero(self._far))
        extra = {**st.extra, "mode": "flat", "network_meta_bytes": max(int(wire) - row, 0)}
        return dataclasses.replace(st, backend="hybrid", extra=extra, bytes_sent_network=row)

    def flat_combine_stats(self, st: Stats, state, prow_bytes: int) -> Stats:
        """A flat combine's stats: the torch backend's `st`, with its network row bytes,
        one partial row per (token, rank) received from another host (`state`: the
        dispatch's, the torch backend's)."""
        st = _plain(st)
        rows = _far_rows(state.recv_per_rank, self._far)
        return dataclasses.replace(st, backend="hybrid", extra={**st.extra, "mode": "flat"},
                                   bytes_sent_network=rows * prow_bytes)

    def _door_error(self, e: BaseException) -> BaseException:
        if isinstance(e, (ValueError, TypeError)):
            return e
        self.in_step = False
        return network_error(self.rank, "flat", self._others(), e, self.config.timeout_s)

    def _flat_combine(self, expert_out, handle, weighted, out) -> CombineResult:
        t0 = _clock()
        try:
            res = self._flat.combine(expert_out, handle, weighted, out)
        except (ValueError, TypeError):
            raise
        except BaseException as e:
            self.in_step = False
            raise network_error(self.rank, "combine/flat", self._others(), e,
                                self.config.timeout_s) from e
        key, took = self._flat_t
        if took is not None:
            self._picker.record(key, True, (took + _clock() - t0) * 1e6)
        return res

    def _others(self) -> list[int]:
        return [r for r in range(self.world) if r != self.rank]

    def _shm_combine(self, rows: torch.Tensor, part: _Part, weighted: bool,
                     phase: str) -> torch.Tensor:
        """The shm part's combine of `rows[part.pos]`, gathered straight into its combine
        buffer (read there in place: no copy into shared memory)."""
        cb = self._shm_call(self._shm.combine_buffer, phase, part.handle, rows.dtype)
        if len(part.pos):
            torch.index_select(_words(rows), 0, part.pos, out=_words(cb))
        return self._shm_call(self._shm.combine, phase, cb, part.handle, weighted).y

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the shared-memory part (idempotent). The host group stays with
        torch.distributed (destroyed with the default group)."""
        if self._closed:
            return
        self._closed = True
        if self._elastic is not None:
            self._elastic.close()
        self._origins.close()
        self._shm.close()
        self._pool.close()
        self._scratch.clear()


def _partial_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in PARTIAL_DTYPES else torch.float32


def _far_rows(per_rank, far: np.ndarray) -> int:
    """Rows of a flat call's per-rank counts `per_rank` that cross the network."""
    return int(sum(n for n, f in zip(per_rank, far.tolist()) if f))


def _plain(st: Stats) -> Stats:
    """A plain `Stats` of `st` (which may build its fields on first read)."""
    return Stats(**{f.name: getattr(st, f.name) for f in dataclasses.fields(Stats)})


def _messages(sends: dict[int, int], recvs: dict[int, int]) -> list[tuple[int, int, int]]:
    """`(peer, bytes to it, bytes from it)` of a step's messages (`Stats.extra["messages"]`,
    what `ubep bench --hosts` replays bare)."""
    return [(p, sends.get(p, 0), recvs.get(p, 0)) for p in sorted({*sends, *recvs})]
