"""Stats of the shm runtime: phases, per-worker intervals, payload efficiency, trace export."""

from __future__ import annotations

import json

import torch

from ubep.plan.blocks import BlockFormat
from ubep.testing import make_routing, make_tokens, run_ranks


def _stats(rank, world, tmp):
    import ubep

    out = {}
    for mode, workers, sync in (("ubep", 2, "tff"), ("bsp", 2, "sp"), ("ubep", 1, "dc")):
        with ubep.Buffer(num_experts=4, hidden=64, max_tokens_per_rank=8, backend="shm",
                         mode=mode, workers=workers, sync=sync, timeout_s=30) as buf:
            idx, w = make_routing(8, 2, 4, seed=rank)
            res = buf.dispatch(make_tokens(rank, 8, 64, torch.bfloat16), idx, w)
            buf.combine(res.recv_x, res.handle)
            st, ct = res.stats, buf.last_stats
            path = ubep.write_chrome_trace([st, ct], f"{tmp}/trace_{mode}_{rank}.json")
            out[(mode, workers, sync)] = dict(
                phases=sorted(st.phases_us), workers={iv.worker for iv in st.intervals},
                kinds={iv.kind for iv in st.intervals}, eff=st.payload_efficiency,
                ceff=ct.payload_efficiency, total=st.total_us, ops=(st.op, ct.op),
                backend=st.backend, sent=st.bytes_sent, n_events=len(
                    json.loads(open(path).read())["traceEvents"]),
                busy=st.busy_us_per_worker(), mode=st.mode, sync=st.sync)
    return out


def test_stats_have_phases_workers_efficiency_and_export(tmp_path):
    out = run_ranks(_stats, 2, str(tmp_path), timeout_s=200)
    for r in range(2):
        ubep2 = out[r][("ubep", 2, "tff")]
        assert ubep2["workers"] == {0, 1} and ubep2["kinds"] == {"busy", "wait"}
        assert {"send_counts", "send_rows", "wait_counts", "reorder"} <= set(ubep2["phases"])
        assert ubep2["eff"] == BlockFormat("tff", 512).efficiency(16 + 128)
        assert ubep2["ceff"] == BlockFormat("tff", 512).efficiency(128)
        assert ubep2["ops"] == ("dispatch", "combine") and ubep2["backend"] == "shm"
        assert ubep2["sent"] > 0 and ubep2["total"] > 0 and ubep2["n_events"] > 4
        bsp = out[r][("bsp", 2, "sp")]
        assert {"send_rows", "send_flags", "wait_counts", "offsets", "reorder"} <= set(
            bsp["phases"])
        assert bsp["eff"] == BlockFormat("sp", 512).efficiency(16 + 128)
        assert (bsp["mode"], bsp["sync"]) == ("bsp", "sp")
        one = out[r][("ubep", 1, "dc")]
        assert one["workers"] == {0} and set(one["phases"]) == {"send", "wait_counts", "reorder"}
        assert all(v >= 0 for v in one["busy"].values())
