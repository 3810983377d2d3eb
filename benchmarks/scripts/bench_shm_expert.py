"""What the stand-in expert between dispatch and combine does to a shm call, in one process
pair: for each Buffer kind (`direct="owned"`, `direct=True`, the staged path), batch-1
dispatch+combine with combine's input made three ways, alternating every 20 calls:

- `identity`: combine(recv_x) itself (`ubep bench --expert identity`);
- `clone`: combine(recv_x.clone()): an expert reads every received row and writes a new
  tensor (`ubep bench`'s default; DeepEP's tests' `simulated_gemm_x`);
- `combine buffer` (direct paths only): the clone written into `get_combine_buffer`'s tensor,
  as a model using the zero-copy API writes its expert outputs there.

The expert step and `get_combine_buffer` are untimed; each call starts after a tight
cross-process barrier, each rank's thread bound to core `rank`, the pair's time the slower
rank's. Not a test (pytest does not collect it): it prints its figures.

    .venv/bin/python -m benchmarks bench_shm_expert [rounds] [batch]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

KINDS = {"owned": "owned", "direct": True, "staged": False}


def _rank(rank: int, world: int, rounds: int, batch: int) -> dict:
    import gc

    import torch

    import ubep
    from ubep.bench.flags import HostSync
    from ubep.testing import make_routing, make_tokens

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=7 + rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    perf = time.perf_counter_ns
    kw = dict(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="shm", workers=1)
    bufs = {name: ubep.Buffer(direct=direct, **kw) for name, direct in KINDS.items()}
    cases = [(name, how) for name in KINDS
             for how in ("identity", "clone", *(("combine buffer",) if name != "staged" else ()))]
    times: dict[str, list[int]] = {f"{n}, {h}": [] for n, h in cases}
    try:
        gc.collect()
        gc.disable()
        for _ in range(rounds):
            for name, how in cases:
                buf = bufs[name]
                for i in range(21):                    # the first call of a turn untimed
                    sync.barrier()
                    t0 = perf()
                    r = buf.dispatch(x, idx, w)
                    t1 = perf()
                    if how == "identity":
                        y = r.recv_x
                    elif how == "clone":
                        y = r.recv_x.clone()
                    else:
                        y = buf.get_combine_buffer(r.handle)
                        y.copy_(r.recv_x)
                    sync.barrier()
                    t2 = perf()
                    buf.combine(y, r.handle)
                    t3 = perf()
                    del r, y
                    if i:
                        times[f"{name}, {how}"].append(t1 - t0 + t3 - t2)
        gc.enable()
        return times
    finally:
        for b in bufs.values():
            b.close()
        sync.close()


def main() -> None:
    from ubep.testing import run_ranks

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    out = run_ranks(_rank, 2, rounds, batch, timeout_s=1800,
                    env={"UBEP_JOB_ID": f"expert{os.getpid()}"})
    print(f"batch {batch}, {rounds} turns of 20 calls per case (alternating), dispatch+combine "
          "µs, the slower rank's:")
    for key in out[0]:
        t = np.maximum(np.array(out[0][key]), np.array(out[1][key])) / 1e3
        print(f"  {key:24s} median {np.median(t):7.1f}  p99 {np.percentile(t, 99):7.1f}")


if __name__ == "__main__":
    sys.exit(main())
