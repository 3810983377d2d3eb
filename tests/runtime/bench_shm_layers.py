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

import os
import sys
import tempfile
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


def main() -> None:
    direct = sys.argv[1] if len(sys.argv) > 1 else "owned"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    torch.set_num_threads(1)
    fd, path = tempfile.mkstemp(prefix="ubep-pg-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    import ubep
    from ubep.runtime.shm.waits import now_us
    from ubep.testing import make_routing, make_tokens

    idx, w = make_routing(1, 8, 16, kind="uniform", seed=7)
    x = make_tokens(0, 1, 7168, torch.bfloat16, seed=3)
    with ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128, backend="shm",
                     workers=1, direct=True if direct == "true" else direct) as buf:
        backend, path_ = buf._backend, buf._backend._path
        calls = iter(range(1 << 40))

        def through_buffer():
            r = buf.dispatch(x, idx, w)
            buf.combine(r.recv_x, r.handle)

        def through_backend():
            r = backend.dispatch(x, idx, w, next(calls))
            backend.combine(r.recv_x, r.handle, True)

        def through_path():
            r = path_.dispatch(x, idx, w, next(calls), now_us())
            path_.combine(r.recv_x, r.handle, True, now_us())

        ways = {"Buffer": through_buffer, "backend": through_backend, "path": through_path}
        times: dict[str, list[int]] = {k: [] for k in ways}
        perf = time.perf_counter_ns
        for rnd in range(rounds):
            for name, fn in ways.items():
                for _ in range(20):
                    t = perf()
                    fn()
                    if rnd >= 20:
                        times[name].append(perf() - t)
    dist.destroy_process_group()
    med = {k: np.median(v) / 1e3 for k, v in times.items()}
    print(f"direct={direct}, batch 1, one process, medians of {len(times['path'])} calls each:")
    for k, v in med.items():
        print(f"  through {k:8s} {v:6.1f} µs")
    print(f"  Buffer's layer {med['Buffer'] - med['backend']:.1f} µs, the backend's "
          f"{med['backend'] - med['path']:.1f} µs")


if __name__ == "__main__":
    main()
