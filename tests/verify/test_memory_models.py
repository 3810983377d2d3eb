"""The model checker's memory models reproduce the classic litmus tests."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.verify.machine import MODELS, Await, Deliver, Fence, Load, Protocol, Store, check


def _sb(fence: bool = False) -> Protocol:
    """Store buffering: each thread stores its flag, (fences,) then loads the other's."""
    mid = (Fence(),) if fence else ()
    return Protocol("SB", "store buffering", (Store((("x", 1),), 1), *mid, Load("y", "r")),
                    (Store((("y", 1),), 1), *mid, Load("x", "r")), {"x": 0, "y": 0}, ())


def _mp(release: bool, acquire: bool) -> Protocol:
    """Message passing: data then flag; the reader waits for the flag, then loads data."""
    return Protocol("MP", "message passing",
                    (Store((("data", 1),), 1), Store((("flag", 1),), 1, release)),
                    (Await("flag", "eq", 1, acquire=acquire), Load("data", "d")),
                    {"data": 0, "flag": 0}, ())


def _values(outcome) -> dict:
    return {(who, reg): v for who, reg, v in outcome}


@pytest.mark.parametrize("model", MODELS)
def test_store_buffering_both_zero_only_with_store_buffers(model):
    outs = [_values(o) for o in check(_sb(), model).outcomes]
    both_zero = any(o[("S", "r")] == 0 and o[("R", "r")] == 0 for o in outs)
    assert both_zero == (model != "sc")
    assert any(o[("S", "r")] == 1 and o[("R", "r")] == 1 for o in outs)


@pytest.mark.parametrize("model", MODELS)
def test_fences_forbid_store_buffering(model):
    outs = [_values(o) for o in check(_sb(fence=True), model).outcomes]
    assert not any(o[("S", "r")] == 0 and o[("R", "r")] == 0 for o in outs)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("acquire", [False, True])
def test_message_passing_needs_release_and_acquire_only_where_weak(model, release, acquire):
    outs = [_values(o) for o in check(_mp(release, acquire), model).outcomes]
    stale_data = any(o[("R", "d")] == 0 for o in outs)
    stores_reorder = model in ("weak", "block") and not release
    loads_reorder = model == "weak" and not acquire
    assert stale_data == (stores_reorder or loads_reorder)
    assert any(o[("R", "d")] == 1 for o in outs)


def test_thread_sees_its_own_buffered_store():
    proto = Protocol("fwd", "store forwarding", (Store((("x", 7),), 1), Load("x", "r")), (),
                     {"x": 0}, ())
    for model in MODELS:
        assert {_values(o)[("S", "r")] for o in check(proto, model).outcomes} == {7}


def test_block_store_is_atomic_only_under_block():
    writer = (Store((("a", 1), ("b", 1)), 1),)
    reader = (Await("b", "eq", 1), Load("a", "r"), Deliver(0, 1, ("r",)))
    proto = Protocol("blk", "two-word block", writer, reader, {"a": 0, "b": 0}, ())
    assert check(proto, "block").ok
    assert check(proto, "tso").ok          # program order: a before b
    assert set(check(proto, "weak").counterexamples) == {"stale"}   # b drained before a


def test_a_wait_that_can_never_succeed_is_stuck():
    proto = Protocol("never", "waits for a value nobody writes", (),
                     (Await("x", "eq", 1),), {"x": 0}, ())
    result = check(proto, "sc")
    assert set(result.counterexamples) == {"stuck"}
    assert not result.ok


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="model='arm'"):
        check(_sb(), "arm")
    proto = Protocol("bad", "", (Load("nowhere", "r"),), (), {"x": 0}, ())
    with pytest.raises(ValueError, match="'nowhere'"):
        check(proto, "sc")


# -- properties over random small programs --------------------------------------------------------

@st.composite
def _programs(draw):
    """Two threads of 1-3 stores/loads/fences over two words; values and registers unique."""
    counter = iter(range(1, 100))
    threads = []
    for _ in range(2):
        prog = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["store", "load", "fence"]))
            addr = draw(st.sampled_from(["x", "y"]))
            n = next(counter)
            if kind == "store":
                prog.append(Store(((addr, n),), n, draw(st.booleans())))
            elif kind == "load":
                prog.append(Load(addr, f"r{n}"))
            else:
                prog.append(Fence())
        threads.append(tuple(prog))
    return Protocol("random", "", threads[0], threads[1], {"x": 0, "y": 0}, ())


@settings(max_examples=150, deadline=None)
@given(_programs())
def test_weaker_models_only_add_behaviours(proto):
    out = {m: check(proto, m).outcomes for m in MODELS}
    assert out["sc"] <= out["tso"] <= out["block"] <= out["weak"]
    assert out["sc"]          # every program finishes somehow


@settings(max_examples=100, deadline=None)
@given(_programs())
def test_fences_everywhere_restore_sequential_consistency(proto):
    def fenced(prog):
        return tuple(x for ins in prog for x in (ins, Fence()))

    fenced_proto = Protocol("fenced", "", fenced(proto.sender), fenced(proto.receiver),
                            proto.initial, ())
    sc = check(proto, "sc").outcomes
    for m in MODELS:
        assert check(fenced_proto, m).outcomes == sc
