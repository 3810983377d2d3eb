"""The torch backend with blocking vs polling waits on its gloo collectives
(`torch_backend.POLL_S` 0 vs its default), alternating every 20 dispatch+combine calls in
one process pair; the pair's time is the slower rank's.

Not a test (pytest does not collect it); the numbers are in docs/results/torch_backend.md.

    .venv/bin/python -m benchmarks bench_torch_wait BATCH [ROUNDS]
"""

from __future__ import annotations

import sys

import torch


def _rank(rank: int, world: int, batch: int, rounds: int) -> dict[str, list[int]]:
    import ubep
    import ubep.runtime.torch_backend as tb
    from ubep.testing import alternate, make_routing, make_tokens

    idx, w = make_routing(batch, 8, 16, kind="uniform", seed=rank)
    x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=3)
    with ubep.Buffer(num_experts=16, hidden=7168, max_tokens_per_rank=128,
                     backend="torch") as buf:
        for _ in range(30):
            r = buf.dispatch(x, idx, w)
            buf.combine(r.recv_x, r.handle)

        def call(poll_s: float):
            def once():
                tb.POLL_S = poll_s
                r = buf.dispatch(x, idx, w)
                buf.combine(r.recv_x, r.handle)
            return once

        return alternate({"blocking": call(0.0), "polling": call(tb.POLL_S)}, rounds)


def main() -> None:
    from ubep.testing import print_turns, run_ranks

    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    out = run_ranks(_rank, 2, batch, rounds, timeout_s=1800, threads_per_rank=1)
    print_turns(out, f"batch {batch} dispatch+combine,")

if __name__ == "__main__":
    main()
