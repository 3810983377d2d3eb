"""Does where `x` lies in its page change a dispatch's time? (`rep movsb` page aliasing)

Not a test (pytest does not collect it). Two ranks dispatch and combine the same batch from
an `x` placed at several byte offsets past a page boundary; per Buffer kind and offset, the
slower rank's median dispatch and combine µs over 30 calls (after 10 untimed). glibc < 2.39
copies a few KiB and more with `rep movsb`, which AMD Zen 3 runs ~8x slower when the
destination lies 1-63 bytes past the source modulo 4 KiB; the shm paths' receive areas are
page-aligned, so an `x` 16 bytes before a page boundary (offset 4080) hit it on every row
until `memcpy_at` began copying such rows in pieces (`ubep.runtime.shm.atomics.ALIAS_PIECE`).

    .venv/bin/python -m benchmarks bench_copy_alias [batch]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

H, E, K = 7168, 16, 8
OFFSETS = (0, 16, 64, 2048 + 16, 4096 - 16)
KINDS = (dict(backend="shm", direct="owned"), dict(backend="shm", direct=True),
         dict(backend="torch"))


def _rank(rank: int, world: int, batch: int, kw: dict) -> dict[int, tuple[float, float]]:
    import ubep
    from ubep.bench.systems import page_aligned
    from ubep.testing import make_routing

    idx, w = make_routing(batch, K, E, seed=rank)
    base = page_aligned(batch * H * 2 + 8192)
    out = {}
    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=batch, **kw) as buf:
        for off in OFFSETS:
            x = torch.from_numpy(base[off:off + batch * H * 2]).view(torch.bfloat16)
            x = x.view(batch, H)
            x.copy_(torch.randn(batch, H).to(torch.bfloat16))
            times = []
            for _ in range(40):
                t0 = time.perf_counter_ns()
                res = buf.dispatch(x, idx, w)
                t1 = time.perf_counter_ns()
                buf.combine(res.recv_x, res.handle)
                times.append(((t1 - t0) / 1e3, (time.perf_counter_ns() - t1) / 1e3))
                del res
            a = np.array(times[10:])
            out[off] = (float(np.median(a[:, 0])), float(np.median(a[:, 1])))
    return out


def main() -> None:
    from ubep.testing import run_ranks

    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    print(f"batch {batch}, hidden {H} bf16, top-{K}, {E} experts, P=2: dispatch / combine µs "
          f"(median, slower rank) by x's offset past a page boundary")
    for kw in KINDS:
        per_rank = run_ranks(_rank, 2, batch, kw, timeout_s=300)
        cells = [f"{off}: {max(r[off][0] for r in per_rank):,.0f} / "
                 f"{max(r[off][1] for r in per_rank):,.0f}" for off in OFFSETS]
        print(f"{kw}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
