"""Where a batch-1 shm call's time goes, layer by layer, in place: the same dispatch+combine
called through `Buffer`, through its backend (`ShmBackend`, no input checks, lock or
autograd/compile decision) and through the backend's path (`DirectPath`), alternating every 20
calls in one process (a 1-rank group), so each layer's cost is the difference of two medians
taken side by side. A piece timed in a tight loop of its own costs less than in place (its
code and data stay hot there), so this is the measure to trust.

Not a test (pytest does not collect it); the numbers are in docs/results.md ("Layer by layer,
in place").

    .venv/bin/python tests/runtime/bench_shm_layers.py [owned|true] [ROUNDS]
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
        alternate(ways, 20)                                   # warm-up
        return alternate(ways, rounds)


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
          f"{med['backend'] - med['path']:.1f} µs")


if __name__ == "__main__":
    main()
