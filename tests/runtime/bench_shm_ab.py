"""The shm backend of this tree against another tree's (e.g. the previous main), in one process
or one process pair: both Buffers alternate every 20 batch-1 dispatch+combine calls, so the
host's speed states (it flips between two ~1.6x apart every few seconds) hit both alike; in a
pair each rank's thread is bound to core `rank` and the pair's time is the slower rank's.

The other tree's `ubep` package is copied to a temporary folder as a package named
`ubep_other` (every `ubep` name in it renamed, its torch operators included), so both import
side by side; its numba caches go there, not into that tree. Results are checked equal before
timing. Not a test (pytest does not collect it); the numbers are in docs/results.md ("Layer by
layer, in place").

    .venv/bin/python tests/runtime/bench_shm_ab.py OTHER_SRC [--world 1|2] [--direct owned|true]
        [--rounds 60] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np


def _copy_other(src: str, folder: str) -> None:
    """`src`/ubep as `folder`/ubep_other, every `ubep` identifier renamed."""
    dst = os.path.join(folder, "ubep_other")
    shutil.copytree(os.path.join(src, "ubep"), dst,
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    for root, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    text = re.sub(r"\bubep\b", "ubep_other", f.read())
                with open(path, "w") as f:
                    f.write(text)


def _run(rank: int, world: int, path: str, folder: str, a, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    sys.path.insert(0, folder)
    import ubep_other

    import ubep
    from ubep.testing import make_routing, make_tokens

    idx, w = make_routing(a.batch, 8, 16, kind="uniform", seed=7 + rank)
    x = make_tokens(rank, a.batch, 7168, torch.bfloat16, seed=3)
    direct = True if a.direct == "true" else a.direct
    kw = dict(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="shm", workers=1,
              direct=direct)
    times: dict[str, list[int]] = {"other": [], "this": []}
    with ubep.Buffer(**kw) as this, ubep_other.Buffer(**kw) as other:
        bufs = {"other": other, "this": this}
        ys = {}
        for m, b in bufs.items():
            for _ in range(50):
                r = b.dispatch(x, idx, w)
                ys[m] = b.combine(r.recv_x, r.handle)
        assert torch.equal(ys["this"].view(torch.int16), ys["other"].view(torch.int16))
        for _ in range(a.rounds):
            for m, b in bufs.items():
                dist.barrier()
                for _ in range(20):
                    t = time.perf_counter_ns()
                    r = b.dispatch(x, idx, w)
                    b.combine(r.recv_x, r.handle)
                    times[m].append(time.perf_counter_ns() - t)
    q.put((rank, times))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("other_src")
    p.add_argument("--world", type=int, default=2, choices=(1, 2))
    p.add_argument("--direct", default="owned", choices=("owned", "true"))
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    fd, path = tempfile.mkstemp(prefix="ubep-pg-")
    os.close(fd)
    os.unlink(path)
    folder = tempfile.mkdtemp(prefix="ubep-ab-")
    try:
        _copy_other(a.other_src, folder)
        if a.world == 1:
            import queue
            q = queue.Queue()
            _run(0, 1, path, folder, a, q)
            out = dict([q.get()])
        else:
            import torch.multiprocessing as mp
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            ps = [ctx.Process(target=_run, args=(r, 2, path, folder, a, q)) for r in range(2)]
            for proc in ps:
                proc.start()
            out = dict(q.get() for _ in ps)
            for proc in ps:
                proc.join()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.exists(path):
            os.unlink(path)
    med = {}
    for m in ("other", "this"):
        t = np.max([np.array(out[r][m]) for r in out], axis=0) / 1e3
        med[m] = np.median(t)
        print(f"world {a.world}, batch {a.batch}, direct={a.direct}, {m}: median {med[m]:.1f} µs, "
              f"p90 {np.percentile(t, 90):.1f} µs ({len(t)} calls)")
    print(f"this/other: {med['this'] / med['other']:.3f}")


if __name__ == "__main__":
    main()
