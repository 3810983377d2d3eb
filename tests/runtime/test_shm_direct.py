"""The direct (one-copy) variant, `Buffer(backend="shm", direct=True)`, against the oracle.

Dispatch bit for bit, combine as `check_case`; the zero-copy combine inputs (the combine
buffer, `recv_x` in place); buffer reuse over many calls; the options it refuses.
"""

from __future__ import annotations

import pytest
import torch

from ubep.testing import Case, check_case, expert_fn, run_case, run_ranks, runtime_cases


def _run(rank, world, workers, cases):
    import ubep

    out = []
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=16, backend="shm", direct=True, workers=workers,
                     timeout_s=30) as buf:
        for case in cases:
            out.append(run_case(buf, case, rank))
    return out


@pytest.mark.parametrize("world,workers", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 3)])
def test_direct_matches_oracle(world, workers):
    cases = runtime_cases(world)
    outs = run_ranks(_run, world, workers, cases, timeout_s=240)
    for k, case in enumerate(cases):
        check_case(case, [outs[r][k] for r in range(world)])


def _zero_copy(rank, world, cases):
    """Each case twice: outputs written into get_combine_buffer, and recv_x combined in place."""
    import ubep

    out = []
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=16, backend="shm", direct=True, timeout_s=30) as buf:
        for case in cases:
            x, idx, w = case.inputs(rank)
            res = buf.dispatch(x, idx, w)
            got = {k: getattr(res, k).clone() for k in (
                "recv_x", "recv_weights", "tokens_per_expert", "recv_src_rank",
                "recv_src_token", "recv_src_slot")}
            y_ref = expert_fn(res.recv_x)
            cb = buf.get_combine_buffer(res.handle, y_ref.dtype)
            assert cb.shape == y_ref.shape and cb.dtype == y_ref.dtype
            cb.copy_(y_ref)
            got["y"] = buf.combine(cb, res.handle, weighted=case.weighted)
            assert buf.last_stats.extra["in_place"]
            res = buf.dispatch(x, idx, w)           # identity experts: combine recv_x itself
            y_same = buf.combine(res.recv_x, res.handle, weighted=case.weighted)
            assert buf.last_stats.extra["in_place"]
            out.append((got, y_same))
    return out


def test_direct_zero_copy_combine_inputs():
    world = 2
    cases = [c for c in runtime_cases(world) if c.dtype in ("bf16", "fp16", "fp32")]
    outs = run_ranks(_zero_copy, world, cases, timeout_s=240)
    from ubep import reference

    for k, case in enumerate(cases):
        check_case(case, [outs[r][k][0] for r in range(world)])
        ins = [case.inputs(r) for r in range(world)]
        ref = reference.dispatch(*[[i[j] for i in ins] for j in range(3)], case.num_experts)
        want = reference.combine([d.recv_x for d in ref], ref, [i[1] for i in ins],
                                 [i[2] for i in ins], weighted=case.weighted)
        for r in range(world):
            assert torch.equal(outs[r][k][1], want[r]), f"{case} rank {r}: in-place combine"


def _many(rank, world, calls):
    """Back-to-back calls with changing batch sizes and routing; every result kept."""
    import ubep

    out = []
    with ubep.Buffer(num_experts=8, hidden=24, max_tokens_per_rank=12, backend="shm",
                     direct=True, timeout_s=30) as buf:
        for case in calls:
            out.append(run_case(buf, case, rank))
    return out


def test_direct_reuse_over_many_calls():
    world = 2
    calls = [Case(num_experts=8, hidden=24, top_k=1 + i % 4,
                  tokens=tuple((i * 7 + r * 5) % 13 for r in range(world)),
                  routing=("uniform", "skewed", "partial")[i % 3], seed=100 + i)
             for i in range(300)]
    outs = run_ranks(_many, world, calls, timeout_s=240)
    for k, case in enumerate(calls):
        check_case(case, [outs[r][k] for r in range(world)])


def _refusals(rank, world):
    import ubep

    errors = []
    for kw in ({"backend": "torch"}, {"mode": "bsp"}, {"sync": "dc"}, {"sync": "sp"}):
        try:
            ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=4, direct=True,
                        **{"backend": "shm", **kw})
        except ValueError as e:
            errors.append(str(e))
    with ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=4, backend="shm") as plain:
        x = torch.ones(2, 8, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [2, 3]])
        w = torch.ones(2, 2)
        res = plain.dispatch(x, idx, w)
        try:
            plain.get_combine_buffer(res.handle)
        except ValueError as e:
            errors.append(str(e))
        plain.combine(res.recv_x, res.handle)
    with ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=4, backend="shm",
                     direct=True) as buf:
        old = buf.dispatch(x, idx, w)
        new = buf.dispatch(x, idx, w)
        try:
            buf.combine(old.recv_x, old.handle)
        except ValueError as e:
            errors.append(str(e))
        y = buf.combine(new.recv_x, new.handle)      # still usable after the refusal
    return errors, y


def test_direct_refusals_name_the_rule():
    outs = run_ranks(_refusals, 2, timeout_s=120)
    for errors, y in outs:
        assert len(errors) == 6, errors
        assert "backend='shm'" in errors[0]
        assert "mode='ubep'" in errors[1]
        assert "'dc'" in errors[2] and "'sp'" in errors[3]
        assert "direct=True" in errors[4]
        assert "latest dispatch" in errors[5]
        assert y.shape == (2, 8)


# -- failures: late and dead peers, dtype disagreements -----------------------------------------
def _small(**kw):
    import ubep

    return ubep.Buffer(num_experts=4, hidden=16, max_tokens_per_rank=8, backend="shm",
                       direct=True, **kw)


def _inputs(rank, dtype=torch.bfloat16):
    from ubep.testing import make_routing, make_tokens

    idx, w = make_routing(8, 4, 4, seed=rank)     # top-4 of 4: every token reaches every rank
    return make_tokens(rank, 8, 16, dtype), idx, w


# late and dead peers on both one-copy paths: tests/runtime/test_shm_owned.py
def _dtypes_differ(rank, world, op):
    import ubep

    with _small(timeout_s=10.0) as buf:
        x, idx, w = _inputs(rank, torch.bfloat16 if rank == 0 or op == "combine"
                            else torch.float16)
        try:
            res = buf.dispatch(x, idx, w)
            out = res.recv_x.to(torch.float32 if rank == 1 else torch.bfloat16)
            buf.combine(out, res.handle)
        except ubep.UbepError as e:
            return str(e)
    return "accepted"


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_direct_peers_with_different_dtypes_fail_clearly(op):
    out = run_ranks(_dtypes_differ, 2, op, timeout_s=120)
    assert all("same dtype" in m for m in out), out
