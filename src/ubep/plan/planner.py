"""`make_plan`: one rank's routing -> a `Plan` of plain arrays that every executor reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ubep.plan.costmodel import balance_count_workers
from ubep.plan.schedule import (
    SCHEDULES,
    ExpertLayout,
    Schedule,
    expert_layout,
    expert_sort,
    schedule_balanced,
    schedule_hierarchical,
    schedule_static,
    slice_starts,
)
from ubep.plan.topology import Topology

MODES = ("ubep", "bsp")
ENGINES = ("numba", "numpy")


@dataclass(frozen=True)
class Plan:
    """What one rank's workers do in one dispatch. Plain numpy arrays; treat as read-only.

    Sends are (token, expert) pairs with a routed slot; `N` of them. The flat arrays list
    them in worker-major send order; worker j (a token worker) owns
    `[worker_offsets[j], worker_offsets[j + 1])`.

    Attributes:
        rank, num_ranks, num_experts, num_tokens, top_k, schedule, mode: the inputs.
        workers: threads of the rank; `count_workers` of them take the count role and
            `token_workers` the token role (mode "ubep", workers >= 2). With one worker,
            `count_workers = 0`, `token_workers = 1`: that thread sends counts first. Mode
            "bsp": `count_workers = 0`, `token_workers = workers` (all do every phase).
        sends: `[N, 3]` int64, (token index, top-k slot, destination rank).
        send_experts: `[N]` int64, the global expert of each send.
        window_pos: `[N]` int64, the row's position in the receiver's window for (this rank,
            expert): among this rank's rows for that expert, numbered in ascending token order.
        hops: `[N]` int64, the hop class (`Topology.hop_class(rank, dest)`) of each send.
        worker_offsets: `[token_workers + 1]` int64.
        send_counts: `[num_experts]` int64, this rank's sends per expert.
        count_dest_ranges: per count worker, the `[lo, hi)` destination ranks it sends counts to.
        expert_order: `[num_experts]` int64, the (remapped, for hierarchical) expert order the
            slices cut.
        segment_targets, segment_sizes: `[token_workers, S]` int64, where each worker's
            slices start in the sends concatenated in `expert_order`, and their lengths (see
            `ubep.plan.schedule.Schedule`).
        hop_names: name of each hop class ("local", then the tiers).
    """

    rank: int
    num_ranks: int
    num_experts: int
    num_tokens: int
    top_k: int
    schedule: str
    mode: str
    workers: int
    count_workers: int
    token_workers: int
    sends: np.ndarray
    send_experts: np.ndarray
    window_pos: np.ndarray
    hops: np.ndarray
    worker_offsets: np.ndarray
    send_counts: np.ndarray
    count_dest_ranges: list[tuple[int, int]]
    expert_order: np.ndarray
    segment_targets: np.ndarray = field(repr=False)
    segment_sizes: np.ndarray = field(repr=False)
    hop_names: tuple[str, ...] = ()

    @property
    def num_sends(self) -> int:
        return int(self.sends.shape[0])

    @property
    def num_hop_classes(self) -> int:
        return len(self.hop_names)

    def _split(self, arr: np.ndarray) -> list[np.ndarray]:
        o = self.worker_offsets
        return [arr[o[j]:o[j + 1]] for j in range(self.token_workers)]

    @cached_property
    def worker_sends(self) -> list[np.ndarray]:
        """Per token worker, `[n_j, 3]` int64 (token, slot, destination rank) in send order."""
        return self._split(self.sends)

    @cached_property
    def worker_window_pos(self) -> list[np.ndarray]:
        """Per token worker, `[n_j]` int64: each send's position in its receiver window."""
        return self._split(self.window_pos)

    @cached_property
    def worker_hops(self) -> list[np.ndarray]:
        """Per token worker, `[n_j]` int64: each send's hop class."""
        return self._split(self.hops)

    @cached_property
    def worker_experts(self) -> list[np.ndarray]:
        """Per token worker, `[n_j]` int64: each send's global expert."""
        return self._split(self.send_experts)

    def sends_per_worker(self) -> np.ndarray:
        """`[token_workers]` int64, sends of each token worker."""
        return np.diff(self.worker_offsets)

    def hop_counts(self) -> np.ndarray:
        """`[token_workers, num_hop_classes]` int64: sends of each worker per hop class."""
        worker = np.repeat(np.arange(self.token_workers), self.sends_per_worker())
        flat = worker * self.num_hop_classes + self.hops
        return np.bincount(flat, minlength=self.token_workers * self.num_hop_classes).reshape(
            self.token_workers, self.num_hop_classes)

    def slice_starts(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Each worker's slice starts found by quaternary search, as a worker would.

        Returns `(expert, offset, steps)`: `expert` `[token_workers, S]` global expert ids
        (`num_experts` past the end), `offset` the send index inside that expert, and the
        largest step count taken.
        """
        pos, offset, steps = slice_starts(self.send_counts[self.expert_order],
                                          self.segment_targets)
        ext = np.concatenate((self.expert_order, [self.num_experts]))
        return ext[pos], offset, steps

    def __repr__(self) -> str:
        per = self.sends_per_worker()
        load = f"{per.min()}-{per.max()}" if per.size else "0"
        return (f"Plan(rank={self.rank}/{self.num_ranks}, schedule={self.schedule!r}, "
                f"mode={self.mode!r}, workers={self.workers} ({self.count_workers} count + "
                f"{self.token_workers} token), sends={self.num_sends} ({load} per worker), "
                f"tokens={self.num_tokens}x{self.top_k}, experts={self.num_experts})")

    def summary(self) -> dict:
        """Small JSON-able description (for stats and traces)."""
        per = self.sends_per_worker()
        return {"schedule": self.schedule, "mode": self.mode, "workers": self.workers,
                "count_workers": self.count_workers, "token_workers": self.token_workers,
                "num_sends": self.num_sends,
                "sends_per_worker_min": int(per.min()) if per.size else 0,
                "sends_per_worker_max": int(per.max()) if per.size else 0}


def _as_numpy_idx(topk_idx, num_experts: int, check_range: bool = True) -> np.ndarray:
    if hasattr(topk_idx, "detach"):  # torch.Tensor, without importing torch here
        if topk_idx.device.type != "cpu":
            topk_idx = topk_idx.cpu()
        topk_idx = topk_idx.detach().numpy()
    if not isinstance(topk_idx, np.ndarray):
        raise TypeError(f"topk_idx must be a torch.Tensor or numpy array, "
                        f"got {type(topk_idx).__name__}")
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be 2-D [num_tokens, num_topk], got shape "
                         f"{tuple(topk_idx.shape)}")
    if topk_idx.dtype.kind not in "iu":
        raise TypeError(f"topk_idx must hold integers, got dtype {topk_idx.dtype}")
    idx = topk_idx.astype(np.int64, copy=False)
    if check_range and idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            _bad_expert(lo if lo < -1 else hi, num_experts)
    return idx


def _bad_expert(bad: int, num_experts: int):
    raise ValueError(f"topk_idx holds expert id {bad}; ids must be in "
                     f"[-1, num_experts={num_experts}) (-1 = not routed)")


def _expert_layout(topology: Topology, rank: int, experts_per_rank: int) -> ExpertLayout:
    # fixed per (fabric, rank): computed once per Topology object, not on every dispatch
    cache = topology._plan_cache
    layout = cache.get((rank, experts_per_rank))
    if layout is None:
        layout = expert_layout(topology.hop_matrix()[rank], experts_per_rank, rank)
        cache[(rank, experts_per_rank)] = layout
    return layout


@dataclass(frozen=True)
class WorkerMapper:
    """What a worker needs to compute its own slice of a rank's sends, without a central
    plan: the compiled `fastplan.map_worker` over these fixed-per-Buffer arrays.

    `make_plan(...).worker_sends[j]` equals `mapper.map(idx, workers, j)[0]` (tests/plan).

    Attributes:
        num_experts, experts_per_rank: the routing's experts and how many each rank holds.
        hop_of_rank: `[P]` int64, hop class from this rank to each rank.
        rank_of_expert: `[E]` int64, each expert's position in the hierarchical order.
        kind: `fastplan.STATIC | BALANCED | HIERARCHICAL`.
        num_hop_classes: hop classes of the topology.
        send_chunk: hierarchical: sends per interleaving step (see `make_plan`).
    """

    num_experts: int
    experts_per_rank: int
    hop_of_rank: np.ndarray = field(repr=False)
    rank_of_expert: np.ndarray = field(repr=False)
    kind: int
    num_hop_classes: int
    send_chunk: int = 1

    @classmethod
    def of(cls, topology: Topology, rank: int, num_experts: int,
           schedule: str = "hierarchical", send_chunk: int = 1) -> WorkerMapper:
        """The mapper of `rank`'s dispatch sends; `num_experts = P` with one "expert" per
        rank maps combine's rows back (by source rank) with the same schedule."""
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of "
                             f"{', '.join(map(repr, SCHEDULES))}")
        epr = num_experts // topology.num_ranks
        layout = _expert_layout(topology, rank, epr)
        return cls(num_experts, epr, np.array(layout.hop_of_rank, np.int64),
                   np.array(layout.rank_of_expert, np.int64), SCHEDULES.index(schedule),
                   topology.num_hop_classes, _check_int("send_chunk", send_chunk, 1))

    def map(self, idx: np.ndarray, workers: int, j: int):
        """Worker j of `workers`: `(sends [m, 3], experts [m], window_pos [m], hops [m])`
        (see `Plan`) from `idx` `[T, K]` int64 (contiguous, ids checked by the caller)."""
        from ubep.plan.fastplan import count_experts, map_worker

        counts = np.zeros(self.num_experts, np.int64)
        count_experts(idx, counts)
        return map_worker(idx, counts, self.experts_per_rank, self.hop_of_rank,
                          self.rank_of_expert, self.kind, workers, self.num_hop_classes, j,
                          self.send_chunk)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def make_plan(topk_idx, *, topology: Topology, rank: int, num_experts: int, workers: int,
              count_workers: int | None = None, schedule: str = "hierarchical",
              mode: str = "ubep", engine: str = "numba", send_chunk: int = 1) -> Plan:
    """Plan one rank's dispatch: roles of its workers and each token worker's ordered sends.

    Experts are placed contiguously: rank r owns experts `[r*E/P, (r+1)*E/P)` with
    `P = topology.num_ranks`.

    Arguments:
        topk_idx: `[num_tokens, num_topk]`, torch.Tensor or numpy array of ints in
            `[-1, num_experts)`, distinct per row; `-1` = slot not routed.
        topology: the fabric (`Topology.resolve(obj, world_size)` gives one).
        rank: this rank, in `[0, topology.num_ranks)`.
        num_experts: global expert count, divisible by `topology.num_ranks`.
        workers: threads of this rank (>= 1).
        count_workers: workers in the count role (mode "ubep", workers >= 2), in
            `[1, workers - 1]`; None = `costmodel.choose_count_workers`. Ignored for "bsp".
        schedule: "static" | "balanced" | "hierarchical".
        mode: "ubep" (count and token roles) | "bsp" (every worker does every phase).
        engine: "numba" (one compiled pass, the default) or "numpy" (the vectorized
            reference); both give the same plan.
        send_chunk: hierarchical: each worker interleaves its hop classes this many sends at
            a time (`schedule.interleave_keys`): 1 (default) spreads every tier's load evenly
            over time, for port-bound sending; the topology's `staging_rows` keeps each
            round of a worker's staging ring to one class, for latency-bound sending
            (`ubep.sim` picks it from its cost model).

    Returns:
        A `Plan`.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a ubep.Topology (Topology.resolve makes one), "
                        f"got {type(topology).__name__}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(map(repr, SCHEDULES))}")
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not one of {', '.join(map(repr, ENGINES))}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(map(repr, MODES))}")
    num_ranks = topology.num_ranks
    rank = _check_int("rank", rank, 0)
    if rank >= num_ranks:
        raise ValueError(f"rank={rank} must be < topology.num_ranks={num_ranks}")
    num_experts = _check_int("num_experts", num_experts, 1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be divisible by topology.num_ranks="
                         f"{num_ranks}")
    workers = _check_int("workers", workers, 1)
    send_chunk = _check_int("send_chunk", send_chunk, 1)
    idx = _as_numpy_idx(topk_idx, num_experts, check_range=engine != "numba")
    num_tokens, top_k = idx.shape

    if mode == "bsp" or workers == 1:
        n_count = 0
    elif count_workers is None:
        n_count = balance_count_workers(workers, num_experts, top_k, num_tokens)
    else:
        n_count = _check_int("count_workers", count_workers, 1)
        if n_count >= workers:
            raise ValueError(f"count_workers={n_count} must be < workers={workers} "
                             f"(token workers need at least one thread)")
    n_token = workers - n_count

    experts_per_rank = num_experts // num_ranks
    layout = _expert_layout(topology, rank, experts_per_rank)
    if engine == "numba":
        from ubep.plan.fastplan import plan_kernel

        kind = SCHEDULES.index(schedule)
        sends, send_experts, window_pos, hops, offsets, send_counts, targets, sizes, bad = \
            plan_kernel(np.ascontiguousarray(idx), num_experts, experts_per_rank,
                        layout.hop_of_rank, layout.rank_of_expert, kind, n_token,
                        topology.num_hop_classes, send_chunk)
        if bad != -1:
            _bad_expert(int(bad), num_experts)
        expert_order = layout.expert_order if schedule == "hierarchical" else layout.identity
    else:
        sched = _numpy_schedule(idx, num_experts, experts_per_rank, layout, schedule, n_token,
                                topology.num_hop_classes, send_chunk)
        sends, send_experts, window_pos, hops, send_counts = sched[:5]
        offsets, expert_order, targets, sizes = sched[5:]
    cuts = (np.arange(n_count + 1) * num_ranks) // max(n_count, 1)
    count_dest_ranges = [(int(cuts[i]), int(cuts[i + 1])) for i in range(n_count)]
    return Plan(
        rank=rank, num_ranks=num_ranks, num_experts=num_experts, num_tokens=num_tokens,
        top_k=top_k, schedule=schedule, mode=mode, workers=workers, count_workers=n_count,
        token_workers=n_token, sends=sends, send_experts=send_experts, window_pos=window_pos,
        hops=hops, worker_offsets=offsets, send_counts=send_counts,
        count_dest_ranges=count_dest_ranges, expert_order=expert_order,
        segment_targets=targets, segment_sizes=sizes,
        hop_names=topology._hop_names)


def _numpy_schedule(idx: np.ndarray, num_experts: int, experts_per_rank: int,
                    layout: ExpertLayout, schedule: str, n_token: int, num_hop_classes: int,
                    send_chunk: int = 1):
    """The vectorized reference path of `make_plan` (see `ubep.plan.schedule`)."""
    num_tokens, top_k = idx.shape
    # the sends, row-major (ascending token, then slot)
    flat = idx.reshape(-1)
    pos = np.flatnonzero(flat >= 0)
    expert = flat[pos]
    token = pos // top_k if top_k else pos
    slot = pos - token * top_k
    dest = expert // experts_per_rank
    hops = layout.hop_of_rank[dest]

    send_counts = np.bincount(expert, minlength=num_experts).astype(np.int64)
    by_expert = expert_sort(expert, num_experts)
    first_of_expert = np.cumsum(send_counts) - send_counts
    window_pos = np.empty_like(expert)
    window_pos[by_expert] = np.arange(expert.shape[0]) - first_of_expert[expert[by_expert]]

    sched: Schedule
    if schedule == "static":
        sched = schedule_static(token, num_tokens, num_experts, n_token)
    elif schedule == "balanced":
        sched = schedule_balanced(by_expert, num_experts, n_token)
    else:
        sched = schedule_hierarchical(expert, layout, n_token, num_hop_classes, send_chunk)
    o = sched.order
    sends = np.stack((token[o], slot[o], dest[o]), axis=1)
    return (sends, expert[o], window_pos[o], hops[o], send_counts, sched.offsets,
            sched.expert_order, sched.segment_targets, sched.segment_sizes)
