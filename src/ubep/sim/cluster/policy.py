"""Which rows cross which link, per policy: the part of the cluster model that decides.

Three ways to move one MoE layer's rows between ranks grouped in hosts:

* "flat" (ubep's torch backend, `all_to_all_single`; DeepEP's layout): dispatch sends a
  token's row once to every rank holding one of its experts, with its routing words; ranks
  of the same host exchange over the host fabric, the others through the NICs. Each rank
  first sends every peer a count header. Combine sums a token's slots on each expert rank
  and sends one partial per (token, rank) back; the token's rank sums them.
* "hybrid" (ubep's hybrid backend; DeepEP's normal kernels): a token's row crosses the
  network at most once per other host holding one of its experts, with its routing for that
  host, to a relay rank there (DeepEP's choice: the rank with the sender's local index), which
  forwards it over the host fabric to that host's expert ranks. Same-host expert ranks get it
  directly. Count headers go to the relay of each other host. Combine: each expert rank sums
  its slots of a token and sends the partial to the relay, which sums the host's partials and
  sends one row per (token, host) back; the token's rank sums those.
* "per-expert" (DeepEP's low-latency kernels): one row per (token, expert), no
  deduplication and no count round (counts travel behind the rows); combine sends every
  expert's row back and the token's rank sums its top-k.

Everything here is counting: `[P, P]` matrices of rows from a source rank (row index) to a
destination rank (column), which the cost model (`ubep.sim.cluster.cost`) prices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ubep.plan.topology import Topology


@dataclass(frozen=True)
class Traffic:
    """The rows one operation moves under one policy, every rank at once.

    Attributes:
        policy, op: "flat" | "hybrid" | "per-expert"; "dispatch" | "combine".
        net: `[P, P]` int64, rows through the NICs from a rank to a rank of another host.
        direct: `[P, P]` int64, rows over the host fabric straight from source to
            destination (same host, different ranks).
        relay: `[P, P]` int64, hybrid: rows over the host fabric between a relay and an
            expert rank (dispatch: relay -> expert; combine: expert -> relay); zero else.
        local: `[P]` int64, rows a rank keeps (its own tokens for its own experts).
        relay_local: `[P]` int64, hybrid: rows a relay keeps for its own experts (tokens of
            other hosts); zero otherwise.
        slots_held: `[P]` int64, (token, expert) slots each rank holds after the dispatch.
        net_meta_rows: `[P, P]` int64, rows of `net` that carry routing words (dispatch).
        header_peers_net: `[P]` int64, network peers each rank sends a count header before
            the rows (dispatch; 0 for per-expert and for combine).
        reduce_first: `[P]` int64, rows a rank reads to sum before it sends (combine: an
            expert rank's slots of each token).
        reduce_relay: `[P]` int64, rows a relay reads to sum between the host fabric and the
            network (hybrid combine).
        reduce_last: `[P]` int64, rows a rank reads to sum after receiving (combine: the
            partials or expert rows of its own tokens).
        net_fanout: hybrid: host-fabric rows per network row at the relay (its forwarding or
            gathering fan-out, mean over relayed rows); 0 otherwise.
    """

    policy: str
    op: str
    net: np.ndarray
    direct: np.ndarray
    relay: np.ndarray
    local: np.ndarray
    relay_local: np.ndarray
    slots_held: np.ndarray
    net_meta_rows: np.ndarray
    header_peers_net: np.ndarray
    reduce_first: np.ndarray
    reduce_relay: np.ndarray
    reduce_last: np.ndarray
    net_fanout: float = 0.0

    @property
    def num_ranks(self) -> int:
        return int(self.net.shape[0])

    def net_rows_sent(self) -> np.ndarray:
        """`[P]` rows each rank puts on the network."""
        return self.net.sum(axis=1)

    def net_rows_received(self) -> np.ndarray:
        """`[P]` rows each rank takes from the network."""
        return self.net.sum(axis=0)

    def host_fabric_rows(self) -> np.ndarray:
        """`[P, P]` every row over the host fabric (direct and relayed)."""
        return self.direct + self.relay


def relay_rank(topology: Topology, src: int, host: int) -> int:
    """The rank of `host` that receives `src`'s rows (and returns their partials): the one
    with `src`'s index inside its own host, modulo the size of `host` (DeepEP's pairing of
    same-index GPUs across nodes, which spreads the rows of a host over all its NICs)."""
    mine = topology.hosts[topology.host_of(src)]
    theirs = topology.hosts[host]
    return theirs[mine.index(src) % len(theirs)]


def dispatch_traffic(topk: np.ndarray, topology: Topology, num_experts: int,
                     policy: str) -> Traffic:
    """What a dispatch moves under `policy`.

    Arguments:
        topk: `[P, T, K]` int64 expert ids of every rank's tokens; -1 = no expert.
        topology: the cluster (`topology.hosts`); expert e lives on rank e // (E / P).
        num_experts: E, a multiple of P.
        policy: "flat" | "hybrid" | "per-expert".
    """
    P = topology.num_ranks
    topk = np.asarray(topk)
    if topk.ndim != 3 or topk.shape[0] != P:
        raise ValueError(f"topk must be [num_ranks={P}, tokens, top_k], got {topk.shape}")
    if num_experts % P:
        raise ValueError(f"num_experts={num_experts} must be a multiple of {P} ranks")
    if policy not in ("flat", "hybrid", "per-expert"):
        raise ValueError(f"policy={policy!r} is not one of 'flat', 'hybrid', 'per-expert'")
    epr = num_experts // P
    host = topology.host_ids()
    same_host = host[:, None] == host[None, :]
    T = topk.shape[1]
    slots = np.zeros((P, P), dtype=np.int64)      # (token, expert) pairs src -> rank
    per_rank = np.zeros((P, P), dtype=np.int64)   # tokens src -> rank (deduplicated)
    net = np.zeros((P, P), dtype=np.int64)
    relay = np.zeros((P, P), dtype=np.int64)
    relay_local = np.zeros(P, dtype=np.int64)     # rows a relay keeps for its own experts
    zeros = np.zeros(P, dtype=np.int64)
    for s in range(P):
        t_idx, k_idx = np.nonzero(topk[s] >= 0)
        dest = topk[s][t_idx, k_idx] // epr
        slots[s] = np.bincount(dest, minlength=P)
        in_rank = np.zeros((T, P), dtype=bool)
        in_rank[t_idx, dest] = True                 # is_token_in_rank
        per_rank[s] = in_rank.sum(axis=0)
        if policy != "hybrid":
            continue
        for b in range(topology.num_hosts):
            if b == host[s]:
                continue
            members = list(topology.hosts[b])
            in_host = in_rank[:, members].any(axis=1)
            q = relay_rank(topology, s, b)
            net[s, q] = int(in_host.sum())
            rows = in_rank[:, members].sum(axis=0)  # tokens of s each member must get
            for d, n in zip(members, rows.tolist()):
                if d == q:
                    relay_local[q] += n
                else:
                    relay[q, d] += n
    remote = ~same_host
    if policy == "flat":
        net = np.where(remote, per_rank, 0)
        direct = np.where(same_host, per_rank, 0)
        headers = (remote.sum(axis=1)).astype(np.int64)
    elif policy == "per-expert":
        net = np.where(remote, slots, 0)
        direct = np.where(same_host, slots, 0)
        headers = zeros
    else:
        direct = np.where(same_host, per_rank, 0)
        headers = (net > 0).sum(axis=1).astype(np.int64)
    np.fill_diagonal(direct, 0)
    local = np.diagonal(per_rank if policy != "per-expert" else slots).copy()
    fan = float((relay.sum() + relay_local.sum()) / net.sum()) if policy == "hybrid" and \
        net.sum() else 0.0
    return Traffic(policy=policy, op="dispatch", net=net, direct=direct, relay=relay,
                   local=local, relay_local=relay_local, slots_held=slots.sum(axis=0),
                   net_meta_rows=net.copy(), header_peers_net=headers, reduce_first=zeros,
                   reduce_relay=zeros, reduce_last=zeros, net_fanout=fan)


def combine_traffic(dispatch: Traffic) -> Traffic:
    """What the combine that reverses `dispatch` moves: every row back the way it came
    (the matrices transposed), summed where the policy sums: flat and hybrid sum each
    token's slots on the expert rank first (per-expert sends them unsummed)."""
    zeros = np.zeros(dispatch.num_ranks, dtype=np.int64)
    first = zeros if dispatch.policy == "per-expert" else dispatch.slots_held
    # a token's rank reads one row back for every row it sent out, and its own
    last = dispatch.net.sum(axis=1) + dispatch.direct.sum(axis=1) + dispatch.local
    # a relay reads its host's partials of every relayed token: over the host fabric and its
    # own
    relay_sum = dispatch.relay.sum(axis=1) + dispatch.relay_local
    return replace(dispatch, op="combine", net=dispatch.net.T.copy(),
                   direct=dispatch.direct.T.copy(), relay=dispatch.relay.T.copy(),
                   net_meta_rows=np.zeros_like(dispatch.net), header_peers_net=zeros,
                   reduce_first=first, reduce_relay=relay_sum, reduce_last=last)
