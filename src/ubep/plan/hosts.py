"""Where a token goes when the ranks span several hosts: the hybrid backend's pure layout.

Ranks are grouped by shared-memory domain ("hosts"). A token crosses the network at most
once per other host that holds one of its experts, to that host's *entry* rank for the
token's source, carrying its routing restricted to that host; the entry forwards it to the
expert ranks through shared memory (as DeepEP's internode kernels send a token once per
node over RDMA and forward it over NVLink). This module computes, from the routing alone,
who sends what to whom and in which order, with no I/O: `runtime.hybrid` executes it.

Entries: the remote sources of host h (every rank not on h) are dealt to h's ranks by their
own index inside their host (`local_index % len(h)`), so with equal hosts rank i of every
host talks to rank i of every other host, DeepEP's pairing, and uneven hosts spread the
sources as evenly as the counts allow.

Forwarded tokens are numbered on their entry by *virtual token*: the sources of an entry in
rank order, each owning a run of as many virtual tokens as it has tokens (`vtoken_offsets`),
so virtual token `offset[s] + t` is token t of source s. Every rank of the host can decode a
forwarded row's origin from (entry, virtual token) once it knows every rank's token count,
which the count exchange carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class HostLayout:
    """Hosts of a group and the fixed entry pairing between them.

    Attributes:
        hosts: the group ranks of each host, ascending; hosts ordered by their first rank.
        num_experts: global expert count E; rank r owns experts `[r*E/W, (r+1)*E/W)`.
    """

    hosts: tuple[tuple[int, ...], ...]
    num_experts: int

    def __post_init__(self) -> None:
        ranks = sorted(r for h in self.hosts for r in h)
        if not self.hosts or any(not h for h in self.hosts):
            raise ValueError(f"hosts={self.hosts!r} must be non-empty groups of ranks")
        if ranks != list(range(len(ranks))):
            raise ValueError(f"hosts={self.hosts!r} must hold every rank 0..W-1 exactly once")
        if self.num_experts % len(ranks):
            raise ValueError(f"num_experts={self.num_experts} must be divisible by the "
                             f"{len(ranks)} ranks")

    @classmethod
    def of(cls, hosts: Sequence[Sequence[int]], num_experts: int) -> HostLayout:
        """The layout of `hosts` (any order): each sorted, hosts ordered by first rank."""
        norm = tuple(sorted(tuple(sorted(int(r) for r in h)) for h in hosts))
        return cls(norm, int(num_experts))

    @property
    def world(self) -> int:
        return sum(len(h) for h in self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world

    @cached_property
    def host_of_rank(self) -> np.ndarray:
        """`[W]` int64: the host of each rank."""
        out = np.empty(self.world, np.int64)
        for h, ranks in enumerate(self.hosts):
            out[list(ranks)] = h
        return out

    @cached_property
    def local_index(self) -> np.ndarray:
        """`[W]` int64: each rank's index among its host's ranks (its shm rank there)."""
        out = np.empty(self.world, np.int64)
        for ranks in self.hosts:
            out[list(ranks)] = np.arange(len(ranks))
        return out

    @cached_property
    def entry(self) -> np.ndarray:
        """`[W, H]` int64: `entry[s, h]`, the rank of host h that receives source s's tokens
        for h; -1 where s is on h itself."""
        out = np.full((self.world, self.num_hosts), -1, np.int64)
        for h, ranks in enumerate(self.hosts):
            for s in range(self.world):
                if self.host_of_rank[s] != h:
                    out[s, h] = ranks[self.local_index[s] % len(ranks)]
        return out

    def sources(self, rank: int) -> tuple[int, ...]:
        """The remote ranks whose tokens `rank` receives as their entry, ascending."""
        h = int(self.host_of_rank[rank])
        return tuple(int(s) for s in np.flatnonzero(self.entry[:, h] == rank))

    @cached_property
    def host_expert(self) -> np.ndarray:
        """`[E]` int64: each expert's id among its host's experts (the host's shm numbering:
        local rank i owns host experts `[i*E/W, (i+1)*E/W)`)."""
        e = np.arange(self.num_experts)
        epr = self.experts_per_rank
        return self.local_index[e // epr] * epr + e % epr

    @cached_property
    def expert_host(self) -> np.ndarray:
        """`[E]` int64: the host of each expert."""
        return self.host_of_rank[np.arange(self.num_experts) // self.experts_per_rank]

    def host_experts(self, h: int) -> int:
        """Experts held by host h (its shm group's num_experts)."""
        return len(self.hosts[h]) * self.experts_per_rank

    def max_virtual_tokens_on(self, h: int, max_tokens_per_rank: int) -> int:
        """The most tokens a forwarded dispatch on host h can carry: the largest number of
        sources of one of its ranks, times `max_tokens_per_rank`."""
        most = max(len(self.sources(r)) for r in self.hosts[h])
        return max(most, 1) * max_tokens_per_rank

    def vtoken_offsets(self, rank: int, num_tokens: np.ndarray) -> dict[int, int]:
        """First virtual token of each source of entry `rank`, from every rank's token
        count `num_tokens` `[W]`."""
        out, at = {}, 0
        for s in self.sources(rank):
            out[s] = at
            at += int(num_tokens[s])
        return out


@dataclass(frozen=True)
class RoutingSplit:
    """One rank's routing split by host (`split_routing`).

    Attributes:
        local_idx: `[T, K]` int64, the slots on this rank's host as host expert ids, -1 else.
        tokens: per host, `[n_h]` int64 ascending: the tokens with a slot there (empty for
            this rank's own host: those go by `local_idx`).
        remote_idx: per host, `[n_h, K]` int64: those tokens' slots there as host expert
            ids of that host, -1 else (the routing restricted to that host).
    """

    local_idx: np.ndarray
    tokens: tuple[np.ndarray, ...]
    remote_idx: tuple[np.ndarray, ...]


def split_routing(layout: HostLayout, rank: int, topk_idx: np.ndarray) -> RoutingSplit:
    """Split `topk_idx` `[T, K]` (global expert ids, -1 = not routed) of `rank` by host."""
    idx = np.asarray(topk_idx, dtype=np.int64)
    routed = idx >= 0
    safe = np.where(routed, idx, 0)
    host = np.where(routed, layout.expert_host[safe], -1)
    hexp = layout.host_expert[safe]
    me = int(layout.host_of_rank[rank])
    tokens, remote = [], []
    for h in range(layout.num_hosts):
        on_h = host == h
        if h == me:
            local_idx = np.where(on_h, hexp, -1)
            tokens.append(np.zeros(0, np.int64))
            remote.append(np.zeros((0, idx.shape[1]), np.int64))
            continue
        sel = np.flatnonzero(on_h.any(axis=1))
        tokens.append(sel)
        remote.append(np.where(on_h[sel], hexp[sel], -1))
    return RoutingSplit(local_idx, tuple(tokens), tuple(remote))


def rows_to_other_hosts(layout: HostLayout, rank: int, topk_idx: np.ndarray, *,
                        per: str = "host") -> int:
    """Rows `rank`'s routing `topk_idx` `[T, K]` puts on the network: one per (token, other
    host holding one of its experts) (`per="host"`, the hybrid exchange), or one per (token,
    rank on another host holding one of its experts) (`per="rank"`, a flat exchange)."""
    if per not in ("host", "rank"):
        raise ValueError(f"per={per!r} is not one of 'host', 'rank'")
    idx = np.asarray(topk_idx, dtype=np.int64)
    ranks = np.where(idx >= 0, idx // layout.experts_per_rank, -1)
    where = layout.host_of_rank[np.maximum(ranks, 0)]
    far = (ranks >= 0) & (where != layout.host_of_rank[rank])
    dest = np.where(far, ranks if per == "rank" else where, -1)
    dest.sort(axis=1)
    distinct = (dest[:, 1:] != dest[:, :-1]) & (dest[:, 1:] >= 0)
    return int(distinct.sum() + (dest[:, :1] >= 0).sum())


def merge_order(*keys: np.ndarray) -> np.ndarray:
    """Where each received row goes in the final expert-major layout.

    `keys`: one `[n_i]` int64 array of sort keys (expert, source rank, token) per exchange
    (the local one, then the forwarded ones), each in its own arrival order. Returns
    `[sum n_i]` int64: the final position of row i of their concatenation.
    """
    cat = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    order = np.argsort(cat, kind="stable")
    pos = np.empty_like(order)
    pos[order] = np.arange(len(order))
    return pos
