"""`ubep e2e` end to end on the tiny model: table, CSV, JSON and plot on disk."""

import csv
import json

from ubep.cli import main


def test_e2e_command_writes_results(tmp_path, capsys):
    rc = main(["e2e", "--size", "tiny", "--arch", "qwen3", "--ranks", "2", "--batch", "1",
               "--steps", "4", "--warmup", "1", "--backends", "gloo", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TPOT" in out and "gloo" in out
    summary = json.loads((tmp_path / "e2e_summary.json").read_text())
    assert summary["command"].startswith(
        "ubep e2e --engine ubep --arch qwen3 --size tiny --ranks 2")
    rows = {r["backend"]: r for r in summary["rows"]}
    assert set(rows) == {"unsplit", "gloo"}
    gloo = rows["gloo"]
    assert gloo["tokens_match_unsplit"] is True
    assert gloo["steps"] == 3 and gloo["norm_p50"] == 1.0
    assert 0 < gloo["comm_share"] < 1 and gloo["comm_p50_ms"] > 0 and gloo["experts_p50_ms"] > 0
    assert gloo["p50_ms"] <= gloo["p99_ms"]
    with open(tmp_path / "e2e_steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert [r["step"] for r in steps if r["backend"] == "gloo"] == ["1", "2", "3"]
    assert all(float(r["latency_ms"]) > 0 for r in steps)
    assert (tmp_path / "e2e_tpot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["params"]["qwen3"]["params_ep_per_rank"][0] < \
        summary["params"]["qwen3"]["params_full"]
