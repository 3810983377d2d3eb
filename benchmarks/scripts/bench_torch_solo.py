"""The torch backend's per-call host cost on one rank, against its bare collectives.

Not a test (pytest does not collect it). One process, a gloo group of one: each collective
still goes through gloo's threads (launch, work queue, completion), but no peer's timing,
no cross-core data and no second process on the cores: what a call costs beyond its
collectives, with little of the host's noise. Batches of 500 calls of each kind (dispatch,
combine, then the same `all_to_all_single` calls bare, as `ubep bench`'s raw-collectives line
replays them), repeated; medians of the per-call means. hidden 7168 bf16, top-8 of 16
experts (all local).

    .venv/bin/python -m benchmarks bench_torch_solo [batch [repeats]]
"""

from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist


def main() -> None:
    import ubep
    import ubep.runtime.torch_backend as tb
    from ubep.bench.systems import replay_calls
    from ubep.testing import make_routing, make_tokens

    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.set_num_threads(1)
    buf = ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=batch, backend="torch",
                      max_top_k=8)
    try:
        idx, w = make_routing(batch, 8, 16, kind="uniform", seed=17)
        x = make_tokens(0, batch, 7168, torch.bfloat16, seed=1)
        for _ in range(5):
            res = buf.dispatch(x, idx, w)
            buf.combine(res.recv_x, res.handle)
        calls = [replay_calls(res.stats), replay_calls(buf.last_stats)]
        pg = dist.group.WORLD
        n = 500
        out: dict[str, list[float]] = {"dispatch": [], "combine": [], "raw dispatch": [],
                                       "raw combine": []}
        perf = time.perf_counter_ns
        gc.collect()
        gc.disable()
        for _ in range(repeats):
            t0 = perf()
            for _ in range(n):
                res = buf.dispatch(x, idx, w)
            t1 = perf()
            for _ in range(n):
                buf.combine(res.recv_x, res.handle)
            t2 = perf()
            for _ in range(n):
                for c in calls[0]:
                    tb.all_to_all(pg, *c)
            t3 = perf()
            for _ in range(n):
                for c in calls[1]:
                    tb.all_to_all(pg, *c)
            t4 = perf()
            for key, a, b in (("dispatch", t0, t1), ("combine", t1, t2),
                              ("raw dispatch", t2, t3), ("raw combine", t3, t4)):
                out[key].append((b - a) / n / 1e3)
        gc.enable()
    finally:
        buf.close()
        dist.destroy_process_group()
    med = {k: float(np.median(v)) for k, v in out.items()}
    native = "on" if buf._backend._native is not None else "off"
    print(f"one rank, batch {batch}, ubep.native {native}, {repeats} x {n} calls; "
          f"load {os.getloadavg()[0]:.1f}")
    for k, v in med.items():
        print(f"{k:13s} {v:7.2f} us")
    print(f"dispatch - raw {med['dispatch'] - med['raw dispatch']:.2f} us, combine - raw "
          f"{med['combine'] - med['raw combine']:.2f} us")


if __name__ == "__main__":
    main()
