"""The compiled extension changes no bit: the same seeded calls in separate processes, one
set with `ubep.native` on and one with it off (`UBEP_NATIVE=0`), on every path that has
compiled entries (the shm direct and owned paths, the one-worker staged path in each mode
and sync, the torch backend), every output compared bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from ubep.native import load_native
from ubep.testing import expert_fn, run_case, run_ranks, runtime_cases

pytestmark = pytest.mark.skipif(
    load_native() is None and not os.environ.get("UBEP_REQUIRE_NATIVE"),
    reason="ubep.native not built (python -m ubep.native build)")

#: every path with compiled entries, as Buffer options
PATHS = {"direct": dict(backend="shm", direct=True),
         "owned": dict(backend="shm", direct="owned"),
         "staged": dict(backend="shm", direct=False, workers=1),
         "staged-bsp": dict(backend="shm", direct=False, workers=1, mode="bsp"),
         "staged-sw": dict(backend="shm", direct=False, workers=1, sync="sw"),
         "torch": dict(backend="torch")}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _all_paths(rank, world, cases):
    """Each case twice on every path (the torch door takes a row type's calls from its
    second on), then a combine into a caller's `out`; every output as bytes, and whether
    the compiled door was there."""
    import ubep

    outs, doors = {}, {}
    for name, kw in PATHS.items():
        got = []
        with ubep.Buffer(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
                         max_tokens_per_rank=16, max_top_k=8, timeout_s=30, **kw) as buf:
            doors[name] = buf._door is not None
            for _ in range(2):
                for case in cases:
                    got.append({k: (str(v.dtype), tuple(v.shape), _bits(v))
                                for k, v in run_case(buf, case, rank).items()})
            x, idx, w = cases[0].inputs(rank)
            res = buf.dispatch(x, idx, w)
            out = torch.empty(x.shape[0], buf.config.hidden, dtype=x.dtype)
            y = buf.combine(expert_fn(res.recv_x), res.handle, out=out)
            got.append({"out": (str(y.dtype), tuple(y.shape), _bits(y))})
        outs[name] = got
    return outs, doors


def test_every_path_gives_the_same_bits_with_the_extension_on_and_off():
    cases = [c for c in runtime_cases(2) if c.dtype in ("bf16", "fp32", "fp16")]
    on = run_ranks(_all_paths, 2, cases, timeout_s=240, env={"UBEP_NATIVE": "1"})
    off = run_ranks(_all_paths, 2, cases, timeout_s=240, env={"UBEP_NATIVE": "0"})
    for rank in range(2):
        assert all(on[rank][1].values()), on[rank][1]        # every door there when on
        assert not any(off[rank][1].values()), off[rank][1]  # and none when off
        for name in PATHS:
            assert on[rank][0][name] == off[rank][0][name], (rank, name)
