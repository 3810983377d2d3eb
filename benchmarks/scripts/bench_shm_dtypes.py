"""Dispatch and combine time by row dtype, one process (a 1-rank group), medians.

Not a test (pytest does not collect it). With one rank no wait is left, so what differs
between dtypes is the work per element: moving rows (bytes) and combine's fp32 sums and
rounding back (docs/results/dtypes.md). The dtypes take turns of 200 calls, each on its own
Buffer, so a change in the host's speed during the run hits every dtype alike (this VM's
cores switch between two speeds from one second to the next, docs/results.md).

    .venv/bin/python -m benchmarks bench_shm_dtypes [shm|torch] [calls]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import ubep
from ubep.testing import make_routing, make_tokens, one_rank_group

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TURN = 200              # calls a dtype runs back to back before the next one's turn


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "shm"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    torch.set_num_threads(1)
    kw = dict(backend="shm", workers=1, direct="owned") if backend == "shm" else dict(
        backend="torch")
    print(f"{backend}: 1 rank, 7168-wide rows, top-8 of 16 experts, {calls} calls, µs "
          f"(median): dispatch / combine")
    cells: dict[torch.dtype, list[str]] = {dt: [] for dt in DTYPES}
    with one_rank_group():
        for tokens in (1, 32):
            idx, w = make_routing(tokens, 8, 16, kind="uniform", seed=7)
            bufs = {dt: ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128, **kw)
                    for dt in DTYPES}
            xs = {dt: make_tokens(0, tokens, 7168, dt, seed=3) for dt in DTYPES}
            times: dict[torch.dtype, tuple[list, list]] = {dt: ([], []) for dt in DTYPES}
            try:
                for turn in range(-1, -(-calls // TURN)):       # turn -1: untimed
                    for dt, buf in bufs.items():
                        d, c = times[dt]
                        for _ in range(TURN):
                            t0 = time.perf_counter_ns()
                            r = buf.dispatch(xs[dt], idx, w)
                            t1 = time.perf_counter_ns()
                            buf.combine(r.recv_x, r.handle)
                            t2 = time.perf_counter_ns()
                            if turn >= 0:
                                d.append((t1 - t0) / 1e3)
                                c.append((t2 - t1) / 1e3)
            finally:
                for buf in bufs.values():
                    buf.close()
            for dt, (d, c) in times.items():
                cells[dt].append(f"batch {tokens}: {statistics.median(d):7.1f} / "
                                 f"{statistics.median(c):7.1f}")
    for dt in DTYPES:
        print(f"  {str(dt).removeprefix('torch.'):9s}  " + "   ".join(cells[dt]))


if __name__ == "__main__":
    main()
