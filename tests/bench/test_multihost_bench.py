"""`ubep bench --hosts`: the multi-host bench runs end to end on emulated hosts and reports
every line for every batch, with the network bytes of both backends."""

import pytest

from ubep.testing import hosts_available


def test_bench_hosts_runs_and_writes_its_table(tmp_path):
    ok, why = hosts_available()
    if not ok:
        pytest.skip(why)
    from ubep.bench.multihost import LINES, MultihostConfig, run

    cfg = MultihostConfig(hosts=2, ranks_per_host=1, batches=(1, 16), hidden=256, rounds=1,
                          block=2, timeout_s=300)
    rows = run(cfg, tmp_path)
    assert [(r["batch"], r["line"]) for r in rows] == [(b, ln) for b in (1, 16) for ln in LINES]
    assert all(r["median_ms"] > 0 and r["calls"] == 2 for r in rows)
    # one rank per host: the torch backend sends a token once per rank = once per host
    big = rows[-1]
    assert big["net_bytes_torch"] == big["net_bytes_ubep"] > 0
    assert big["torch_over_control"] > 0          # the A/A control line ran
    assert (tmp_path / "multihost_2x1_unlimited.csv").exists()
