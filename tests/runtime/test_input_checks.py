"""Input rules that hold on every path (one-worker, pool, direct, torch)."""

from __future__ import annotations

import pytest

from ubep.testing import Case, check_case, expert_fn, run_ranks

PATHS = {"one-worker": dict(backend="shm", workers=1), "pool": dict(backend="shm", workers=2),
         "direct": dict(backend="shm", workers=2, direct=True), "torch": dict(backend="torch")}
CASE = Case(num_experts=4, hidden=16, top_k=2, tokens=(5, 3), dtype="fp32", routing="partial")


def _grad_inputs(rank, world, kw):
    import torch

    import ubep

    with ubep.Buffer(num_experts=4, hidden=16, max_tokens_per_rank=8, timeout_s=10.0,
                     **kw) as buf:
        x, idx, w = CASE.inputs(rank)
        x, w = x.requires_grad_(), w.requires_grad_()
        if kw.get("direct"):
            # direct=True cannot carry gradients (recv_x is a view the next dispatch
            # overwrites): a named error before any communication, then usable as data
            with pytest.raises(ValueError, match="direct=True"):
                buf.dispatch(x, idx, w)
            with torch.no_grad():
                res = buf.dispatch(x, idx, w)
                out = expert_fn(res.recv_x)
                y = buf.combine(out, res.handle)
            return {"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
                    "tokens_per_expert": res.tokens_per_expert,
                    "recv_src_rank": res.recv_src_rank, "recv_src_token": res.recv_src_token,
                    "recv_src_slot": res.recv_src_slot, "y": y}
        res = buf.dispatch(x, idx, w)
        out = expert_fn(res.recv_x).requires_grad_()
        y = buf.combine(out, res.handle)
        return {"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
                "tokens_per_expert": res.tokens_per_expert, "recv_src_rank": res.recv_src_rank,
                "recv_src_token": res.recv_src_token, "recv_src_slot": res.recv_src_slot,
                "y": y.detach()}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_tensors_that_require_grad_are_moved_as_data_on_every_path(path):
    check_case(CASE, run_ranks(_grad_inputs, 2, PATHS[path], timeout_s=120))
