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


def _late_or_dead(rank, world, how, job):
    import os
    import signal
    import time

    import ubep
    from ubep.runtime.shm.kernels import direct as direct_kernels

    with _small(timeout_s=2.0 if how == "late" else 20.0) as buf:
        if rank == 1 and how == "late":
            time.sleep(4.0)
            return "slept"
        if rank == 1 and how == "dead":
            def die(*args):
                os.kill(os.getpid(), signal.SIGKILL)   # counts are out, the rows never come
            direct_kernels.dispatch_rows_at = die     # the one-worker entry after counts
        t0 = time.monotonic()
        try:
            buf.dispatch(*_inputs(rank))
        except (ubep.PeerTimeoutError, ubep.PeerDiedError) as e:
            left = [n for n in os.listdir("/dev/shm") if job in n]
            return type(e).__name__, e.rank, e.phase, e.peers, time.monotonic() - t0, left
    return "no error"


@pytest.mark.parametrize("how", ["late", "dead"])
def test_direct_late_or_dead_peer_is_named_within_the_deadline(how):
    import os

    from ubep.testing import RankFailure

    job = f"direct{how}{os.getpid()}"
    out = run_ranks(_late_or_dead, 2, how, job, timeout_s=120, return_exceptions=True,
                    env={"UBEP_JOB_ID": job})
    kind, rank, phase, peers, took, left = out[0]
    assert (rank, peers, left) == (0, [1], [])
    if how == "late":          # at the 2 s deadline, not before
        assert (kind, phase) == ("PeerTimeoutError", "dispatch/counts") and took >= 2.0
    else:                      # found dead by liveness, not at the 20 s deadline
        assert isinstance(out[1], RankFailure) and out[1].kind == "died"
        assert (kind, phase) == ("PeerDiedError", "dispatch/rows")


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
