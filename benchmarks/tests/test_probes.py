"""The host probes read a bench run: which calls ran across the host's timer windows, and the
floor the host's gaps alone put under each row's tail."""

import numpy as np
import pytest

from benchmarks.host_floor import tail_ratio
from benchmarks.probes import GapLog, HostProbes, gaps_per_s, host_record
from ubep.bench.config import BenchConfig
from ubep.bench.run import BenchResult, collect, summarise


def _rank(times, rtt):
    return {"times": times, "phases": {}, "unavailable": {}, "bytes": {(64, 4): (1024, 2048)},
            "rtt_us": rtt, "rtt_us_end": rtt + 1}


class _Sync:
    def __init__(self):
        self.barriers = 0

    def barrier(self):
        self.barriers += 1


def test_the_probe_measures_every_rank_at_once_at_both_ends():
    sync, probe = _Sync(), HostProbes(gap_s=0.01, loop_s=0.06)
    probe.start(sync)
    probe.end(sync)
    out = probe.result()
    assert len(out["gaps"]) == 2 and min(out["gaps"]) >= 0
    assert len(out["speed"]) == 2 and min(out["speed"]) > 0
    assert len(out["gap_log"].probes) == 2 and sync.barriers == 6
    assert gaps_per_s(sync, 0.01) >= 0 and sync.barriers == 8


def test_calls_across_the_hosts_timer_windows_are_told_apart_per_op():
    """A call counts as hit where its dispatch or combine, on either rank, ran across a
    window; each op's clear figures use its own span."""
    cfg = BenchConfig(hiddens=(64,), batches=(4,), iters=3, experts=4, top_k=2, block=3)
    t = np.array([[10.0, 10, 40], [5, 30, 5]])
    ms = 10**9                                     # a clock reading at a millisecond's start
    per_rank = [_rank({("shm-ubep", 64, 4): t}, 4.0), _rank({("shm-ubep", 64, 4): t}, 4.0)]
    # the gaps bunch 700-750 µs into the millisecond; iteration 1's combine (on rank 1 only)
    # and iteration 2's dispatch (rank 0) run across it, iteration 0 stays clear
    starts = [ms + 1_000_000 * k + 710_000 for k in range(59)]
    spans0 = np.array([[ms + 100_000, ms + 110_000, ms + 120_000, ms + 130_000],
                       [ms + 300_000, ms + 310_000, ms + 320_000, ms + 330_000],
                       [ms + 690_000, ms + 705_000, ms + 760_000, ms + 770_000]]).T
    spans1 = spans0.copy()
    spans1[3, 1] = ms + 720_000                    # rank 1's combine of iteration 1 ends late
    for r, sp in zip(per_rank, (spans0, spans1)):
        log = GapLog([(ms, ms + 60_000_000, np.asarray(starts, dtype=np.int64),
                       np.full(len(starts), 20_000, np.int64))])
        r["probe"] = {"gaps": (59.0, 59.0), "speed": (10.0, 10.0), "gap_log": log}
        r["spans"] = {("shm-ubep", 64, 4): sp}
    res = BenchResult(config=cfg)
    collect(res, 2, per_rank)
    summarise(res)
    rec = host_record(res)
    assert rec.windows[2].spans == ((700_000, 750_000),)
    assert rec.in_window[("shm-ubep", 2, 64, 4)].tolist() == [
        [False, False, True], [False, True, False], [False, True, True]]
    row = {(r["system"], r["op"]): r for r in res.rows}
    assert row[("shm-ubep", "dispatch")]["clear_share"] == pytest.approx(2 / 3)
    assert row[("shm-ubep", "combine")]["clear_median_us"] == 5.0
    assert row[("shm-ubep", "total")]["clear_share"] == pytest.approx(1 / 3)
    assert row[("shm-ubep", "total")]["clear_p99_us"] == 15.0
    # the host's floor under each op's tail: that op's median replayed over both probes
    logs = [r["probe"]["gap_log"] for r in per_rank]
    assert rec.gap_probes[2] == [[logs[0].probes[0], logs[1].probes[0]]]
    assert row[("shm-ubep", "total")]["host_p99x"] == tail_ratio(40.0, rec.gap_probes[2]) > 1
    assert rec.gaps[2] == [(59.0, 59.0)] * 2 and rec.speed[2] == [(10.0, 10.0)] * 2


def test_a_bench_run_carries_the_probe_to_every_rank_and_back():
    """`run_bench(probe=)` runs the probe on each rank around the timed points (pickled to the
    rank processes) and returns each rank's result; `host_record` reads them."""
    from ubep.bench.run import run_bench

    cfg = BenchConfig(ranks=(2,), hiddens=(64,), batches=(2,), top_k=2, experts=4, iters=3,
                      warmup=1, systems=("shm-owned",), pin=False)
    res = run_bench(cfg, timeout_s=300, probe=HostProbes(gap_s=0.02, loop_s=0.06))
    assert not res.unavailable, res.unavailable
    per_rank = res.probes[2]
    assert len(per_rank) == 2
    for r in per_rank:
        assert len(r["gaps"]) == 2 and len(r["speed"]) == 2 and min(r["speed"]) > 0
        assert len(r["gap_log"].probes) == 2
    assert res.spans[("shm-owned", 2, 64, 2)].shape == (2, 4, 3)
    rec = host_record(res)
    assert set(rec.gap_probes) == {2} and len(rec.gap_probes[2]) == 2
    assert all("host_p99x" in row and "clear_share" in row for row in res.rows)
