"""How host work right before a gloo collective changes the collective's time.

Not a test (pytest does not collect it). Two ranks; each round: a tight cross-process
barrier, then X, then one all_to_all_single of 28 KB per peer (two bf16 rows of hidden
7168); X in {nothing, a 60 µs Python spin, the spin then `os.sched_yield()`, 30 small numpy
calls, 20 small torch ops, the spin on rank 0 only}, interleaved round by round. Prints
the median (max over ranks) of the collective alone and of X + collective. The raw-
collectives line of `ubep bench` is the "nothing" case; the torch backend does its packing
(or combine's reduction) where X is.

    .venv/bin/python -m benchmarks bench_torch_gap [rounds]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

KINDS = ("nothing", "spin60", "spin60+yield", "numpy30", "torch20", "spin60 rank0 only")


def _rank(rank: int, world: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    from ubep.bench.flags import HostSync

    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    send = torch.zeros(world * 2 * 14336, dtype=torch.uint8)
    recv = torch.empty_like(send)
    split = [2 * 14336] * world
    a, t = np.random.rand(64), torch.zeros(8)

    def spin(us: float) -> None:
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass

    out = {k: [] for k in KINDS}
    try:
        for _ in range(rounds):
            for k in KINDS:
                sync.barrier()
                t0 = time.perf_counter()
                if k in ("spin60", "spin60+yield") or (k == "spin60 rank0 only" and rank == 0):
                    spin(60)
                    if k == "spin60+yield":
                        os.sched_yield()
                elif k == "numpy30":
                    for _ in range(30):
                        np.cumsum(a)
                elif k == "torch20":
                    for _ in range(20):
                        t.add_(1)
                t1 = time.perf_counter()
                dist.all_to_all_single(recv, send, split, split)
                out[k].append(((t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6))
    finally:
        sync.close()
    return {k: np.array(v) for k, v in out.items()}


def main() -> None:
    from ubep.testing import run_ranks

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    res = run_ranks(_rank, 2, rounds)
    for k in KINDS:
        coll = np.maximum(res[0][k][:, 1], res[1][k][:, 1])
        total = np.maximum(res[0][k].sum(1), res[1][k].sum(1))
        print(f"{k:18s} collective median {np.median(coll):6.0f} us  p10 "
              f"{np.percentile(coll, 10):6.0f}  X + collective median {np.median(total):6.0f}")


if __name__ == "__main__":
    main()
