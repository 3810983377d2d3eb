"""How many of a rank's workers take the count role (docs/design.md §2.1).

Count workers handle the per-expert counts (send, wait, prefix sums); token workers move
the K*B rows. With linear costs, T_count = beta * E / n_count and
T_token = alpha * K * B / (n - n_count); they are equal at

    n_count = n * beta*E / (beta*E + alpha*K*B)   (~ (beta/alpha) * n * E / (K*B) when small)

so more experts call for more count workers and more traffic for fewer. `alpha` and `beta`
are relative unit costs (one row sent by one worker, one expert counted by one worker);
the autotuner (`ubep tune`) replaces this guess with a measured sweep.
"""

from __future__ import annotations

#: relative cost of sending one (token, expert) row from one worker
DEFAULT_ALPHA = 1.0
#: relative cost of counting, sending and summing one expert's count in one worker
DEFAULT_BETA = 0.25


def choose_count_workers(workers: int, num_experts: int, top_k: int, num_tokens: int,
                         alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA) -> int:
    """Count-role workers out of `workers`: the balance point, clamped to [1, workers - 1].

    Returns 0 when `workers == 1` (the single thread does counts first, then tokens).
    """
    for name, v in (("workers", workers), ("num_experts", num_experts)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    for name, v in (("top_k", top_k), ("num_tokens", num_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}={v!r} must be an int >= 0")
    if not (alpha > 0 and beta > 0):
        raise ValueError(f"alpha={alpha!r} and beta={beta!r} must be positive")
    return balance_count_workers(workers, num_experts, top_k, num_tokens, alpha, beta)


def balance_count_workers(workers: int, num_experts: int, top_k: int, num_tokens: int,
                          alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA) -> int:
    """`choose_count_workers` without the argument checks (the planner's per-call path)."""
    if workers == 1:
        return 0
    count_cost = beta * num_experts
    token_cost = alpha * top_k * num_tokens
    n_count = round(workers * count_cost / (count_cost + token_cost))
    return min(max(n_count, 1), workers - 1)
