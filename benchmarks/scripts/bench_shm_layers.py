"""Where a batch-1 shm call's time goes, layer by layer, in place: the same dispatch+combine
called through `Buffer`, through its backend (`ShmBackend`, no input checks, lock or
autograd/compile decision), through the backend's path (`DirectPath`) and, with `ubep.native`
built, through the path's two C++ entries alone (same arguments, no result objects or stats:
no stats builder, so they return their raw parts),
alternating every 20 calls in one process (a 1-rank group), so each layer's cost is the
difference of two medians taken side by side. A piece timed in a tight loop of its own costs
less than in place (its code and data stay hot there), so this is the measure to trust.

Not a test (pytest does not collect it): it prints its figures.

    .venv/bin/python -m benchmarks bench_shm_layers [owned|true] [ROUNDS]
"""

from __future__ import annotations

import sys

import numpy as np


def _rank(rank: int, world: int, direct: str, rounds: int) -> dict[str, list[int]]:
    import torch

    import ubep
    from ubep.runtime.shm.waits import now_us
    from ubep.testing import alternate, make_routing, make_tokens

    idx, w = make_routing(1, 8, 16, kind="uniform", seed=7)
    x = make_tokens(0, 1, 7168, torch.bfloat16, seed=3)
    with ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="shm",
                     workers=1, direct=True if direct == "true" else direct) as buf:
        backend, path = buf._backend, buf._backend._path
        calls = iter(range(1 << 40))

        def through_buffer():
            r = buf.dispatch(x, idx, w)
            buf.combine(r.recv_x, r.handle)

        def through_backend():
            r = backend.dispatch(x, idx, w, next(calls))
            backend.combine(r.recv_x, r.handle, True)

        def through_path():
            r = path.dispatch(x, idx, w, next(calls), now_us())
            path.combine(r.recv_x, r.handle, True, now_us())

        ways = {"Buffer": through_buffer, "backend": through_backend, "path": through_path}
        if path._native is not None:
            ways["entries"] = _entries(path, x, idx, w)
        alternate(ways, 20)                                   # warm-up
        return alternate(ways, rounds)


def _entries(path, x, idx, w):
    """The path's compiled dispatch and combine entries called as its common call calls them
    (rows to a free lent area or the recv area; combined where they lie)."""
    import torch

    from ubep.runtime.shm.direct.path import combine_codes

    code, ecode, _ = combine_codes(x.dtype)
    area = 1 if path.owned else 0
    roff = path._recv_off + area * path._area
    view = path._area_view(area, roff, x.shape[1], x.dtype)
    t_n, k_n = idx.shape
    nat, base = path._native, path.ctx.base

    def call():
        path._epoch += 1
        left, n, missing, tpe, ints, wts, state, recv_x, t1 = nat.direct_dispatch(
            path._st_addr, x, idx, w, path._epoch, code, roff, path.owned, view, 0, 0, 0.0,
            None)
        assert not (left or missing)
        path._c_epoch += 1
        ptr = recv_x.data_ptr()
        left, waiting, out, t1 = nat.direct_combine(
            path._st_addr, path._c_epoch, code, ecode, ptr - base, ptr, 0, ints, state[0],
            state[1], t_n, k_n, True, state[4], None, x.dtype is torch.bfloat16, 0.0, None,
            False, idx)
        assert not (left or waiting)
    return call


def main() -> None:
    from ubep.testing import run_ranks

    direct = sys.argv[1] if len(sys.argv) > 1 else "owned"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    times = run_ranks(_rank, 1, direct, rounds, timeout_s=1800, threads_per_rank=1)[0]
    med = {k: np.median(v) / 1e3 for k, v in times.items()}
    print(f"direct={direct}, batch 1, one process, medians of {len(times['path'])} calls each:")
    for k, v in med.items():
        print(f"  through {k:8s} {v:6.1f} µs")
    print(f"  Buffer's layer {med['Buffer'] - med['backend']:.1f} µs, the backend's "
          f"{med['backend'] - med['path']:.1f} µs"
          + (f", the path's around its C++ entries {med['path'] - med['entries']:.1f} µs"
             if "entries" in med else " (ubep.native not built: no C++ entries)"))


if __name__ == "__main__":
    main()
