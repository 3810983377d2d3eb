"""Token schedulers: which token worker sends which (token, expert) pair, in what order.

Each scheduler takes one rank's sends (listed row-major: ascending token, then slot) and
returns a `Schedule`: a permutation of them in worker-major send order plus each worker's
offsets into it. All three are vectorized numpy; none loops over sends in Python.

* static: worker j owns a fixed range of tokens and sends all of their pairs (the BSP
  baseline's ownership); loads follow the routing.
* balanced: all sends in expert order, cut into equal contiguous slices ("balanced w/o
  mapping" in the paper's ablation).
* hierarchical (docs/design.md §2.2): experts are remapped to hop-class-major order (farthest
  class first; inside a class rotated to start after the planning rank), i.e. the sends
  form a virtual matrix with one row per hop class; each row is cut into `n` token-level
  equal slices and worker j takes slice j of every row. Every worker gets `floor` or
  `ceil` of `N / n` sends and at most `ceil(V_h / n)` of the `V_h` sends of hop class h:
  the remainders of the rows are dealt out cyclically, continuing from row to row. Reading
  the matrix column-wise (the logical transposition) is also each worker's send order: its
  slices are interleaved in proportion (`interleave_keys`), so near rows go out while far
  rows are in flight and every worker loads each tier of the fabric evenly over time,
  instead of all workers sending their far rows first at once. A worker finds where each
  of its slices starts (expert and offset) with the quaternary search (`slice_starts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ubep.plan.search import quaternary_search as quaternary_search  # re-export (contract)
from ubep.plan.search import quaternary_search_many

SCHEDULES = ("static", "balanced", "hierarchical")


@dataclass(frozen=True)
class Schedule:
    """One scheduler's answer.

    Attributes:
        order: `[N]` int64, indices into the row-major send list, in worker-major send order.
        offsets: `[n + 1]` int64; worker j sends `order[offsets[j]:offsets[j + 1]]`.
        expert_order: `[E]` int64, the expert order the slices cut (remapped for hierarchical).
        segment_targets: `[n, S]` int64, where each worker's slices start, as positions in the
            sends concatenated in `expert_order` (S = 1 for balanced, one per hop class for
            hierarchical, 0 for static, which cuts tokens, not experts).
        segment_sizes: `[n, S]` int64, the sends in each of those slices.
    """

    order: np.ndarray
    offsets: np.ndarray
    expert_order: np.ndarray
    segment_targets: np.ndarray
    segment_sizes: np.ndarray


def equal_cuts(total: int, n: int) -> np.ndarray:
    """`[n + 1]` cut points splitting `total` items into n contiguous parts of sizes ±1."""
    return (np.arange(n + 1, dtype=np.int64) * total) // n


def schedule_static(token: np.ndarray, num_tokens: int, num_experts: int, n: int) -> Schedule:
    """Worker j owns tokens `[j*T/n, (j+1)*T/n)` and sends their pairs in (token, slot) order."""
    offsets = np.searchsorted(token, equal_cuts(num_tokens, n), side="left").astype(np.int64)
    empty = np.zeros((n, 0), dtype=np.int64)
    return Schedule(np.arange(token.shape[0], dtype=np.int64), offsets,
                    np.arange(num_experts, dtype=np.int64), empty, empty)


def _small_key(n: int) -> type:
    """The narrowest int dtype for keys < n (numpy's stable sort radix-sorts 8/16-bit ints)."""
    return np.int16 if n < 2**15 else np.int64


def expert_sort(expert: np.ndarray, num_experts: int) -> np.ndarray:
    """Stable order of the sends by expert (ascending token within an expert)."""
    return np.argsort(expert.astype(_small_key(num_experts)), kind="stable")


def schedule_balanced(by_expert: np.ndarray, num_experts: int, n: int) -> Schedule:
    """All sends in expert order (ascending token within an expert), cut into n equal slices.

    `by_expert` is `expert_sort(expert, num_experts)`.
    """
    order = by_expert
    offsets = equal_cuts(order.shape[0], n)
    return Schedule(order, offsets, np.arange(num_experts, dtype=np.int64),
                    offsets[:-1, None].copy(), np.diff(offsets)[:, None])


def remap_experts(hop_of_expert: np.ndarray, first: int = 0,
                  experts_per_rank: int = 1) -> np.ndarray:
    """The hierarchical expert order: hop-class-major, farthest class first; inside a class
    the experts' `[rank, local expert]` matrix read column-wise (the logical transposition:
    local expert 0 of every rank, then local expert 1, ...), ranks in id order rotated to
    start at the rank of expert `first`.

    The transposition puts consecutive experts on different ranks, so a worker's
    contiguous slice spreads over as many destinations as it has experts, instead of
    sending its whole slice to one rank. The planner passes the first expert after its own
    rank's, so that at the start of a dispatch the ranks' workers aim at different
    destinations instead of all at the lowest-numbered one (an incast at a single rank).
    """
    num_experts = hop_of_expert.shape[0]
    epr = max(int(experts_per_rank), 1)
    e = np.arange(num_experts)
    ranks = max(num_experts // epr, 1)
    rotated_rank = (e // epr - first // epr) % ranks
    return np.lexsort((rotated_rank, e % epr, -hop_of_expert)).astype(np.int64)


@dataclass(frozen=True)
class ExpertLayout:
    """What the schedulers need per (topology, rank, experts per rank): fixed across calls."""

    hop_of_rank: np.ndarray      # [P] hop class from this rank to each rank
    hop_of_expert: np.ndarray    # [E] hop class from this rank to each expert's rank
    expert_order: np.ndarray     # [E] remap_experts(hop_of_expert, first)
    rank_of_expert: np.ndarray   # [E] small ints, position of each expert in expert_order
    identity: np.ndarray         # [E] arange: the expert order of static and balanced


def expert_layout(hop_of_rank: np.ndarray, experts_per_rank: int, rank: int = -1) -> ExpertLayout:
    """Remap the experts once for `rank`; the schedulers reuse it on every call."""
    hop_of_expert = np.repeat(hop_of_rank, experts_per_rank)
    expert_order = remap_experts(hop_of_expert, first=(rank + 1) * experts_per_rank,
                                 experts_per_rank=experts_per_rank)
    num_experts = expert_order.shape[0]
    rank_of_expert = np.empty(num_experts, dtype=_small_key(num_experts))
    rank_of_expert[expert_order] = np.arange(num_experts)
    layout = ExpertLayout(np.ascontiguousarray(hop_of_rank, dtype=np.int64), hop_of_expert,
                          expert_order, rank_of_expert, np.arange(num_experts, dtype=np.int64))
    for a in (layout.hop_of_rank, hop_of_expert, expert_order, rank_of_expert, layout.identity):
        a.setflags(write=False)
    return layout


def interleave_keys(q: np.ndarray, size: np.ndarray, chunk: int = 1) -> np.ndarray:
    """Where the q-th of `size` sends of one slice falls in its worker's send order, as a
    fraction: the middle of its chunk's share, `(2c + 1) / (2 C)` for chunk `c = q // chunk`
    of `C = ceil(size / chunk)`. A worker sends its slices merged by this key (ties: the
    farther class first, then in order), so each hop class is spread over the whole list in
    proportion to its size, `chunk` sends at a time. Exact for equal fractions (IEEE
    division is correctly rounded), so `fastplan` computes the same order.

    `chunk` 1 spreads every tier's load evenly over time (right when the ports are the
    bound); a chunk of the staging depth keeps each round of the staging ring to one class,
    so near rows are not held up by far rows sharing their round (right when each worker's
    hop latency is the bound)."""
    return (2 * (q // chunk) + 1) / (2 * -(-size // chunk))


def schedule_hierarchical(expert: np.ndarray, layout: ExpertLayout, n: int,
                          num_hop_classes: int, chunk: int = 1) -> Schedule:
    """Per hop class, equal token-level slices; worker j takes slice j of every class and
    sends them interleaved in proportion, `chunk` sends at a time (`interleave_keys`)."""
    hop_of_expert, expert_order = layout.hop_of_expert, layout.expert_order
    # class-major, then expert, then token (small int keys: numpy radix-sorts them)
    by_class = np.argsort(layout.rank_of_expert[expert], kind="stable")
    # sends per class, farthest class first (the row order of the virtual matrix)
    per_class = np.bincount(hop_of_expert[expert], minlength=num_hop_classes)[::-1]
    H = per_class.shape[0]
    base, extra = np.divmod(per_class, n)
    # deal each row's remainder cyclically, continuing where the previous row stopped
    first = (np.cumsum(extra) - extra) % n
    j = np.arange(n)
    sizes = base[:, None] + (((j[None, :] - first[:, None]) % n) < extra[:, None])  # [H, n]
    targets = (np.cumsum(per_class) - per_class)[:, None] + np.cumsum(sizes, axis=1) - sizes
    per_worker = sizes.sum(axis=0)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(per_worker, out=offsets[1:])
    # the sends in class-major order lie slice by slice, (row h, worker j) row-major: each
    # one's row, worker and index inside its slice; then merge every worker's slices
    flat = sizes.ravel()
    row = np.repeat(np.repeat(np.arange(H), n), flat)
    worker = np.repeat(np.tile(j, H), flat)
    q = np.arange(by_class.shape[0]) - np.repeat(targets.ravel(), flat)
    merged = np.lexsort((q, row, interleave_keys(q, np.repeat(flat, flat), chunk), worker))
    return Schedule(by_class[merged], offsets, expert_order, targets.T.astype(np.int64),
                    sizes.T.astype(np.int64))


def slice_starts(counts_in_order: np.ndarray,
                 targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Where slices start: `(position in expert_order, offset in that expert, steps)`.

    `counts_in_order` are the per-expert send counts in the schedule's expert order;
    `targets` are slice start positions in the sends concatenated in that order. This is
    what each worker computes on its own on the device (three pivots per step).
    """
    prefix = np.cumsum(counts_in_order)
    flat = targets.ravel()
    index, steps = quaternary_search_many(prefix, flat)
    before = np.concatenate(([0], prefix))[np.minimum(index, prefix.shape[0])]
    return index.reshape(targets.shape), (flat - before).reshape(targets.shape), steps

