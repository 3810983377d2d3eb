"""`ubep.native`: the compiled fast checks give the Python checks' answers, the compiled call
path of the shm direct backend gives the oracle's results (also when a rank is late and the
Python path takes over the wait), and the library runs the same without them
(`UBEP_NATIVE=0`)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep import validate
from ubep.native import load_native, status
from ubep.testing import Counted, check_case, expert_fn, run_case, run_ranks, runtime_cases

NATIVE = load_native()
needs_native = pytest.mark.skipif(
    NATIVE is None and not os.environ.get("UBEP_REQUIRE_NATIVE"),
    reason="ubep.native not built (python -m ubep.native build)")

H, E, MAX_T, MAX_K = 16, 8, 6, 4
LIMITS = (H, E, MAX_T, MAX_K)


class _Sub(torch.Tensor):
    """A tensor subclass: the compiled checks answer "not sure" for any."""


def test_the_build_is_there_when_required():
    if os.environ.get("UBEP_REQUIRE_NATIVE"):
        assert NATIVE is not None, status()
    assert status() in ("ubep.native on", "ubep.native not built "
                        "(python -m ubep.native build)", "ubep.native off (UBEP_NATIVE=0)")


@st.composite
def _dispatch_args(draw):
    t_n = draw(st.integers(0, MAX_T + 1))
    k_n = draw(st.integers(1, MAX_K + 1))
    hidden = draw(st.sampled_from((H, H + 1, 1)))
    xdt = draw(st.sampled_from((torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn,
                                torch.float64, torch.int64, torch.bool)))
    x = torch.zeros(t_n, hidden, dtype=xdt)
    ids = draw(st.lists(st.lists(st.integers(-2, E), min_size=k_n, max_size=k_n),
                        min_size=t_n, max_size=t_n))
    idx = torch.tensor(ids, dtype=torch.int64).reshape(t_n, k_n)
    idx = idx.to(draw(st.sampled_from((torch.int64, torch.int64, torch.int32))))
    w = torch.rand(t_n, k_n).to(draw(st.sampled_from((torch.float32, torch.float32,
                                                      torch.float16))))
    which = draw(st.sampled_from(("none", "x_t", "idx_t", "w_grad", "x_grad", "w_shape",
                                  "x_meta", "sub", "param", "x_3d", "x_list")))
    if which == "x_t":
        x = torch.zeros(hidden, t_n, dtype=xdt).t()
    elif which == "idx_t":
        idx = idx.t().contiguous().t()
    elif which == "w_grad" and w.is_floating_point():
        w.requires_grad_(True)
    elif which == "x_grad" and x.is_floating_point():
        x.requires_grad_(True)
    elif which == "w_shape":
        w = w.reshape(-1)
    elif which == "x_meta":
        x = x.to("meta")
    elif which == "sub":
        x = x.as_subclass(_Sub)
    elif which == "param" and x.is_floating_point():
        x = torch.nn.Parameter(x, requires_grad=False)
    elif which == "x_3d":
        x = x.unsqueeze(0)
    elif which == "x_list":
        x = x.tolist()
    return x, idx, w, which


@needs_native
@settings(max_examples=400, deadline=None)
@given(_dispatch_args())
def test_dispatch_check_answers_as_the_python_one(args):
    x, idx, w, which = args
    py = validate.py_dispatch_inputs_ready(x, idx, w, *LIMITS)
    c = NATIVE.dispatch_inputs_ready(x, idx, w, *LIMITS)
    if which == "sub":
        assert c is False           # "not sure": the full check decides
    else:
        assert c is py, (which, x.dtype if isinstance(x, torch.Tensor) else x, py, c)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 4), st.sampled_from((H, H + 1)),
       st.sampled_from((torch.bfloat16, torch.float16, torch.float32, torch.float8_e5m2,
                        torch.float64, torch.int32)),
       st.sampled_from(("none", "t", "grad", "sub", "meta", "slice")))
def test_combine_check_answers_as_the_python_one(n, hidden, dtype, which):
    e = torch.zeros(n, hidden, dtype=dtype)
    if which == "t":
        e = torch.zeros(hidden, n, dtype=dtype).t()
    elif which == "grad" and dtype.is_floating_point:
        e.requires_grad_(True)
    elif which == "sub":
        e = e.as_subclass(_Sub)
    elif which == "meta":
        e = e.to("meta")
    elif which == "slice":
        e = torch.zeros(n, 2 * hidden, dtype=dtype)[:, ::2]
    py = validate.py_combine_inputs_ready(e, 3, H)
    c = NATIVE.combine_inputs_ready(e, 3, H)
    assert c is (False if which == "sub" else py)


@needs_native
def test_bad_arguments_raise_and_the_checks_still_answer():
    x, idx, w = torch.zeros(1, H), torch.tensor([[0, 1]]), torch.ones(1, 2)
    with pytest.raises(TypeError, match="expected 7 positional arguments, got 3"):
        NATIVE.dispatch_inputs_ready(x, idx, w)
    with pytest.raises(TypeError):
        NATIVE.dispatch_inputs_ready(x, idx, w, "16", E, MAX_T, MAX_K)
    with pytest.raises(TypeError, match="expected 3 positional arguments"):
        NATIVE.combine_inputs_ready(x)
    with pytest.raises(TypeError, match="expected a torch.Tensor, got list"):
        NATIVE.direct_dispatch(0, [x], idx, w, 1, 0, 0, True, None, 1, 1, 0.0, None)
    with pytest.raises(TypeError, match="C-contiguous"):
        NATIVE.direct_combine(0, 1, 0, 0, 0, 0, 0, [1, 2], 0, 0, 1, 1, True, 0, None, True, 0.0,
                              None, False, idx)
    with pytest.raises(TypeError, match="four classes"):
        NATIVE.set_result_types(1, 2, 3, 4, ())
    with pytest.raises(TypeError, match="layout.NAMES"):
        NATIVE.set_result_types(int, int, int, int, ("x",))
    assert NATIVE.dispatch_inputs_ready(x, idx, w, *LIMITS) is True
    assert NATIVE.combine_inputs_ready(torch.zeros(3, H), 3, H) is True
    assert validate.fast_checks() == (NATIVE.dispatch_inputs_ready,
                                      NATIVE.combine_inputs_ready)


def _round_trips(rank, world, cases):
    import ubep
    from ubep import validate as v

    out = []
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
                     max_tokens_per_rank=16, backend="shm", max_top_k=8, timeout_s=30,
                     direct="owned") as buf:
        assert buf._dispatch_ready is v.py_dispatch_inputs_ready
        assert buf._combine_ready is v.py_combine_inputs_ready
        assert buf._backend._path._native is None
        for case in cases:
            out.append(run_case(buf, case, rank))
        with pytest.raises(ValueError, match=r"expert id 99; ids must lie in \[-1, "):
            buf.dispatch(torch.zeros(1, buf.config.hidden), torch.tensor([[99]]),
                         torch.ones(1, 1))
        out.append(run_case(buf, cases[0], rank))
    return out


def test_without_the_extension_the_python_checks_run_and_agree_with_the_oracle():
    cases = runtime_cases(2)[:4]
    outs = run_ranks(_round_trips, 2, cases, timeout_s=120, env={"UBEP_NATIVE": "0"})
    for k, case in enumerate([*cases, cases[0]]):
        check_case(case, [o[k] for o in outs])


#: the shm paths with compiled entries, as Buffer options: the direct paths, and the
#: one-worker staged path (`SinglePath`, its door `staged.cpp`) in both modes and more syncs
PATHS = {"direct": dict(direct=True), "owned": dict(direct="owned"),
         "staged": dict(direct=False, workers=1),
         "staged-bsp": dict(direct=False, workers=1, mode="bsp"),
         "staged-dc": dict(direct=False, workers=1, sync="dc"),
         "staged-sw": dict(direct=False, workers=1, sync="sw")}


def _late(rank, world, path, cases):
    """Every case once per (late rank, before dispatch or combine): the late rank sleeps
    50 ms, so the other's compiled entry finds counts or rows missing and hands the wait on."""
    import ubep

    out = []
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
                     max_tokens_per_rank=16, backend="shm", max_top_k=8, timeout_s=30,
                     **PATHS[path]) as buf:
        native = buf._door is not None
        for case in cases:
            for late, where in ((0, "dispatch"), (1, "dispatch"), (1, "combine")):
                x, idx, w = case.inputs(rank)
                if rank == late and where == "dispatch":
                    time.sleep(0.05)
                res = buf.dispatch(x, idx, w)
                rows = expert_fn(res.recv_x)
                if rank == late and where == "combine":
                    time.sleep(0.05)
                y = buf.combine(rows, res.handle, weighted=case.weighted)
                out.append({"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
                            "tokens_per_expert": res.tokens_per_expert,
                            "recv_src_rank": res.recv_src_rank,
                            "recv_src_token": res.recv_src_token,
                            "recv_src_slot": res.recv_src_slot, "y": y})
    return native, out


@pytest.mark.parametrize(("path", "native"), [
    *((p, "on") for p in PATHS), *((p, "off") for p in ("direct", "owned", "staged"))])
def test_late_ranks_on_both_paths_agree_with_the_oracle(path, native):
    if native == "on" and NATIVE is None:
        if os.environ.get("UBEP_REQUIRE_NATIVE"):
            pytest.fail(status())
        pytest.skip(status())
    cases = [c for c in runtime_cases(2) if sum(c.tokens)][:4]
    outs = run_ranks(_late, 2, path, cases, timeout_s=200,
                     env={"UBEP_NATIVE": "0" if native == "off" else "1"})
    assert all(o[0] is (native == "on") for o in outs)
    k = 0
    for case in cases:
        for _ in range(3):
            check_case(case, [o[1][k] for o in outs])
            k += 1


def _objects(rank, world, direct):
    """The results the compiled entries make, beside those the Python constructors make."""
    import numpy as np

    import ubep
    from ubep.handle import CombineResult, DispatchResult, new_dispatch_result, new_handle
    from ubep.stats import DeferredStats

    x = torch.randn(3, H).to(torch.bfloat16)
    idx, w = torch.tensor([[0, 5], [7, -1], [2, 3]]), torch.rand(3, 2)
    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=4, backend="shm",
                     direct=direct) as buf:
        path = buf._backend._path
        r = buf.dispatch(x, idx, w)
        h = r.handle
        py_h = new_handle(h.buffer_id, h.call, 3, h.num_recv, H, idx, w, np.zeros((3, 5)),
                          h.state)
        py_r = new_dispatch_result(r.recv_x, np.zeros(5, np.float32), np.zeros(2, np.int64), h,
                                   DeferredStats.of(path._dispatch_stats, ()))
        kinds = (type(r), type(h), type(r.stats), set(vars(r)) == set(vars(py_r)),
                 set(vars(h)) == set(vars(py_h)), h.num_tokens, h.hidden, h.topk_idx is idx)
        d_stats = (r.stats.op, r.stats.total_us > 0, buf.last_stats == r.stats)
        ref = reference_of(x, idx, w)
        got = (r.recv_x.clone(), r.recv_weights.clone(), r.tokens_per_expert.clone(),
               r.recv_src_rank.clone(), r.recv_src_token.clone(), r.recv_src_slot.clone())
        y = buf.combine(r.recv_x, h)
        c = path.combine(r.recv_x, h, True, 0.0)
        c_kinds = (type(c), set(vars(c)) == {"y", "stats"}, buf.last_stats.op,
                   torch.equal(c.y, y))
    return kinds, d_stats, got, ref, y, c_kinds, (DispatchResult, CombineResult)


def reference_of(x, idx, w):
    from ubep import reference

    d = reference.dispatch([x], [idx], [w], E)[0]
    y = reference.combine([d.recv_x], [d], [idx], [w])[0]
    return (d.recv_x, d.recv_weights, d.tokens_per_expert, d.recv_src_rank, d.recv_src_token,
            d.recv_src_slot, y)


@needs_native
@pytest.mark.parametrize("direct", [True, "owned"])
def test_the_compiled_entries_make_the_results_python_makes(direct):
    from ubep.handle import DispatchHandle
    from ubep.stats import DeferredStats

    kinds, d_stats, got, ref, y, c_kinds, (d_type, c_type) = run_ranks(_objects, 1, direct)[0]
    assert kinds == (d_type, DispatchHandle, DeferredStats, True, True, 3, H, True)
    assert d_stats == ("dispatch", True, True)
    for g, want in zip(got, ref[:6], strict=True):
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.bfloat16 else g,
                           want.view(torch.uint8) if want.dtype == torch.bfloat16 else want)
    assert torch.equal(y.view(torch.uint8), ref[6].view(torch.uint8))     # the oracle's bits
    assert c_kinds == (c_type, True, "combine", True)


def _staged_objects(rank, world):
    """A staged Buffer's results through its door and through its Python path, side by
    side: the objects, their fields and what their stats say apart from times."""
    import ubep

    x = torch.randn(3, H).to(torch.bfloat16)
    idx, w = torch.tensor([[0, 5], [7, -1], [2, 3]]), torch.rand(3, 2)
    out = []
    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=4, backend="shm",
                     **PATHS["staged"]) as buf:
        door = buf._door
        for on in (True, False):
            buf._door = door if on else None
            r = buf.dispatch(x, idx, w)
            y = buf.combine(expert_fn(r.recv_x), r.handle)
            c_stats = buf.last_stats
            s = [(st.op, st.mode, st.rank, sorted(st.phases_us), st.bytes_sent, st.bytes_recv,
                  st.extra["workers"]) for st in (r.stats, c_stats)]
            out.append((type(r), type(r.handle), sorted(vars(r)), sorted(vars(r.handle)),
                        r.handle.state[:3], r.recv_x.clone(), r.recv_weights.clone(),
                        r.tokens_per_expert.clone(), r.recv_src_rank.clone(),
                        r.recv_src_token.clone(), r.recv_src_slot.clone(), y, s,
                        r.stats.extra["epoch"] - (1 if on else 2)))
    return door is not None, out


@needs_native
def test_the_staged_door_makes_the_results_its_python_path_makes():
    took, (door, py) = run_ranks(_staged_objects, 1)[0]
    assert took
    for a, b in zip(door, py, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:
            assert a == b


def _pool_sized(rank, world, cases):
    """Calls whose outputs the staged path lends from its pool: the door takes them, its
    outputs lent by the pool as the Python path's are."""
    import ubep

    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=64, backend="shm", max_top_k=4, timeout_s=30,
                     **PATHS["staged"]) as buf:
        d = buf._door_dispatch = Counted(buf._door_dispatch)
        c = buf._door_combine = Counted(buf._door_combine)
        out = [run_case(buf, case, rank) for case in cases]
        pool = buf._backend._path._lend
        return out, (d.took, d.declined, c.took, c.declined), len(pool._blocks), pool.min_bytes


@needs_native
def test_the_staged_door_lends_pool_sized_outputs_from_the_pool():
    from ubep.testing import Case

    cases = [Case(num_experts=8, hidden=4096, top_k=4, tokens=(40, 33), seed=s, dtype=dt)
             for s, dt in ((1, "bf16"), (2, "fp32"))]
    outs = run_ranks(_pool_sized, 2, cases, timeout_s=200)
    for k, case in enumerate(cases):
        check_case(case, [o[0][k] for o in outs])
    for _, counts, blocks, min_bytes in outs:
        assert 33 * 4096 * 2 >= min_bytes                  # outputs the pool lends
        assert counts == (2, 0, 2, 0) and blocks > 0       # taken, outputs from the pool


def _door(rank, world, path, cases):
    """Every runtime case through a Buffer whose door is on, then the calls the door must
    leave to the Python path (each leaves the Buffer usable): all lent areas held, an older
    handle with direct=True, bad input, a closed Buffer."""
    import ubep

    out, counts = [], {}
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
                     max_tokens_per_rank=16, backend="shm", max_top_k=8, timeout_s=30,
                     **PATHS[path]) as buf:
        assert buf._door is not None
        d = buf._door_dispatch = Counted(buf._door_dispatch)
        c = buf._door_combine = Counted(buf._door_combine)
        for case in cases:                    # makes each dtype's views (declined: first
            run_case(buf, case, rank)         # calls of a dtype run the Python path)
        d.took = d.declined = c.took = c.declined = 0
        for case in cases:
            out.append(run_case(buf, case, rank))
        counts["cases"] = (d.took, d.declined, c.took, c.declined)
        x, idx, w = cases[0].inputs(rank)
        calls, held = [], []
        took, declined = d.took, d.declined
        for _ in range(6):                    # owned: more results held than lent areas
            res = buf.dispatch(x, idx, w)
            calls.append((res.handle.call, buf.last_stats is res.stats))
            held.append(res)
        counts["held"] = (d.took - took, d.declined - declined)
        ys = [buf.combine(expert_fn(r.recv_x), r.handle) for r in held[-1:]]
        counts["last_stats"] = buf.last_stats.op
        if path == "direct":                  # an older handle: the Python path names it
            with pytest.raises(ValueError, match="latest dispatch"):
                buf.combine(expert_fn(held[0].recv_x), held[0].handle)
        del held, res
        with pytest.raises(ValueError, match="hidden"):
            buf.dispatch(torch.zeros(1, buf.config.hidden + 1, dtype=torch.bfloat16),
                         idx[:1], w[:1])
        out.append(run_case(buf, cases[0], rank))
        counts["after"] = (d.took, c.took)
    with pytest.raises(RuntimeError, match="after close"):
        buf.dispatch(x, idx, w)
    return out, counts, calls, ys


@needs_native
@pytest.mark.parametrize("path", ["direct", "owned", "staged"])
def test_the_door_takes_the_common_call_and_leaves_the_rest_to_python(path):
    cases = runtime_cases(2)
    outs = run_ranks(_door, 2, path, cases, timeout_s=200)
    for k, case in enumerate([*cases, cases[0]]):
        check_case(case, [o[0][k] for o in outs])
    assert any(c.dtype == "fp16" for c in cases)
    for rank, (_, counts, calls, ys) in enumerate(outs):
        # every dispatch but those of no tokens (the Python checks take T = 0); every combine
        # (bf16, fp16 and fp32 rows; the expert function's output of int8/fp8 rows is bf16)
        empty = sum(c.tokens[rank] == 0 for c in cases)
        assert counts["cases"] == (len(cases) - empty, empty, len(cases), 0)
        assert [c for c, _ in calls] == list(range(2 * len(cases) + 1, 2 * len(cases) + 7))
        assert all(same for _, same in calls)
        held_took, held_declined = counts["held"]
        if path == "owned":       # each held result keeps its lent area: the door declines
            assert held_declined > 0   # once all are held, and the Python path copies out
        else:
            assert held_declined == 0
        assert counts["last_stats"] == "combine" and len(ys) == 1
        assert counts["after"][0] > held_took


def _door_timeout(rank, world, where, path):
    """Rank 1 leaves before the second call; rank 0's door hands the wait to Python, which
    times out and breaks the Buffer, as the Python path does."""
    import ubep

    x = torch.randn(2, H).to(torch.bfloat16)
    idx, w = torch.tensor([[0, 5], [7, 1]]), torch.rand(2, 2)
    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=4, backend="shm",
                     timeout_s=1.0, **PATHS[path]) as buf:
        first = buf.dispatch(x, idx, w)
        if rank == 1:
            time.sleep(2.5)
            return None
        try:
            if where == "dispatch":
                buf.dispatch(x, idx, w)
            else:
                buf.combine(first.recv_x, first.handle)
        except ubep.PeerTimeoutError as e:
            kind = type(e).__name__
        try:
            buf.dispatch(x, idx, w)
        except ubep.BrokenBufferError as e:
            return kind, type(e).__name__
    return "no error"


@needs_native
@pytest.mark.parametrize("path", ["owned", "staged"])
@pytest.mark.parametrize("where", ["dispatch", "combine"])
def test_a_wait_the_door_hands_on_times_out_and_breaks_the_buffer(where, path):
    out = run_ranks(_door_timeout, 2, where, path, timeout_s=60)
    assert out[0] == ("PeerTimeoutError", "BrokenBufferError")


def _two_threads(rank, world, n):
    """Two threads per rank, each calling its own Buffer (door on) at the same time: the
    door's kernels run without the GIL, so the two calls overlap for real."""
    import threading

    import ubep
    from ubep import reference
    from ubep.testing import make_routing, make_tokens

    bufs = [ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=4, backend="shm",
                        timeout_s=30, **PATHS[p]) for p in ("owned", "direct", "staged")]
    errors, done = [], [0, 0, 0]

    def work(k):
        try:
            for i in range(n):
                ins = [(make_tokens(r, 4, H, torch.bfloat16, seed=7 * i + k),
                        *make_routing(4, 3, E, seed=13 * i + r + 100 * k)) for r in range(world)]
                ref = reference.dispatch(*(list(a) for a in zip(*ins, strict=True)), E)
                res = bufs[k].dispatch(*ins[rank])
                assert torch.equal(res.recv_x.view(torch.uint8),
                                   ref[rank].recv_x.view(torch.uint8))
                y = bufs[k].combine(res.recv_x, res.handle)
                want = reference.combine([d.recv_x for d in ref], ref, [a[1] for a in ins],
                                         [a[2] for a in ins])[rank]
                assert torch.equal(y.view(torch.uint8), want.view(torch.uint8))
                done[k] += 1
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(repr(e))

    try:
        assert all(b._door is not None for b in bufs)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(bufs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for b in bufs:
            b.close()
    return errors, done


@needs_native
def test_two_threads_each_with_its_buffer_run_through_the_door_at_once():
    for errors, done in run_ranks(_two_threads, 2, 60, timeout_s=120):
        assert errors == [] and done == [60, 60, 60]
