"""ubep.testing.run_ranks: results, propagated failures, deaths and timeouts."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from ubep.options import BufferConfig
from ubep.runtime import make_backend
from ubep.testing import RankFailedError, RankFailure, run_ranks


def _sum_ranks(rank, world, scale):
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t), world


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def _die_or_sleep(rank, world, mode):
    if rank == 1:
        if mode == "die":
            os._exit(3)
        time.sleep(30)
    return rank


def test_results_come_back_in_rank_order():
    assert run_ranks(_sum_ranks, 3, 10) == [(30, 3)] * 3


def test_exception_names_rank_and_traceback():
    with pytest.raises(RankFailedError, match="rank 1 failed") as info:
        run_ranks(_fail_on_one, 2)
    assert "rank one says no" in info.value.traceback
    out = run_ranks(_fail_on_one, 2, return_exceptions=True)
    assert out[0] == 0 and isinstance(out[1], RankFailure) and out[1].kind == "exception"


def test_death_and_timeout_are_reported():
    out = run_ranks(_die_or_sleep, 2, "die", return_exceptions=True)
    assert out[0] == 0 and out[1].kind == "died" and "3" in out[1].message
    start = time.monotonic()
    out = run_ranks(_die_or_sleep, 2, "sleep", timeout_s=3, return_exceptions=True)
    assert out[1].kind == "timeout" and time.monotonic() - start < 20


def test_unknown_backend_is_not_implemented():
    cfg = BufferConfig(rank=0, world_size=1, num_experts=2, hidden=4, max_tokens_per_rank=1,
                       max_top_k=1, backend="triton")
    with pytest.raises(NotImplementedError, match="backend 'triton' is not built yet"):
        make_backend(cfg, None, 0)


def test_alternate_times_every_way_and_balances_what_runs_before_it():
    from collections import Counter

    from ubep.testing import alternate

    for n in (1, 2, 3, 4, 5):
        ran: list[str] = []
        names = "abcde"[:n]
        ways = {name: (lambda m=name, ran=ran: ran.append(m)) for name in names}
        cycle = n if n % 2 == 0 or n == 1 else 2 * n
        times = alternate(ways, rounds=cycle, block=2, barrier=lambda: None)
        assert {k: len(v) for k, v in times.items()} == {k: 2 * cycle for k in names}
        turns = ran[::2]
        rounds = [turns[i:i + n] for i in range(0, len(turns), n)]
        assert all(sorted(r) == sorted(names) for r in rounds)
        assert Counter(r[0] for r in rounds) == Counter({k: cycle // n for k in names})
        after = Counter((a, b) for r in rounds for a, b in zip(r, r[1:]))
        assert set(after.values()) <= {cycle // n} and len(after) == n * (n - 1), after
