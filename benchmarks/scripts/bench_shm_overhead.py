"""Per-call overhead of a shm dispatch+combine with no peer to wait for: a 1-rank group.

Not a test (pytest does not collect it). With one rank every wait is satisfied at once, so
what remains is validation, kernel entries, copies and building results: the part of a
batch-1 call that profiling can attribute (run it under `py-spy record` or line_profiler).
Stable to a few percent even on a busy host, unlike a 2-rank latency.

    .venv/bin/python -m benchmarks bench_shm_overhead [direct|owned|ubep|bsp] [pairs]
"""

from __future__ import annotations

import sys
import time

import torch

import ubep
from ubep.testing import make_routing, make_tokens, one_rank_group


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "direct"
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    torch.set_num_threads(1)
    opts = {"direct": dict(direct=True), "owned": dict(direct="owned"),
            "ubep": dict(mode="ubep"), "bsp": dict(mode="bsp")}
    idx, w = make_routing(1, 8, 16, kind="uniform", seed=7)
    x = make_tokens(0, 1, 7168, torch.bfloat16, seed=3)
    with one_rank_group(), ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128,
                                       backend="shm", workers=1, **opts[kind]) as buf:
        def pair() -> None:
            r = buf.dispatch(x, idx, w)
            buf.combine(r.recv_x, r.handle)

        for _ in range(300):
            pair()
        ts = []
        for _ in range(pairs):
            t0 = time.perf_counter_ns()
            pair()
            ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    print(f"{kind}: batch-1 dispatch+combine, 1 rank, {pairs} pairs: median "
          f"{ts[pairs // 2] / 1e3:.1f} µs, p10 {ts[pairs // 10] / 1e3:.1f} µs, p99 "
          f"{ts[pairs * 99 // 100] / 1e3:.1f} µs")


if __name__ == "__main__":
    main()
