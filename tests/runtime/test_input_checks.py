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
        with torch.no_grad():          # the data path (with grad, ubep.ops takes the call)
            res = buf.dispatch(x, idx, w)
            out = expert_fn(res.recv_x).requires_grad_()
            y = buf.combine(out, res.handle)
        return {"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
                "tokens_per_expert": res.tokens_per_expert, "recv_src_rank": res.recv_src_rank,
                "recv_src_token": res.recv_src_token, "recv_src_slot": res.recv_src_slot,
                "y": y.detach()}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_tensors_that_require_grad_are_moved_as_data_under_no_grad_on_every_path(path):
    # with grad enabled the call goes through ubep.ops (autograd); under no_grad the rows and
    # weights are data: every path reads them (workers=2 and direct raised numpy's error)
    check_case(CASE, run_ranks(_grad_inputs, 2, PATHS[path], timeout_s=120),
               contract="torch" if path == "torch" else "oracle")


def test_a_timeout_names_only_other_ranks_as_peers():
    from ubep.errors import PeerTimeoutError

    e = PeerTimeoutError(0, "dispatch/rows", [0, 1], 2.0)
    assert e.peers == [1] and "rank(s) [1]" in str(e) and "own workers" in str(e)
    own = PeerTimeoutError(1, "dispatch/barrier", [1], 2.0)
    assert own.peers == [] and "[1]" not in str(own) and "own workers" in str(own)
    plain = PeerTimeoutError(1, "combine/rows", [0, 2], 2.0, "detail")
    assert plain.peers == [0, 2] and "own workers" not in str(plain)
    assert str(plain).endswith(": detail")


@pytest.mark.parametrize("what,verb", [("dispatch", "dispatches"), ("combine", "combines")])
def test_a_dtype_mismatch_says_what_the_rank_does(what, verb):
    import numpy as np

    from ubep.runtime.shm.protocol import ShmProtocolError, check_peers_meta

    meta = np.array([[1, 0, 0], [1, 2, 0]], np.int64)       # rank 1 uses another dtype
    with pytest.raises(ShmProtocolError) as e:
        check_peers_meta(meta, 0, 0, what)
    assert f"rank 0 {verb} " in str(e.value) and "same dtype" in str(e.value)


ODD = Case(num_experts=4, hidden=1, top_k=2, tokens=(5, 0), dtype="fp32")


def _odd_strides(rank, world, kw):
    import torch

    import ubep

    with ubep.Buffer(num_experts=4, hidden=1, max_tokens_per_rank=8, timeout_s=10.0,
                     **kw) as buf:
        x, idx, w = ODD.inputs(rank)
        # "contiguous" to torch, but no unit element stride: a [T, 1] transpose, an empty
        # product; neither can be viewed as bytes as it is
        x = x.reshape(1, -1).t() if x.numel() else torch.randn(0, 1) * 4
        assert x.is_contiguous() and x.stride(-1) != 1
        res = buf.dispatch(x, idx, w)
        out = expert_fn(res.recv_x)
        out = out.reshape(1, -1).t() if out.numel() else torch.randn(0, 1) * 4
        y = buf.combine(out.to(expert_fn(res.recv_x).dtype), res.handle)
        return {"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
                "tokens_per_expert": res.tokens_per_expert, "recv_src_rank": res.recv_src_rank,
                "recv_src_token": res.recv_src_token, "recv_src_slot": res.recv_src_slot,
                "y": y}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_rows_torch_calls_contiguous_without_unit_stride_are_moved_on_every_path(path):
    # found by `ubep soak`: the torch backend raised on an empty [0, 1] x of strides (1, 0)
    check_case(ODD, run_ranks(_odd_strides, 2, PATHS[path], timeout_s=120),
               contract="torch" if path == "torch" else "oracle")
