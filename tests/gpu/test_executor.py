"""ubep.gpu against the oracle: every rank's dispatch and combine bit-exact."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="ubep.gpu needs triton (pip install 'ubep[gpu]')")

from ubep import reference  # noqa: E402
from ubep.errors import BrokenBufferError  # noqa: E402
from ubep.gpu import EmulatedSuperpod, SpinLimitError  # noqa: E402
from ubep.gpu import kernels as K  # noqa: E402

FIELDS = ("recv_x", "recv_weights", "tokens_per_expert", "recv_src_rank", "recv_src_token",
          "recv_src_slot")


def routing(kind: str, P: int, T: int, K_: int, E: int, seed: int = 0):
    """`[P, T, K]` expert ids and weights: uniform, skewed onto few ranks, or with -1 slots."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K_] for _ in range(T)])
                       for _ in range(P)])
    if kind == "skewed":       # every token to rank 0's experts, where it can
        per_rank = E // P
        for s in range(P):
            for t in range(T):
                hot = torch.randperm(per_rank, generator=g)[:K_]
                idx[s, t, :hot.numel()] = hot
    elif kind == "holes":      # -1 slots, a token routed nowhere, a rank sending nothing
        idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
        idx[0, 0] = -1
        idx[P - 1] = -1
    elif kind == "one-expert":  # all traffic to one expert of the last rank
        idx[:] = -1
        idx[:, :, 0] = E - 1
    weights = torch.rand(P, T, K_, generator=g)
    return idx, weights


def payload(P: int, T: int, H: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Rows that name their source: element 0 = rank, 1 = token; the rest random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(P, T, H, generator=g)
    x[:, :, 0] = torch.arange(P, dtype=torch.float32)[:, None]
    x[:, :, 1] = torch.arange(T, dtype=torch.float32)[None, :]
    return x.to(dtype)


def check_dispatch(got, xs, idx, w, E):
    P = xs.shape[0]
    ref = reference.dispatch(list(xs), list(idx), list(w), E)
    for r in range(P):
        mine = got.rank(r)
        for f in FIELDS:
            a, b = getattr(mine, f), getattr(ref[r], f)
            assert a.shape == b.shape, (r, f, a.shape, b.shape)
            assert a.dtype == b.dtype, (r, f, a.dtype, b.dtype)
            # bit-exact for moved rows: compare the bytes, not the values
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b), (r, f)
    return ref


def check_combine(y, outs, ref, idx, w, weighted=True):
    """Every rank's combine `y[s]` against the oracle's contract bit for bit: fp32 products
    `w * row`, summed in slot order, rounded once to the output dtype. Under the interpreter
    that rounding is the interpreter's: it converts fp32 to bf16 by truncation, so bf16 is
    checked against the oracle's fp32 sums truncated. (On a GPU the conversion rounds to
    nearest even, and Triton may contract `acc + w * row` into one FMA; these tests run under
    the interpreter only.) Catches a combine that sums in another order or precision or rounds
    its weights (the fp32 top-4 case shows the order)."""
    sums = reference.combine([o.float() for o in outs], ref, list(idx), list(w),
                             weighted=weighted)            # fp32 rows: the sums, unrounded
    for s, want in enumerate(sums):
        if y.dtype == torch.bfloat16 and K.INTERPRETED:
            want = (want.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
        else:
            want = want.to(y.dtype)
        assert torch.equal(y[s].view(torch.uint8), want.view(torch.uint8)), \
            (s, (y[s].float() - want.float()).abs().max())


def expert_outputs(got, dtype, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    P, NC, H = got.recv_x.shape
    out = torch.zeros(P, NC, H, dtype=dtype)
    for r in range(P):
        n = got.num_recv[r]
        out[r, :n] = (got.recv_x[r, :n].float() * torch.rand(n, H, generator=g) * 2).to(dtype)
    return out


@pytest.mark.parametrize("mode", ["ubep", "bsp"])
@pytest.mark.parametrize("kind,P,T,K_,E,H,dtype", [
    ("uniform", 4, 8, 4, 16, 64, torch.bfloat16),
    ("skewed", 4, 6, 2, 8, 32, torch.float32),
    ("holes", 3, 5, 3, 9, 48, torch.float16),
    ("one-expert", 2, 7, 4, 8, 16, torch.bfloat16),
    ("uniform", 3, 6, 4, 12, 32, torch.float32),     # fp32 sums of 4: their order shows
])
def test_dispatch_and_combine_match_the_oracle(mode, kind, P, T, K_, E, H, dtype):
    idx, w = routing(kind, P, T, K_, E)
    x = payload(P, T, H, dtype)
    pod = EmulatedSuperpod(P, E, H, mode=mode, device="cpu", rows_per_step=8)
    got = pod.dispatch(x, pod.route(idx, w))
    ref = check_dispatch(got, x, idx, w, E)
    out = expert_outputs(got, dtype)
    outs = [out[r, :got.num_recv[r]] for r in range(P)]
    for weighted in (True, False):
        y = pod.combine(out, got, weighted=weighted)
        assert y.dtype == dtype and y.shape == (P, T, H)
        check_combine(y, outs, ref, idx, w, weighted)


@pytest.mark.parametrize("mode", ["ubep", "bsp"])
def test_repeated_calls_reuse_and_grow_the_buffers(mode):
    """Epoch flags: a second routing (more rows, other dtype) on the same superpod."""
    P, E, H = 2, 4, 16
    pod = EmulatedSuperpod(P, E, H, mode=mode, device="cpu", count_programs=2,
                           send_programs=3, recv_programs=2, schedule="balanced")
    for i, (T, K_, dtype) in enumerate([(2, 1, torch.bfloat16), (6, 3, torch.float32),
                                         (3, 2, torch.bfloat16)]):
        idx, w = routing("uniform", P, T, K_, E, seed=10 + i)
        x = payload(P, T, H, dtype, seed=20 + i)
        got = pod.dispatch(x, pod.route(idx, w))
        ref = check_dispatch(got, x, idx, w, E)
        out = expert_outputs(got, dtype)
        y = pod.combine(out, got)
        check_combine(y, [out[r, :got.num_recv[r]] for r in range(P)], ref, idx, w)
        if mode == "ubep":   # the last program of each call moved the device epoch on
            assert pod._state.tolist() == [1 + 2 * (i + 1), 0, 0]   # tickets reset too


def test_only_the_latest_dispatch_can_be_combined():
    P, E, H = 2, 4, 8
    pod = EmulatedSuperpod(P, E, H, device="cpu")
    idx, w = routing("uniform", P, 2, 2, E)
    x = payload(P, 2, H, torch.float32)
    first = pod.dispatch(x, pod.route(idx, w))
    pod.dispatch(x, pod.route(idx, w))
    with pytest.raises(ValueError, match="latest dispatch"):
        pod.combine(first.recv_x, first)


def _launch_dispatch(pod, rt, x, *, count_programs: int, send_programs: int) -> None:
    """`ubep_dispatch` as `EmulatedSuperpod.dispatch` launches it, with `count_programs` and
    `send_programs` per rank instead of the pod's (0: that role never runs), its receivers
    the pod's. Returns at once; `pod.check()` reports."""
    P, H = pod.num_ranks, pod.hidden
    T, K_ = rt.num_tokens, rt.top_k
    C, S, RV = count_programs, send_programs, pod.recv_programs
    xw = x.contiguous().view(torch.int32)            # float32 rows, moved as 4-byte words
    pod._reserve(torch.int32, rt)
    K.ubep_dispatch[(P * (C + S + RV),)](
        rt.cnt, rt.count_dest, rt.send_lo, rt.send_tok, rt.send_slot, rt.send_dst, rt.send_pos,
        xw, rt.topk_weights, pod._counts, pod._count_flag, pod._win, pod._win_w, pod._win_ts,
        pod._row_flag, pod._recv_x, pod._recv_w, pod._recv_rank, pod._recv_ts,
        pod._tokens_per_expert, pod._err, pod._state, P, pod.num_experts,
        pod.experts_per_rank, T, K_, pod._win_rows, pod._recv_rows, H, C, S, RV, pod.max_spins,
        BP=pod._bp, BE=pod._be, ROWS=pod.rows_per_step, BH=pod.block_hidden)


def _launch_combine(pod, got, expert_out, *, send_programs: int) -> None:
    """`ubep_combine` as `EmulatedSuperpod.combine` launches it, with `send_programs` per
    rank returning rows (0: none does), its reducers the pod's."""
    P, H, rt = pod.num_ranks, pod.hidden, got.routing
    T, K_ = rt.num_tokens, rt.top_k
    pod._reserve_combine(expert_out.dtype, T * K_)
    y = torch.empty(P, T, H, dtype=expert_out.dtype)
    K.ubep_combine[(P * (send_programs + pod.recv_programs),)](
        rt.topk_idx, rt.topk_weights, expert_out, expert_out.shape[1], pod._tokens_per_expert,
        pod._recv_rank, pod._recv_ts, pod._cwin.view(expert_out.dtype), pod._cflag, y, pod._err,
        pod._state, P, pod.experts_per_rank, T, K_, pod._recv_rows, H, send_programs,
        pod.recv_programs, pod.max_spins, BE=pod._be, BK=K.next_pow2(K_), WEIGHTED=True,
        ROWS=pod.rows_per_step, BH=pod.block_hidden)


def test_a_receiver_whose_producers_never_run_gives_up_with_a_clear_error():
    """The ubep kernel launched with its receivers only: they poll counts nobody sends."""
    P, E, H = 2, 4, 8
    pod = EmulatedSuperpod(P, E, H, device="cpu", max_spins=3)
    idx, w = routing("uniform", P, 2, 2, E)
    rt = pod.route(idx, w)
    _launch_dispatch(pod, rt, payload(P, 2, H, torch.float32), count_programs=0,
                     send_programs=0)
    with pytest.raises(SpinLimitError, match=r"rank 0 gave up in phase 'dispatch counts' after "
                                             r"3 polls: 2 flag\(s\) not set, the first from "
                                             r"rank 0"):
        pod.check()
    with pytest.raises(BrokenBufferError, match="broken"):
        pod.dispatch(payload(P, 2, H, torch.float32), rt)


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale-flags"])
def test_receivers_whose_rows_never_come_give_up_in_dispatch_rows(stale):
    """The ubep kernel launched with its count programs and receivers, no senders: the counts
    arrive, the rows never do, so every receiver must give up polling their flags. Under the
    interpreter the senders otherwise always finish first, so this is what catches the
    mutation `_place_rows(..., POLL=False)` in `ubep_dispatch` (receivers copy rows without
    waiting for them) and, with `stale`, a poll that takes the previous call's flags (every
    row flag still holds epoch 1 of a completed dispatch of the same routing)."""
    P, E, H, T, K_ = 2, 4, 8, 3, 2
    pod = EmulatedSuperpod(P, E, H, device="cpu", max_spins=3)
    idx, w = routing("uniform", P, T, K_, E, seed=3)
    x = payload(P, T, H, torch.float32)
    rt = pod.route(idx, w)
    if stale:
        check_dispatch(pod.dispatch(x, rt), x, idx, w, E)
    _launch_dispatch(pod, rt, x, count_programs=1, send_programs=0)
    # rank 0's receiver gives up on its first step: its first rows, the oracle's order
    first = reference.dispatch(list(x), list(idx), list(w), E)[0].recv_src_rank
    first = first[:pod.rows_per_step]
    assert first.numel() > 0
    with pytest.raises(SpinLimitError, match=rf"rank 0 gave up in phase 'dispatch rows' after "
                                             rf"3 polls: {first.numel()} flag\(s\) not set, "
                                             rf"the first from rank {int(first.min())}$"):
        pod.check()


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale-flags"])
def test_reducers_whose_rows_never_come_give_up_in_combine_rows(stale):
    """The ubep combine kernel launched with its reducers only, after a real dispatch: no
    row comes back, so every reducer must give up polling. Catches the mutation
    `_reduce(..., POLL=False)` in `ubep_combine` (reducers sum whatever the window holds)
    and, with `stale`, a poll that takes the previous combine's flags."""
    P, E, H, T, K_ = 2, 4, 8, 3, 2
    pod = EmulatedSuperpod(P, E, H, device="cpu", max_spins=3)
    idx, w = routing("uniform", P, T, K_, E, seed=4)
    x = payload(P, T, H, torch.float32)
    got = pod.dispatch(x, pod.route(idx, w))
    out = expert_outputs(got, torch.float32)
    if stale:
        pod.combine(out, got)
    _launch_combine(pod, got, out, send_programs=0)
    # rank 0's reducer gives up on its first tokens: their routed slots, by expert's rank
    slots = idx[0, :pod.rows_per_step]
    slots = slots[slots >= 0]
    with pytest.raises(SpinLimitError, match=rf"rank 0 gave up in phase 'combine rows' after "
                                             rf"3 polls: {slots.numel()} flag\(s\) not set, "
                                             rf"the first from rank "
                                             rf"{int(slots.min()) // (E // P)}$"):
        pod.check()


def test_the_single_kernel_must_fit_the_resident_programs():
    with pytest.raises(ValueError, match=r"all 16 programs \(4 ranks x 4\).*holds 8"):
        EmulatedSuperpod(4, 8, 16, mode="ubep", device="cpu", resident_programs=8)
    # the baseline's kernels never wait, so any grid runs
    EmulatedSuperpod(4, 8, 16, mode="bsp", device="cpu", resident_programs=8)


@pytest.mark.parametrize("bad,match", [
    (dict(num_experts=6), "divisible by num_ranks=4"),
    (dict(mode="fast"), "mode='fast' is not one of"),
    (dict(send_programs=0), "send_programs=0 must be >= 1"),
    (dict(rows_per_step=3), "rows_per_step=3 must be a power of two"),
    (dict(device="meta"), "must be a CUDA device or 'cpu'"),
])
def test_bad_configuration_names_the_argument(bad, match):
    args = dict(num_ranks=4, num_experts=8, hidden=16, device="cpu") | bad
    with pytest.raises(ValueError, match=match):
        EmulatedSuperpod(**args)


def test_bad_inputs_name_the_argument_and_leave_the_superpod_usable():
    P, E, H = 2, 4, 8
    pod = EmulatedSuperpod(P, E, H, device="cpu")
    idx, w = routing("uniform", P, 3, 2, E)
    bad = idx.clone()
    bad[1, 2, 0] = E
    with pytest.raises(ValueError, match=r"rank 1: topk_idx holds expert id 4"):
        pod.route(bad, w)
    bad = idx.clone()
    bad[0, 1, 1] = bad[0, 1, 0]
    with pytest.raises(ValueError, match=r"rank 0: topk_idx row 1 names expert"):
        pod.route(bad, w)
    with pytest.raises(ValueError, match="topk_weights must be a tensor of topk_idx's shape"):
        pod.route(idx, w[:, :2])
    rt = pod.route(idx, w)
    with pytest.raises(ValueError, match=r"x must be \[num_ranks=2, num_tokens=3, hidden=8\]"):
        pod.dispatch(torch.zeros(P, 4, H), rt)
    with pytest.raises(TypeError, match="8-byte elements"):
        pod.dispatch(torch.zeros(P, 3, H, dtype=torch.float64), rt)
    x = payload(P, 3, H, torch.float32)
    got = pod.dispatch(x, rt)
    check_dispatch(got, x, idx, w, E)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        pod.combine(got.recv_x.to(torch.float64), got)


@pytest.mark.parametrize("schedule", ["static", "hierarchical"])
def test_plans_for_a_tiered_fabric_place_rows_as_the_oracle(schedule):
    """A CM384 slice as the planner's fabric: its send order changes, the result does not."""
    from ubep.plan import Topology

    P, E, T, K_, H = 4, 8, 6, 3, 32
    idx, w = routing("uniform", P, T, K_, E, seed=5)
    x = payload(P, T, H, torch.bfloat16)
    pod = EmulatedSuperpod(P, E, H, device="cpu", topology=Topology.preset("cm384", P),
                           schedule=schedule, send_programs=3)
    rt = pod.route(idx, w)
    assert rt.plans[0].schedule == schedule and rt.plans[0].token_workers == 3
    check_dispatch(pod.dispatch(x, rt), x, idx, w, E)


@pytest.mark.parametrize("mode", ["ubep", "bsp"])
def test_any_routing_and_program_split_places_rows_as_the_oracle(mode):
    """Property: random ranks, tokens, top-k, -1 slots and programs per role (hypothesis)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=6, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(P=st.integers(2, 3), per_rank=st.integers(1, 3), T=st.integers(1, 5),
                      K_=st.integers(1, 3), holes=st.floats(0, 0.6), seed=st.integers(0, 99),
                      programs=st.tuples(st.integers(1, 2), st.integers(1, 3),
                                         st.integers(1, 3)))
    def check(P, per_rank, T, K_, holes, seed, programs):
        E = P * per_rank
        K_ = min(K_, E)
        idx, w = routing("uniform", P, T, K_, E, seed=seed)
        g = torch.Generator().manual_seed(seed)
        idx[torch.rand(idx.shape, generator=g) < holes] = -1
        x = payload(P, T, 16, torch.bfloat16, seed=seed)
        c, s, r = programs
        pod = EmulatedSuperpod(P, E, 16, mode=mode, device="cpu", count_programs=c,
                               send_programs=s, recv_programs=r)
        got = pod.dispatch(x, pod.route(idx, w))
        ref = check_dispatch(got, x, idx, w, E)
        y = pod.combine(got.recv_x, got)
        check_combine(y, [got.recv_x[q, :got.num_recv[q]] for q in range(P)], ref, idx, w)

    check()
