"""`ubep.native`'s compiled torch path (`torch_door_dispatch` / `torch_door_combine` from
`Buffer`, `torch_dispatch` / `torch_combine` from the backend): the door takes the CPU calls it
is made for, a dispatch whose peers sent more than its first collective holds goes on in
Python, and every result is the Python path's bit for bit (and the oracle's); a peer's failure
reaches the caller as an error, not a hang, and breaks the Buffer."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from ubep import validate
from ubep.native import load_native
from ubep.testing import check_case, run_case, run_ranks, runtime_cases

NATIVE = load_native()
pytestmark = pytest.mark.skipif(
    NATIVE is None and not os.environ.get("UBEP_REQUIRE_NATIVE"),
    reason="ubep.native not built (python -m ubep.native build)")


def _enum(cpp: str, name: str) -> list[tuple[str, str | None]]:
    body = re.search(rf"enum {name} : \w+ \{{([^}}]*)\}}", cpp).group(1)
    items = [n.strip() for n in body.split(",") if n.strip()]
    return [(i.split("=")[0].strip(), i.split("=")[1].strip() if "=" in i else None)
            for i in items]


def test_the_torch_path_reads_its_words_where_python_puts_them():
    """torch_path.cpp's K_/B_ enums are torch_entries' words; TD_/TC_ its door tuples'."""
    from ubep.runtime import torch_entries as te

    cpp = (Path(validate.__file__).parent / "native" / "torch_path.cpp").read_text()
    for enum in ("K", "B"):
        value = -1
        for name, expr in _enum(cpp, enum):
            value = eval(expr, vars(te)) if expr else value + 1     # "K_ERR = K_OFFSETS + 8"
            assert getattr(te, name) == value, name
        assert name == f"{enum}_LEN"
    for enum, fields in (("Td", te.DISPATCH_DOOR), ("Tc", te.COMBINE_DOOR),
                         ("Tr", te.BUFFER_DOOR)):
        names = [n for n, _ in _enum(cpp, enum)]
        assert names[-1].endswith("_LEN")
        assert tuple(n[3:].lower() for n in names[:-1]) == fields


class _Counted:
    """An entry that counts its answers: a result (`took`) or NotImplemented (`declined`)."""

    def __init__(self, fn):
        self.fn, self.took, self.declined = fn, 0, 0

    def __call__(self, *args):
        r = self.fn(*args)
        if r is NotImplemented:
            self.declined += 1
        else:
            self.took += 1
        return r


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (an empty tensor's: none; numpy's empty arrays come with stride 0)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0)


def _both_paths(rank, world, cases, rounds):
    """Each case through a Buffer on the compiled path and one on the Python path, `rounds`
    times (the inline capacity changes with the batches, so some calls need phase 2; the
    first round's growing scratch drops the shapes' words, so the door takes calls from the
    second round on)."""
    import ubep

    kw = dict(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
              max_tokens_per_rank=16, backend="torch", max_top_k=8)
    nat = ubep.Buffer(**kw)
    os.environ["UBEP_NATIVE"] = "0"
    try:
        py = ubep.Buffer(**kw)
    finally:
        os.environ.pop("UBEP_NATIVE")
    assert py._backend._native is None and py._door is None
    d = nat._door_dispatch = _Counted(nat._door_dispatch)
    c = nat._door_combine = _Counted(nat._door_combine)
    rest = nat._backend._native_rest = _Counted(nat._backend._native_rest)
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
        check_case(case, [o[0][k] for o in outs])
    for _, same, (took, declined, handed, c_took, c_declined), stats in outs:
        assert same
        # the door takes every call but a shape's first (which makes its words); some of the
        # calls it took went on in Python after their first collective (phase 2)
        assert took > 0 and declined > 0 and handed > 0
        # combines of bf16 and fp32 expert outputs (fp16 ones take the torch ops: declined)
        assert c_took > 0 and c_declined > 0
        assert stats["backend"] == "torch" and stats["op"] == "combine"
        assert stats["extra"]["collectives"][0][0] == "partials_back"


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
