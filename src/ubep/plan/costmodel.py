"""How many of a rank's workers take the count role: the paper's Eq. 4, min max(T_count, T_token).

Count workers count the rank's (token, expert) pairs, store one count word per destination
rank (pipelined: a store costs its issue time, not its flight), wait for the last count to
arrive (polling overlaps the arrivals; one vector pass reads them after the last one), and
split the prefix sum (CalCumSum) among themselves. Token workers move the K*B rows, each at
its staging depth's pace, all of them together no faster than the rank's port, and then
reorder the K*B rows the rank receives (uniform routing: as many as it sends):

    T_count(c) = K*B*pair/c + ceil(P/c)*store + flight + scan + E*scan_entry
                 + E*cumsum_entry/c + (merge if c > 1) + publish
    T_token(t) = max(K*B*row/t, K*B*port_row) + K*B*reorder_row/t

and the choice is the `c` in [1, workers - 1] minimising max(T_count(c), T_token(workers - c)).
`CountCosts` holds the unit costs. The simulator builds them from its own `CostParams`
(`ubep.sim.params.count_costs`) and executes the count path with these same functions, so
the planner and the simulator share one formula; `DEFAULT_COUNT_COSTS` are nominal values
for callers that pass none. A measured choice (`ubep tune`'s cache, `ubep.tuning`) is passed
in as `tuned` by the caller: this module does no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CountCosts:
    """Unit costs of the two roles, microseconds (see the module docstring)."""

    pair_us: float = 0.002          # count one (token, expert) pair
    store_us: float = 0.05          # issue one count store (pipelined)
    flight_us: float = 2.5          # the slowest count store's hop latency
    scan_us: float = 0.05           # the vector pass after the last arrival, fixed part
    scan_entry_us: float = 0.0005   # ... per received count entry
    cumsum_entry_us: float = 0.002  # CalCumSum per entry (split over the count workers)
    merge_us: float = 0.3           # joining the count workers' partial sums (c > 1)
    publish_us: float = 0.3         # release the offsets to the token workers
    row_us: float = 0.5             # one token worker per row (slot time / staging depth)
    port_row_us: float = 0.0        # the rank's port per row (all token workers together)
    reorder_row_us: float = 0.0     # one token worker copying a received row into place

    def __post_init__(self) -> None:
        for name, v in self.__dict__.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"CountCosts.{name}={v!r} must be a number >= 0")


#: nominal unit costs for callers without a model of their machine (the simulator passes its own)
DEFAULT_COUNT_COSTS = CountCosts()


def t_count(c: int, *, ranks: int, num_experts: int, top_k: int, num_tokens: int,
            costs: CountCosts) -> float:
    """The count path with `c` count workers, us (launch excluded)."""
    return (count_us(c, top_k, num_tokens, costs) + math.ceil(ranks / c) * costs.store_us
            + costs.flight_us + scan_us(num_experts, costs)
            + cumsum_us(c, num_experts, costs) + costs.publish_us)


def count_us(c: int, top_k: int, num_tokens: int, costs: CountCosts) -> float:
    """Counting the rank's K*B pairs, split over `c` count workers, us."""
    return top_k * num_tokens * costs.pair_us / c


def scan_us(num_experts: int, costs: CountCosts) -> float:
    """The one vector pass over the received counts after the last one arrived, us."""
    return costs.scan_us + num_experts * costs.scan_entry_us


def cumsum_us(c: int, num_experts: int, costs: CountCosts) -> float:
    """CalCumSum over the received counts split in `c` groups, plus the merge, us."""
    return num_experts * costs.cumsum_entry_us / c + (costs.merge_us if c > 1 else 0.0)


def t_token(t: int, *, top_k: int, num_tokens: int, costs: CountCosts) -> float:
    """Sending the K*B rows with `t` token workers, then reordering as many, us."""
    rows = top_k * num_tokens
    return max(rows * costs.row_us / t, rows * costs.port_row_us) + \
        rows * costs.reorder_row_us / t


def choose_count_workers(workers: int, num_experts: int, top_k: int, num_tokens: int, *,
                         ranks: int | None = None, costs: CountCosts | None = None,
                         tuned: int | None = None) -> int:
    """Count-role workers out of `workers` (Eq. 4), in [1, workers - 1].

    `ranks`: destinations of the count stores (default: `num_experts`, one expert per
    rank). `costs`: unit costs (default `DEFAULT_COUNT_COSTS`). `tuned`: a measured choice
    for this workload (from `ubep tune`'s cache), used when it fits in [1, workers - 1].
    Returns 0 when `workers == 1` (the single thread does counts first, then tokens).
    """
    for name, v in (("workers", workers), ("num_experts", num_experts)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    for name, v in (("top_k", top_k), ("num_tokens", num_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}={v!r} must be an int >= 0")
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int)
                              or ranks < 1):
        raise ValueError(f"ranks={ranks!r} must be an int >= 1")
    if tuned is not None and (isinstance(tuned, bool) or not isinstance(tuned, int)):
        raise ValueError(f"tuned={tuned!r} must be an int or None")
    if costs is not None and not isinstance(costs, CountCosts):
        raise TypeError(f"costs must be a CountCosts, got {type(costs).__name__}")
    return balance_count_workers(workers, num_experts, top_k, num_tokens, ranks=ranks,
                                 costs=costs, tuned=tuned)


def balance_count_workers(workers: int, num_experts: int, top_k: int, num_tokens: int, *,
                          ranks: int | None = None, costs: CountCosts | None = None,
                          tuned: int | None = None) -> int:
    """`choose_count_workers` without the argument checks (the planner's per-call path)."""
    if workers == 1:
        return 0
    if tuned is not None and 1 <= tuned <= workers - 1:
        return tuned
    costs = costs or DEFAULT_COUNT_COSTS
    p = num_experts if ranks is None else ranks
    best, best_t = 1, math.inf
    for c in range(1, workers):
        t = max(t_count(c, ranks=p, num_experts=num_experts, top_k=top_k,
                        num_tokens=num_tokens, costs=costs),
                t_token(workers - c, top_k=top_k, num_tokens=num_tokens, costs=costs))
        if t < best_t:
            best, best_t = c, t
    return best
