"""`ubep.native`: the compiled fast checks give the Python checks' answers, and the library
runs the same without them (`UBEP_NATIVE=0`)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep import validate
from ubep.native import load_native, status
from ubep.testing import check_case, run_case, run_ranks, runtime_cases

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
    assert status() in ("native checks on", "native checks not built "
                        "(python -m ubep.native build)", "native checks off (UBEP_NATIVE=0)")


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
    assert NATIVE.dispatch_inputs_ready(x, idx, w, *LIMITS) is True
    assert NATIVE.combine_inputs_ready(torch.zeros(3, H), 3, H) is True
    assert validate.dispatch_inputs_ready is NATIVE.dispatch_inputs_ready


def _round_trips(rank, world, cases):
    import ubep
    from ubep import validate as v

    assert v.dispatch_inputs_ready is v.py_dispatch_inputs_ready
    assert v.combine_inputs_ready is v.py_combine_inputs_ready
    out = []
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
                     max_tokens_per_rank=16, backend="shm", max_top_k=8, timeout_s=30,
                     direct="owned") as buf:
        for case in cases:
            out.append(run_case(buf, case, rank))
        with pytest.raises(ValueError, match=r"expert id 99; ids must lie in \[-1, "):
            buf.dispatch(torch.zeros(1, buf.config.hidden), torch.tensor([[99]]),
                         torch.ones(1, 1))
        out.append(run_case(buf, cases[0], rank))
    return out


def test_without_the_extension_the_python_checks_run_and_agree_with_the_oracle(monkeypatch):
    monkeypatch.setenv("UBEP_NATIVE", "0")
    cases = runtime_cases(2)[:4]
    outs = run_ranks(_round_trips, 2, cases, timeout_s=120)
    for k, case in enumerate([*cases, cases[0]]):
        check_case(case, [o[k] for o in outs])
