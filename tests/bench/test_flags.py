"""The benchmark's shared-memory barrier holds every rank until all arrived and are awake;
ping-pong ends."""

import os
import random
import time

from ubep.testing import run_ranks


def _rank(rank, world):
    from ubep.bench.flags import _SLOT, HostSync

    sync = HostSync.create(rank, world, os.environ["UBEP_JOB_ID"], timeout_s=30,
                           copy_bytes=1 << 16)
    rng = random.Random(rank)
    early = 0
    try:
        for k in range(1, 31):
            time.sleep(rng.random() * 2e-3)  # arrive in a different order every time
            sync.barrier()
            # past barrier k (two rounds, epochs 2k-1 and 2k), every rank must have left its
            # first round, awake, and entered the second: its arrival word is >= 2k
            arrived = [int(sync.words[(2 + r) * _SLOT]) for r in range(world)]
            early += sum(a < 2 * k for a in arrived)
        rtt = sync.flag_round_trip_us(rounds=200, repeats=3)
        # rank 0 copies what rank 1 wrote (checked inside: a stale byte raises); more bytes
        # than the segment has room for: not measured, on every rank
        xcopy = sync.cross_core_copy_us(1 << 16, repeats=20)
        too_big = sync.cross_core_copy_us((1 << 16) + 1, repeats=2)
    finally:
        sync.close()
    return early, rtt, xcopy, too_big


def test_barrier_and_ping_pong():
    out = run_ranks(_rank, 3, timeout_s=120)  # 3 ranks: rank 2 only joins the barriers
    assert [o[0] for o in out] == [0, 0, 0]
    assert out[0][1] > 0 and out[1][1] > 0 and out[2][1] is None
    peer_us, own_us = out[0][2]
    assert peer_us > 0 and own_us > 0
    assert out[1][2] is None and out[2][2] is None and {o[3] for o in out} == {None}
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("ubep-bench-t")]


def test_bounds_copy_between_page_aligned_buffers():
    # memcpy between buffers malloc placed back to back (16 bytes apart modulo 4 KiB) hits
    # `rep movsb`'s page-aliasing slow case on AMD Zen 3: the bounds' buffers start on a page
    import mmap

    import torch

    from ubep.bench.config import BOUND, BenchConfig
    from ubep.bench.systems import CopyBound, page_aligned

    a = page_aligned(3 * mmap.PAGESIZE + 5)
    assert a.ctypes.data % mmap.PAGESIZE == 0 and a.size == 3 * mmap.PAGESIZE + 5
    assert a.dtype == "uint8" and not a.any()
    a[-1] = 7                                   # writable, the whole length
    cfg = BenchConfig(batches=(1, 4), hiddens=(64,), top_k=2, experts=4, ranks=(2,))
    bound = CopyBound(BOUND, cfg, 64)
    assert bound._src.ctypes.data % mmap.PAGESIZE == 0
    assert bound._dst.ctypes.data % mmap.PAGESIZE == 0
    assert bound.row_bytes == 64 * torch.empty(0, dtype=cfg.torch_dtype).element_size()
