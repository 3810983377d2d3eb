"""`Buffer.combine(..., out=)`: y written into the caller's tensor, checked against the oracle."""

import pytest
import torch

import ubep
from ubep.testing import Case, check_case, expert_fn, run_ranks

_CASES = [
    Case(8, 16, 2, (5, 7), "uniform", "fp32", seed=11),
    Case(8, 16, 4, (6, 0), "skewed", "bf16", seed=12),          # a rank with no tokens
    Case(8, 16, 3, (4, 5), "unrouted", "fp32", seed=13),         # zeros for unrouted tokens
    Case(8, 16, 2, (5, 3), "uniform", "fp16", seed=14, weighted=False),
]


def _for_oracle(res, y: torch.Tensor) -> dict:
    """What `check_case` compares of one rank's dispatch result and combine output."""
    return {"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
            "tokens_per_expert": res.tokens_per_expert, "recv_src_rank": res.recv_src_rank,
            "recv_src_token": res.recv_src_token, "recv_src_slot": res.recv_src_slot,
            "y": y.clone()}


def _combine_into_out(rank, world, backend, cases):
    outs = []
    for case in cases:
        with ubep.Buffer(num_experts=case.num_experts, hidden=case.hidden,
                         max_tokens_per_rank=max(case.tokens), backend=backend) as buf:
            x, idx, w = case.inputs(rank)
            res = buf.dispatch(x, idx, w)
            # a strided view of a larger tensor, filled with a sentinel, as a framework's
            # preallocated output may be: only the view must change
            T = case.tokens[rank]
            store = torch.full((T, 2 * case.hidden), 7.0, dtype=case.torch_dtype())
            out = store[:, ::2]
            got = buf.combine(expert_fn(res.recv_x), res.handle, weighted=case.weighted, out=out)
            if got is not out:
                raise AssertionError("combine(out=) must return out itself")
            if not torch.all(store[:, 1::2] == 7.0):
                raise AssertionError("combine(out=) wrote outside out")
            outs.append(_for_oracle(res, out))
    return outs


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_combine_out_matches_reference(backend):
    per_rank = run_ranks(_combine_into_out, 2, backend, _CASES, timeout_s=180)
    for i, case in enumerate(_CASES):
        check_case(case, [per_rank[r][i] for r in range(2)])


def _combine_into_contiguous_out(rank, world, kw, cases):
    """A row-major `out` (what vLLM passes): the one-worker path sums straight into it."""
    outs = []
    for case in cases:
        with ubep.Buffer(num_experts=case.num_experts, hidden=case.hidden,
                         max_tokens_per_rank=max(case.tokens), backend="shm", **kw) as buf:
            x, idx, w = case.inputs(rank)
            res = buf.dispatch(x, idx, w)
            out = torch.full((case.tokens[rank], case.hidden), 7.0, dtype=case.torch_dtype())
            got = buf.combine(expert_fn(res.recv_x), res.handle, weighted=case.weighted, out=out)
            if got is not out:
                raise AssertionError("combine(out=) must return out itself")
            outs.append(_for_oracle(res, out))
    return outs


@pytest.mark.parametrize("kw", [dict(workers=1), dict(workers=2), dict(direct=True),
                                dict(direct="owned")],
                         ids=["one-worker", "pool", "direct", "owned"])
def test_contiguous_out_on_every_shm_path(kw):
    per_rank = run_ranks(_combine_into_contiguous_out, 2, kw, _CASES, timeout_s=180)
    for i, case in enumerate(_CASES):
        check_case(case, [per_rank[r][i] for r in range(2)])


@pytest.fixture()
def buf(single_rank_group):
    with ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=4) as b:
        yield b


@pytest.mark.parametrize("bad, exc, match", [
    (torch.zeros(3, 8), ValueError, r"out has shape \(3, 8\).*must be \(4, 8\)"),
    (torch.zeros(4, 8, dtype=torch.float64), TypeError, "out must be torch.float32"),
    (torch.zeros(4, 8, device="meta"), ValueError, "out is on meta"),
    (torch.zeros(32), ValueError, "out must be 2-D"),
    ([[0.0] * 8] * 4, TypeError, "out must be a torch.Tensor"),
])
def test_combine_out_rejects_bad_out_and_stays_usable(buf, bad, exc, match):
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, 1], [2, -1], [3, 0], [-1, -1]])
    res = buf.dispatch(x, idx, torch.rand(4, 2))
    with pytest.raises(exc, match=match):
        buf.combine(res.recv_x, res.handle, out=bad)
    out = torch.empty(4, 8)
    y = buf.combine(res.recv_x, res.handle, out=out)   # the same handle still combines
    assert y is out and torch.equal(out, buf.combine(res.recv_x, res.handle))


def _combine_into_expert_out(rank, world, kw, cases):
    """`out` on the memory of `expert_out` itself (one workspace for both, as vLLM's modular
    kernel can hand them): y must still be the sum of the rows as they were."""
    outs = []
    for case in cases:
        with ubep.Buffer(num_experts=case.num_experts, hidden=case.hidden,
                         max_tokens_per_rank=max(case.tokens), **kw) as buf:
            x, idx, w = case.inputs(rank)
            res = buf.dispatch(x, idx, w)
            rows = expert_fn(res.recv_x)
            T, N = case.tokens[rank], rows.shape[0]
            work = torch.empty(max(T, N), case.hidden, dtype=rows.dtype)
            work[:N] = rows
            out = work[:T]
            got = buf.combine(work[:N], res.handle, weighted=case.weighted, out=out)
            if got is not out:
                raise AssertionError("combine(out=) must return out itself")
            outs.append(_for_oracle(res, out))
    return outs


@pytest.mark.parametrize("kw", [dict(backend="torch"), dict(backend="shm", workers=1),
                                dict(backend="shm", workers=2),
                                dict(backend="shm", direct=True),
                                dict(backend="shm", direct="owned"),
                                dict(backend="shm", direct="owned", workers=2)],
                         ids=["torch", "shm-1", "shm-2", "shm-direct", "shm-owned",
                              "shm-owned-2"])
def test_out_sharing_memory_with_expert_out(kw):
    per_rank = run_ranks(_combine_into_expert_out, 2, kw, _CASES, timeout_s=180)
    for i, case in enumerate(_CASES):
        check_case(case, [per_rank[r][i] for r in range(2)])
