"""The torch.distributed backend: dispatch and combine as `all_to_all_single` collectives.

Works over any process group (gloo on CPU, NCCL, MPI): rows move with torch ops on the
tensors' own device, so it is the path across hosts and the bulk-synchronous baseline
everyone already has. Two or three collectives per dispatch+combine: dispatch's first
carries each peer's token count and, while they fit a small budget (`_INLINE_BYTES`), the
tokens themselves; a second carries the tokens that did not fit (every rank or none);
combine's one brings the partial sums back.

Bytes across ranks are what a cross-host user pays for, so each token crosses to a rank
once, however many of its experts live there (DeepEP's layout; top-8 of 16 experts on 2
ranks would otherwise send a token ~4 times to each):

* dispatch sends a token's row once to every rank hosting one of its experts, with its
  routing (token index, top-k expert ids and weights) as a few whole rows in front of each
  destination's rows; the receiver expands them into the expert-major per-(token, expert)
  layout `Buffer.dispatch` returns with one gather - the copy pass;
* combine sums a token's slots on the expert side first (fp32 accumulation) and returns one
  partial row per (token, rank); the source sums its <= P partials (fp32 accumulation, one
  rounding). Partials travel in the expert output's dtype when that is fp32, bf16 or fp16
  (as DeepEP's combine does) and in fp32 for 8-bit outputs.

What that costs in rounding: the oracle (and the shm backend) sums a token's slots in slot
order in fp32 and rounds once; here the slots are summed per rank and each partial is
rounded to the output dtype before the partials are summed. On CPU (bf16, fp16 and fp32
partials; fp16 since 2026-12-03) the expert-side sums are the oracle's loop for the slots a
rank holds (`bag_sums`: fp32 weights, `acc + w * row` in slot order, rounded to nearest
even), so a token whose experts all live on one rank gets the oracle's bits, and the
source-side sums round as `embedding_bag` does (tests/test_torch_backend.py checks both bit
for bit). On other devices they are `embedding_bag` with the weights in the rows' dtype
split as `hi + lo` (16+ significant bits of the fp32 weight); measured there (P=2, hidden
7168, top-8 of 16, T=128, the tests' expert function): 77% of bf16 and fp16 outputs
bit-identical to the oracle, the rest one unit in the last place off (none more); fp32 56%
identical, at most 3e-7 relative. Within the tests' tolerance; the shm backend stays
bit-exact.

At batch 1 the host work around the small collectives is what costs, so the index
bookkeeping is compiled (`ubep.runtime.torch_layout`) instead of ~80 numpy/torch calls. On
CPU the rows move in the same compiled calls: `pack_send_at` writes the send buffer
(headers, routing words, rows), `recv_gather_at` (`recv_plan_at` then `gather_at` at large
batches) lays out recv_x from the received rows and, for this rank's own tokens, straight
from x; combine's `bag_sums_at` write the partials straight into the send buffer and
`final_sums_at` read the received partials and this rank's own where they lie (the
source-side rounding as `embedding_bag`'s). The kernels take ints only: x, the routing,
expert_out, y and the scratch by address (contiguous CPU tensors Buffer checked;
`view(word).numpy()`/`from_numpy` cost 10-20 µs each between collectives on a slow host),
with sizes they check; a dispatch's plan lives in a kept per-shape workspace, and what its
handle keeps comes back as ONE int64 array whose parts are views (numba boxes each array it
returns, ~0.5 µs warm and more with cold caches). What needs nothing from the peers runs
while a collective is in flight (`async_op=True`, then `wait`, which keeps the group's
timeout): dispatch prepares recv_x's array, combine sums this rank's own tokens' partials.
Per-shape sizes, splits and scratch views are computed once and dropped whenever a scratch
buffer is reallocated. On other devices the rows move with `index_select`/`embedding_bag`.
Send/receive scratch is kept and grown, not allocated per call. A wait on a gloo
collective polls it for up to `POLL_S` before blocking (`wait`): a blocked caller is woken
by gloo's thread, which on a VM whose core went idle meanwhile costs tens of µs.
`Stats.extra["collectives"]` lists each collective's bytes to/from every peer: `ubep bench`
replays exactly those calls, bare (synchronous: there is nothing to overlap), as its "raw
collectives" line. Every collective is called on the process group object (`all_to_all`),
not through `dist.all_to_all_single`'s Python wrapper, whose checks cost 15-20 µs a call on
a slow host; the raw line calls it the same way.

Where `ubep.native` is built, a CPU call runs compiled (`native/torch_path.cpp`, from
`Buffer` through its door): the same numba kernels as cfuncs (`torch_entries`), the same
collectives on the group's C++ object (`c10d::ProcessGroup::all_to_all_single`, polled as
`wait` polls them, then their `wait()`), the result objects made in C++, no Python between
pack, collectives and results. It takes every CPU dispatch whose batch fits the scratch and
every bf16/fp16/fp32 combine (into a contiguous `out` too); its words (`_doors`) are per row type
and inline capacity and read the scratch on every call, so changing batches keep it. A
dispatch whose phase 2 needs a larger receive buffer goes on in Python after its first
collective (`_native_rest`); everything else runs the Python path below, the definition.
An elastic Buffer runs it too (through `_elastic_dispatch`, not the door) until a recovery
replaces the group: its waits call `TorchElastic.overdue` and each collective is recorded in
the door's REC block for a replay (`torch_elastic.Recorded`).
Same bits as the Python path (tests/test_native_torch.py). Why: at batch 1 the Python between the
collectives cost more than the collectives' own host work, each statement on caches gloo's
threads had just used (docs/results/torch_backend.md, "The compiled path").

On a host with one core per rank (2 ranks on 2 cores, gloo) the overlap is partial: gloo
runs a collective on its own threads (a worker, a socket loop), ~100 µs of CPU per rank per
small collective, and the woken worker runs on the caller's core first (the async call
returns after ~50-70 of the collective's ~100 µs). It still pays: the same work done before
a synchronous collective measured worse at batch 1 (dispatch+combine over raw+copy, three
alternations: 2.25x against 2.13x in turns of 20, 1.98x against 1.74x interleaved).
"""

from __future__ import annotations

import functools
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from ubep.elastic import Membership, note_combine
from ubep.handle import (
    CombineResult,
    DispatchHandle,
    new_combine_result,
    new_dispatch_result,
    new_handle,
)
from ubep.native import layout as L
from ubep.native import load_native
from ubep.options import BufferConfig
from ubep.runtime import Backend
from ubep.runtime.collectives import HOST_BACKENDS, POLL_S, all_to_all, wait
from ubep.runtime.torch_elastic import FLAG_EVERY_S, Recorded, Redo, TorchElastic
from ubep.runtime.torch_layout import (
    BAG_WORDS,
    KIND_BF16,
    KIND_F16,
    KIND_F32,
    bag_sums_at,
    final_sums_at,
    gather_at,
    pack_send_at,
    phase2_at,
    read_counts_at,
    read_headers_at,
    recv_gather_at,
    recv_plan,
    recv_plan_at,
    send_plan,
    ws_size,
    ws_views,
)
from ubep.stats import DeferredStats, Stats

#: phase 1's header per peer: int32 token count, int32 the sender's largest count, padding
_HEADER_BYTES = 16
#: dispatch's first collective carries up to this many bytes of rows inline, all peers
#: together (header rows included): a few tokens at hidden 7168 on 2 ranks, none on 64
_INLINE_BYTES = 64 << 10
#: on CPU, move rows with numpy (tests turn it off to run the device path's torch ops on CPU)
HOST_MOVES_ROWS = True
#: the partial dtypes the CPU combine sums with its compiled kernels (`bag_sums_at`,
#: `final_sums_at`: the same rounding as embedding_bag's, which the device path uses), by
#: the kernels' code for them
_CPU_COMBINE = {torch.bfloat16: KIND_BF16, torch.float16: KIND_F16, torch.float32: KIND_F32}
#: where an elastic call's record of its compiled collectives lies in the doors' tuples
_TD_REC, _TD_SCRATCH, _TD_HDR = (L.TORCH_DISPATCH_DOOR.index(f)
                                 for f in ("rec", "scratch", "hdr_send"))
_TC_REC, _TC_SCRATCH = (L.TORCH_COMBINE_DOOR.index(f) for f in ("rec", "scratch"))
#: partial sums travel in the output dtype for these; in fp32 for everything else (the
#: hybrid backend's partials too)
PARTIAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bag_sum(rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """`F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)`: the
    same op, without the functional wrapper's argument checks (several µs a call)."""
    return torch.embedding_bag(rows, index, offsets, False, 0, False, weights, False, None)[0]


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


def _torch_stats(op: str, rank: int, phases: dict[str, float], sent: int, recv: int,
                 collectives: list) -> Stats:
    return Stats(op=op, backend="torch", rank=rank, total_us=sum(phases.values()),
                 phases_us=phases, bytes_sent=sent, bytes_recv=recv, payload_efficiency=None,
                 extra={"collectives": collectives})


def _dispatch_stats(world: int, me: int, phases: dict[str, float], inline: int,
                    block_bytes: int, row_bytes: int,
                    rows: tuple[list[int], list[int]] | None) -> Stats:
    """A dispatch's stats with the collectives it ran: the first carries the counts and,
    when `inline` rows fit, a `block_bytes` block to each peer; `rows` (rows sent to and
    received from each rank) when a second collective moved them."""
    if inline:
        b1 = [0 if r == me else block_bytes for r in range(world)]
        collectives = [("inline", b1, b1)]
    else:
        collectives = [("counts", [_HEADER_BYTES] * world, [_HEADER_BYTES] * world)]
    if rows is not None:
        collectives.append(("rows", [r * row_bytes for r in rows[0]],
                            [r * row_bytes for r in rows[1]]))
    sent = sum(sum(b) for _, b, _ in collectives)
    return _torch_stats("dispatch", me, phases, sent, sum(sum(b) for _, _, b in collectives),
                        collectives)


def _rows_dispatch_stats(world: int, me: int, t: tuple, inline: int, block_bytes: int,
                         row_bytes: int, sent_rows: list, got_rows: list,
                         handle: DispatchHandle | None = None) -> Stats:
    """A two-collective CPU dispatch's Stats from its timestamps (`DeferredStats`; the
    compiled path passes the `handle` too, for a backend's own builder: `stats=`)."""
    t0, t1, t2, t3, t4, t5 = t
    phases = {"layout": t5 - t4, "pack": t1 - t0, "count_exchange": t2 - t1,
              "token_exchange": t3 - t2, "reorder": t4 - t3}
    return _dispatch_stats(world, me, phases, inline, block_bytes, row_bytes,
                           (sent_rows, got_rows))


def _cpu_dispatch_stats(rank: int, t: tuple, nbytes: int, collectives: list,
                        row_bytes: int = 0, handle: DispatchHandle | None = None) -> Stats:
    """A one-collective CPU dispatch's Stats from its timestamps (`DeferredStats`; the
    compiled path passes the row bytes and `handle` too, as `_rows_dispatch_stats`)."""
    t0, t1, t2, t3, t4, t5 = t
    phases = {"layout": t5 - t4, "pack": t1 - t0, "count_exchange": t2 - t1,
              "token_exchange": t3 - t2, "reorder": t4 - t3}
    return _torch_stats("dispatch", rank, phases, nbytes, nbytes, collectives)


def _cpu_combine_stats(rank: int, t: tuple, sent: int, recv: int, collectives: list) -> Stats:
    """A CPU combine's Stats from its timestamps: [reduce | wait for the collective |
    source-side sums] (`DeferredStats`)."""
    t0, t2, t3, t4 = t
    return _torch_stats("combine", rank, {"reduce": t2 - t0 + t4 - t3, "token_exchange": t3 - t2},
                        sent, recv, collectives)


def _combine_splits(st: _TorchState, prow_bytes: int) -> tuple[list, list, list]:
    """Combine's byte splits (to each rank, from each rank) and its collectives entry for
    partial rows of `prow_bytes`, made once per handle (kept on it)."""
    sp = st.splits
    if sp is None or sp[0] != prow_bytes:
        send = [n * prow_bytes for n in st.recv_per_rank]
        recv = [n * prow_bytes for n in st.sent_per_rank]
        sp = st.splits = (prow_bytes, send, recv, [("partials_back", send, recv)])
    return sp[1], sp[2], sp[3]


def _native_combine_stats(rank: int, t: tuple, sent: int, recv: int, st: _TorchState,
                          prow_bytes: int) -> Stats:
    """`_cpu_combine_stats` of a combine `ubep.native` ran (its collectives from the handle)."""
    return _cpu_combine_stats(rank, t, sent, recv, _combine_splits(st, prow_bytes)[2])


def _restated_one(restate, rank: int, t: tuple, nbytes: int, collectives: list,
                  row_bytes: int, handle: DispatchHandle) -> Stats:
    return restate.flat_dispatch_stats(_cpu_dispatch_stats(rank, t, nbytes, collectives),
                                       handle, row_bytes)


def _restated_rows(restate, world: int, me: int, t: tuple, inline: int, block_bytes: int,
                   row_bytes: int, sent_rows: list, got_rows: list,
                   handle: DispatchHandle) -> Stats:
    return restate.flat_dispatch_stats(_rows_dispatch_stats(
        world, me, t, inline, block_bytes, row_bytes, sent_rows, got_rows), handle, row_bytes)


def _restated_combine(restate, rank: int, t: tuple, sent: int, recv: int, st: _TorchState,
                      prow_bytes: int) -> Stats:
    return restate.flat_combine_stats(_native_combine_stats(rank, t, sent, recv, st,
                                                            prow_bytes), st, prow_bytes)


#: the compiled path's stats builders for a backend made with `restate`
_RESTATED = (_restated_one, _restated_rows, _restated_combine)


class _TorchState:
    """What combine needs from a dispatch (private to this backend; kept on the handle).

    Expert side: `bag_rows`/`bag_offsets` gather each received token's slots (rows of
    expert_out, in slot order), `weights_by_dtype` their weights as embedding_bag takes
    them (`recv_weights` is expert-major); the bags come remote sources
    first (rank order), this rank's own tokens last. Source side: `final_rows`/
    `final_offsets` pick each of this rank's tokens' partials from the combine work buffer
    [partials returned by each remote rank, in rank order | own partials].

    A CPU dispatch keeps them all in one int64 array `res` (`torch_layout.res_offsets`), and
    `at` = their addresses `(recv_weights, bag_rows, bag_offsets, final_rows,
    final_offsets)` with their sizes `(num_pairs, num_bags, sends)`: the compiled combine
    takes ints, not arrays; numpy views of them are made only for the torch-op fallback.
    """

    __slots__ = ("bag_rows", "bag_offsets", "recv_weights", "weights_by_dtype", "bag_rows2",
                 "bag_offsets2", "final_rows", "final_offsets", "sent_per_rank", "recv_per_rank",
                 "num_back", "num_own", "num_remote_bags", "num_tokens", "final_rows_np",
                 "final_offsets_np", "bag_rows_np", "bag_offsets_np", "splits", "res", "at",
                 "sizes", "offsets")

    def __init__(self, **kw):
        self.res = None
        for k, v in kw.items():
            setattr(self, k, v)

    @classmethod
    def cpu(cls, res: np.ndarray, res_addr: int, offsets: tuple, recv_weights: np.ndarray,
            num_pairs: int, num_bags: int, sends: int, num_tokens: int, sent_per_rank: list,
            recv_per_rank: list, num_back: int, num_own: int,
            num_remote_bags: int) -> _TorchState:
        """A CPU dispatch's state: `res` laid out at `offsets` (`res_offsets`); the numpy
        and torch index arrays, for `embedding_bag` (fp16 outputs), made on need."""
        st = cls.__new__(cls)
        _, o_br, o_bo, _, o_fr, o_fo, o_w, _ = offsets
        st.res, st.offsets, st.recv_weights = res, offsets, recv_weights
        st.at = (res_addr + 8 * o_w, res_addr + 8 * o_br, res_addr + 8 * o_bo,
                 res_addr + 8 * o_fr, res_addr + 8 * o_fo)
        st.sizes = (num_pairs, num_bags, sends)
        st.num_tokens, st.sent_per_rank, st.recv_per_rank = num_tokens, sent_per_rank, recv_per_rank
        st.num_back, st.num_own, st.num_remote_bags = num_back, num_own, num_remote_bags
        st.bag_rows_np = st.bag_offsets_np = st.final_rows_np = st.final_offsets_np = None
        st.bag_rows = st.bag_offsets = st.bag_rows2 = st.bag_offsets2 = None
        st.final_rows = st.final_offsets = st.splits = None
        st.weights_by_dtype = {}
        return st

    def numpy_plan(self) -> None:
        """A CPU dispatch's index arrays as numpy views of `res` (for the torch ops)."""
        if self.res is not None and self.bag_rows_np is None:
            _, o_br, o_bo, _, o_fr, o_fo, _, _ = self.offsets
            n, j, sends = self.sizes
            res = self.res
            self.bag_rows_np, self.bag_offsets_np = res[o_br:o_br + n], res[o_bo:o_bo + j]
            self.final_rows_np = res[o_fr:o_fr + sends]
            self.final_offsets_np = res[o_fo:o_fo + self.num_tokens]


class TorchBackend(Backend):
    """Dispatch/combine over `torch.distributed.all_to_all_single`."""

    def __init__(self, config: BufferConfig, group, buffer_id: int, restate=None):
        """`restate`: None, or an object whose `flat_dispatch_stats(stats, handle,
        row_bytes)` and `flat_combine_stats(stats, state, partial_row_bytes)` turn this
        backend's stats into its own (the hybrid backend's flat calls): every result comes
        with them, built when read."""
        self.config = config
        self._restate = restate
        self._builders = ((_cpu_dispatch_stats, _rows_dispatch_stats, _native_combine_stats)
                          if restate is None else
                          tuple(functools.partial(f, restate) for f in _RESTATED))
        #: the process group object the collectives run on (`group`, or the default one)
        self._pg = group if group is not None else dist.group.WORLD
        self.buffer_id = buffer_id
        self._scratch: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}
        self._owned: list[tuple[np.ndarray, int]] = []
        #: the compiled path's twin of `_owned`: uint8 tensors (`torch_path.cpp`)
        self._owned_t: list[torch.Tensor] = []
        #: the state this backend shares with its compiled door (`ubep.native.layout`'s TW_*
        #: words; `_inline` reads and writes it)
        self._tw = np.zeros(L.TW_LEN, np.int64)
        self._inline = config.max_tokens_per_rank
        #: the CPU path's per-shape constants and scratch views (`_cpu_shape`,
        #: `_combine_views`); emptied whenever a scratch buffer is reallocated, so its views
        #: are always the current ones
        self._shapes: dict[tuple, tuple] = {}
        #: the compiled path's words per row type and inline capacity (`_dispatch_door`,
        #: `_combine_door`): they read the scratch from `_scratch` on every call, so a
        #: scratch buffer's growth leaves them valid (never emptied but at close)
        self._doors: dict[tuple, tuple] = {}
        #: the compiled CPU path (`ubep.native.torch_dispatch` / `torch_combine`) when built,
        #: with the group as C++ sees it; None: the Python path below runs every call
        self._native = self._group_cap = None
        native = load_native()
        if native is not None:
            try:
                self._group_cap = native.torch_group(self._pg)
            except TypeError:       # a group C++ cannot see (a Python-made one)
                native = None
        if native is not None:
            self._native = native
        #: how long the compiled path polls a collective before blocking in its wait (`wait`)
        self._poll_ns = int(POLL_S * 1e9) if self._pg.name() in HOST_BACKENDS else 0
        #: elastic (`Buffer(elastic=True)`, `torch_elastic.py`): the membership, the recovery,
        #: and a second scratch set the calls alternate with; None without elastic
        self.membership = self._el = None
        if config.elastic:
            self.membership = Membership(config.rank, config.world_size,
                                         config.experts_per_rank)
            # the compiled path runs while the group is the original one: its collectives
            # bounded and recorded through the door's `check` and `rec` (`torch_path.cpp`)
            self._el = TorchElastic(self.membership, group, buffer_id, config.timeout_s,
                                    on_regroup=self._native_off)
            self._alt = ({}, {}, {}, {})
            self.dispatch, self.combine = self._elastic_dispatch, self._elastic_combine

    @property
    def _inline(self) -> int:
        """Tokens per peer that ride in dispatch's first collective; every rank computes the
        same value from the same headers (starts at what max_tokens_per_rank could need)."""
        return int(self._tw[L.TW_INLINE])

    @_inline.setter
    def _inline(self, v: int) -> None:
        self._tw[L.TW_INLINE] = v

    @property
    def recovery(self) -> TorchElastic | None:
        """Elastic: this Buffer's `TorchElastic` (heartbeat, agreement, members' group), which
        the hybrid backend's elastic mode shares; None without elastic."""
        return self._el

    #: `ubep_native`'s entries for `door`'s tuple (`Buffer` calls them)
    DOOR_ENTRIES = ("torch_door_dispatch", "torch_door_combine")

    def door(self, lock, limits: tuple[int, int, int, int],
             buffer_words: np.ndarray) -> tuple | None:
        """What `ubep.native`'s torch door (`torch_door_dispatch` / `torch_door_combine`)
        reads to take a `Buffer`'s common call whole (`layout.TORCH_DOOR`): this backend's
        state words, the Buffer's (`buffer_words`) and `lock`, the compiled path's words
        (`_doors`: the first call of a row type and inline capacity runs through the backend
        and makes them), the handle state's class, where a dispatch whose phase 2 needs more
        scratch goes on (`_native_rest`), and `limits` the fast checks' (hidden, num_experts,
        max_tokens_per_rank, max_top_k). None without `ubep.native`."""
        if self._native is None or self._el is not None:    # (elastic: `_elastic_dispatch`)
            return None
        return L.door(L.TORCH_DOOR, words=self._tw, buffer_words=buffer_words, lock=lock,
                      doors=self._doors, state_type=_TorchState, rest=self._native_rest,
                      buffer_id=self.buffer_id, hidden=limits[0], experts=limits[1],
                      max_tokens=limits[2], max_top_k=limits[3])

    @property
    def last_global_max(self) -> int:
        """The largest count of tokens any rank sent one peer in this backend's latest
        dispatch (from the count headers every rank receives: the same on every rank; 0
        before the first), through `dispatch` or the Buffer's compiled door."""
        return int(self._tw[L.TW_GMAX])

    def _restate_dispatch(self, stats: Stats, handle: DispatchHandle, row_bytes: int) -> Stats:
        """A Python-path dispatch's `stats` in `restate`'s terms (the compiled path's
        builders make them so), built when read."""
        if self._restate is None:
            return stats
        return DeferredStats.of(self._restate.flat_dispatch_stats, stats, handle, row_bytes)

    def _restate_combine(self, stats: Stats, state: _TorchState, prow_bytes: int) -> Stats:
        """`_restate_dispatch` of a Python-path combine."""
        if self._restate is None:
            return stats
        return DeferredStats.of(self._restate.flat_combine_stats, stats, state, prow_bytes)

    def shut_door(self, shut: bool) -> None:
        """Whether the Buffer's compiled door declines every dispatch (the hybrid backend's
        while its next call is not flat; it makes this backend's door its own)."""
        self._tw[L.TW_SHUT] = int(shut)

    def _buffer(self, name: str, rows: int, row_bytes: int, device,
                keep: int = 0) -> torch.Tensor:
        """`[rows, row_bytes]` uint8 scratch, reused across calls (grown when too small,
        keeping the first `keep` rows). Views are cached: slicing a tensor costs µs."""
        key = (name, rows, row_bytes)
        view = self._views.get(key)
        if view is not None and view.device == device:
            return view
        need = rows * row_bytes
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < need or buf.device != device:
            old = buf
            buf = torch.empty(max(need, 1), dtype=torch.uint8, device=device)
            if keep:
                buf[:keep * row_bytes].copy_(old[:keep * row_bytes])
            self._scratch[name] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
            self._shapes.clear()
        if len(self._views) > 64:
            self._views.clear()
        view = self._views[key] = buf[:need].view(rows, row_bytes)
        return view

    def _flat(self, name: str, start: int, nbytes: int) -> torch.Tensor:
        """Bytes `start:start + nbytes` of scratch `name` (sized by `_buffer` first) as a
        flat tensor, cached: gloo's all_to_all_single takes a flat tensor with byte splits
        ~15 µs faster than a `[rows, row_bytes]` view with row splits (measured, 2 ranks)."""
        key = (name, "flat", start, nbytes)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._scratch[name][start:start + nbytes]
        return view

    def _owned_rows(self, rows: int, row_bytes: int) -> tuple[np.ndarray, int]:
        """`[rows, row_bytes]` uint8 for a result the caller will own: an array of an
        earlier result that nothing references any more (no tensor, view or storage of it is
        alive), else a new one. Writing into fresh memory costs a page fault per 4 KiB
        (measured: 14.7 MB of rows 1.0 ms fresh against 0.6 ms reused); torch's CUDA caching
        allocator does the same for GPU tensors.

        Returns the array (at least `rows` rows) and its address (kept with it: numpy's
        `.ctypes.data` costs ~2 µs)."""
        pool = self._owned
        for i in range(len(pool)):
            a, addr = pool[i]
            # references: the pool's pair, `a`, getrefcount's argument; more = still in use
            if a.shape[1] == row_bytes and sys.getrefcount(a) == 3:
                if a.shape[0] >= rows:
                    return a, addr
                a = np.empty((rows + rows // 8, row_bytes), dtype=np.uint8)
                pool[i] = (a, a.ctypes.data)
                return pool[i]
        a = np.empty((rows + rows // 8, row_bytes), dtype=np.uint8)
        if len(pool) < 3:
            pool.append((a, a.ctypes.data))
            return pool[-1]
        return a, a.ctypes.data

    def _stats(self, op: str, phases: dict[str, float], sent: int, recv: int,
               collectives: list) -> Stats:
        return _torch_stats(op, self.config.rank, phases, sent, recv, collectives)

    def _dispatch_stats(self, phases: dict[str, float], inline: int, block_bytes: int,
                        row_bytes: int, rows: tuple[list[int], list[int]] | None) -> Stats:
        """`_dispatch_stats` of this backend's rank."""
        return _dispatch_stats(self.config.world_size, self.config.rank, phases, inline,
                               block_bytes, row_bytes, rows)

    # -- the collectives, and elastic calls ------------------------------------------------
    def _a2a(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
             input_splits: list[int], async_op: bool = False):
        """`all_to_all` on this Buffer's group; elastic: on its current members, bounded, a
        failure recovered (`TorchElastic.all_to_all`)."""
        if self._el is None:
            return all_to_all(self._pg, output, input, output_splits, input_splits, async_op)
        return self._el.all_to_all(output, input, output_splits, input_splits, async_op)

    def _wait(self, work) -> None:
        """`wait` for an `_a2a(..., async_op=True)` (elastic: bounded, a failure recovered;
        None: done already)."""
        if work is None:
            return
        if self._el is None:
            wait(work, self._pg)
        else:
            self._el.finish(work)

    def _forced_phase2(self) -> bool:
        """Elastic: a dispatch redone after a recovery runs phase 2 when the ranks that
        replay it for this one ran it (the same collectives on every rank)."""
        return self._el is not None and self._el.redo_collectives >= 2

    def _flip(self) -> None:
        """Elastic: the next call uses the other scratch set (and the compiled path's words
        made on it), so this call's send buffers stay intact for a replay
        (`torch_elastic.py`, step 5)."""
        alt = self._alt
        self._alt = (self._scratch, self._views, self._shapes, self._doors)
        self._scratch, self._views, self._shapes, self._doors = alt

    def _native_off(self) -> None:
        """Elastic: the members' group replaced the original one, on which the compiled
        path's collectives run: the Python path runs every call from now on."""
        self._native = None
        self._doors.clear()
        self._alt[3].clear()

    def _elastic_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                          topk_weights: torch.Tensor, call: int):
        """`dispatch` of an elastic Buffer: again from its start, on the new members, when
        a recovery interrupted it (`Redo`); the inline capacity as the replaying ranks had
        it, then none after a recovery (every rank alike)."""
        el = self._el
        self._flip()
        inline, redone = self._inline, False
        while True:
            el.begin()
            try:
                res = self._dispatch_once(x, topk_idx, topk_weights, call)
            except Redo:
                # a rank that replayed its previous call for the others starts this one as
                # they will (no inline rows); one that redoes it, as the replaying ranks ran it
                redone = not el.served
                self._inline = inline if redone else 0
                topk_idx = self.membership.mask(topk_idx)[0]
                continue
            el.end()
            if redone:      # the replaying ranks' next call starts with no inline rows
                self._inline = 0
            return res

    def _elastic_combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                         weighted: bool, out: torch.Tensor | None = None) -> CombineResult:
        """`combine` of an elastic Buffer (see `_elastic_dispatch`): partial sums of
        inactive ranks are not summed (zeros), and `handle.masked` says which slots."""
        el = self._el
        self._flip()
        redone = False
        while True:
            el.begin()
            try:
                res = self._combine_once(expert_out, handle, weighted, out)
            except Redo:
                redone = not el.served      # (as in `_elastic_dispatch`)
                if not redone:
                    self._inline = 0
                continue
            el.end()
            if redone:
                self._inline = 0
            note_combine(handle, self.membership, self.membership.inactive)
            return res

    #: the membership changes inside calls only (a recovery): nothing to read between them
    membership_word = None

    def set_active_ranks(self, mask: np.ndarray) -> None:
        """Remove the ranks `mask` drops (`TorchElastic.drain`)."""
        self._el.drain(mask)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int):
        on_cpu = x.is_cpu
        if on_cpu and HOST_MOVES_ROWS:
            return self._dispatch_cpu(x, topk_idx, topk_weights, call)
        c = self.config
        world, per_rank, me = c.world_size, c.experts_per_rank, c.rank
        num_tokens, top_k = topk_idx.shape
        hidden = x.shape[1]
        row_bytes = hidden * x.element_size()
        device = x.device
        meta_k = max(c.max_top_k, top_k)
        meta_bytes = 4 * (1 + 2 * meta_k)   # token index, top-k expert ids, top-k weight bits

        def dev(a: np.ndarray) -> torch.Tensor:   # a host index array where the rows are
            t = torch.from_numpy(a)
            return t if on_cpu else t.to(device)

        t0 = _now_us()
        idx = topk_idx.numpy() if on_cpu else topk_idx.cpu().numpy()
        weights = topk_weights.numpy() if on_cpu else topk_weights.cpu().numpy()
        per_dest, token_of, meta, final_rows, final_offsets, num_back = send_plan(
            idx, weights, per_rank, world, me, meta_k)
        t1 = _now_us()

        # Phase 1, one collective of fixed size: to each peer a block [header: its token
        # count, this rank's largest count to any peer][routing words of its first C
        # tokens][their rows]; C (`self._inline`, the same on every rank: the last call's
        # largest count if it fit the budget, else 0 = header alone, a count exchange), so
        # a small batch needs no second collective. Phase 2, only if some rank had more than
        # C tokens for a peer (every header says so, so every rank agrees): [routing words
        # of the rest][their rows].
        # Everything is packed before the first collective, so the two run back to back:
        # host work right before a gloo collective makes it slower, by more than the work
        # on this 2-core host (a 30/100 µs gap added 47/82 µs to two collectives).
        cap = max(0, _INLINE_BYTES // (max(1, world - 1) * row_bytes) - 1)
        C = min(self._inline, cap)
        dests = per_dest.tolist()
        n_me = dests[me]
        my_max = max([n for d, n in enumerate(dests) if d != me], default=0)
        hrows = -(-(_HEADER_BYTES + C * meta_bytes) // row_bytes) if C else 0
        blk = hrows + C                                   # rows per peer in phase 1
        n1 = [min(n, C) for n in dests]
        send2 = [0 if d == me or n <= C else -(-(n - C) * meta_bytes // row_bytes) + n - C
                 for d, n in enumerate(dests)]
        xb = x.view(torch.uint8)                     # [T, row_bytes]
        send1_rows = (world - 1) * blk
        send = self._buffer("send", send1_rows + sum(send2), row_bytes, device)
        meta_u8 = meta.reshape(-1).view(np.uint8)
        sendn = send.numpy() if on_cpu else None

        def put(row: int, first: int, n: int, meta_at: int, rows_at: int) -> None:
            """Routing words of tokens first..first+n at byte `meta_at` of row `row`, their
            rows from row `rows_at` on."""
            words = meta_u8[first * meta_bytes:(first + n) * meta_bytes]
            send[row:].view(-1)[meta_at:meta_at + len(words)].copy_(dev(words))
            torch.index_select(xb, 0, dev(token_of[first:first + n]),
                               out=send[rows_at:rows_at + n])

        header = np.zeros((world, _HEADER_BYTES // 4), dtype=np.int32)
        header[:, 0], header[:, 1] = per_dest, my_max
        row2, first, slot = send1_rows, 0, 0
        for d in range(world):
            n = dests[d]
            if d == me:
                first += n
                continue
            if C:
                b0 = slot * blk
                hb = header[d].view(np.uint8)
                if on_cpu:
                    sendn[b0:].reshape(-1)[:_HEADER_BYTES] = hb
                else:
                    send[b0:].view(-1)[:_HEADER_BYTES].copy_(dev(hb))
                if n1[d]:
                    put(b0, first, n1[d], _HEADER_BYTES, b0 + hrows)
                slot += 1
            if send2[d]:
                put(row2, first + n1[d], n - n1[d], 0, row2 + send2[d] - (n - n1[d]))
            row2 += send2[d]
            first += n
        t2 = _now_us()

        # phase 1: the headers (and first C tokens) from every peer
        recv1_rows = (world - 1) * blk
        work = self._buffer("recv", recv1_rows, row_bytes, device)
        if C:
            split1 = [0 if r == me else blk * row_bytes for r in range(world)]
            self._a2a(self._flat("recv", 0, recv1_rows * row_bytes),
                       self._flat("send", 0, send1_rows * row_bytes), split1, split1)
            hdr = work.view(-1)
            hdr = hdr.numpy() if on_cpu else hdr.cpu().numpy()
            heads = [hdr[(r - (r > me)) * blk * row_bytes:][:_HEADER_BYTES].view(np.int32)
                     if r != me else header[me] for r in range(world)]
            srcs = [int(h[0]) for h in heads]
            global_max = max(int(h[1]) for h in heads)
        else:
            hdr_in = torch.empty(world * _HEADER_BYTES // 4, dtype=torch.int32, device=device)
            self._a2a(hdr_in, dev(header.reshape(-1)), [], [])
            hdr_in = (hdr_in.numpy() if on_cpu else hdr_in.cpu().numpy()).reshape(world, -1)
            srcs = hdr_in[:, 0].tolist()
            srcs[me] = n_me
            global_max = int(max(hdr_in[:, 1].max(), my_max))
        t3 = _now_us()

        # phase 2 (every rank or none), then this rank's own tokens: one gather reads all
        recv2 = [0 if s == me or n <= C else -(-(n - C) * meta_bytes // row_bytes) + n - C
                 for s, n in enumerate(srcs)]
        num_remote = recv1_rows + sum(recv2)
        work = self._buffer("recv", num_remote + n_me, row_bytes, device, keep=recv1_rows)
        if global_max > C or self._forced_phase2():
            self._a2a(
                self._flat("recv", recv1_rows * row_bytes, (num_remote - recv1_rows) * row_bytes),
                self._flat("send", send1_rows * row_bytes, sum(send2) * row_bytes),
                [r * row_bytes for r in recv2], [r * row_bytes for r in send2])
        # the next call's inline capacity: what this call needed if that fit the budget;
        # else none (a batch that overflowed will likely overflow again: then the first
        # collective is a 16-byte count exchange, not rows that save nothing)
        self._inline = global_max if global_max <= cap else 0
        self._tw[L.TW_GMAX] = global_max
        t4 = _now_us()
        own = slice(first := sum(dests[:me]), first + n_me)
        if n_me:
            torch.index_select(xb, 0, dev(token_of[own]), out=work[num_remote:])
        # segments of received tokens in bag order: (source, count, routing byte, first row)
        segs = []
        slot, row2 = 0, recv1_rows
        for s in range(world):
            if s == me:
                continue
            n = srcs[s]
            if C:
                b0 = slot * blk
                segs.append((s, min(n, C), b0 * row_bytes + _HEADER_BYTES, b0 + hrows))
                slot += 1
            if recv2[s]:
                segs.append((s, n - C if C else n, row2 * row_bytes,
                             row2 + recv2[s] - (n - C if C else n)))
            row2 += recv2[s]
        flat = work.view(-1)   # only the routing words come to the host, not the rows
        head = np.empty(num_remote * row_bytes, dtype=np.uint8)
        for _, n, off, _ in segs:
            if n:
                head[off:off + n * meta_bytes] = flat[off:off + n * meta_bytes].cpu().numpy()
        bf16 = x.dtype == torch.bfloat16
        (gather, origins, recv_weights, tokens_per_expert, bag_rows, bag_offsets, bag_rows2,
         bag_offsets2, weights2, num_remote_bags) = recv_plan(
            head, np.array(segs, dtype=np.int64).reshape(-1, 4), meta[own], num_remote, me,
            per_rank, world, bf16)
        num_recv = len(gather)
        recv_x = torch.index_select(work, 0, dev(gather)).view(x.dtype)  # bytes -> [N, hidden]
        t5 = _now_us()

        state = _TorchState(
            bag_rows=dev(bag_rows), bag_offsets=dev(bag_offsets), recv_weights=recv_weights,
            weights_by_dtype=({torch.bfloat16: dev(weights2.view(np.int16)).view(torch.bfloat16)}
                              if bf16 else {}),
            bag_rows2=dev(bag_rows2) if bf16 else None,
            bag_offsets2=dev(bag_offsets2) if bf16 else None,
            final_rows=dev(final_rows), final_offsets=dev(final_offsets),
            final_rows_np=final_rows, final_offsets_np=final_offsets, num_tokens=num_tokens,
            sent_per_rank=[0 if d == me else n for d, n in enumerate(dests)],
            recv_per_rank=[0 if s == me else n for s, n in enumerate(srcs)],
            num_back=num_back, num_own=n_me, num_remote_bags=num_remote_bags,
            bag_rows_np=None, bag_offsets_np=None, splits=None)
        handle = new_handle(self.buffer_id, call, num_tokens, num_recv, hidden, topk_idx,
                            topk_weights, origins, state)
        t6 = _now_us()
        phases = {"layout": t1 - t0 + t6 - t5, "pack": t2 - t1, "count_exchange": t3 - t2,
                  "token_exchange": t4 - t3, "reorder": t5 - t4}
        stats = self._dispatch_stats(phases, C, blk * row_bytes, row_bytes,
                                     (send2, recv2) if global_max > C else None)
        return new_dispatch_result(recv_x, recv_weights, tokens_per_expert, handle,
                                   self._restate_dispatch(stats, handle, row_bytes))

    def _cpu_shape(self, num_tokens: int, x: torch.Tensor) -> tuple:
        """What a CPU dispatch of rows like `x` needs before its first collective, computed
        once per row type and inline capacity (whatever the batch: a server's batch changes
        every step) and again when a batch outgrows it: sizes, the phase-1 splits, the
        scratch views (send, room for `num_tokens` tokens or more, and phase-1 receive
        regions as tensors, and their addresses) and the workspace the kernels keep their
        per-call plan in (`ws_size` of the largest batch; with its head's numpy views and
        address). Its last word: the most tokens a call of it may send."""
        c = self.config
        world, me = c.world_size, c.rank
        row_bytes = x.shape[1] * x.element_size()
        meta_k = c.max_top_k
        meta_bytes = 4 * (1 + 2 * meta_k)
        cap = max(0, _INLINE_BYTES // (max(1, world - 1) * row_bytes) - 1)
        C = min(self._inline, cap)
        hrows = -(-(_HEADER_BYTES + C * meta_bytes) // row_bytes) if C else 0
        blk = hrows + C
        send1_rows = (world - 1) * blk
        # room for phase 1 and for every peer's phase 2 (at most all tokens to each peer)
        most = send1_rows + (world - 1) * (num_tokens + -(-num_tokens * meta_bytes // row_bytes))
        self._buffer("send", most, row_bytes, x.device)
        self._buffer("recv", send1_rows, row_bytes, x.device)
        send, recv = self._scratch["send"], self._scratch["recv"]
        # the most tokens the send scratch holds a call of (it may have grown for another)
        per_token = (world - 1) * (row_bytes + meta_bytes)
        t_cap = max(num_tokens, (send.numel() - send1_rows * row_bytes - (world - 1) * row_bytes)
                    // max(per_token, 1))
        most = send1_rows + (world - 1) * (t_cap + -(-t_cap * meta_bytes // row_bytes))
        assert most * row_bytes <= send.numel()
        split1 = [0 if r == me else blk * row_bytes for r in range(world)]
        n1 = send1_rows * row_bytes
        if len(self._shapes) > 32:
            self._shapes.clear()
        ws = np.zeros(ws_size(world, c.max_tokens_per_rank, c.max_top_k, meta_k),
                      dtype=np.int64)
        # the head of the workspace (the same for every batch)
        wsv = ws_views(ws, world, 1, 1, meta_k)[:5]
        # the collectives a call of this shape runs when no rank overflows (Stats)
        if C:
            coll1 = [("inline", split1, split1)]
        else:
            coll1 = [("counts", [_HEADER_BYTES] * world, [_HEADER_BYTES] * world)]
        return (row_bytes, meta_k, meta_bytes, cap, C, hrows, blk, send1_rows, split1,
                recv[:n1], send[:n1], coll1, sum(coll1[0][1]), send.data_ptr(),
                most * row_bytes, recv.data_ptr(), n1, ws, ws.ctypes.data, len(ws), wsv,
                t_cap)

    def _dispatch_door(self, shape: tuple) -> tuple:
        """What `ubep.native.torch_dispatch` reads for calls of `shape`'s row type and inline
        capacity (`torch_path.cpp`'s TD_* words, `layout.TORCH_DISPATCH_DOOR`): its block
        (`torch_entries`' K_* words: sizes, the shape's workspace (for any batch; kept alive
        here when the shape is dropped), the poll, the kernels' addresses), the group, the
        scratch (`_scratch`, read on every call: the call is declined when its batch does not
        fit), the count exchange's headers
        (this rank's, a view of the workspace; room for the peers'), this backend (its
        `_inline`), how to make the handle's state and the stats."""
        from ubep.runtime import torch_entries as te

        c = self.config
        (row_bytes, meta_k, _, cap, C, hrows, blk, _, _, _, _, coll1, bytes1, _, _, _, n1, ws,
         _, _, wsv, _) = shape
        header = torch.from_numpy(wsv[4])
        hdr_recv = torch.empty_like(header)
        k = L.block(L.K_LEN, {
            L.K_ROW_BYTES: row_bytes, L.K_PER_RANK: c.experts_per_rank,
            L.K_WORLD: c.world_size, L.K_ME: c.rank, L.K_META_K: meta_k,
            L.K_INLINE: C, L.K_HROWS: hrows, L.K_WS: ws.ctypes.data,
            L.K_WS_LEN: len(ws), L.K_RECV_BYTES: n1, L.K_BLK_BYTES: blk * row_bytes,
            L.K_PAIRS: min(meta_k, c.experts_per_rank), L.K_CAP: cap,
            L.K_POLL_NS: self._poll_ns, L.K_HDR_IN: hdr_recv.data_ptr(),
            L.K_PACK: te.pack_c.address, L.K_HEADERS: te.headers_c.address,
            L.K_COUNTS: te.counts_c.address, L.K_PHASE2: te.phase2_c.address,
            L.K_PLAN: te.plan_c.address, L.K_ROWS: te.rows_c.address,
            L.K_CHECK_NS: int(FLAG_EVERY_S * 1e9)})
        return L.door(L.TORCH_DISPATCH_DOOR, k=k, ws=ws, group=self._group_cap,
                      scratch=self._scratch, hdr_send=header, hdr_recv=hdr_recv,
                      words=self._tw, state=_TorchState.cpu, build=self._builders[0],
                      build_rows=self._builders[1], coll=coll1, buffer_id=self.buffer_id,
                      rank=self.config.rank, bytes=bytes1, pool=self._owned_t,
                      **self._watch())

    #: one attempt of a call (an elastic Buffer's calls may make several)
    _dispatch_once = dispatch

    def _dispatch_cpu(self, x: torch.Tensor, topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor, call: int):
        """`dispatch` for host memory: the same bytes on the wire as the device path below,
        every pass over rows and indices compiled (`torch_layout.pack_send_at` before the
        first collective; `read_headers_at`, `recv_gather_at` after), this rank's own
        rows read straight from x into recv_x (no staging copy). The kernels take ints
        (addresses, sizes) and keep their plan in a per-shape workspace; what the handle
        keeps comes back as one array (`res`), whose parts are numpy views."""
        c = self.config
        world, per_rank, me = c.world_size, c.experts_per_rank, c.rank
        num_tokens, top_k = topk_idx.shape
        key = (x.shape[1], x.dtype, self._inline)
        door = self._doors.get(key)
        if door is not None:     # compiled (`ubep.native`): the whole call, or phase 1 of it
            r = (self._native.torch_dispatch(door, x, topk_idx, topk_weights, call)
                 if self._el is None else self._el.compiled(
                     self._native.torch_dispatch, Recorded(door[_TD_REC], door[_TD_SCRATCH],
                                                           door[_TD_HDR]),
                     door, x, topk_idx, topk_weights, call))
            if type(r) is tuple:
                return self._native_rest(x, topk_idx, topk_weights, call, r)
            if r is not NotImplemented:
                return r
        shape = self._shapes.get(key)
        if shape is None or num_tokens > shape[-1]:     # (grows the send scratch)
            shape = self._shapes[key] = self._cpu_shape(num_tokens, x)
        if door is None and self._native is not None:
            self._doors[key] = self._dispatch_door(shape)
            return self._dispatch_cpu(x, topk_idx, topk_weights, call)
        (row_bytes, meta_k, meta_bytes, cap, C, hrows, blk, send1_rows, split1, recv1, send1,
         coll1, bytes1, send_addr, send_bytes, recv_addr, recv1_bytes, ws, ws_addr, ws_len,
         wsv, _) = shape

        t0 = _now_us()
        # x, topk_idx and topk_weights are contiguous CPU tensors of checked dtypes (Buffer's
        # checks): the kernels read them by address (rows by memcpy: any alignment)
        xa, x_bytes = x.data_ptr(), num_tokens * row_bytes
        num_back, sends, first, n_me = pack_send_at(
            topk_idx.data_ptr(), topk_weights.data_ptr(), num_tokens, top_k, xa, x_bytes,
            send_addr, send_bytes, row_bytes, per_rank, world, me, meta_k, C, hrows, ws_addr,
            ws_len)
        header = wsv[4]
        t1 = _now_us()

        pairs = min(meta_k, per_rank)          # most local experts one token can name
        if C:
            pending = self._a2a(recv1, send1, split1, split1, async_op=True)
            # while it runs, what needs nothing from the peers: recv_x's array, with room
            # for every pair the tokens of a call that fits inline could name (every peer
            # sends <= C)
            pool, pool_addr = self._owned_rows(((world - 1) * C + n_me) * pairs, row_bytes)
            self._wait(pending)
            global_max, num_bags = read_headers_at(recv_addr, recv1_bytes, blk * row_bytes, me,
                                                   world, ws_addr, ws_len)
        else:
            hdr_in = torch.empty((world, _HEADER_BYTES // 4), dtype=torch.int32)
            self._a2a(hdr_in, torch.from_numpy(header), [], [])
            global_max, num_bags = read_counts_at(hdr_in.data_ptr(), me, world, ws_addr,
                                                  ws_len)
            pool, pool_addr = None, 0
        t2 = _now_us()
        return self._dispatch_rest(shape, x, topk_idx, topk_weights, call, t0, t1, t2,
                                   global_max, num_bags, pool, pool_addr, num_back, sends,
                                   first, n_me)

    def _native_rest(self, x: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor, call: int, r: tuple):
        """A compiled dispatch that handed back after its first collective because phase 2
        needs a larger receive scratch (`r`: the largest count, tokens received and its
        timestamps; the plan's words in its door's block and workspace): on in Python
        (`_dispatch_rest`, which grows the scratch). The inline capacity is still the one
        the call began with (this call sets the next one)."""

        key = (x.shape[1], x.dtype, self._inline)
        door = self._doors[key]
        shape = self._shapes.get(key)
        if shape is None or topk_idx.shape[0] > shape[-1]:
            # (the send scratch already holds this call: the compiled path checked it, so
            # this grows nothing that phase 2 is about to send)
            shape = self._shapes[key] = self._cpu_shape(topk_idx.shape[0], x)
        # phase 2 reads the plan the compiled pack wrote in the door's workspace
        shape = (*shape[:17], door[1], door[1].ctypes.data, len(door[1]),
                 ws_views(door[1], self.config.world_size, 1, 1, shape[1])[:5], shape[-1])
        global_max, num_bags, t0, t1, t2 = r
        num_back, sends, first, n_me = door[0][L.K_NUM_BACK:L.K_N_ME + 1].tolist()
        return self._dispatch_rest(shape, x, topk_idx, topk_weights, call, t0, t1, t2,
                                   global_max, num_bags, None, 0, num_back, sends, first, n_me)

    def _dispatch_rest(self, shape: tuple, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor, call: int, t0: float, t1: float,
                       t2: float, global_max: int, num_bags: int, pool: np.ndarray | None,
                       pool_addr: int, num_back: int, sends: int, first: int, n_me: int):
        """A CPU dispatch from its first collective's end on (the Python path's, and the
        compiled one's when a peer sent more than phase 1 holds): phase 2 if any rank needs
        it, recv_x's rows and the plan (`pool`: recv_x's array made during phase 1, or None),
        the results."""
        c = self.config
        world, per_rank, me = c.world_size, c.experts_per_rank, c.rank
        num_tokens, top_k = topk_idx.shape
        (row_bytes, meta_k, meta_bytes, cap, C, hrows, blk, send1_rows, split1, recv1, send1,
         coll1, bytes1, send_addr, send_bytes, recv_addr, recv1_bytes, ws, ws_addr, ws_len,
         wsv, _) = shape
        per_dest, send2, srcs, recv2 = wsv[:4]
        recv1_rows = send1_rows
        pairs = min(meta_k, per_rank)
        hidden = x.shape[1]
        xa, x_bytes = x.data_ptr(), num_tokens * row_bytes
        if global_max > C or self._forced_phase2():
            phase2_at(ws_addr, ws_len, world, me, C, meta_bytes, row_bytes)   # into recv2
            r2, s2 = recv2.tolist(), send2.tolist()
            num_remote = recv1_rows + sum(r2)
            work = self._buffer("recv", num_remote, row_bytes, x.device, keep=recv1_rows)
            self._a2a(
                self._flat("recv", recv1_rows * row_bytes, (num_remote - recv1_rows) * row_bytes),
                self._flat("send", send1_rows * row_bytes, sum(s2) * row_bytes),
                [r * row_bytes for r in r2], [r * row_bytes for r in s2])
            work_addr, work_bytes = work.data_ptr(), num_remote * row_bytes
        else:
            work, work_addr, work_bytes = None, recv_addr, recv1_bytes
        self._inline = global_max if global_max <= cap else 0
        self._tw[L.TW_GMAX] = global_max
        t3 = _now_us()

        if pool is None:    # large batches: the plan first, then recv_x's rows exactly
            (res, res_addr, num_remote_bags, num_recv, offsets, gather,
             num_remote) = recv_plan_at(work_addr, work_bytes, row_bytes, C, hrows, me,
                                        per_rank, world, num_tokens, top_k, meta_k, first, n_me,
                                        sends, ws_addr, ws_len)
            pool, pool_addr = self._owned_rows(num_recv, row_bytes)
            gather_at(work_addr, work_bytes, xa, x_bytes, pool_addr, num_recv * row_bytes,
                      gather, num_remote, row_bytes, world, num_tokens, top_k, meta_k, first,
                      n_me, ws_addr, ws_len)
        else:               # plan and rows in one call, into room for every pair named
            if global_max > C:
                pool = None                      # (an unused array is the pool's again)
                pool, pool_addr = self._owned_rows(num_bags * pairs, row_bytes)
            res, res_addr, num_remote_bags, num_recv, offsets = recv_gather_at(
                work_addr, work_bytes, xa, x_bytes, pool_addr, len(pool) * row_bytes,
                row_bytes, C, hrows, me, per_rank, world, num_tokens, top_k, meta_k, first,
                n_me, sends, ws_addr, ws_len)
        _, o_br, _, o_tpe, o_fr, _, o_w, end = offsets
        tokens_per_expert = res[o_tpe:o_fr]
        if num_recv:
            origins = res[:o_br].reshape(3, num_recv)
            recv_weights = res[o_w:end].view(np.float32)[:num_recv]
            recv_x = torch.from_numpy(pool[:num_recv]).view(x.dtype)
        else:   # torch reads an empty array's strides as 0 and refuses the view; empty
            # views of `res` would be tensors at one address as two types (torch.save fails)
            origins, recv_weights = np.empty((3, 0), np.int64), np.empty(0, np.float32)
            recv_x = x.new_empty((0, hidden))
        t4 = _now_us()

        sent, got = per_dest.tolist(), srcs.tolist()
        sent[me] = got[me] = 0
        state = _TorchState.cpu(res, res_addr, offsets, recv_weights, num_recv, num_bags,
                                sends, num_tokens, sent, got, num_back, n_me, num_remote_bags)
        handle = new_handle(self.buffer_id, call, num_tokens, num_recv, hidden, topk_idx,
                            topk_weights, origins, state)
        t5 = _now_us()
        if global_max > C:
            phases = {"layout": t5 - t4, "pack": t1 - t0, "count_exchange": t2 - t1,
                      "token_exchange": t3 - t2, "reorder": t4 - t3}
            stats = self._dispatch_stats(phases, C, blk * row_bytes, row_bytes,
                                         (s2, r2))
        else:   # built when first read
            stats = DeferredStats.of(_cpu_dispatch_stats, c.rank, (t0, t1, t2, t3, t4, t5),
                                     bytes1, coll1)
        return new_dispatch_result(recv_x, recv_weights, tokens_per_expert, handle,
                                   self._restate_dispatch(stats, handle, row_bytes))

    def _bag_weights(self, st: _TorchState, dtype: torch.dtype, device) -> torch.Tensor:
        """The slots' weights as `embedding_bag` takes them for rows of `dtype`.

        fp32 rows: the weights. 16-bit rows: each weight as `hi, lo` in that dtype (every
        slot row then appears twice in the bag), so the products keep ~16 significant bits
        of the weight instead of 8 (bf16) or 11 (fp16).
        """
        w = st.weights_by_dtype.get(dtype)
        if w is None:
            bag_rows = st.bag_rows.cpu().numpy()
            w32 = torch.from_numpy(st.recv_weights[bag_rows]).to(device)
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
        pdtype = dtype if dtype in PARTIAL_DTYPES else torch.float32
        if st.res is not None and pdtype in _CPU_COMBINE and HOST_MOVES_ROWS:
            return self._combine_cpu(expert_out, st, weighted, out, pdtype)
        if st.bag_rows is None:     # a CPU dispatch's index arrays, for embedding_bag
            st.numpy_plan()
            st.bag_rows = torch.from_numpy(st.bag_rows_np)
            st.bag_offsets = torch.from_numpy(st.bag_offsets_np)
        hidden = expert_out.shape[1]
        t0 = _now_us()
        rows = expert_out if pdtype == dtype else expert_out.to(pdtype)
        # one partial per received token: the sum of its slots here, fp32 accumulation
        if not weighted:
            partial = _bag_sum(rows, st.bag_rows, st.bag_offsets)
        elif pdtype == torch.float32:
            partial = _bag_sum(rows, st.bag_rows, st.bag_offsets,
                               self._bag_weights(st, pdtype, device))
        else:
            w = self._bag_weights(st, pdtype, device)   # [hi, lo] per slot: each row twice
            partial = _bag_sum(rows, st.bag_rows2, st.bag_offsets2, w)
        prow_bytes = hidden * partial.element_size()
        back, own = st.num_back, st.num_own
        work = self._buffer("combine", back + own, prow_bytes, device)
        nret = st.num_remote_bags
        send_splits, recv_splits, collectives = _combine_splits(st, prow_bytes)
        t1 = _now_us()
        flat = partial.view(-1).view(torch.uint8)
        self._a2a(self._flat("combine", 0, back * prow_bytes),
                   flat[:nret * prow_bytes], recv_splits, send_splits)
        t2 = _now_us()
        if own:     # after the collective: work before one slows it more than it costs
            self._flat("combine", back * prow_bytes, own * prow_bytes).copy_(
                flat[nret * prow_bytes:])
        if st.final_rows is None:
            st.final_rows = torch.from_numpy(st.final_rows_np).to(device)
            st.final_offsets = torch.from_numpy(st.final_offsets_np).to(device)
        y = _bag_sum(work.view(pdtype), st.final_rows, st.final_offsets)
        if pdtype != dtype:
            y = y.to(dtype)
        if out is not None:
            y = out.copy_(y)
        t3 = _now_us()
        phases = {"reduce": t1 - t0 + t3 - t2, "token_exchange": t2 - t1}
        return CombineResult(y=y, stats=self._restate_combine(
            self._stats("combine", phases, nret * prow_bytes, back * prow_bytes, collectives),
            st, prow_bytes))

    _combine_once = combine

    def _combine_cpu(self, expert_out: torch.Tensor, st: _TorchState, weighted: bool,
                     out: torch.Tensor | None, pdtype: torch.dtype) -> CombineResult:
        """`combine` for a CPU dispatch with bf16/fp16/fp32 partials: each received token's
        partial summed by a compiled pass straight into the send buffer (fp32 weights and
        accumulation, slot order, one rounding), the collective, this rank's own tokens'
        partials (while a small collective runs, after a large one), then each token's
        partials summed at the source (`final_sums_*`) into y."""
        t0 = _now_us()
        kind = _CPU_COMBINE[pdtype]
        # contiguous (Buffer's checks): the kernels read its rows by address
        src = expert_out if pdtype == expert_out.dtype else expert_out.to(pdtype)
        rows, (num_rows, hidden) = src.data_ptr(), src.shape
        itemsize = src.element_size()
        back, own, nret = st.num_back, st.num_own, st.num_remote_bags
        key = (pdtype, hidden)       # (a dispatch shape's key has three words)
        door = self._doors.get(key)
        if door is None and self._native is not None and expert_out.is_cpu:
            door = self._doors[key] = self._combine_door(pdtype, hidden)
        if door is not None and src is expert_out and (out is None or out.is_contiguous()):
            # compiled (`ubep.native`): the same kernels and collective, no Python between
            r = (self._native.torch_combine(door, expert_out, st, weighted, out)
                 if self._el is None else self._el.compiled(
                     self._native.torch_combine, Recorded(door[_TC_REC], door[_TC_SCRATCH],
                                                          None),
                     door, expert_out, st, weighted, out))
            if r is not NotImplemented:
                return r
        v = self._shapes.get(key)
        if v is None or nret + own > v[2] or back > v[3]:
            v = self._shapes[key] = self._combine_views(pdtype, hidden, nret + own, back,
                                                        expert_out.device)
        send_at, back_at, _, _, send_t, back_t = v
        nbytes = itemsize * hidden
        own_at, recv_flat, send_flat = send_at + nret * nbytes, back_t[:back * nbytes], \
            send_t[:nret * nbytes]
        send_splits, recv_splits, coll = _combine_splits(st, itemsize * hidden)
        w_at, rows_at, offs_at, fin_rows_at, fin_offs_at = st.at
        num_pairs, num_bags, sends = st.sizes
        bag_sums_at(kind, rows, num_rows, hidden, w_at, weighted, rows_at, offs_at, num_pairs,
                    num_bags, 0, nret, send_at)
        if nret * itemsize * hidden <= _INLINE_BYTES:
            # a small collective is latency: own tokens' partials (they do not travel) are
            # summed while it runs
            work = self._a2a(recv_flat, send_flat, recv_splits, send_splits, async_op=True)
            bag_sums_at(kind, rows, num_rows, hidden, w_at, weighted, rows_at, offs_at,
                        num_pairs, num_bags, nret, nret + own, own_at)
            t2 = _now_us()
            self._wait(work)
            t3 = _now_us()
        else:   # a large one moves bytes: the sums would compete with it for the cores
            t2 = _now_us()
            self._a2a(recv_flat, send_flat, recv_splits, send_splits)
            t3 = _now_us()
            bag_sums_at(kind, rows, num_rows, hidden, w_at, weighted, rows_at, offs_at,
                        num_pairs, num_bags, nret, nret + own, own_at)
        dtype = expert_out.dtype
        into_out = out is not None and pdtype == dtype and out.is_contiguous()
        y = out if into_out else torch.empty((st.num_tokens, hidden), dtype=pdtype)
        final_sums_at(kind, back_at, back, own_at, own, hidden, fin_rows_at, fin_offs_at,
                      sends, st.num_tokens, y.data_ptr())
        if not into_out:
            if pdtype != dtype:
                y = y.to(dtype)
            if out is not None:
                y = out.copy_(y)
        t4 = _now_us()
        return new_combine_result(y, self._restate_combine(DeferredStats.of(
            _cpu_combine_stats, self.config.rank, (t0, t2, t3, t4), nret * nbytes,
            back * nbytes, coll), st, nbytes))

    def _combine_views(self, pdtype: torch.dtype, hidden: int, sums: int, back: int,
                       device) -> tuple:
        """The scratch CPU combines of `pdtype` partials reuse (kept in `_shapes`, so dropped
        whenever a scratch buffer is reallocated; made again when a call needs more): the
        send buffer's address [partials of the received tokens | this rank's own], room for
        `sums` partials or more, the received partials' (`back` or more), both capacities in
        partials, both buffers as flat bytes."""
        word = BAG_WORDS[pdtype]
        prow_bytes = hidden * torch.empty(0, dtype=word).element_size()
        self._buffer("csend", sums, prow_bytes, device)
        self._buffer("combine", back, prow_bytes, device)
        send_t, back_t = self._scratch["csend"], self._scratch["combine"]
        if len(self._shapes) > 32:
            self._shapes.clear()
        send_at, back_at = send_t.data_ptr(), back_t.data_ptr()
        send_cap, back_cap = send_t.numel() // prow_bytes, back_t.numel() // prow_bytes
        return (send_at, back_at, send_cap, back_cap, send_t, back_t)

    def _combine_door(self, pdtype: torch.dtype, hidden: int) -> tuple:
        """What `ubep.native.torch_combine` reads for combines of `pdtype` partials
        (`torch_path.cpp`'s TC_* words, `layout.TORCH_COMBINE_DOOR`): its block (B_* words:
        sizes, the poll, the kernels' addresses), the group, the scratch (`_scratch`, read on
        every call: a call whose partials do not fit is declined, and the Python path grows
        it), how to make the stats."""
        from ubep.runtime import torch_entries as te

        b = L.block(L.B_LEN, {
            L.B_HIDDEN: hidden, L.B_INLINE_BYTES: _INLINE_BYTES, L.B_POLL_NS: self._poll_ns,
            L.B_BAGS: te.bags_c.address, L.B_FINAL: te.final_c.address,
            L.B_KIND: _CPU_COMBINE[pdtype], L.B_CHECK_NS: int(FLAG_EVERY_S * 1e9)})
        return L.door(L.TORCH_COMBINE_DOOR, b=b, group=self._group_cap, scratch=self._scratch,
                      build=self._builders[2], rank=self.config.rank, **self._watch())

    def _watch(self) -> dict:
        """The compiled path's elastic hooks (`check`, `rec`: `torch_path.cpp`'s Watch)."""
        el = self._el
        return (dict(check=None, rec=None) if el is None
                else dict(check=el.overdue, rec=np.zeros(L.rec_len(self.config.world_size),
                                                         np.int64)))

    def close(self) -> None:
        """Drop the scratch buffers; the process group belongs to the caller."""
        if self._el is not None:
            self._el.close()
            self._alt = ({}, {}, {})
        self._scratch.clear()
        self._views.clear()
        self._owned.clear()
        self._owned_t.clear()
        self._doors.clear()
