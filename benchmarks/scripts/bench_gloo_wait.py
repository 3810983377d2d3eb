"""Waiting on a gloo collective: `work.wait()` vs polling `is_completed()` (with and
without yielding the core), 2 ranks, the modes alternating in one run.

Not a test (pytest does not collect it); the numbers are in docs/results/torch_backend.md.

    .venv/bin/python -m benchmarks bench_gloo_wait [bytes per peer ...]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, path: str, n: int, nbytes: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    pg = dist.group.WORLD
    inp = torch.ones(nbytes * 2, dtype=torch.uint8)
    out = torch.empty_like(inp)
    opts = dist.AllToAllOptions()
    opts.asyncOp = True
    splits = [nbytes, nbytes]

    def block(w) -> None:
        w.wait()

    def poll_yield(w) -> None:
        while not w.is_completed():
            os.sched_yield()
        w.wait()

    def spin(w) -> None:
        while not w.is_completed():
            pass
        w.wait()

    modes = {"wait()": block, "poll + yield": poll_yield, "pure spin": spin}
    res: dict[str, list[int]] = {m: [] for m in modes}
    for _ in range(6):
        for m, f in modes.items():
            for i in range(n):
                if i % 20 == 0:
                    dist.barrier()
                t = time.perf_counter_ns()
                f(pg.alltoall_base(out, inp, splits, splits, opts))
                res[m].append(time.perf_counter_ns() - t)
    if rank == 0:
        for m, ts in res.items():
            ts.sort()
            q.put(f"{nbytes} B per peer, {m}: median {ts[len(ts) // 2] / 1e3:.1f} µs, "
                  f"p90 {ts[len(ts) * 9 // 10] / 1e3:.1f} µs")
    dist.destroy_process_group()


def main() -> None:
    for nbytes in [int(a) for a in sys.argv[1:]] or [16, 57344, 1835008]:
        fd, path = tempfile.mkstemp(prefix="ubep-pg-")
        os.close(fd)
        os.unlink(path)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=_run, args=(r, path, 100, nbytes, q)) for r in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        while not q.empty():
            print(q.get())
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
