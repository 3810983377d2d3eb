"""The direct path's placement (`direct.kernels.place_rows`) against the oracle, in one process.

From the all-ranks count matrix every sender computes where each of its rows lands in its
destination's expert-major output; that must be exactly the row the reference puts it in,
and the receiver's N, tokens per expert and source ranks must match the reference too.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep import reference
from ubep.runtime.shm.direct.kernels import place_rows
from ubep.testing import ROUTINGS, make_routing


@settings(max_examples=150, deadline=None)
@given(world=st.integers(1, 4), per_rank=st.integers(1, 4), top_k=st.integers(1, 4),
       tokens=st.lists(st.integers(0, 7), min_size=4, max_size=4),
       routing=st.sampled_from(ROUTINGS), seed=st.integers(0, 10_000))
def test_place_rows_puts_every_row_where_the_reference_does(world, per_rank, top_k, tokens,
                                                          routing, seed):
    experts = world * per_rank
    top_k = min(top_k, experts)
    idxs, ws, xs = [], [], []
    for r in range(world):
        idx, w = make_routing(tokens[r], top_k, experts, kind=routing, seed=seed * 10 + r)
        idxs.append(idx)
        ws.append(w)
        xs.append(torch.zeros(tokens[r], 1))
    ref = reference.dispatch(xs, idxs, ws, experts)
    counts = np.zeros((world, experts), np.int64)
    for r, idx in enumerate(idxs):
        routed = idx[idx >= 0].numpy()
        counts[r] = np.bincount(routed, minlength=experts)
    landed = {}
    for dest in range(world):
        d = ref[dest]
        for row, key in enumerate(zip(d.recv_src_rank.tolist(), d.recv_src_token.tolist(),
                                      d.recv_src_slot.tolist())):
            landed[key] = (dest, row)
    for s in range(world):
        idx = idxs[s].numpy()
        pos = np.empty(idx.shape, np.int64)
        tpe = np.empty(per_rank, np.int64)
        src_rank = np.full(world * 7 * top_k + 1, -1, np.int64)
        n = place_rows(counts, s, per_rank, idx, pos, tpe, src_rank)
        assert n == ref[s].recv_x.shape[0]
        assert tpe.tolist() == ref[s].tokens_per_expert.tolist()
        assert src_rank[:n].tolist() == ref[s].recv_src_rank.tolist()
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e < 0:
                    assert pos[t, k] == -1
                else:
                    assert landed[(s, t, k)] == (e // per_rank, int(pos[t, k]))
