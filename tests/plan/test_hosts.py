"""`ubep.plan.hosts`: the hybrid backend's pure layout, against brute force."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.plan.hosts import HostLayout, merge_order, rows_to_other_hosts, split_routing


@st.composite
def layouts(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    world = sum(sizes)
    perm = draw(st.permutations(range(world)))
    hosts, at = [], 0
    for n in sizes:
        hosts.append(perm[at:at + n])
        at += n
    epr = draw(st.integers(1, 3))
    return HostLayout.of(hosts, world * epr)


@st.composite
def routings(draw, layout):
    t = draw(st.integers(0, 6))
    k = draw(st.integers(1, 4))
    e = layout.num_experts
    rows = [draw(st.lists(st.integers(-1, e - 1), min_size=k, max_size=k)) for _ in range(t)]
    idx = np.full((t, k), -1, np.int64)
    for i, row in enumerate(rows):
        seen = set()
        for j, x in enumerate(row):
            if x >= 0 and x not in seen:
                idx[i, j] = x
                seen.add(x)
    return idx


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pairing_covers_every_remote_source_once(data):
    """Every rank sends to exactly one entry on each other host; each entry's sources are
    the ranks whose entry it is, and all of a host's entries together hear every remote
    rank once."""
    lay = data.draw(layouts())
    for h, ranks in enumerate(lay.hosts):
        heard = sorted(s for r in ranks for s in lay.sources(r))
        assert heard == sorted(r for r in range(lay.world) if r not in ranks)
        for s in range(lay.world):
            e = lay.entry[s, h]
            assert (e == -1) == (s in ranks)
            assert e == -1 or e in ranks


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_split_routing_restricts_each_token_to_each_host(data):
    lay = data.draw(layouts())
    rank = data.draw(st.integers(0, lay.world - 1))
    idx = data.draw(routings(lay))
    sp = split_routing(lay, rank, idx)
    me = lay.host_of_rank[rank]
    epr = lay.experts_per_rank
    for t, row in enumerate(idx):
        for k, e in enumerate(row):
            h = -1 if e < 0 else lay.host_of_rank[e // epr]
            want = lay.local_index[e // epr] * epr + e % epr if e >= 0 else -1
            assert sp.local_idx[t, k] == (want if h == me else -1)
            for hh in range(lay.num_hosts):
                if hh == me:
                    continue
                toks = list(sp.tokens[hh])
                if t in toks:
                    got = sp.remote_idx[hh][toks.index(t), k]
                    assert got == (want if h == hh else -1)
                else:
                    assert h != hh
    # one row per (token, other host) on the network
    rows = sum(len(sp.tokens[h]) for h in range(lay.num_hosts) if h != me)
    assert rows == rows_to_other_hosts(lay, rank, idx)
    brute = sum(len({lay.host_of_rank[e // epr] for e in r if e >= 0} - {me}) for r in idx)
    assert rows == brute
    brute_rank = sum(len({e // epr for e in r if e >= 0 and lay.host_of_rank[e // epr] != me})
                     for r in idx)
    assert rows_to_other_hosts(lay, rank, idx, per="rank") == brute_rank


def test_merge_order_sorts_by_key():
    a, b = np.array([5, 1, 9]), np.array([3, 7])
    pos = merge_order(a, b)
    out = np.empty(5, np.int64)
    out[pos] = np.concatenate([a, b])
    assert out.tolist() == [1, 3, 5, 7, 9]
    c = np.array([0, 8])                # a third exchange (a chunk of forwarded rows)
    pos = merge_order(a, b, c)
    out = np.empty(7, np.int64)
    out[pos] = np.concatenate([a, b, c])
    assert out.tolist() == [0, 1, 3, 5, 7, 8, 9]


@pytest.mark.parametrize("hosts, experts, rule", [
    ([[0, 1], [1, 2]], 6, "exactly once"), ([[0], []], 2, "non-empty"),
    ([[0, 1]], 3, "divisible")])
def test_bad_layouts_name_the_rule(hosts, experts, rule):
    with pytest.raises(ValueError, match=rule):
        HostLayout.of(hosts, experts)
