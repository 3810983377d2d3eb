"""`ubep reproduce --short` end to end, other fabrics, and the CLI commands."""

import csv

import pytest

from ubep.cli import main
from ubep.sim import simulate
from ubep.sim.reproduce import EXPERIMENTS, run


def test_reproduce_short_writes_every_experiment(tmp_path):
    report = run(tmp_path, short=True, topology="cm384", progress=False)
    text = report.read_text()
    names = [f(True, "cm384").name for f in EXPERIMENTS]
    for name in names:
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        assert f"![{name}]({name}.png)" in text
        with (tmp_path / f"{name}.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert rows and {r["label"] for r in rows} <= {"fitted", "predicted"}
    with (tmp_path / "table4.csv").open() as f:
        t4 = {int(r["ranks"]): r for r in csv.DictReader(f)}
    assert t4[16]["label"] == "fitted" and t4[32]["label"] == "predicted"
    assert float(t4[32]["bsp_us"]) > float(t4[32]["ubep_us"]) > 0
    with (tmp_path / "fig9.csv").open() as f:
        assert {r["schedule"] for r in csv.DictReader(f)} == {"static", "balanced",
                                                             "hierarchical"}


@pytest.mark.parametrize("topo", ["nvl72", "nvl576", "ib-cluster"])
def test_other_fabrics_simulate(topo):
    b = simulate(topo, ranks=16, tokens_per_rank=16, hidden=1024, mode="bsp")
    u = simulate(topo, ranks=16, tokens_per_rank=16, hidden=1024, mode="ubep")
    assert b.latency_us > 0 and u.latency_us > 0 and b.topology == topo


def test_cli_simulate_tune_and_check(tmp_path, capsys, monkeypatch):
    from ubep import tuning

    monkeypatch.setenv("UBEP_TUNING_CACHE", str(tmp_path / "tuning.json"))
    trace = tmp_path / "t.json"
    assert main(["simulate", "--ranks", "8", "--tokens-per-rank", "8", "--hidden", "256",
                 "--json", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert '"latency_us"' in out and trace.stat().st_size > 0
    assert main(["tune", "--ranks", "8", "--tokens-per-rank", "8", "--hidden", "256",
                 "--max-count-workers", "3"]) == 0
    assert "cost model" in capsys.readouterr().out
    hit = tuning.lookup("cm384", 48, 8, 8)
    assert hit is not None and 1 <= hit <= 3
    assert main(["simulate", "--ranks", "8", "--tokens-per-rank", "8", "--hidden", "256",
                 "--json", "--use-tuned"]) == 0
    assert f'"count_workers": {hit}' in capsys.readouterr().out
    assert main(["simulate", "--ranks", "8", "--num-experts", "12"]) == 2
    assert "num_experts=12" in capsys.readouterr().out
