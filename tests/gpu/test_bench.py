"""The GPU benchmark script runs end to end (tiny, on CPU under Triton's interpreter)."""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("triton", reason="ubep.gpu needs triton (pip install 'ubep[gpu]')")
pytest.importorskip("matplotlib")

from ubep.gpu import bench  # noqa: E402


def test_smoke_run_writes_every_system_and_op(tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "gpu_bench.csv") as f:
        rows = list(csv.DictReader(f))
    # 1 rank count x 2 batches x 2 ops x 4 systems, each timed
    assert {(r["batch"], r["op"], r["system"]) for r in rows} == {
        (b, op, s) for b in ("1", "4") for op in bench.OPS for s in bench.SYSTEMS}
    assert all(float(r["us"]) > 0 and r["graph_us"] == "" for r in rows)
    assert (tmp_path / "gpu_bench.png").stat().st_size > 10_000


def test_programs_fill_the_device_and_fit_it():
    assert bench.programs_for(32, None) == (1, 2, 1)
    for P in (8, 16, 32):
        c, s, r = bench.programs_for(P, 132)
        assert P * (c + s + r) <= 132 and c == 1 and s >= r >= 1
