"""TPOT statistics from ranks' step times: slowest rank per step, warmup, gloo normalisation."""

import numpy as np
import pytest
import torch

from ubep.moe.decode import DecodeResult
from ubep.moe.e2e import RankReport, RankRun, plot_tpot, summarize


def _result(step_s, comm_s, experts_s) -> DecodeResult:
    n = len(step_s)
    return DecodeResult(tokens=torch.zeros(1, n + 1, dtype=torch.int64), logits=None,
                        step_s=torch.tensor(step_s, dtype=torch.float64),
                        comm_s=torch.tensor(comm_s, dtype=torch.float64), prefill_s=0.0,
                        experts_s=torch.tensor(experts_s, dtype=torch.float64))


def _reports(rng):
    steps = {(r, b): rng.uniform(0.01, 0.05, size=10) for r in range(2)
             for b in ("gloo", "shm-ubep")}
    reports = [RankReport(rank=r, params_full=10, params_ep=6, local_experts_per_layer=[2],
                          num_experts=4,
                          runs=[RankRun(b, 1, _result(steps[(r, b)], steps[(r, b)] / 2,
                                                      steps[(r, b)] / 4))
                                for b in ("gloo", "shm-ubep")])
               for r in range(2)]
    return reports, steps


def test_summarize_takes_slowest_rank_after_warmup(tmp_path):
    reports, steps = _reports(np.random.default_rng(0))
    rows = {s.backend: s for s in summarize("qwen3", reports, warmup=3)}
    for b, s in rows.items():
        slowest = np.maximum(steps[(0, b)], steps[(1, b)])[3:]
        assert s.steps == 7
        assert s.latencies_ms == pytest.approx(list(slowest * 1e3))
        assert s.p50_ms == pytest.approx(np.percentile(slowest, 50) * 1e3)
        assert s.p99_ms == pytest.approx(np.percentile(slowest, 99) * 1e3)
        assert s.comm_share == pytest.approx(0.5)
        mean_over_ranks = (steps[(0, b)] + steps[(1, b)])[3:] / 2
        assert s.comm_p50_ms == pytest.approx(np.median(mean_over_ranks / 2) * 1e3)
        assert s.experts_p50_ms == pytest.approx(np.median(mean_over_ranks / 4) * 1e3)
    assert rows["gloo"].norm_p50 == pytest.approx(1.0)
    assert rows["shm-ubep"].norm_p50 == pytest.approx(rows["shm-ubep"].p50_ms /
                                                      rows["gloo"].p50_ms)
    plot_tpot(list(rows.values()), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_summarize_rejects_warmup_covering_all_steps():
    reports, _ = _reports(np.random.default_rng(1))
    with pytest.raises(ValueError, match="warmup=10"):
        summarize("qwen3", reports, warmup=10)
