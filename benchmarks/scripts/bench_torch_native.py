"""The torch backend's compiled CPU path against its Python path, its raw collectives and
the copy bound, in one process pair.

Not a test (pytest does not collect it). Two ranks (gloo), P=2, hidden 7168 bf16, top-8 of
16 experts. Each rank makes two `Buffer(backend="torch")`: one with `ubep.native` (the
compiled path), one made under `UBEP_NATIVE=0` (the Python path); then, round by round, each
started after a tight cross-process barrier, a dispatch+combine through each, the same
`all_to_all_single` calls bare (`raw`, as `ubep bench`'s raw-collectives line replays them)
and one memcpy of the bytes dispatch and combine move (`copy`). Every call is interleaved
with the other systems' (cold caches, as a model's MoE layer meets them). The pair's time is
the slower rank's.

    .venv/bin/python -m benchmarks bench_torch_native [batch [rounds]]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

KINDS = ("compiled", "python", "raw", "copy")


def _rank(rank: int, world: int, batch: int, rounds: int) -> dict:
    import gc

    import torch

    import ubep
    import ubep.runtime.torch_backend as tb
    from ubep.bench.flags import HostSync
    from ubep.bench.systems import replay_calls
    from ubep.testing import make_routing, make_tokens

    torch.set_num_threads(1)
    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=60)
    kw = dict(num_experts=16, hidden=7168, max_tokens_per_rank=batch, backend="torch",
              max_top_k=8)
    compiled = ubep.Buffer(**kw)
    os.environ["UBEP_NATIVE"] = "0"
    python = ubep.Buffer(**kw)
    del os.environ["UBEP_NATIVE"]
    if compiled._backend._native is None:
        raise SystemExit("ubep.native is not built (python -m ubep.native build)")
    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=17 + rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=1)
    res = compiled.dispatch(x, idx, w)
    compiled.combine(res.recv_x, res.handle)
    calls = (replay_calls(res.stats), replay_calls(compiled.last_stats))
    nbytes = (int((idx >= 0).sum()) * 7168 * 2, res.recv_x.numel() * 2)
    src = np.ones(max(nbytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    pg = tb.dist.group.WORLD
    out = {k: [] for k in KINDS}
    gc.disable()
    try:
        for _ in range(rounds):
            for k in KINDS:
                t = 0
                for op in (0, 1):
                    sync.barrier()
                    t0 = time.perf_counter_ns()
                    if k == "raw":
                        for c in calls[op]:
                            tb.all_to_all(pg, *c)
                    elif k == "copy":
                        np.copyto(dst[:nbytes[op]], src[:nbytes[op]])
                    else:
                        buf = compiled if k == "compiled" else python
                        if op == 0:
                            res = buf.dispatch(x, idx, w)
                        else:
                            buf.combine(res.recv_x, res.handle)
                    t += time.perf_counter_ns() - t0
                out[k].append(t / 1e3)
    finally:
        gc.enable()
        sync.close()
        compiled.close()
        python.close()
    return {k: np.array(v) for k, v in out.items()}


def main() -> None:
    from ubep.testing import run_ranks

    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    res = run_ranks(_rank, 2, batch, rounds, timeout_s=900)
    print(f"P=2, hidden 7168 bf16, top-8 of 16 experts, batch {batch}, {rounds} rounds "
          f"interleaved; load {os.getloadavg()[0]:.1f}")
    med = {}
    for k in KINDS:
        t = np.maximum(res[0][k], res[1][k])
        med[k] = float(np.median(t))
        print(f"{k:9s} dispatch+combine median {med[k]:8.1f} us  p90 "
              f"{np.percentile(t, 90):8.1f}")
    base = med["raw"] + med["copy"]
    print(f"compiled / (raw + copy) {med['compiled'] / base:.2f}x   python / (raw + copy) "
          f"{med['python'] / base:.2f}x   compiled / python {med['compiled'] / med['python']:.3f}")


if __name__ == "__main__":
    main()
