"""Where vLLM's experts live, in ubep's numbering. Pure torch: no vLLM, no communication.

vLLM places experts by an `expert_map` per EP rank: `expert_map[g]` = the local slot of
global (physical) expert g on that rank, or -1 if the rank does not hold it. "linear",
"round_robin" and EPLB's rearrangements are all such maps. ubep places experts
contiguously (rank r owns ids `[r*L, (r+1)*L)`), so a global id g held by rank r in local
slot l is ubep id `r*L + l`; dispatching with ubep ids sends every row where vLLM keeps its
expert, and on arrival `ubep id - r*L` is the local slot.
"""

from __future__ import annotations

import torch


def ubep_ids_of_global(expert_maps: torch.Tensor) -> torch.Tensor:
    """`[E]` int64: the ubep id of each global expert, from every rank's `expert_map`.

    Arguments:
        expert_maps: `[P, E]` integer; row r is rank r's vLLM `expert_map` (local slot or -1).

    Every global expert must be held by exactly one rank and every rank must hold the same
    number L of experts in slots `0..L-1`; otherwise ValueError naming the expert or rank.
    """
    if expert_maps.dim() != 2:
        raise ValueError(f"expert_maps must be [P, E], got shape {tuple(expert_maps.shape)}")
    maps = expert_maps.to(torch.int64)
    world, num_experts = maps.shape
    held = maps >= 0
    holders = held.sum(dim=0)
    if bool((holders != 1).any()):
        g = int((holders != 1).nonzero()[0, 0])
        raise ValueError(f"global expert {g} is held by {int(holders[g])} ranks; ubep needs "
                         f"exactly one (redundant copies must have their own physical ids)")
    per_rank = held.sum(dim=1)
    local = int(per_rank[0])
    for r in range(world):
        slots = torch.sort(maps[r][held[r]]).values
        if int(per_rank[r]) != local or not torch.equal(slots, torch.arange(local)):
            raise ValueError(f"rank {r}'s expert_map holds slots {slots.tolist()}; every rank "
                             f"must hold slots 0..{local - 1} (the same expert count)")
    owner = held.to(torch.int64).argmax(dim=0)
    slot = maps.gather(0, owner.view(1, -1)).view(-1)
    return owner * local + slot


def local_to_global(expert_map: torch.Tensor) -> torch.Tensor:
    """`[L]` int64: the global id of each local slot of one rank's `expert_map`."""
    held = (expert_map >= 0).nonzero().view(-1)
    out = torch.empty(held.numel(), dtype=torch.int64)
    out[expert_map[held].to(torch.int64)] = held
    return out
