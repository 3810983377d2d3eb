"""`Buffer`: the one door. Dispatch tokens to their experts' ranks and combine them back."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ubep import ops, quant
from ubep.elastic import check_drain_mask
from ubep.errors import BrokenBufferError, RankRemovedError, UbepError
from ubep.handle import DispatchHandle, DispatchResult
from ubep.native import load_native
from ubep.native.layout import BW_CALLS, BW_LEN, BW_USABLE
from ubep.options import (
    BACKENDS,
    MODES,
    SCHEDULES,
    SYNCS,
    BufferConfig,
    check_choice,
    check_positive_int,
)
from ubep.runtime import make_backend
from ubep.runtime.auto import choose_backend
from ubep.runtime.bootstrap import agree
from ubep.runtime.hosts import discover_hosts
from ubep.stats import Stats
from ubep.validate import (
    byte_span,
    check_combine_inputs,
    check_combine_out,
    check_dispatch_inputs,
    fast_checks,
)

_buffer_ids = itertools.count(1)
#: dispatches whose tokens per expert `Buffer` keeps before adding them up (`expert_load`)
_LOAD_FOLD = 256
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


class Buffer:
    """Expert-parallel communication buffer bound to a process group (cf. DeepEP's Buffer).

    Experts are placed contiguously: rank r owns experts `[r*E/P, (r+1)*E/P)`. Rows of any
    dtype of at most 4 bytes per element (bf16, fp16, fp32, fp8, int8, uint8) are moved as
    bytes. One Buffer serves calls one at a time; every rank of the group must make the same
    sequence of calls.

    Arguments:
        group: the process group; `None` = the default group (`torch.distributed` must be
            initialized).
        num_experts: global expert count E, divisible by the group size.
        hidden: elements per token row.
        max_tokens_per_rank: the largest token count T any call may pass on any rank.
        backend: "auto" (default), "torch" (all_to_all_single, any process group, across
            hosts), "shm" (ranks on one host through shared memory, workers as threads) or
            "hybrid" (ranks on several hosts: shared memory inside each host,
            torch.distributed between hosts, each token over the network once per host).
            "auto" picks shm when every rank of the group maps this host's /dev/shm and it
            has room for all the ranks' segments, hybrid when the ranks span several hosts
            (shared-memory domains; `config.hosts` lists each one's ranks), torch otherwise;
            `config.backend` says which runs, `config.backend_reason` why, and every
            `Stats.backend` names it. On
            shm, when neither `mode`, `direct` nor `count_workers` is given and `sync` is
            "tff" or "sw", auto runs `direct="owned"` (the fastest path whose results the
            caller owns; below); it never turns on `direct=True`, whose `recv_x` is a view
            that the next dispatch overwrites.
        mode: "ubep" (decomposed, dependency-driven) or "bsp" (the barrier-separated baseline);
            None (default): "ubep". Used by the shm runtime; recorded but not used by the
            torch backend. Given explicitly, the shm path runs that mechanism (auto then does
            not pick `direct="owned"`).
        sync: Data-as-Flag variant, "sw" | "tff" | "dc" | "sp" (shm runtime).
        schedule: token-to-worker schedule, "static" | "balanced" | "hierarchical" (shm).
        workers: worker threads per rank (shm); None = the cores available to the rank.
        count_workers: workers in the count role (shm, mode="ubep"); None = cost model.
        topology: a `ubep.Topology`, a preset name or a TOML path; None = this host.
        timeout_s: deadline of every wait, the constructor's included; a stuck or dead peer
            becomes an error naming the rank and phase instead of a hang.
        max_top_k: the largest K (slots per token) any call may pass; sizes shm windows.
        block_bytes: synchronization block size in bytes (shm), default 512 as in the paper.
        direct: (shm, mode="ubep") exchange counts first, then write every row straight to
            its final place at its destination: one copy per row instead of the paper's two
            (window, then place), and combine reads expert outputs where they lie.
            `direct=True`: as in DeepEP's low-latency mode, `recv_x` is then a view of this
            Buffer's shared memory, valid until its next dispatch, and only the latest
            dispatch can be combined (as often as wanted: combine returns once every peer has
            read the rows it needed, so the caller may then reuse `recv_x` and the combine
            buffer); write expert outputs into `get_combine_buffer(handle)` (or pass `recv_x`
            itself) and combine copies nothing. `direct="owned"`: the same exchange, but each
            received row is copied out of shared memory into a `recv_x` the caller owns as
            it arrives, and a handle carries all combine needs: results stay valid while
            held, any handle can be combined, in any order, as with other EP libraries; the
            expert outputs peers read are copied into shared memory once (none with
            `get_combine_buffer`, valid until the next combine). None (default): "owned" where
            auto picks it (see `backend`), else False. Rows carry a per-row flag word, so
            `sync` must be "tff" (the default) or "sw"; workers split the tokens evenly, in
            order (`schedule` does not apply; stats report "static"). Shared memory per rank:
            two areas (True) or four ("owned": two lent as recv_x, a scratch one, the combine
            area) of world x max_tokens_per_rank x min(max_top_k, E/P) rows of hidden x 4
            bytes.
        elastic: a rank found dead (shm: its liveness lock; torch: a failed or overdue
            collective; hybrid: either, then the survivors go on flat over the network)
            leaves `active_ranks` on every other rank instead of failing the
            call: the call completes without it, raises nothing, and no later call waits for
            it. Slots routed to an inactive rank's experts are not delivered
            (`DispatchResult.masked`) and combine does not sum them; traffic between the
            remaining ranks stays exact. `set_active_ranks` removes ranks on purpose.
            Default False: a dead peer is a `PeerDiedError`. Costs nothing while nothing
            fails (docs/reliability.md, "Elastic").

    Every rank must pass the same backend, mode, sync, direct, num_experts, hidden,
    max_tokens_per_rank, max_top_k, block_bytes and workers: the constructor compares them
    and raises the same ValueError on every rank, naming each field and the ranks' values.
    schedule, count_workers, topology and timeout_s may differ per rank.

    Attributes:
        rank, world_size, num_experts, num_local_experts, config (`ubep.BufferConfig`),
        last_stats (stats of the latest dispatch or combine, or None), active_ranks
        (`[world]` bool, elastic).
    """

    def __init__(self, group=None, *, num_experts: int, hidden: int, max_tokens_per_rank: int,
                 backend: str = "auto", mode: str | None = None, sync: str = "tff",
                 schedule: str = "hierarchical", workers: int | None = None,
                 count_workers: int | None = None, topology=None, timeout_s: float = 30.0,
                 max_top_k: int = 8, block_bytes: int = 512, direct: bool | str | None = None,
                 elastic: bool = False):
        check_choice("backend", backend, BACKENDS)
        if mode is not None:
            check_choice("mode", mode, MODES)
        check_choice("sync", sync, SYNCS)
        check_choice("schedule", schedule, SCHEDULES)
        check_positive_int("num_experts", num_experts)
        check_positive_int("hidden", hidden)
        check_positive_int("max_tokens_per_rank", max_tokens_per_rank)
        check_positive_int("max_top_k", max_top_k)
        check_positive_int("block_bytes", block_bytes, minimum=16)
        if workers is not None:
            check_positive_int("workers", workers)
        if count_workers is not None:
            check_positive_int("count_workers", count_workers)
            if workers is not None and workers >= 2 and count_workers >= workers:
                raise ValueError(f"count_workers={count_workers} must be < workers={workers} "
                                 f"(token workers need at least one core)")
        if direct is not None and not isinstance(direct, bool) and direct != "owned":
            raise ValueError(f"direct={direct!r} is not one of None, False, True, 'owned'")
        if direct:
            if backend not in ("shm", "auto"):
                raise ValueError(f"direct={direct!r} needs backend='shm' (rows are written into "
                                 f"the receivers' shared memory), got backend={backend!r}")
            if mode not in (None, "ubep"):
                raise ValueError(f"direct={direct!r} needs mode='ubep': the counts go first, so "
                                 f"there are no barrier-separated phases to run")
            if sync not in ("tff", "sw"):
                raise ValueError(f"direct={direct!r} flags each row with one word written after "
                                 f"it; sync={sync!r} does not apply: use 'tff' or 'sw'")
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be a bool, got {type(elastic).__name__}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group first (or use torchrun)")
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        # every field that shapes memory or the protocol, compared before anything is built
        agree(dict(backend=backend, mode=mode, sync=sync, direct=direct, num_experts=num_experts,
                   hidden=hidden, max_tokens_per_rank=max_tokens_per_rank, max_top_k=max_top_k,
                   block_bytes=block_bytes, workers=workers, elastic=elastic),
              group, rank=rank, world=world_size, timeout_s=float(timeout_s))
        if num_experts % world_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the group size "
                             f"{world_size} (experts are split evenly across ranks)")
        self.config = BufferConfig(
            rank=rank, world_size=world_size, num_experts=num_experts, hidden=hidden,
            max_tokens_per_rank=max_tokens_per_rank, max_top_k=max_top_k, backend=backend,
            mode=mode or "ubep", sync=sync, schedule=schedule, workers=workers,
            count_workers=count_workers, block_bytes=block_bytes, timeout_s=float(timeout_s),
            topology=topology, direct=False if direct is None else direct, elastic=elastic,
            requested_backend=backend, backend_reason="" if backend == "auto" else "asked for")
        if backend == "auto":
            # the fastest path whose results the caller owns, unless a choice rules it out
            owned = (direct is None and mode is None and count_workers is None
                     and sync in ("tff", "sw"))
            chosen, why, chosen_direct, hosts = choose_backend(self.config, group, owned=owned)
            if direct and chosen != "shm":
                raise ValueError(f"direct={direct!r} needs the shm backend, which this group "
                                 f"cannot use: {why}")
            self.config = dataclasses.replace(self.config, backend=chosen, backend_reason=why,
                                              direct=chosen_direct, hosts=hosts)
        self.group = group
        self.rank, self.world_size = rank, world_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // world_size
        self.last_stats: Stats | None = None
        self._id = next(_buffer_ids)
        self._lock = threading.Lock()
        self._closed = False
        self._broken: BaseException | None = None
        #: the state this Buffer shares with its compiled door (`ubep.native.layout`'s BW_*
        #: words): whether it takes calls, its dispatches so far
        self._words = np.zeros(BW_LEN, np.int64)
        self._words[BW_USABLE] = 1
        c = self.config     # `dispatch_inputs_ready`'s limits, in its argument order
        self._limits = (c.hidden, c.num_experts, c.max_tokens_per_rank, c.max_top_k)
        # the inputs' fast checks, compiled when `ubep.native` is built (same answers)
        self._dispatch_ready, self._combine_ready = fast_checks()
        if self.config.backend == "hybrid" and not self.config.hosts:   # asked for by name
            self.config = dataclasses.replace(self.config, hosts=discover_hosts(
                group, rank=rank, world=world_size, timeout_s=float(timeout_s)))
        self._backend = make_backend(self.config, group, self._id)
        # the common call's whole way in one compiled call where the backend offers it
        # (`ubep.native`'s doors: shm's direct path with one worker, torch's CPU path); None:
        # the Python layers below
        native = load_native()
        self._door = (self._backend.door(self._lock, self._limits, self._words)
                      if native is not None else None)
        if self._door is not None:
            self._door_dispatch, self._door_combine = (
                getattr(native, name) for name in self._backend.DOOR_ENTRIES)
        #: the backend's books on the calls its door took (`Backend.door_hooks`), or None
        self._hooks = self._backend.door_hooks
        self._companions: dict[int, Buffer] = {}  # rows of other widths (`companion`)
        # `expert_load`: each dispatch's tokens per local expert, summed when read (or every
        # `_LOAD_FOLD` dispatches): a list append per call
        self._loads: list = []
        self._load = np.zeros(self.num_local_experts, np.int64)
        #: the elastic membership (`ubep.elastic.Membership`), None without elastic; and the
        #: backend's shared membership word with the bits of it applied (compared before each
        #: call: one load; None where the membership changes inside calls only)
        self._members = self._backend.membership
        self._word, self._applied = self._backend.membership_word or (None, None)
        if elastic and self._members is None:
            self._backend.close()
            raise ValueError(f"elastic=True is not supported by the "
                             f"{self.config.backend!r} backend")
        ops.register_buffer(self)

    # -- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Release shared memory, threads and windows. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._words[BW_USABLE] = 0
            self._door = None
            self._word = None           # (a view of shared memory the backend unmaps)
            self._backend.close()
            for companion in self._companions.values():
                companion.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffer_id(self) -> int:
        """This Buffer's id in this process; its handles carry it (`handle.buffer_id`)."""
        return self._id

    def companion(self, width: int) -> Buffer:
        """The Buffer of this one's group and options that moves rows of `width` elements
        (the scales of quantized rows, `ubep.quant`): made on its first use, which every rank
        must make at the same call (it is collective), and closed with this one."""
        comp = self._companions.get(width)
        if comp is None:
            c = self.config
            comp = Buffer(self.group, num_experts=c.num_experts, hidden=width,
                          max_tokens_per_rank=c.max_tokens_per_rank, backend=c.backend,
                          mode=c.mode, sync=c.sync, schedule=c.schedule, workers=c.workers,
                          count_workers=c.count_workers, topology=c.topology,
                          timeout_s=c.timeout_s, max_top_k=c.max_top_k,
                          block_bytes=c.block_bytes, direct=c.direct)
            self._companions[width] = comp
        return comp

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {what} after close")
        if isinstance(self._broken, RankRemovedError):
            raise RankRemovedError(self.rank, self._members.why.get(self.rank, "died")
                                   ) from self._broken
        if self._broken is not None:
            raise BrokenBufferError(
                f"cannot {what}: an earlier call failed ({type(self._broken).__name__}: "
                f"{self._broken}) and left this rank out of step with its peers; close this "
                f"Buffer and make a new one on every rank") from self._broken

    def _failed(self, e: BaseException) -> None:
        """Record that a backend call raised `e` (the caller re-raises it)."""
        # Bad input the backend refuses before anything moved leaves every rank in step.
        # Anything else (a runtime failure, an interrupt, an error raised after the peers
        # were told to abort) leaves this rank out of step with its peers: refuse reuse.
        before_sending = isinstance(e, (ValueError, TypeError)) and self._backend.in_step
        if isinstance(e, UbepError) or not before_sending:
            self._break(e)

    def _door_failed(self, e: BaseException) -> NoReturn:
        """Raise what a door call's error `e` is in the backend's terms, recorded."""
        if self._hooks is not None:
            named = self._hooks[1](e)
            if named is not e:
                self._failed(named)
                raise named from e
        self._failed(e)
        raise e

    def _break(self, e: BaseException) -> None:
        """Refuse every later call, naming `e` (`_check_usable`)."""
        self._broken = e
        self._words[BW_USABLE] = 0

    # -- the two operations ----------------------------------------------------------
    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 *, handle: DispatchHandle | None = None) -> DispatchResult:
        """Send each token's row to every rank hosting one of its experts.

        Arguments:
            x: `[T, hidden]`, any movable dtype, `T <= max_tokens_per_rank`; or a tuple
                `(x, x_scales)` of quantized rows and their float32 scales `[T, S]` (e.g.
                fp8 with one scale per 128 channels, `ubep.quant.per_token_cast_to_fp8`):
                the scales go with their rows, `recv_x_scales` holds them.
            topk_idx: `[T, K]`, int32/int64, values in `[-1, num_experts)`, distinct per row;
                `-1` = slot not routed.
            topk_weights: `[T, K]`, floating; the gating weight of each slot.
            handle: instead of `topk_idx`/`topk_weights`: the handle of an earlier dispatch
                of this Buffer, whose routing is reused (cached re-dispatch, as DeepEP's
                `handle=`): the rows land in that dispatch's order.

        Returns:
            A `DispatchResult`: `recv_x` `[N, hidden]` expert-major, `recv_weights` `[N]`,
            `tokens_per_expert` `[num_local_experts]`, row origins, `handle` and `stats`
            (and `recv_x_scales` `[N, S]` when `x` is a tuple).

        Gradients flow back to `x` and `topk_weights` when they require grad (see
        `ubep.ops`); under `torch.compile` the call is the `ubep::dispatch` operator.
        """
        # the common call (eager, CPU tensors of the checked dtypes and shapes, nothing that
        # requires grad, valid ids) is recognised by the inputs' fast check alone and goes
        # straight to the backend: every frame and keyword call saved here is ~0.3-1 µs of a
        # ~40 µs batch-1 dispatch+combine in one process; on the shm direct path with
        # `ubep.native`, the door takes it whole
        if self._word is not None and self._word[0] != self._applied[0]:
            self._sync_members()            # elastic: a rank another rank found dead
        if handle is None and not _is_compiling():
            if self._door is not None:      # the whole call compiled, or NotImplemented
                try:
                    res = self._door_dispatch(self._door, x, topk_idx, topk_weights)
                except BaseException as e:
                    self._door_failed(e)
                if res is not NotImplemented:
                    if self._hooks is not None:
                        self._hooks[0](res)
                    self.last_stats = res.stats
                    tpe = res.__dict__.get("_tpe")     # `expert_load`'s: not the rows
                    self._loads.append(res.tokens_per_expert if tpe is None else tpe)
                    if len(self._loads) >= _LOAD_FOLD:
                        self._fold_loads()
                    if self._members is not None and self._members.any_inactive:
                        self._note_masked(res, topk_idx)    # a rank died in this call
                    return res
            if self._dispatch_ready(x, topk_idx, topk_weights, *self._limits):
                return self._dispatch_checked(x, topk_idx, topk_weights)
        if handle is not None:
            topk_idx, topk_weights = self._routing_of(handle, topk_idx, topk_weights)
        if type(x) is tuple:
            if self._members is not None:
                raise ValueError("x=(rows, scales) is not supported with elastic=True: the "
                                 "scales travel through a second Buffer, whose rows could "
                                 "differ from these in the call a rank dies in; send the "
                                 "scales inside the rows (one byte row each), or use "
                                 "elastic=False")
            return quant.dispatch_with_scales(self, x, topk_idx, topk_weights)
        if ((getattr(x, "requires_grad", False) or getattr(topk_weights, "requires_grad", False))
                and _grad_enabled() or _is_compiling()):
            return ops.dispatch(self, x, topk_idx, topk_weights)
        return self.dispatch_eager(x, topk_idx, topk_weights)

    def _routing_of(self, handle, topk_idx, topk_weights) -> tuple[torch.Tensor, torch.Tensor]:
        """`handle`'s routing, for a cached re-dispatch."""
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("pass either handle= (reuse an earlier dispatch's routing) or "
                             "topk_idx and topk_weights, not both")
        if not isinstance(handle, (DispatchHandle, ops.OpHandle)) or handle.buffer_id != self._id:
            raise ValueError("handle must be the handle of a dispatch of this Buffer")
        return handle.topk_idx, handle.topk_weights

    def dispatch_eager(self, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor) -> DispatchResult:
        """`dispatch` of one tensor `x`, in eager mode, without autograd: the body `ubep.ops`'
        operators run (the inputs fully checked, as `dispatch` checks them)."""
        if self._closed or self._broken is not None:
            self._check_usable("dispatch")      # before the inputs' errors, as always
        c = self.config
        x, idx, w = check_dispatch_inputs(
            x, topk_idx, topk_weights, hidden=c.hidden, num_experts=c.num_experts,
            max_tokens_per_rank=c.max_tokens_per_rank, max_top_k=c.max_top_k)
        return self._dispatch_checked(x, idx, w)

    def _dispatch_checked(self, x: torch.Tensor, idx: torch.Tensor,
                          w: torch.Tensor) -> DispatchResult:
        """`dispatch_eager` of inputs `check_dispatch_inputs` accepted as they are."""
        with self._lock:
            if self._closed or self._broken is not None:
                self._check_usable("dispatch")
            self._words[BW_CALLS] = call = int(self._words[BW_CALLS]) + 1
            routing = idx
            if self._members is not None and self._members.any_inactive:
                idx = self._members.mask(idx)[0]    # nothing goes to an inactive rank
            try:                # inline (a helper call per op costs more than the try)
                res = self._backend.dispatch(x, idx, w, call)
            except BaseException as e:
                self._failed(e)
                raise
            if self._members is not None and self._members.any_inactive:
                self._note_masked(res, routing)
            self.last_stats = res.stats
            tpe = res.__dict__.get("_tpe")
            self._loads.append(res.tokens_per_expert if tpe is None else tpe)
            if len(self._loads) >= _LOAD_FOLD:
                self._fold_loads()
            return res

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """Send expert outputs back to their tokens and sum them.

        Arguments:
            expert_out: `[N, hidden]`, floating; row i is the output for the dispatch's row i.
            handle: the `handle` of the `DispatchResult` these rows answer.
            weighted: multiply each row by its gating weight before summing (default).
            out: optional `[T, hidden]` tensor of `expert_out.dtype` on its device (any
                strides) that receives `y`, as a framework's preallocated output (vLLM's
                `finalize(output, ...)`); checked before any communication. It may share
                memory with `expert_out` (then filled once the sums are done), not with
                `get_combine_buffer`'s memory (ValueError: peers read rows there meanwhile).

        Returns:
            `y` `[T, hidden]` in `expert_out.dtype`: for each token, the fp32 sum over its
            routed slots k of `w[t, k] * row(t, k)` (plain sum if not weighted); zeros for a
            token with no routed slot. With `out`, `out` itself, overwritten with `y`.

        Gradients flow back to `expert_out` and (weighted) to the dispatch's `topk_weights`
        when they require grad (see `ubep.ops`); under `torch.compile` the call is the
        `ubep::combine` operator.
        """
        # the common call (eager, this Buffer's handle, rows as the handle expects, `out`
        # None or a contiguous tensor apart from them): the rows' fast check alone, then the
        # backend (as in `dispatch`)
        if self._word is not None and self._word[0] != self._applied[0]:
            self._sync_members()            # elastic: a rank another rank found dead
        if self._door is not None and not _is_compiling():
            try:
                r = self._door_combine(self._door, expert_out, handle, weighted, out)
            except BaseException as e:
                self._door_failed(e)
            if r is not NotImplemented:
                if self._members is not None and self._members.any_inactive:
                    self._door = None       # a rank died in this call (the door assumes none)
                self.last_stats = r.stats
                return r.y
        if (type(handle) is DispatchHandle and out is None and handle.buffer_id == self._id
                and not _is_compiling() and self._combine_ready(expert_out, handle.num_recv,
                                                                handle.hidden)):
            return self._combine_checked(expert_out, handle, weighted, None)
        if (type(handle) is not DispatchHandle or _is_compiling()
                or getattr(expert_out, "requires_grad", False) and _grad_enabled()):
            if isinstance(handle, (ops.OpHandle, DispatchHandle)) and handle.buffer_id == self._id:
                if out is not None and isinstance(expert_out, torch.Tensor):
                    check_combine_out(out, num_tokens=handle.num_tokens, hidden=handle.hidden,
                                      dtype=expert_out.dtype, device=expert_out.device)
                y = ops.combine(self, expert_out, handle, weighted)
                return y if out is None else out.copy_(y)
        return self.combine_eager(expert_out, handle, weighted, out)

    def combine_eager(self, expert_out: torch.Tensor, handle: DispatchHandle,
                      weighted: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """`combine` in eager mode, without autograd: the body `ubep.ops`' operators run
        (`handle` a `DispatchHandle` of this Buffer, the rows fully checked)."""
        with self._lock:
            if self._closed or self._broken is not None:
                self._check_usable("combine")
            if not isinstance(handle, DispatchHandle):
                raise TypeError(f"handle must be the DispatchHandle of a dispatch, "
                                f"got {type(handle).__name__}")
            if handle.buffer_id != self._id:
                raise ValueError("handle comes from another Buffer; combine with the Buffer "
                                 "that dispatched")
            rows = check_combine_inputs(expert_out, num_recv=handle.num_recv,
                                        hidden=handle.hidden)
            if out is not None:
                check_combine_out(out, num_tokens=handle.num_tokens, hidden=handle.hidden,
                                  dtype=rows.dtype, device=rows.device)
        # a framework may hand `out` on the very memory of `expert_out` (one workspace for
        # both, as vLLM's modular kernel can): backends that sum into `out` while still
        # reading rows would read their own sums, so such an `out` is filled afterwards
        if out is not None and _overlap(out, rows):
            return out.copy_(self._combine_checked(rows, handle, weighted, None))
        return self._combine_checked(rows, handle, weighted, out)

    def _combine_checked(self, rows: torch.Tensor, handle: DispatchHandle, weighted: bool,
                         out: torch.Tensor | None) -> torch.Tensor:
        """`combine_eager` of checked rows of this Buffer's `handle` (`out` not overlapping
        them)."""
        with self._lock:
            if self._closed or self._broken is not None:
                self._check_usable("combine")
            try:
                res = self._backend.combine(rows, handle, bool(weighted), out)
            except BaseException as e:
                self._failed(e)
                raise
            if self._members is not None and self._members.any_inactive:
                self._door = None
            self.last_stats = res.stats
            return res.y

    # -- elastic expert parallelism and load ----------------------------------------------
    def _note_masked(self, res: DispatchResult, routing: torch.Tensor) -> None:
        """Elastic, some rank inactive: `res.masked` (and its handle's) are the slots of the
        caller's `routing` on inactive ranks; the door is off from now on."""
        self._door = None
        hit = self._members.slots_on_inactive(routing)
        if hit is not None:
            res.__dict__["masked"] = hit
            res.handle.__dict__["masked"] = hit

    def _sync_members(self) -> None:
        """Apply what the backend's shared membership says (a rank found dead elsewhere)."""
        with self._lock:
            if self._closed or self._broken is not None:
                return              # the call raises the reason
            try:
                self._backend.sync_membership()
            except RankRemovedError as e:
                self._break(e)
                raise
            if self._members.any_inactive:
                self._door = None   # the compiled door assumes every rank active

    @property
    def active_ranks(self) -> torch.Tensor:
        """`[world]` bool: the ranks this Buffer still exchanges with (all True without
        elastic). With elastic, a rank leaves it when found dead or removed by
        `set_active_ranks`; the remaining ranks agree on it once each has made a call after
        the death (a dead rank is found by every remaining rank in the first call it misses)."""
        if self._members is None:
            return torch.ones(self.world_size, dtype=torch.bool)
        if not self._closed and self._word is not None and self._word[0] != self._applied[0]:
            self._sync_members()
        return self._members.active_ranks()

    def set_active_ranks(self, mask: torch.Tensor) -> None:
        """Remove ranks without a failure (a planned drain: maintenance, or after a load
        balancer moved their experts away).

        Called by every rank that stays active, at the same point of their calls, with the
        same mask; the removed ranks do not call it: their Buffer refuses every later call
        (`RankRemovedError`) and may be closed. Returns once the remaining ranks agreed
        (bounded by `timeout_s`; masks that differ between them are the same ValueError on
        each). Needs `elastic=True`.

        Arguments:
            mask: `[world]` bool tensor, True = stays active. It may only remove ranks (an
                inactive rank cannot come back: make a new Buffer to grow) and must keep the
                calling rank.
        """
        if self._members is None:
            raise ValueError("set_active_ranks needs Buffer(elastic=True)")
        with self._lock:
            self._check_usable("set_active_ranks")
        if self._word is not None and self._word[0] != self._applied[0]:
            self._sync_members()
        new = check_drain_mask(mask, self._members.active, self.rank)
        with self._lock:
            self._check_usable("set_active_ranks")
            try:
                self._backend.set_active_ranks(new)
            except ValueError:
                raise               # masks differ: nothing changed, on every rank alike
            except BaseException as e:
                self._failed(e)
                raise
            if self._members.any_inactive:
                self._door = None

    def expert_load(self, reset: bool = False) -> torch.Tensor:
        """Tokens received per local expert since this Buffer was made or last reset (rows
        its dispatches delivered here, masked slots not counted), as DeepEP's
        `cumulative_local_expert_recv_stats`: what a load balancer reads to move experts.

        Arguments:
            reset: start counting again from zero after this read.

        Returns:
            `[num_local_experts]` int64 (a copy).
        """
        with self._lock:
            self._fold_loads()
            out = torch.from_numpy(self._load.copy())
            if reset:
                self._load[:] = 0
            return out

    def _fold_loads(self) -> None:
        """Add the kept dispatches' tokens per expert into the running total."""
        loads, self._loads = self._loads, []
        for tpe in loads:
            self._load += tpe.numpy() if isinstance(tpe, torch.Tensor) else tpe

    def get_combine_buffer(self, handle: DispatchHandle,
                           dtype: torch.dtype | None = None) -> torch.Tensor:
        """Where to write the expert outputs of `handle`'s rows so combine copies nothing.

        Only with `direct` (cf. DeepEP's `get_next_low_latency_combine_buffer`). Returns
        `[N, hidden]` of `dtype` (default: the dispatched rows' dtype) in this Buffer's shared
        memory; write row i's expert output to row i, then `combine(that_tensor, handle)`.
        Valid until the next dispatch (`direct=True`, latest dispatch only) or the next
        combine or `get_combine_buffer` (`direct="owned"`, any handle).
        """
        with self._lock:
            self._check_usable("get_combine_buffer")
            if not self.config.direct:
                raise ValueError("get_combine_buffer needs Buffer(backend='shm', direct=True or "
                                 "'owned'); other buffers combine any expert_out tensor")
            if not isinstance(handle, DispatchHandle) or handle.buffer_id != self._id:
                raise ValueError("handle must be the DispatchHandle of this Buffer's dispatch")
            return self._backend.combine_buffer(handle, dtype)

    def __repr__(self) -> str:
        c = self.config
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return (f"Buffer(rank={c.rank}/{c.world_size}, num_experts={c.num_experts}, "
                f"hidden={c.hidden}, backend={c.backend!r}, mode={c.mode!r}, sync={c.sync!r}, "
                f"{state})")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges `a` and `b` span on one device intersect (strides included)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    return a0 < b1 and b0 < a1
