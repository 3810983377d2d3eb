"""Latency of dispatch+combine: shm (ubep, bsp) vs torch (gloo), 2 ranks, same routing.

Not a test (pytest does not collect it). The issue 3 setting: hidden 7168 bf16, top-8,
16 experts, batch 1/8/64/128 tokens per rank. Prints median/p99 per (backend, batch).

    .venv/bin/python -m benchmarks bench_shm_latency "(1,8,64,128)" 300 ubep,bsp,gloo
"""

from __future__ import annotations

import sys
import time

import torch

from ubep.testing import make_routing, make_tokens, run_ranks

CONFIGS = {"ubep": dict(backend="shm", mode="ubep"), "bsp": dict(backend="shm", mode="bsp"),
           "gloo": dict(backend="torch")}


def _rank(rank, world, batches, iters, names):
    import ubep

    res = {}
    for name in names:
        with ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=max(batches),
                         max_top_k=8, **CONFIGS[name]) as buf:
            for b in batches:
                idx, w = make_routing(b, 8, 16, seed=rank)
                x = make_tokens(rank, b, 7168, torch.bfloat16)
                total, disp = [], []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    r = buf.dispatch(x, idx, w)
                    t1 = time.perf_counter()
                    buf.combine(r.recv_x, r.handle)
                    total.append(time.perf_counter() - t0)
                    disp.append(t1 - t0)
                total.sort()
                disp.sort()
                res[(name, b)] = (total[len(total) // 2] * 1e6,
                                  total[int(len(total) * 0.99)] * 1e6,
                                  disp[len(disp) // 2] * 1e6, r.stats.phases_us)
    return res


def main() -> None:
    batches = tuple(eval(sys.argv[1])) if len(sys.argv) > 1 else (1, 8, 64, 128)
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CONFIGS)
    out = run_ranks(_rank, 2, batches, iters, names, timeout_s=1800)
    for (name, b), (med, p99, dmed, phases) in out[0].items():
        rounded = {k: round(v, 1) for k, v in phases.items()}
        print(f"{name:5s} batch {b:4d}: dispatch+combine median {med:9.1f} us  p99 {p99:9.1f} us"
              f"  dispatch median {dmed:8.1f} us  phases {rounded}")


if __name__ == "__main__":
    main()
