"""`ubep.native`'s compiled torch path (`torch_door_dispatch` / `torch_door_combine` from
`Buffer`, `torch_dispatch` / `torch_combine` from the backend): the door takes the CPU calls it
is made for, a dispatch whose peers sent more than its first collective holds goes on in
Python, and every result is the Python path's bit for bit (and the oracle's); a peer's failure
reaches the caller as an error, not a hang, and breaks the Buffer."""

from __future__ import annotations

import os

import pytest
import torch

from ubep.native import load_native
from ubep.testing import Counted, check_case, expert_fn, run_case, run_ranks, runtime_cases

NATIVE = load_native()
pytestmark = pytest.mark.skipif(
    NATIVE is None and not os.environ.get("UBEP_REQUIRE_NATIVE"),
    reason="ubep.native not built (python -m ubep.native build)")


def _both(**kw):
    """A torch Buffer on the compiled path and one on the Python path (made under
    `UBEP_NATIVE=0`), same arguments; the first's door entries and phase-2 hand-over counted
    (`Counted`: `.dispatch`, `.combine`, `.rest`)."""
    import ubep

    nat = ubep.Buffer(backend="torch", **kw)
    os.environ["UBEP_NATIVE"] = "0"
    try:
        py = ubep.Buffer(backend="torch", **kw)
    finally:
        os.environ.pop("UBEP_NATIVE")
    assert nat._door is not None and py._backend._native is None and py._door is None
    nat.dispatch_count = nat._door_dispatch = Counted(nat._door_dispatch)
    nat.combine_count = nat._door_combine = Counted(nat._door_combine)
    nat.rest_count = nat._backend._native_rest = Counted(nat._backend._native_rest)
    nat._door = nat._backend.door(nat._lock, nat._limits, nat._words)    # (holds `rest`)
    return nat, py


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (an empty tensor's: none; numpy's empty arrays come with stride 0)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0)


def _both_paths(rank, world, cases, rounds):
    """Each case through a Buffer on the compiled path and one on the Python path, `rounds`
    times (the inline capacity changes with the batches, so some calls need phase 2; the
    first round's growing scratch drops the shapes' words, so the door takes calls from the
    second round on)."""
    nat, py = _both(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
                    max_tokens_per_rank=16, max_top_k=8)
    d, c, rest = nat.dispatch_count, nat.combine_count, nat.rest_count
    outs, same = [], True
    with nat, py:
        for _ in range(rounds):
            for case in cases:
                a, b = run_case(nat, case, rank), run_case(py, case, rank)
                same = same and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                    and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)
                outs.append(a)
        st = nat.last_stats
    return outs, same, (d.took, d.declined, rest.took, c.took, c.declined), st.to_dict()


def test_the_compiled_torch_path_gives_the_python_paths_bits_and_the_oracles_results():
    cases = runtime_cases(2)
    outs = run_ranks(_both_paths, 2, cases, 3, timeout_s=300)
    for k, case in enumerate(cases * 3):
        check_case(case, [o[0][k] for o in outs], contract="torch")
    for _, same, (took, declined, _, c_took, c_declined), stats in outs:
        assert same
        # the door takes every call but a shape's first (which makes its words)
        assert took > 0 and declined > 0
        # combines of bf16, fp16 and fp32 expert outputs (a shape's first: declined)
        assert c_took > 0 and c_declined > 0
        assert stats["backend"] == "torch" and stats["op"] == "combine"
        assert stats["extra"]["collectives"][0][0] == "partials_back"


def _phase2_inputs(rank: int, call: int):
    """Batch 1 on both ranks, except from call 3 on: rank 1 sends 16 tokens, all to rank 0's
    experts (more than the first collective holds at hidden 7168: three tokens)."""
    from ubep.testing import make_tokens

    n = 16 if rank == 1 and call >= 3 else 1
    g = torch.Generator().manual_seed(100 * call + rank)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])
    w = torch.rand(n, 2, generator=g)
    return make_tokens(rank, n, 7168, torch.bfloat16, seed=call), idx, w


def _phase2(rank, world):
    """Six calls on a compiled-path Buffer and a Python-path one (see `_phase2_inputs`): on
    rank 0, call 3 finds its receive scratch too small for phase 2 (the door hands it to
    Python, which grows it); call 4, a new shape (no tokens inline: a count exchange first),
    runs in Python and makes its words; call 5 runs both collectives compiled."""
    nat, py = _both(num_experts=16, hidden=7168, max_tokens_per_rank=16)
    d, rest = nat.dispatch_count, nat.rest_count
    out, log = [], []
    with nat, py:
        for call in range(6):
            x, idx, w = _phase2_inputs(rank, call)
            took, handed = d.took, rest.took
            a, b = nat.dispatch(x, idx, w), py.dispatch(x, idx, w)
            ya = nat.combine(expert_fn(a.recv_x), a.handle)
            yb = py.combine(expert_fn(b.recv_x), b.handle)
            assert torch.equal(_bits(a.recv_x), _bits(b.recv_x)) and torch.equal(ya, yb)
            assert torch.equal(a.recv_src_token, b.recv_src_token)
            assert torch.equal(a.recv_weights, b.recv_weights)
            colls = [c[0] for c in a.stats.extra["collectives"]]
            log.append((d.took - took, rest.took - handed, colls))
            out.append((a.recv_x.clone(), a.recv_src_rank, a.recv_src_token, a.recv_src_slot,
                        ya))
    return out, log


def test_phase_2_runs_compiled_and_hands_to_python_when_the_scratch_must_grow():
    from ubep import reference

    outs = run_ranks(_phase2, 2, timeout_s=300)
    log = outs[0][1]
    assert log[2] == (1, 0, ["inline"])                # the door, phase 1 only
    assert log[3] == (1, 1, ["inline", "rows"])        # the door; phase 2 in Python (grows)
    assert log[4] == (0, 0, ["counts", "rows"])        # a new shape: Python
    assert log[5] == (1, 0, ["counts", "rows"])        # the door, both compiled
    for call in range(6):
        ins = [_phase2_inputs(r, call) for r in range(2)]
        ref = reference.dispatch([i[0] for i in ins], [i[1] for i in ins],
                                 [i[2] for i in ins], 16)
        ref_y = reference.combine_partials([expert_fn(r.recv_x) for r in ref], ref,
                                           [i[1] for i in ins], [i[2] for i in ins],
                                           bf16_ties_away=True)      # the torch contract
        for r in range(2):
            x, src_rank, src_token, src_slot, y = outs[r][0][call]
            assert torch.equal(_bits(x), _bits(ref[r].recv_x))
            assert torch.equal(src_rank, ref[r].recv_src_rank)
            assert torch.equal(src_token, ref[r].recv_src_token)
            assert torch.equal(src_slot, ref[r].recv_src_slot)
            assert torch.equal(_bits(y), _bits(ref_y[r]))


def _serving(rank, world, calls):
    """`calls` dispatch+combine calls whose batch (1-16 tokens) and routing change every call,
    as a server's decode steps do, on a compiled-path Buffer and a Python-path one."""
    from ubep.testing import make_routing, make_tokens

    nat, py = _both(num_experts=16, hidden=4096, max_tokens_per_rank=16)
    d, c = nat.dispatch_count, nat.combine_count
    g = torch.Generator().manual_seed(rank)
    with nat, py:
        for call in range(calls):
            n = int(torch.randint(1, 17, (1,), generator=g))
            idx, w = make_routing(n, 4, 16, kind="uniform", seed=1000 * call + rank)
            x = make_tokens(rank, n, 4096, torch.bfloat16, seed=call)
            a, b = nat.dispatch(x, idx, w), py.dispatch(x, idx, w)
            assert torch.equal(_bits(a.recv_x), _bits(b.recv_x))
            assert torch.equal(a.recv_src_token, b.recv_src_token)
            assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)
            weighted = call % 3 != 0
            ya = nat.combine(expert_fn(a.recv_x), a.handle, weighted=weighted)
            yb = py.combine(expert_fn(b.recv_x), b.handle, weighted=weighted)
            assert torch.equal(_bits(ya), _bits(yb))
    return d.took, d.declined, c.took, c.declined


def test_the_door_keeps_taking_calls_when_the_batch_and_routing_change_every_call():
    """The compiled path's words are per row type and inline capacity, not per batch: a
    server's changing batches do not make every call a first one."""
    for took, declined, c_took, c_declined in run_ranks(_serving, 2, 60, timeout_s=300):
        assert took + declined == 60 and took >= 40, (took, declined)
        assert c_took + c_declined == 60 and c_took >= 50, (c_took, c_declined)


def _peer_gone(rank, world):
    import ubep
    from ubep.testing import make_routing, make_tokens

    buf = ubep.Buffer(num_experts=8, hidden=64, max_tokens_per_rank=4, backend="torch")
    assert buf._backend._native is not None
    idx, w = make_routing(2, 2, 8, kind="uniform", seed=rank)
    x = make_tokens(rank, 2, 64, torch.bfloat16, seed=1)
    r = buf.dispatch(x, idx, w)
    buf.combine(r.recv_x, r.handle)
    if rank == 1:
        os._exit(0)                    # gone, its sockets closed
    assert buf._door is not None
    with pytest.raises(RuntimeError):          # through the door (the shape is known)
        buf.dispatch(x, idx, w)
    with pytest.raises(ubep.BrokenBufferError, match="earlier call failed"):
        buf.dispatch(x, idx, w)                 # the failure broke the Buffer
    buf.close()
    return "raised"


def test_a_peer_that_is_gone_is_an_error_of_the_compiled_dispatch_and_breaks_the_buffer():
    out = run_ranks(_peer_gone, 2, timeout_s=120, return_exceptions=True, pg_timeout_s=20)
    assert out[0] == "raised", out


def _elastic_pair(rank, world):
    """`_phase2`'s six calls on two elastic Buffers, one on the compiled path and one on the
    Python path: what each call's collectives sent (the compiled path's from the record a
    recovery would replay, the Python path's as they ran), as bytes and byte splits."""
    import ubep

    kw = dict(backend="torch", num_experts=16, hidden=7168, max_tokens_per_rank=16,
              elastic=True)
    nat = ubep.Buffer(**kw)
    os.environ["UBEP_NATIVE"] = "0"
    try:
        py = ubep.Buffer(**kw)
    finally:
        os.environ.pop("UBEP_NATIVE")

    def sent(buf) -> list:
        return [(_bits(i).clone(), [n * i.element_size() for n in s],
                 [n * i.element_size() for n in r])
                for i, s, r in buf._backend.recovery.last_collectives()]

    log = []
    with nat, py:
        assert nat._door is None and py._backend._native is None
        for call in range(12):      # the second six: on scratch the first six grew
            x, idx, w = _phase2_inputs(rank, call % 6)
            for buf in (nat, py):   # what a call does not write is the same in both: zeros
                for scratch in (buf._backend._scratch, buf._backend._alt[0]):
                    for t in scratch.values():
                        t.zero_()
            a, b = nat.dispatch(x, idx, w), py.dispatch(x, idx, w)
            sd = sent(nat), sent(py)
            ya = nat.combine(expert_fn(a.recv_x), a.handle)
            yb = py.combine(expert_fn(b.recv_x), b.handle)
            sc = sent(nat), sent(py)
            same = (torch.equal(_bits(a.recv_x), _bits(b.recv_x)) and torch.equal(ya, yb)
                    and torch.equal(a.recv_src_token, b.recv_src_token))
            log.append((same, sd, sc) if call >= 6 else (same,))
        compiled = nat._backend.recovery.compiled_calls
    return log, compiled


def test_an_elastic_buffer_runs_compiled_and_records_what_the_python_path_sends():
    """With `elastic=True` the compiled path takes the calls while every rank is active, its
    waits bounded and each collective recorded for a replay (`torch_path.cpp`'s Watch); the
    record is, byte for byte, what the Python path's collectives sent."""
    for log, compiled in run_ranks(_elastic_pair, 2, timeout_s=300):
        assert compiled >= 20                    # of 24 calls (a new shape's: Python)
        for same, *sends in log:
            assert same
            for nat, py in sends:
                assert len(nat) == len(py) > 0
                for (a, sa, ra), (b, sb, rb) in zip(nat, py):
                    assert torch.equal(a, b) and sa == sb and ra == rb
