"""The benchmark's shared-memory barrier holds every rank until all arrived; ping-pong ends."""

import os
import random
import time

from ubep.testing import run_ranks


def _rank(rank, world):
    from ubep.bench.flags import _SLOT, HostSync

    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=30)
    rng = random.Random(rank)
    early = 0
    try:
        for k in range(1, 31):
            time.sleep(rng.random() * 2e-3)  # arrive in a different order every time
            sync.barrier()
            # past barrier k, every rank must have entered it: its arrival word is >= k
            arrived = [int(sync.words[(2 + r) * _SLOT]) for r in range(world)]
            early += sum(a < k for a in arrived)
        rtt = sync.flag_round_trip_us(rounds=200, repeats=3)
    finally:
        sync.close()
    return early, rtt


def test_barrier_and_ping_pong():
    out = run_ranks(_rank, 3, timeout_s=120)  # 3 ranks: rank 2 only joins the barriers
    assert [early for early, _ in out] == [0, 0, 0]
    assert out[0][1] > 0 and out[1][1] > 0 and out[2][1] is None
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("ubep-bench-t")]
