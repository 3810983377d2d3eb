"""Dispatch and combine time by row dtype, one process (a 1-rank group), medians.

Not a test (pytest does not collect it). With one rank no wait is left, so what differs
between dtypes is the work per element: moving rows (bytes) and combine's fp32 sums and
rounding back (docs/results/dtypes.md).

    .venv/bin/python tests/runtime/bench_shm_dtypes.py [shm|torch] [calls]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import ubep
from ubep.testing import make_routing, make_tokens, one_rank_group


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "shm"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    torch.set_num_threads(1)
    kw = dict(backend="shm", workers=1, direct="owned") if backend == "shm" else dict(
        backend="torch")
    print(f"{backend}: 1 rank, 7168-wide rows, top-8 of 16 experts, {calls} calls, µs "
          f"(median): dispatch / combine")
    with one_rank_group():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            cells = []
            for tokens in (1, 32):
                idx, w = make_routing(tokens, 8, 16, kind="uniform", seed=7)
                x = make_tokens(0, tokens, 7168, dtype, seed=3)
                with ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128,
                                 **kw) as buf:
                    d, c = [], []
                    for i in range(calls + 200):          # the first 200 untimed
                        t0 = time.perf_counter_ns()
                        r = buf.dispatch(x, idx, w)
                        t1 = time.perf_counter_ns()
                        buf.combine(r.recv_x, r.handle)
                        t2 = time.perf_counter_ns()
                        if i >= 200:
                            d.append((t1 - t0) / 1e3)
                            c.append((t2 - t1) / 1e3)
                cells.append(f"batch {tokens}: {statistics.median(d):7.1f} / "
                             f"{statistics.median(c):7.1f}")
            print(f"  {str(dtype).removeprefix('torch.'):9s}  " + "   ".join(cells))


if __name__ == "__main__":
    main()
