"""The torch backend with blocking vs polling waits on its gloo collectives
(`torch_backend.POLL_S` 0 vs its default), alternating every 20 dispatch+combine calls in
one process pair; the pair's time is the slower rank's.

Not a test (pytest does not collect it); the numbers are in docs/results/torch_backend.md.

    .venv/bin/python tests/runtime/bench_torch_wait.py BATCH [ROUNDS]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, path: str, batch: int, rounds: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    import ubep
    import ubep.runtime.torch_backend as tb
    from ubep.testing import make_routing, make_tokens

    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    modes = {"blocking": 0.0, "polling": tb.POLL_S}
    res: dict[str, list[int]] = {m: [] for m in modes}
    with ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128,
                     backend="torch") as buf:
        for _ in range(30):
            r = buf.dispatch(x, idx, w)
            buf.combine(r.recv_x, r.handle)
        for _ in range(rounds):
            for m, poll_s in modes.items():
                tb.POLL_S = poll_s
                dist.barrier()
                for _ in range(20):
                    t = time.perf_counter_ns()
                    r = buf.dispatch(x, idx, w)
                    buf.combine(r.recv_x, r.handle)
                    res[m].append(time.perf_counter_ns() - t)
    q.put((rank, res))
    dist.destroy_process_group()


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    fd, path = tempfile.mkstemp(prefix="ubep-pg-")
    os.close(fd)
    os.unlink(path)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_run, args=(r, path, batch, rounds, q)) for r in range(2)]
    for p in ps:
        p.start()
    out = dict(q.get() for _ in ps)
    for p in ps:
        p.join()
    if os.path.exists(path):
        os.unlink(path)
    for m in out[0]:
        t = np.maximum(np.array(out[0][m]), np.array(out[1][m])) / 1e3
        print(f"batch {batch} {m}: median {np.median(t):.1f} µs, p90 "
              f"{np.percentile(t, 90):.1f} µs (dispatch+combine, slower rank)")


if __name__ == "__main__":
    main()
