"""`Buffer(backend="shm", direct="owned")`: one copy per row, results the caller owns.

Against the oracle (dispatch bit for bit, combine as `check_case`), with nothing cloned:
several dispatches outstanding, combined in any order and more than once, every `recv_x` and
`y` kept while later calls run; `out=`, unweighted, fp32/bf16/fp16; the combine buffer's
rules; late and dead peers named within the deadline; bad option values named.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from ubep.testing import Case, RankFailure, check_case, expert_fn, run_ranks, runtime_cases


def _kept(res, y) -> dict:
    """What `check_case` compares, as the Buffer returned it (no clone)."""
    return {"recv_x": res.recv_x, "recv_weights": res.recv_weights,
            "tokens_per_expert": res.tokens_per_expert, "recv_src_rank": res.recv_src_rank,
            "recv_src_token": res.recv_src_token, "recv_src_slot": res.recv_src_slot, "y": y}


def _owned(**kw):
    import ubep

    return ubep.Buffer(backend="shm", direct="owned", timeout_s=30, **kw)


def _all_cases(rank, world, workers, cases):
    """Every case dispatched first (all outstanding), then combined last to first."""
    with _owned(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                max_tokens_per_rank=16, workers=workers) as buf:
        res = [buf.dispatch(*case.inputs(rank)) for case in cases]
        ys = {}
        for k in reversed(range(len(cases))):
            ys[k] = buf.combine(expert_fn(res[k].recv_x), res[k].handle,
                                weighted=cases[k].weighted)
            assert buf.last_stats.extra["direct"] == "owned"
        return [_kept(res[k], ys[k]) for k in range(len(cases))]


@pytest.mark.parametrize("world,workers", [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_owned_results_outstanding_then_combined_in_reverse_match_the_oracle(world, workers):
    cases = runtime_cases(world)
    outs = run_ranks(_all_cases, world, workers, cases, timeout_s=240)
    for k, case in enumerate(cases):
        check_case(case, [outs[r][k] for r in range(world)])


CASES = [Case(num_experts=8, hidden=1024, top_k=4, tokens=(64, 48), seed=1, dtype="bf16"),
         Case(num_experts=8, hidden=1024, top_k=3, tokens=(20, 33), seed=2, dtype="fp32",
              routing="skewed"),
         Case(num_experts=8, hidden=1024, top_k=2, tokens=(7, 0), seed=3, dtype="fp16",
              weighted=False),
         Case(num_experts=8, hidden=1024, top_k=4, tokens=(64, 64), seed=4, dtype="bf16",
              routing="partial")]


def _orders(rank, world, workers):
    """D0 D1 D2 C2 C0 D3 C1 C3 C0(again, into out=), every result kept; then the memory of a
    dropped result is lent again and a held one's is not."""
    outs = []
    with _owned(num_experts=8, hidden=1024, max_tokens_per_rank=64, max_top_k=4,
                workers=workers) as buf:
        res = {k: buf.dispatch(*CASES[k].inputs(rank)) for k in (0, 1, 2)}

        def combine(k, out=None):
            return buf.combine(expert_fn(res[k].recv_x), res[k].handle,
                               weighted=CASES[k].weighted, out=out)

        outs.append((2, _kept(res[2], combine(2))))
        outs.append((0, _kept(res[0], combine(0))))
        res[3] = buf.dispatch(*CASES[3].inputs(rank))
        outs.append((1, _kept(res[1], combine(1))))
        outs.append((3, _kept(res[3], combine(3))))
        out = torch.full((CASES[0].tokens[rank], 1024), 7.0, dtype=torch.bfloat16)
        y = combine(0, out)
        assert y is out
        outs.append((0, _kept(res[0], out)))
        held = {r.recv_x.data_ptr() for r in res.values() if r.recv_x.numel()}
        again = buf.dispatch(*CASES[0].inputs(rank))
        reused = again.recv_x.data_ptr() in held
        buf.combine(again.recv_x, again.handle)
    return outs, reused


@pytest.mark.parametrize("workers", [1, 2])
def test_owned_handles_combine_in_any_order_and_results_stay_valid(workers):
    outs = run_ranks(_orders, 2, workers, timeout_s=180)
    assert [k for k, _ in outs[0][0]] == [k for k, _ in outs[1][0]] == [2, 0, 1, 3, 0]
    for i, (k, _) in enumerate(outs[0][0]):
        check_case(CASES[k], [outs[r][0][i][1] for r in range(2)])
    assert not any(o[1] for o in outs)


def _many(rank, world, calls):
    """Back-to-back calls, batch size and routing changing, two dispatches in flight."""
    outs = []
    with _owned(num_experts=8, hidden=24, max_tokens_per_rank=12) as buf:
        prev = None
        for k, case in enumerate(calls):
            res = buf.dispatch(*case.inputs(rank))
            if prev is not None:
                j, pres = prev
                outs.append((j, _kept(pres, buf.combine(expert_fn(pres.recv_x), pres.handle,
                                                        weighted=calls[j].weighted))))
            prev = (k, res)
        j, pres = prev
        outs.append((j, _kept(pres, buf.combine(expert_fn(pres.recv_x), pres.handle,
                                                weighted=calls[j].weighted))))
    return outs


def test_owned_reuse_over_many_calls_with_two_dispatches_in_flight():
    world = 2
    calls = [Case(num_experts=8, hidden=24, top_k=1 + i % 4,
                  tokens=tuple((i * 7 + r * 5) % 13 for r in range(world)),
                  routing=("uniform", "skewed", "partial")[i % 3], seed=300 + i,
                  dtype=("bf16", "fp32")[i % 2])
             for i in range(150)]
    outs = run_ranks(_many, world, calls, timeout_s=240)
    for i, (k, _) in enumerate(outs[0]):
        check_case(calls[k], [outs[r][i][1] for r in range(world)])


def _combine_buffer(rank, world):
    """The combine buffer of any handle is read in place; one a later combine overwrote (or
    another handle's) is refused with the rule, and the Buffer stays usable."""
    case = CASES[0]
    errors = []
    with _owned(num_experts=8, hidden=1024, max_tokens_per_rank=64, max_top_k=4) as buf:
        a = buf.dispatch(*case.inputs(rank))
        b = buf.dispatch(*case.inputs(rank))
        cb = buf.get_combine_buffer(a.handle)          # not the latest dispatch: allowed
        cb.copy_(expert_fn(a.recv_x))
        ya = buf.combine(cb, a.handle)
        assert buf.last_stats.extra["in_place"]
        cb = buf.get_combine_buffer(b.handle)
        cb.copy_(expert_fn(b.recv_x))
        try:
            buf.combine(cb, a.handle)                   # b's outputs, a's handle
        except ValueError as e:
            errors.append(str(e))
        yb = buf.combine(cb, b.handle)
        try:
            buf.combine(cb, b.handle)                   # the combine area is free again
        except ValueError as e:
            errors.append(str(e))
        yb2 = buf.combine(expert_fn(b.recv_x), b.handle)
    return errors, _kept(a, ya), _kept(b, yb), torch.equal(yb, yb2)


def test_owned_combine_buffer_serves_any_handle_once():
    outs = run_ranks(_combine_buffer, 2, timeout_s=120)
    for errors, *_ in outs:
        assert len(errors) == 2 and all("get_combine_buffer" in e for e in errors), errors
    check_case(CASES[0], [o[1] for o in outs])
    check_case(CASES[0], [o[2] for o in outs])
    assert all(o[3] for o in outs)


def _one_rank_refused(rank, world, workers):
    """Rank 0 alone passes a stale combine buffer (refused), then retries with its own
    tensor; rank 1 combines once and waits for it meanwhile: the refusal moved nothing, so
    the retry is the combine rank 1 waits for."""
    with _owned(num_experts=8, hidden=1024, max_tokens_per_rank=64, max_top_k=4,
                workers=workers) as buf:
        x, idx, w = CASES[0].inputs(rank)
        a, b = buf.dispatch(x, idx, w), buf.dispatch(x, idx, w)
        error = None
        if rank == 0:
            stale = buf.get_combine_buffer(a.handle)
            buf.get_combine_buffer(b.handle)            # a's tensor is stale from here on
            try:
                buf.combine(stale, a.handle)
            except ValueError as e:
                error = str(e)
        ya = buf.combine(expert_fn(a.recv_x), a.handle)
        yb = buf.combine(expert_fn(b.recv_x), b.handle)
    return error, _kept(a, ya), _kept(b, yb)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_refused_combine_on_one_rank_leaves_it_in_step_with_its_peers(workers):
    outs = run_ranks(_one_rank_refused, 2, workers, timeout_s=120)
    assert "get_combine_buffer" in outs[0][0] and outs[1][0] is None
    check_case(CASES[0], [o[1] for o in outs])
    check_case(CASES[0], [o[2] for o in outs])


def _refusals(rank, world):
    import ubep

    errors = []
    for kw in ({"direct": "copy"}, {"direct": "owned", "backend": "torch"},
               {"direct": "owned", "mode": "bsp"}, {"direct": "owned", "sync": "sp"}):
        try:
            ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=4, **{"backend": "shm",
                                                                          **kw})
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_owned_bad_options_name_the_rule():
    for errors in run_ranks(_refusals, 2, timeout_s=120):
        assert len(errors) == 4, errors
        assert "direct='copy'" in errors[0] and "'owned'" in errors[0]
        assert "backend='shm'" in errors[1] and "mode='ubep'" in errors[2]
        assert "'sp'" in errors[3]


def _late_or_dead(rank, world, direct, how, job):
    import time

    import ubep
    from ubep.runtime.shm.direct import kernels as direct_kernels
    from ubep.testing import make_routing, make_tokens

    idx, w = make_routing(8, 4, 4, seed=rank)    # top-4 of 4: every token reaches every rank
    x = make_tokens(rank, 8, 16, torch.bfloat16)
    with ubep.Buffer(num_experts=4, hidden=16, max_tokens_per_rank=8, backend="shm",
                     direct=direct, timeout_s=2.0 if how != "dead" else 20.0) as buf:
        first = buf.dispatch(x, idx, w)
        if rank == 1 and how == "late":
            time.sleep(4.0)
            return "slept"
        if rank == 1 and how == "dead":
            def die(*args):
                os.kill(os.getpid(), signal.SIGKILL)   # counts are out, the rows never come
            # the one-worker entry after counts, on the Python path (this test's ranks run
            # without `ubep.native`, whose entries call the same kernels by address)
            setattr(direct_kernels, "dispatch_rows_own" if direct == "owned"
                    else "dispatch_rows_at", die)
        t0 = time.monotonic()
        try:
            if how == "late-combine" and rank == 1:
                time.sleep(4.0)
                return "slept"
            if how == "late-combine":                  # an older handle, the peer never comes
                buf.combine(first.recv_x, first.handle)
            else:
                buf.dispatch(x, idx, w)
        except (ubep.PeerTimeoutError, ubep.PeerDiedError) as e:
            left = [n for n in os.listdir("/dev/shm") if job in n]
            return type(e).__name__, e.rank, e.phase, e.peers, time.monotonic() - t0, left
    return "no error"


@pytest.mark.parametrize("direct", [True, "owned"])
@pytest.mark.parametrize("how", ["late", "dead", "late-combine"])
def test_late_or_dead_peer_is_named_within_the_deadline(direct, how):
    """Both one-copy paths: a late peer at the deadline, not before; a dead one by liveness."""
    job = f"d{str(direct)[0]}{how.replace('-', '')}{os.getpid()}"
    out = run_ranks(_late_or_dead, 2, direct, how, job, timeout_s=120,
                    return_exceptions=True, env={"UBEP_JOB_ID": job, "UBEP_NATIVE": "0"})
    kind, rank, phase, peers, took, left = out[0]
    assert (rank, peers, left) == (0, [1], [])
    if how == "late":
        assert (kind, phase) == ("PeerTimeoutError", "dispatch/counts") and took >= 2.0
    elif how == "late-combine":
        assert (kind, phase) == ("PeerTimeoutError", "combine/rows") and took >= 2.0
    else:
        assert isinstance(out[1], RankFailure) and out[1].kind == "died"
        assert (kind, phase) == ("PeerDiedError", "dispatch/rows")


def _lending(rank, world):
    """Large results land in lent shared areas while held (combined in place: the expert
    outputs written over recv_x), and in private tensors once every lent area is held; a
    dropped one's area is lent again."""
    case = CASES[0]
    with _owned(num_experts=8, hidden=1024, max_tokens_per_rank=64, max_top_k=4) as buf:
        path = buf._backend._path
        held, where, in_place, outs = [], [], [], []
        for _ in range(4):
            res = buf.dispatch(*case.inputs(rank))
            p = res.recv_x.data_ptr()
            where.append(path._lent_lo <= p < path._lent_hi)
            held.append(res)
        for res in reversed(held):
            kept = _kept(res, None)
            kept["recv_x"] = res.recv_x.clone()             # the oracle's copy
            res.recv_x.copy_(expert_fn(res.recv_x))         # expert outputs in place
            kept["y"] = buf.combine(res.recv_x, res.handle, weighted=case.weighted)
            in_place.append(buf.last_stats.extra["in_place"])
            outs.append(kept)
        first = held[0].recv_x.data_ptr()
        del held[0], res
        again = buf.dispatch(*case.inputs(rank))
        outs.append(_kept(again, buf.combine(expert_fn(again.recv_x), again.handle)))
        return where, in_place, again.recv_x.data_ptr() == first, outs


def test_owned_lends_shared_areas_while_free_and_copies_out_when_all_are_held():
    outs = run_ranks(_lending, 2, timeout_s=120)
    for where, in_place, reused, _ in outs:
        assert where == [True, True, False, False]
        assert in_place == [False, False, True, True]
        assert reused
    for i in range(5):
        check_case(CASES[0], [o[3][i] for o in outs])


def _views_hold(rank, world):
    """Only a slice of recv_x survives its result: its area is not lent again until it goes."""
    case = CASES[0]
    with _owned(num_experts=8, hidden=1024, max_tokens_per_rank=64, max_top_k=4) as buf:
        res = buf.dispatch(*case.inputs(rank))
        first, view = res.recv_x.data_ptr(), res.recv_x[1:]
        copy = view.clone()
        buf.combine(res.recv_x, res.handle)
        del res
        later = []
        for _ in range(3):                  # each result dropped before the next dispatch
            r = buf.dispatch(*case.inputs(rank))
            later.append(r.recv_x.data_ptr())
            buf.combine(r.recv_x, r.handle)
            del r
        intact = torch.equal(view, copy)
        del view
        r = buf.dispatch(*case.inputs(rank))
        again = r.recv_x.data_ptr() == first
        buf.combine(r.recv_x, r.handle)
        return first in later, intact, again


def test_owned_a_surviving_view_keeps_its_area_held():
    for reused_while_viewed, intact, again in run_ranks(_views_hold, 2, timeout_s=120):
        assert (reused_while_viewed, intact, again) == (False, True, True)
