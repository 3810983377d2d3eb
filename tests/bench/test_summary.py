"""How per-rank times become the reported numbers: max over ranks, bound + flag RTT, ratios."""

import numpy as np
import pytest

from ubep.bench.config import BenchConfig
from ubep.bench.report import markdown
from ubep.bench.run import BenchResult, collect, summarise


def _rank(times, rtt):
    return {"times": times, "phases": {}, "unavailable": {"mpi": "not launched"},
            "bytes": {(64, 4): (1024, 2048)}, "rtt_us": rtt, "rtt_us_end": rtt + 1}


def test_max_over_ranks_bound_and_ratios():
    cfg = BenchConfig(hiddens=(64,), batches=(4,), iters=3, experts=4, top_k=2)
    ubep_r0 = np.array([[10.0, 30, 20], [5, 5, 5]])     # [dispatch, combine] x iters
    ubep_r1 = np.array([[12.0, 10, 40], [1, 9, 1]])
    bound = np.array([[2.0, 2, 2], [1, 1, 1]])
    per_rank = [_rank({("shm-ubep", 64, 4): ubep_r0, ("bound", 64, 4): bound}, 4.0),
                _rank({("shm-ubep", 64, 4): ubep_r1, ("bound", 64, 4): bound}, 6.0)]
    res = BenchResult(config=cfg)
    collect(res, 2, per_rank)
    summarise(res)
    row = {(r["system"], r["op"]): r for r in res.rows}
    # per iteration: dispatch max(10,12)=12, max(30,10)=30, max(20,40)=40 -> median 30
    assert row[("shm-ubep", "dispatch")]["median_us"] == 30
    # combine max: 5, 9, 5 -> median 5; total per iteration 17, 39, 45 -> median 39
    assert row[("shm-ubep", "combine")]["median_us"] == 5
    assert row[("shm-ubep", "total")]["median_us"] == 39
    assert row[("shm-ubep", "total")]["min_us"] == 17
    # the bound adds half the (smallest, rank 0) flag round trip to each op: 4 / 2
    assert res.rtt_us[2] == 4.0
    assert row[("bound", "dispatch")]["median_us"] == 4
    assert row[("bound", "total")]["median_us"] == 7
    assert row[("shm-ubep", "total")]["x_bound"] == pytest.approx(39 / 7)
    assert row[("bound", "total")]["x_ubep"] == pytest.approx(7 / 39)
    assert row[("bound", "total")]["bytes_per_rank"] == 3072
    assert res.unavailable == {"mpi": "not launched"}
    md = markdown(res)
    assert "| 4 | shm-ubep | 30.0 / " in md and "- mpi: unavailable — not launched" in md


class _Sys:
    """A system that logs each call: (name, op)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def dispatch(self):
        self.log.append(self.name)

    def combine(self):
        pass


class _Sync:
    def barrier(self):
        pass


@pytest.mark.parametrize("block", [1, 4])
def test_turns_start_with_an_untimed_lead(block):
    from ubep.bench.runner import _timed_loop

    cfg = BenchConfig(hiddens=(64,), batches=(4,), iters=8, warmup=2, block=block)
    log: list[str] = []
    order = [_Sys("a", log), _Sys("b", log)]
    times = {s.name: np.full((2, cfg.iters), np.nan) for s in order}
    leads = {s.name: [] for s in order}
    _timed_loop(cfg, order, _Sync(), times, {}, leads)
    assert all(not np.isnan(t).any() for t in times.values())   # every iteration timed
    if block == 1:
        assert all(not v for v in leads.values())
        assert log.count("a") == cfg.warmup + cfg.iters
    else:
        # a warm-up turn, then turns of one lead + `block` timed calls
        assert {len(v) for v in leads.values()} == {cfg.iters // block}
        assert log.count("a") == cfg.warmup + cfg.iters + cfg.iters // block


def test_leads_are_max_over_ranks_and_kept_out_of_samples():
    cfg = BenchConfig(hiddens=(64,), batches=(4,), iters=3, experts=4, top_k=2, block=3)
    t = np.array([[10.0, 10, 10], [5, 5, 5]])
    per_rank = [_rank({("shm-ubep", 64, 4): t}, 4.0), _rank({("shm-ubep", 64, 4): t}, 4.0)]
    per_rank[0]["leads"] = {("shm-ubep", 64, 4): np.array([100.0, 50.0])}
    per_rank[1]["leads"] = {("shm-ubep", 64, 4): np.array([60.0, 80.0])}
    res = BenchResult(config=cfg)
    collect(res, 2, per_rank)
    summarise(res)
    assert res.leads[("shm-ubep", 2, 64, 4)].tolist() == [100.0, 80.0]
    row = {(r["system"], r["op"]): r for r in res.rows}
    assert row[("shm-ubep", "total")]["p99_us"] == 15.0


def test_the_stand_in_expert_runs_between_dispatch_and_combine_untimed():
    from ubep.bench.runner import timed_pair

    log: list[str] = []

    class Steps:
        def dispatch(self):
            log.append("dispatch")

        def expert(self):
            log.append("expert")

        def combine(self):
            log.append("combine")

    at = np.zeros(4, dtype=np.int64)
    timed_pair(_Sync(), Steps(), at)
    assert log == ["dispatch", "expert", "combine"]
    assert at[0] > 0 and (np.diff(at) >= 0).all()          # the four clock readings, in order
    with pytest.raises(ValueError, match="expert='gemm' is not one of"):
        BenchConfig(expert="gemm")
