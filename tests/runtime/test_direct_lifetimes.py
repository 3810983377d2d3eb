"""direct=True and "owned": what the caller may do once combine returned (items the review found).

* combining the latest dispatch twice (weighted, then not) works as without direct;
* writing into `recv_x` or the combine buffer after combine returned cannot change a
  peer's result: combine returns only once every peer has read what it needed.
"""

from __future__ import annotations

import time

import pytest
import torch

from ubep import reference
from ubep.testing import expert_fn, make_tokens, run_ranks

E, H = 4, 24


def _inputs(rank):
    """Rank 0 routes only to its own experts (its combine needs nobody's outputs); rank 1
    routes to every expert, rank 0's included."""
    if rank == 0:
        idx = torch.tensor([[0, 1], [1, -1], [0, 1]])
    else:
        idx = torch.tensor([[0, 2], [1, 3], [3, 0], [2, -1]])
    w = torch.linspace(0.2, 0.9, idx.numel()).reshape(idx.shape)
    return make_tokens(rank, idx.shape[0], H, torch.float32, seed=rank + 1), idx, w


def _reference(weighted: bool):
    ins = [_inputs(r) for r in range(2)]
    ref = reference.dispatch([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E)
    return reference.combine([expert_fn(d.recv_x) for d in ref], ref, [i[1] for i in ins],
                             [i[2] for i in ins], weighted=weighted)


def _twice(rank, world, workers, direct):
    import ubep

    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=8, max_top_k=2,
                     backend="shm", direct=direct, workers=workers, timeout_s=10) as buf:
        res = buf.dispatch(*_inputs(rank))
        out = expert_fn(res.recv_x)
        y1 = buf.combine(out, res.handle, weighted=True)
        y2 = buf.combine(out, res.handle, weighted=False)       # the same handle again
        cb = buf.get_combine_buffer(res.handle)
        cb.copy_(out)
        y3 = buf.combine(cb, res.handle, weighted=True)          # and in place
        return y1, y2, y3


@pytest.mark.parametrize("direct", [True, "owned"])
@pytest.mark.parametrize("workers", [1, 2])
def test_combining_the_latest_dispatch_twice_works(workers, direct):
    out = run_ranks(_twice, 2, workers, direct, timeout_s=120)
    yw, yu = _reference(True), _reference(False)
    for r in range(2):
        y1, y2, y3 = out[r]
        assert torch.equal(y1, yw[r]) and torch.equal(y2, yu[r]) and torch.equal(y3, yw[r])


def _scribble_after_combine(rank, world, workers, where, direct):
    import ubep

    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=8, max_top_k=2,
                     backend="shm", direct=direct, workers=workers, timeout_s=10) as buf:
        res = buf.dispatch(*_inputs(rank))
        out = expert_fn(res.recv_x)
        if where == "combine_buffer":
            target = buf.get_combine_buffer(res.handle)
            target.copy_(out)
        else:                                  # combine recv_x in place
            res.recv_x.copy_(out)
            target = res.recv_x
        if rank == 1:
            time.sleep(0.5)                    # rank 0 is long done with its own tokens
        y = buf.combine(target, res.handle)
        if rank == 0:
            target.fill_(1e6)                  # the caller's memory again: reuse it
        return y


@pytest.mark.parametrize("direct", [True, "owned"])
@pytest.mark.parametrize("where", ["combine_buffer", "recv_x"])
@pytest.mark.parametrize("workers", [1, 2])
def test_writing_the_combined_rows_after_combine_returned_leaves_peers_correct(workers, where,
                                                                                direct):
    out = run_ranks(_scribble_after_combine, 2, workers, where, direct, timeout_s=120)
    ref = _reference(True)
    for r in range(2):
        assert torch.equal(out[r], ref[r]), f"rank {r}"
