"""Elastic expert parallelism: which ranks of a Buffer are active, and routing masked to them.

`Buffer(elastic=True)` drops a rank found dead (or removed by `set_active_ranks`) from its
active ranks instead of failing: slots routed to an inactive rank's experts are not
delivered (`DispatchResult.masked`), combine sums the delivered ones, and no call waits
for an inactive rank again (docs/reliability.md, "Elastic"). The model follows Mooncake
EP's `active_ranks` mask and DeepEP's skipping of failed ranks.

This module is backend-neutral: `Membership` holds one rank's view of the active ranks
and masks a routing against it; `check_drain_mask` validates `set_active_ranks`'s mask.
How ranks learn of a death and agree on it is the backend's (shared memory: a word in
every rank's region, `runtime/shm/membership.py`; torch.distributed: the store,
`runtime/torch_elastic.py`); each backend holds a `Membership` and updates it through
`remove`, which a Buffer reads at the start of every call (`version`).
"""

from __future__ import annotations

import threading

import numpy as np
import torch


class Membership:
    """One rank's view of the active ranks of an elastic Buffer.

    Attributes:
        rank, world: this rank and the group size.
        experts_per_rank: experts each rank hosts (rank r: `[r*E/P, (r+1)*E/P)`).
        active: `[world]` bool numpy array, this rank's view (only ever loses ranks).
        version: incremented whenever a rank is removed: a Buffer compares it before and after
            a call to see whether ranks were removed meanwhile.
        any_inactive: whether some rank is inactive.
        why: per removed rank, why ("died", "removed by set_active_ranks").
    """

    def __init__(self, rank: int, world: int, experts_per_rank: int):
        self.rank, self.world, self.experts_per_rank = rank, world, experts_per_rank
        self.active = np.ones(world, dtype=bool)
        self.version = 0
        self.why: dict[int, str] = {}
        #: removals come from waits of a call's worker threads too
        self._lock = threading.Lock()
        #: `[num_experts]` bool: expert hosted by an inactive rank (None while all active)
        self._expert_inactive: torch.Tensor | None = None
        #: whether some rank is inactive (an attribute: read on every call)
        self.any_inactive = False

    @property
    def inactive(self) -> list[int]:
        """The inactive ranks, ascending."""
        if not self.any_inactive:       # (read after every call of an elastic Buffer)
            return []
        return [int(r) for r in np.flatnonzero(~self.active)]

    def active_ranks(self) -> torch.Tensor:
        """`[world]` bool tensor, a copy (True = active)."""
        return torch.from_numpy(self.active.copy())

    def remove(self, ranks, why: str) -> list[int]:
        """Mark `ranks` inactive; returns those that were active until now."""
        with self._lock:
            new = [int(r) for r in ranks if self.active[int(r)]]
            if not new:
                return []
            for r in new:
                self.active[r] = False
                self.why[r] = why
            self._expert_inactive = torch.from_numpy(
                np.repeat(~self.active, self.experts_per_rank))
            self.any_inactive = True
            self.version += 1
            return new

    def removed_me(self) -> bool:
        return not self.active[self.rank]

    def slots_on_inactive(self, topk_idx: torch.Tensor, ranks=None) -> torch.Tensor | None:
        """`[T, K]` bool: slots of `topk_idx` routed to an inactive rank's experts (or to
        one of `ranks` if given); None when there are none (cheap to test)."""
        if ranks is not None:
            off = torch.zeros(self.world * self.experts_per_rank, dtype=torch.bool)
            for r in ranks:
                off[r * self.experts_per_rank:(r + 1) * self.experts_per_rank] = True
        else:
            off = self._expert_inactive
            if off is None:
                return None
        idx = topk_idx.to(torch.int64)
        hit = (idx >= 0) & off[idx.clamp(min=0)]
        return hit if bool(hit.any()) else None

    def mask(self, topk_idx: torch.Tensor, ranks=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(topk_idx with slots on inactive ranks set to -1, those slots [T, K] bool)`;
        `(topk_idx, None)` itself when no slot is routed to an inactive rank. The masked
        routing is a new contiguous int64 tensor (the caller's is never written)."""
        hit = self.slots_on_inactive(topk_idx, ranks)
        if hit is None:
            return topk_idx, None
        return topk_idx.to(torch.int64).masked_fill(hit, -1).contiguous(), hit


def check_drain_mask(mask, active: np.ndarray, rank: int) -> np.ndarray:
    """`set_active_ranks`'s `mask` as a numpy bool array, or a ValueError/TypeError naming
    the rule it breaks: a `[world]` bool tensor that only removes ranks (no inactive rank
    comes back) and keeps the calling rank active."""
    world = active.shape[0]
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor of dtype torch.bool and shape "
                        f"[{world}], got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool, got {mask.dtype}")
    if tuple(mask.shape) != (world,):
        raise ValueError(f"mask must have shape [{world}] (one entry per rank of the group), "
                         f"got {list(mask.shape)}")
    new = mask.detach().cpu().numpy().astype(bool)
    back = np.flatnonzero(new & ~active)
    if back.size:
        raise ValueError(f"mask may only remove ranks: rank(s) {back.tolist()} are inactive "
                         f"already and cannot become active again (make a new Buffer to grow)")
    if not new[rank]:
        raise ValueError(f"mask removes rank {rank}, the caller: set_active_ranks is called by "
                         f"the ranks that stay active (a removed rank only closes its Buffer)")
    return new


# -- results without some sources' rows, and what combine did not sum ----------------------------
def without_sources(res, ranks: list[int]):
    """`res` (a `DispatchResult`) without the rows from source `ranks`: an elastic Buffer's
    dispatch whose source died with some of its rows not arrived keeps none of them.

    The new result's rows are a copy (the kept ones, in order); its handle combines through
    the full one: combine puts the kept expert outputs back in their rows of the full layout
    (`expand`) and runs the full handle, whose dropped rows go back to their dead source."""
    from ubep.handle import DispatchResult, new_handle

    src = res.recv_src_rank
    keep = ~torch.isin(src, torch.tensor(ranks, dtype=src.dtype))
    where = torch.nonzero(keep).flatten()
    full = res.handle
    origins = np.stack([res.recv_src_rank.numpy()[where.numpy()],
                        res.recv_src_token.numpy()[where.numpy()],
                        res.recv_src_slot.numpy()[where.numpy()]]).astype(np.int64)
    tpe = res.tokens_per_expert.to(torch.int64)
    ends = torch.cumsum(tpe, 0)
    kept = torch.cumsum(keep.to(torch.int64), 0)
    at_end = torch.where(ends > 0, kept[(ends - 1).clamp(min=0)], torch.zeros_like(ends))
    new_tpe = torch.diff(at_end, prepend=torch.zeros(1, dtype=torch.int64))
    h = new_handle(full.buffer_id, full.call, full.num_tokens, int(where.numel()), full.hidden,
                   full.topk_idx, full.topk_weights, origins, full.state)
    h.__dict__["_full"] = (full, where)
    out = DispatchResult(
        recv_x=res.recv_x[where], recv_weights=res.recv_weights[where],
        tokens_per_expert=new_tpe, recv_src_rank=h.recv_src_rank,
        recv_src_token=h.recv_src_token, recv_src_slot=h.recv_src_slot, handle=h,
        stats=res.stats,
        recv_x_scales=None if res.recv_x_scales is None else res.recv_x_scales[where])
    return out


def expand(expert_out: torch.Tensor, handle) -> tuple[torch.Tensor, object]:
    """`(expert_out, handle)` of a handle `without_sources` made, in the full layout: its
    rows in their places of the full dispatch (the rest zeros, never read by a live rank)."""
    full, where = handle.__dict__["_full"]
    rows = expert_out.new_zeros(full.num_recv, expert_out.shape[1])
    rows[where] = expert_out
    return rows, full


def note_combine(handle, members: Membership, ranks) -> None:
    """After a combine of `handle` that did not sum the slots on `ranks` (inactive at its
    start, or dropped meanwhile): `handle.masked` says so."""
    hit = members.slots_on_inactive(handle.topk_idx, ranks) if ranks else None
    if hit is not None:
        handle.__dict__["masked"] = handle.masked | hit
