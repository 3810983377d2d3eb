"""`ubep.native`'s compiled torch path (`torch_dispatch` / `torch_combine`): it takes the CPU
calls it is made for, hands a dispatch whose peers sent more than its first collective holds
back to the Python path, and every result is the Python path's bit for bit (and the oracle's);
a peer's failure reaches the caller as an error, not a hang."""

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
    for enum, fields in (("Td", te.DISPATCH_DOOR), ("Tc", te.COMBINE_DOOR)):
        names = [n for n, _ in _enum(cpp, enum)]
        assert names[-1].endswith("_LEN")
        assert tuple(n[3:].lower() for n in names[:-1]) == fields


class _Counting:
    """A Buffer's `ubep_native` seen through a proxy that counts the torch entries' answers:
    a result (`took`) or a tuple (`handed`: the dispatch goes on in Python)."""

    def __init__(self, mod):
        self.mod, self.took, self.handed, self.combines = mod, 0, 0, 0

    def __getattr__(self, name):
        return getattr(self.mod, name)

    def torch_dispatch(self, *args):
        r = self.mod.torch_dispatch(*args)
        if type(r) is tuple:
            self.handed += 1
        else:
            self.took += 1
        return r

    def torch_combine(self, *args):
        self.combines += 1
        return self.mod.torch_combine(*args)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (an empty tensor's: none; numpy's empty arrays come with stride 0)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0)


def _both_paths(rank, world, cases, rounds):
    """Each case through a Buffer on the compiled path and one on the Python path, `rounds`
    times (the inline capacity changes with the batches, so some calls need phase 2)."""
    import ubep

    kw = dict(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
              max_tokens_per_rank=16, backend="torch", max_top_k=8)
    nat = ubep.Buffer(**kw)
    os.environ["UBEP_NATIVE"] = "0"
    try:
        py = ubep.Buffer(**kw)
    finally:
        os.environ.pop("UBEP_NATIVE")
    assert py._backend._native is None
    counting = nat._backend._native = _Counting(nat._backend._native)
    outs, same = [], True
    with nat, py:
        for _ in range(rounds):
            for case in cases:
                a, b = run_case(nat, case, rank), run_case(py, case, rank)
                same = same and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                    and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)
                outs.append(a)
        st = nat.last_stats
    return outs, same, (counting.took, counting.handed, counting.combines), st.to_dict()


def test_the_compiled_torch_path_gives_the_python_paths_bits_and_the_oracles_results():
    cases = runtime_cases(2)
    outs = run_ranks(_both_paths, 2, cases, 2, timeout_s=300)
    for k, case in enumerate(cases * 2):
        check_case(case, [o[0][k] for o in outs])
    for _, same, (took, handed, combines), stats in outs:
        assert same
        assert took > 0 and handed > 0       # both the whole call and phase 1 only
        # combines of bf16 and fp32 expert outputs (fp16 ones take the torch ops)
        assert combines > 0
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
    try:
        buf.dispatch(x, idx, w)
    except RuntimeError as e:
        return f"raised: {e}"[:200]
    return "returned"


def test_a_peer_that_is_gone_is_an_error_of_the_compiled_dispatch():
    out = run_ranks(_peer_gone, 2, timeout_s=120, return_exceptions=True, pg_timeout_s=20)
    assert isinstance(out[0], str) and out[0].startswith("raised"), out
