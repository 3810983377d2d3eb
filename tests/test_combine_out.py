"""`Buffer.combine(..., out=)`: y written into the caller's tensor, checked against the oracle."""

import os
import time

import pytest
import torch

import ubep
from ubep.native import load_native
from ubep.testing import Case, Counted, check_case, expert_fn, run_ranks

_CASES = [
    Case(8, 16, 2, (5, 7), "uniform", "fp32", seed=11),
    Case(8, 16, 4, (6, 0), "skewed", "bf16", seed=12),          # a rank with no tokens
    Case(8, 16, 3, (4, 5), "unrouted", "fp32", seed=13),         # zeros for unrouted tokens
    Case(8, 16, 2, (5, 3), "uniform", "fp16", seed=14, weighted=False),
]


def _contract(backend: str) -> str:
    """The combine contract `check_case` holds a backend to (the torch backend sums per rank
    first)."""
    return "torch" if backend == "torch" else "oracle"


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
        check_case(case, [per_rank[r][i] for r in range(2)], contract=_contract(backend))


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
        check_case(case, [per_rank[r][i] for r in range(2)], contract=_contract(kw["backend"]))


def _door_out(rank, world, kw, cases):
    """One Buffer, every case twice: first without `out` (a dtype's first calls make the
    door's words), then into a row-major `out` (what vLLM's finalize passes: the compiled
    door takes it), into an `out` on the rows' own memory and into a strided one (both
    declined: the Python path). On the shm path rank 1 comes late to the first case's
    `out` combine, so rank 0's door hands a wait on to Python, `out` with it."""
    res_out, counts = [], []
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=max(max(c.tokens) for c in cases), timeout_s=30,
                     **kw) as buf:
        assert buf._door is not None
        for case in cases:
            x, idx, w = case.inputs(rank)
            res = buf.dispatch(x, idx, w)
            buf.combine(expert_fn(res.recv_x), res.handle, weighted=case.weighted)
        c = buf._door_combine = Counted(buf._door_combine)
        path = getattr(buf._backend, "_path", None)
        if path is not None:        # shm: count the waits the door hands on
            path.combine_resume = resumed = Counted(path.combine_resume)
        for i, case in enumerate(cases):
            x, idx, w = case.inputs(rank)
            res = buf.dispatch(x, idx, w)
            rows = expert_fn(res.recv_x)
            T, N = case.tokens[rank], rows.shape[0]
            if i == 0 and rank == 1 and kw.get("backend") == "shm":
                time.sleep(0.05)
            before = c.took, c.declined
            out = torch.full((T, case.hidden), 7.0, dtype=rows.dtype)
            got = buf.combine(rows, res.handle, weighted=case.weighted, out=out)
            took = (c.took - before[0], c.declined - before[1])
            if got is not out:
                raise AssertionError("combine(out=) must return out itself")
            stats = buf.last_stats
            res_out.append(_for_oracle(res, out))
            # `out` on the rows' memory, then a strided `out`: declined, same sums
            work = torch.empty(max(T, N), case.hidden, dtype=rows.dtype)
            work[:N] = rows
            before = c.took, c.declined
            on_rows = buf.combine(work[:N], res.handle, weighted=case.weighted, out=work[:T])
            store = torch.full((T, 2 * case.hidden), 7.0, dtype=rows.dtype)
            strided = buf.combine(rows, res.handle, weighted=case.weighted, out=store[:, ::2])
            declined = (c.took - before[0], c.declined - before[1])
            same = (torch.equal(on_rows, out) and torch.equal(strided, out)
                    and bool(torch.all(store[:, 1::2] == 7.0)))
            counts.append((case.dtype, took, declined, same, stats.op, N, T))
    return res_out, counts, resumed.took if path is not None else None


@pytest.mark.skipif(load_native() is None and not os.environ.get("UBEP_REQUIRE_NATIVE"),
                    reason="ubep.native not built (python -m ubep.native build)")
@pytest.mark.parametrize("kw", [dict(backend="torch"), dict(backend="shm", direct=True),
                                dict(backend="shm", direct="owned")],
                         ids=["torch", "shm-direct", "shm-owned"])
def test_the_compiled_door_combines_into_a_contiguous_out(kw):
    per_rank = run_ranks(_door_out, 2, kw, _CASES, timeout_s=180)
    for i, case in enumerate(_CASES):
        check_case(case, [per_rank[r][0][i] for r in range(2)],
                   contract=_contract(kw["backend"]))
    if kw["backend"] == "shm":      # rank 0 waited for rank 1 in Python, `out` handed on
        assert per_rank[0][2] >= 1
    for _, counts, _ in per_rank:
        for dtype, took, declined, same, op, n, t in counts:
            # rows (bf16, fp16, fp32) into a contiguous out: the door; an out on the rows'
            # memory or strided: the Python path (unless one side is empty)
            assert took == (1, 0), (dtype, took)
            empty = (n == 0 or t == 0) + (t == 0)
            assert declined == (empty, 2 - empty), (dtype, declined, n, t)
            assert same and op == "combine", (dtype, same, op)


def _out_in_combine_buffer(rank, world, kw, case):
    """`out` in the Buffer's own combine buffer while expert_out is another tensor: combine
    puts the rows peers read there, so summing into it would hand peers its sums. Refused on
    every rank (ValueError, before anything moved), then the same handle combines."""
    with ubep.Buffer(num_experts=case.num_experts, hidden=case.hidden,
                     max_tokens_per_rank=max(case.tokens), backend="shm", timeout_s=30,
                     **kw) as buf:
        x, idx, w = case.inputs(rank)
        for _ in range(2):                      # the second call's door is warm
            res = buf.dispatch(x, idx, w)
            rows = expert_fn(res.recv_x).clone()
            T = case.tokens[rank]
            cb = buf.get_combine_buffer(res.handle)
            assert cb.shape[0] >= T
            with pytest.raises(ValueError, match="out lies in this Buffer's combine buffer"):
                buf.combine(rows, res.handle, weighted=case.weighted, out=cb[:T])
            out = torch.empty(T, case.hidden, dtype=rows.dtype)
            y = buf.combine(rows, res.handle, weighted=case.weighted, out=out)
        return _for_oracle(res, y)


@pytest.mark.parametrize("kw", [dict(direct=True), dict(direct="owned"),
                                dict(direct="owned", workers=2)],
                         ids=["direct", "owned", "owned-2"])
def test_out_in_the_combine_buffer_is_refused_and_the_buffer_stays_usable(kw):
    case = Case(8, 16, 2, (6, 6), "uniform", "fp32", seed=21)
    check_case(case, run_ranks(_out_in_combine_buffer, 2, kw, case, timeout_s=120))
