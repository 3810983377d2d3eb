"""Dispatch layout: how many tokens and (token, expert) pairs go to each rank and expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchLayout:
    """Counts of one rank's routing, as DeepEP's `get_dispatch_layout` gives them.

    Attributes:
        tokens_per_rank: `[num_ranks]`, int64; tokens with at least one expert on that rank
            (a token routed to two experts of one rank counts once).
        tokens_per_expert: `[num_experts]`, int64; (token, expert) pairs per expert.
        is_token_in_rank: `[num_tokens, num_ranks]`, bool; token has an expert on that rank.
    """

    tokens_per_rank: torch.Tensor
    tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor

    def __iter__(self):
        """Unpack as `(tokens_per_rank, tokens_per_expert, is_token_in_rank)`."""
        return iter((self.tokens_per_rank, self.tokens_per_expert, self.is_token_in_rank))


def get_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> DispatchLayout:
    """Count one rank's routing per destination rank and per expert.

    Arguments:
        topk_idx: `[num_tokens, num_topk]`, int32/int64, values in `[-1, num_experts)`;
            `-1` = slot not routed.
        num_experts: global expert count, divisible by `num_ranks`; experts are placed
            contiguously (rank r owns `[r*E/P, (r+1)*E/P)`).
        num_ranks: number of ranks.

    Returns:
        A `DispatchLayout` (also unpackable as a 3-tuple).
    """
    from ubep.validate import check_topk_idx

    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks!r} must be a positive int")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % num_ranks:
        raise ValueError(
            f"num_experts={num_experts!r} must be a positive int divisible by "
            f"num_ranks={num_ranks}")
    idx = check_topk_idx(topk_idx, num_experts=num_experts, num_tokens=None)
    per_rank = num_experts // num_ranks
    routed = idx >= 0
    tokens_per_expert = torch.bincount(idx[routed], minlength=num_experts)
    dest = torch.where(routed, idx // per_rank, num_ranks)  # num_ranks = "nowhere"
    is_token_in_rank = torch.zeros(idx.shape[0], num_ranks + 1, dtype=torch.bool, device=idx.device)
    is_token_in_rank.scatter_(1, dest, True)
    is_token_in_rank = is_token_in_rank[:, :num_ranks].contiguous()
    return DispatchLayout(
        tokens_per_rank=is_token_in_rank.sum(0, dtype=torch.int64),
        tokens_per_expert=tokens_per_expert.to(torch.int64),
        is_token_in_rank=is_token_in_rank,
    )
