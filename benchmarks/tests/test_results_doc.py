"""`python -m benchmarks results` renders docs/results.md from two runs: figures are ratios of
one run."""

import numpy as np

from benchmarks.probes import GapLog, HostRecord, host_record
from benchmarks.results import (
    README_END,
    README_START,
    figures,
    headline_table,
    render,
    update_readme,
)
from ubep.bench.config import BenchConfig
from ubep.bench.run import BenchResult, collect, summarise

H = 7168


def _result(scale: float, block: int) -> tuple[BenchResult, HostRecord]:
    """A run at batch 1 and 128 where every system's times are fixed multiples."""
    cfg = BenchConfig(hiddens=(H,), batches=(1, 128), iters=3, block=block,
                      systems=("shm-owned", "shm-direct", "shm-ubep", "torch", "agrs"))
    base = {"shm-owned": 30.0, "shm-direct": 30.0, "shm-ubep": 50.0, "torch": 900.0, "raw": 500.0,
            "agrs": 1000.0, "bound": 10.0}
    times = {}
    for name, us in base.items():
        for batch in (1, 128):
            t = np.full((2, 3), us * scale * (1 if batch == 1 else 100) / 2)
            t[:, 2] *= 2                                       # one slow iteration: p99
            times[(name, H, batch)] = t
    # the host's gaps bunch 700-750 µs into each millisecond; iteration 2 (the slow one) runs
    # across that window, the others clear of it
    gap_starts = np.arange(100, dtype=np.int64) * 1_000_000 + 720_000
    log = GapLog([(0, 100_000_000, gap_starts, np.full(100, 30_000, np.int64))])
    at = [10**9 + 100_000, 10**9 + 200_000, 10**9 + 690_000]        # each iteration's start
    spans = {key: np.array([[a, a + 20_000, a + 30_000, a + 50_000] for a in at]).T
             for key in times}
    rank = {"times": times, "phases": {}, "unavailable": {}, "rtt_us": 0.0, "spans": spans,
            "probe": {"gap_log": log, "gaps": (150.0, 40.0 * scale), "speed": (10.0, 10.0)},
            "xcopy": (114688, 6.0 * scale, 3.0 * scale),
            "bytes": {(H, 1): (1, 1), (H, 128): (1, 1)}}
    res = BenchResult(config=cfg, machine={"time_utc": "now", "cpus_usable": 2,
                                           "load_avg_1m": 0.1})
    collect(res, 2, [rank, rank])
    summarise(res)
    return res, host_record(res)


def test_figures_are_ratios_of_one_run():
    (turns, _), (inter, _) = _result(1.0, 20), _result(2.0, 1)
    lines = figures(turns, inter)
    row = {line.split(" | ")[0].lstrip("| "): line for line in lines}
    # torch / (raw + bound) = 900 / 510 in both runs, whatever the run's scale
    assert row["torch / (raw collectives + copy bound), batch 1"].count("1.76×") == 2
    assert row["agrs / shm-owned, batch 128"].count("33.33×") == 2
    assert "| 3.00× | 3.00× | yes |" in row["shm-direct batch 1 / copy bound"]
    md = render(turns, inter, command="ubep results")
    assert not any("µs" in line.split(" | ")[2] for line in lines[2:])   # ratios only
    assert "    ubep results" in md and "## Run 2: every iteration interleaved" in md
    assert "| 1 | raw collectives |" in md and "× raw+copy" in md


def test_the_readme_table_is_the_runs_ratios(tmp_path):
    (turns, _), (inter, _) = _result(1.0, 20), _result(2.0, 1)
    table = headline_table(turns, inter)
    rows = {line.split(" | ")[0].lstrip("| ") + f" b{line.split(' | ')[1]}": line
            for line in table.splitlines()[2:]}
    # torch 900 / shm-owned 30 in both runs, at batch 1 and 128 alike
    assert rows["torch (gloo) / ubep's default path b1"].endswith("| 30.00× | 30.00× |")
    assert rows["ubep's default path / copy bound b128"].endswith("| 3.00× | 3.00× |")
    assert not any(k.startswith("MPI") for k in rows)          # no mpi in this run
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_START}\nold\n{README_END}\nrest\n")
    assert update_readme(readme, table)
    text = readme.read_text()
    assert "old" not in text and table in text and text.endswith(f"{README_END}\nrest\n")
    readme.write_text("no markers\n")
    assert not update_readme(readme, table) and readme.read_text() == "no markers\n"
