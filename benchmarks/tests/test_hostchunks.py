"""The interleaved host validation's pairing (`benchmarks.hostchunks`): which tables a bench
chunk is predicted from, which chunks are dropped, how a point is summarised. Synthetic
records; no timed assertion (one tiny real run checks the record's shape only)."""

import os
import random

import numpy as np
import pytest

from benchmarks import host, hostbench, hostchunks
from benchmarks.hostchunks import ChunkSpec, pair_point, schedule, settled


def test_every_bench_chunk_sits_between_two_tables_of_its_batch():
    ev = schedule((1, 8), rounds=2, chunks=3)
    assert len(ev) == 2 * 2 * (2 * 3 + 1)
    for i, (kind, b, r, j) in enumerate(ev):
        if kind == "bench":
            assert ev[i - 1] == ("table", b, r, j) and ev[i + 1] == ("table", b, r, j + 1)
    benches = [e for e in ev if e[0] == "bench"]
    assert sorted({(b, r, j) for _, b, r, j in benches}) == \
        [(b, r, j) for b in (1, 8) for r in range(2) for j in range(3)]
    assert [b for k, b, r, j in ev if k == "table" and j == 0] == [1, 8, 1, 8]  # in turn


def test_tables_agree_within_the_tolerance_either_way():
    assert settled(100.0, 125.0) and settled(125.0, 100.0)
    assert not settled(100.0, 126.0) and not settled(126.0, 100.0)
    assert settled(100.0, 140.0, tol=0.5) and not settled(0.0, 0.0)


def test_a_chunk_across_a_state_change_is_dropped_and_the_rest_paired():
    chunks = [(100.0, 104.0, 95.0),       # cheap state around it: +7.4%
              (100.0, 300.0, 280.0),      # the host switched during it: dropped
              (300.0, 310.0, 290.0),      # dear: +5.2%
              (98.0, 102.0, 200.0)]       # its bench alone in the other state: kept, -50%
    p = pair_point(chunks)
    assert (p["chunks"], p["kept"], p["unsettled"]) == (4, 3, False)
    errs = [102 / 95 - 1, 305 / 290 - 1, 100 / 200 - 1]
    assert p["chunk_errors"] == pytest.approx(errs)
    assert p["error"] == pytest.approx(float(np.median(errs)))
    assert (p["predicted_lo_us"], p["predicted_hi_us"]) == (100.0, 305.0)
    assert (p["measured_lo_us"], p["measured_hi_us"]) == (95.0, 290.0)
    assert p["measured_us"] == 200.0 and p["predicted_us"] == 102.0


def test_a_point_with_no_settled_chunk_uses_all_and_says_so():
    p = pair_point([(100.0, 300.0, 150.0), (300.0, 100.0, 250.0)])
    assert p["unsettled"] and (p["kept"], p["chunks"]) == (0, 2)
    assert p["error"] == pytest.approx(np.median([200 / 150 - 1, 200 / 250 - 1]))
    with pytest.raises(ValueError, match="chunks"):
        pair_point([])


def test_spec_names_a_bad_argument():
    for kw, name in (({"rounds": 0}, "rounds"), ({"chunks": 0}, "chunks"),
                     ({"iters": 0}, "iters"), ({"warmup": -1}, "warmup"),
                     ({"batches": (3,)}, "batches")):
        with pytest.raises(ValueError, match=name):
            ChunkSpec(**kw)


def _ns(batch: int, scale: float) -> dict:
    fps = host.model_footprints((batch,))
    return {p: {str(f): [0.05 * scale, 0.04 * scale] for f in fps}
            for p in host.model_passes()}


def _record(batch: int, scales: list[float], measured) -> dict:
    """A one-batch, one-round record: tables with every pass at 0.05 ns/B x `scales[j]`,
    bench chunk j's calls all taking `measured(j, system, hidden, op)` us."""
    events = []
    for kind, b, r, j in schedule((batch,), 1, len(scales) - 1):
        ev = {"kind": kind, "batch": b, "round": r, "index": j, "t_s": [0.0, 0.0]}
        if kind == "table":
            ev["ns_per_byte"] = _ns(b, scales[j])
        else:
            ev["us"] = {f"{s}:{h}": [[measured(j, s, h, "dispatch")] * 3,
                                     [measured(j, s, h, "combine")] * 3]
                        for s in host.SYSTEMS for h in hostchunks.HIDDENS}
        events.append(ev)
    return {"spec": {"batches": [batch]}, "rtt_us": 0.2, "events": events}


def _model(batch: int, scale: float, call: float = 20.0) -> dict:
    """The model's hidden-7168 predictions on a table at `scale`, hidden-64 calls `call` us."""
    t = hostchunks.table_of({"ns_per_byte": _ns(batch, scale)})
    med = {(s, host.TINY_HIDDEN, batch, o): call for s in host.SYSTEMS
           for o in ("dispatch", "combine")}
    hc = host.constants(med, 0.2, t, batches=(batch,))
    return {(r["system"], r["op"]): r["predicted_us"]
            for r in host.validate(med, hc, batches=(batch,))}


def test_each_chunk_is_predicted_from_the_two_tables_around_it():
    """Tables cheap, cheap, dear (3x), dear: chunk 0 between two cheap ones, chunk 1 across
    the switch (dropped where the predictions differ by more than 25%), chunk 2 between
    two dear ones; each bench 10% slower than the prediction of its own state."""
    b = 16
    cheap, dear = _model(b, 1.0), _model(b, 3.0)
    state = {0: cheap, 1: dear, 2: dear}

    def measured(j, s, h, op):
        return 20.0 if h == host.TINY_HIDDEN else 1.1 * state[j][(s, op)]

    rows = hostchunks.validate_chunks(_record(b, [1.0, 1.0, 3.0, 3.0], measured))
    assert len(rows) == len(host.SYSTEMS) * 2
    for r in rows:
        c, d = cheap[(r["system"], r["op"])], dear[(r["system"], r["op"])]
        assert d > 1.25 * c                     # the switch shows in every point
        assert (r["chunks"], r["kept"]) == (3, 2)
        assert r["chunk_errors"] == pytest.approx([1 / 1.1 - 1] * 2)
        assert r["error"] == pytest.approx(1 / 1.1 - 1)
        assert r["predicted_lo_us"] == pytest.approx(c)
        assert r["predicted_hi_us"] == pytest.approx(d)
    md = host.markdown_table(rows[:0] + [dict(r, batch=bb) for bb in host.BATCHES
                                         for r in rows])
    assert "(err, chunks kept)" in md and ", 2/3)" in md


def test_ranks_merge_as_the_bench_does():
    """Tables: the median (mean of two) over ranks per pass and footprint; bench: the max
    over ranks of each call."""
    spec = ChunkSpec(batches=(1,), rounds=1, chunks=1, iters=2)
    fps = host.model_footprints((1,))

    def rank(v):
        tab = {g: {str(f): ((v, 2 * v) if g in hostbench.EXCHANGES else (v,)) for f in fps}
               for g in hostchunks.GROUPS}
        bench = {"shm-ubep:7168": [[v, 10 - v], [1.0, 1.0]]}
        phases = {"shm-ubep:7168": [{"dispatch:send": v}, {"dispatch:send": 10 - v}]}
        cold = {"shm-ubep:64": [[v, 2 * v], [3.0, 4.0 - v]]}
        return {"tables": [tab, tab], "bench": [bench], "phases": [phases], "cold": [cold],
                "t": [(0.0, 1.0)] * 3, "rtt_us": [0.3, 0.2]}

    rec = hostchunks.merge_ranks(spec, [rank(1.0), rank(3.0)])
    t0, bench, _ = rec["events"]
    assert t0["ns_per_byte"]["copy_fanout"][str(fps[0])] == [1.0, 3.0]
    assert t0["ns_per_byte"]["record_read_peer"][str(fps[0])] == [2.0, 6.0]  # read half
    f = fps[0]
    assert hostchunks.table_of(t0).cost_ns_per_byte("record_read_peer", f) == 6.0
    assert hostchunks.table_of(t0, "median").cost_ns_per_byte("record_read_peer", f) == 4.0
    assert bench["us"]["shm-ubep:7168"] == [[3.0, 9.0], [1.0, 1.0]]
    assert bench["phases_us"]["shm-ubep:7168"] == {"dispatch:send": 6.0}   # median(3, 9)
    assert bench["cold_us"]["shm-ubep:64"] == [[3.0, 6.0], [3.0, 3.0]]
    assert rec["rtt_us"] == 0.2


def test_the_per_call_overhead_is_the_cold_hidden_64_calls():
    """With `cold_us` in a bench event, the hidden-64 calls timed right after a hidden-7168
    call set the per-call overhead (overhead="cold", the default); "warm" takes the bench's
    back-to-back ones; each prediction moves by the difference; a bad name is an error."""
    b = 8
    rec = _record(b, [1.0, 1.0], lambda j, s, h, op: 20.0 if h == host.TINY_HIDDEN else 500.0)
    for ev in rec["events"]:
        if ev["kind"] == "bench":
            ev["cold_us"] = {f"{s}:{host.TINY_HIDDEN}": [[50.0] * 3, [35.0] * 3]
                             for s in host.SYSTEMS}
    cold = hostchunks.validate_chunks(rec)
    warm = hostchunks.validate_chunks(rec, overhead="warm")
    for c, w in zip(cold, warm):
        extra = 30.0 if c["op"] == "dispatch" else 15.0
        assert c["call_us"] == pytest.approx(w["call_us"] + extra)
        assert c["predicted_us"] == pytest.approx(w["predicted_us"] + extra, rel=1e-6)
        assert c["measured_us"] == w["measured_us"] == 500.0
    for ev in rec["events"]:                # no cold calls recorded: the warm ones
        ev.pop("cold_us", None)
    assert [r["call_us"] for r in hostchunks.validate_chunks(rec)] == \
        [r["call_us"] for r in warm]
    with pytest.raises(ValueError, match="overhead='hot' must be one of"):
        hostchunks.validate_chunks(rec, overhead="hot")


def test_each_cold_call_follows_a_big_call_of_its_system():
    """`_time_cold`: every hidden-64 call (warm-up and timed) right after a hidden-7168
    dispatch and combine of the same system; one series per system, `iters` calls each."""
    log = []

    class Fake:
        def __init__(self, name, h):
            self.key = (name, h)

        def dispatch(self):
            log.append(("d",) + self.key)

        def combine(self):
            log.append(("c",) + self.key)

    class Sync:
        def barrier(self):
            pass

    names = ("shm-bsp", "shm-ubep")
    systems = {(h, n): Fake(n, h) for n in names for h in hostchunks.HIDDENS}
    out = hostchunks._time_cold(systems, Sync(), 3, 2, random.Random(0))
    assert sorted(out) == [(n, host.TINY_HIDDEN) for n in names]
    assert all(np.array(v).shape == (2, 3) for v in out.values())
    assert len(log) == 2 * 5 * 4
    for i in range(0, len(log), 4):
        (d1, n1, h1), (c1, n2, h2), (d2, n3, h3), (c2, n4, h4) = log[i:i + 4]
        assert (d1, c1, d2, c2) == ("d", "c", "d", "c")
        assert n1 == n2 == n3 == n4
        assert (h1, h2, h3, h4) == (host.HIDDEN, host.HIDDEN, host.TINY_HIDDEN,
                                    host.TINY_HIDDEN)


@pytest.mark.host_timing
def test_a_tiny_interleaved_run_prices_every_point(tmp_path):
    """The real ranks (two processes, the runtime and the microbenchmark's kernels), one
    batch, one chunk: every point has a finite positive prediction and measurement, and
    nothing is left in /dev/shm. Shape only, no timing."""
    spec = ChunkSpec(batches=(1,), rounds=1, chunks=1, iters=2, warmup=1, seconds=0.001)
    rec = hostchunks.run_chunks(tmp_path, spec)
    assert [e["kind"] for e in rec["events"]] == ["table", "bench", "table"]
    rows = hostchunks.validate_chunks(rec)
    assert len(rows) == len(host.SYSTEMS) * 2
    for r in rows:
        assert 0 < r["predicted_us"] < 1e6 and 0 < r["measured_us"] < 1e6
        assert r["chunks"] == 1
    assert (tmp_path / "chunks.json").exists()
    assert "dispatch:send" in rec["events"][1]["phases_us"]["shm-ubep:7168"]
    assert sorted(rec["events"][1]["cold_us"]) == sorted(f"{s}:{host.TINY_HIDDEN}"
                                                         for s in host.SYSTEMS)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("ubep-hostbench")]


def test_a_table_times_each_exchange_as_a_chunk_times_a_systems_calls(monkeypatch):
    """Every exchange of a table runs the chunk's `warmup` untimed then `iters` timed rounds
    (calls), and the epochs it used are counted past: the bench's calls 4-13 of a run are
    priced by rounds 4-13, not by the first rounds after other work."""
    seen = []

    def windows(f, rb, own, peer, sec, spin, me, setup=None, epoch0=0, warmup=None,
                calls=None):
        seen.append(("windows", f, epoch0, warmup, calls))
        return {p: 1.0 for n in hostbench.WINDOWS for p in hostbench.EXCHANGES[n]}

    def exchange(g, f, rb, own, peer, sec, spin, me, setup=None, epoch0=0, warmup=None,
                 rounds=None):
        seen.append((g, f, epoch0, warmup, rounds))
        return (1.0, 1.0)

    monkeypatch.setattr(hostbench, "time_windows", windows)
    monkeypatch.setattr(hostbench, "time_exchange", exchange)
    monkeypatch.setattr(hostbench, "window_setups", lambda *a, **k: {})
    monkeypatch.setattr(hostbench, "_exchange_setup", lambda *a, **k: None)
    monkeypatch.setattr(hostbench, "_setup", lambda *a, **k: None)
    monkeypatch.setattr(hostbench, "time_pass", lambda *a, **k: 1.0)
    state = {"spin": None, "own": None, "peer": None, "me": 0, "setups": {}, "epoch": 2,
             "seconds": 0.02, "warmup": 3, "iters": 10}
    tab = hostchunks._time_table(128, state, random.Random(0))
    fps = host.model_footprints((128,))
    assert sorted(f for g, f, *_ in seen if g == "windows") == sorted(fps)
    assert sorted(f for g, f, *_ in seen if g == "direct") == sorted(fps)
    assert all((w, n) == (3, 10) for *_, w, n in seen)
    # epochs: consecutive blocks, a window point 13 calls of 2 rounds, a direct one 13 rounds
    e = 2
    for g, _, e0, _, _ in seen:
        assert e0 == e
        e += 13 * (len(hostbench.WINDOWS) if g == "windows" else 1)
    assert state["epoch"] == e
    assert set(tab) == set(hostchunks.GROUPS)


def test_a_hidden_64_pool_lends_exactly_the_outputs_the_hidden_7168_one_does():
    """`lend_as_at`: at every row count a bench call's outputs have (each batch's tokens and
    the rows a dispatch receives, around the pool's 256 KiB threshold too), a pool scaled to
    hidden 64 lends from its kept blocks exactly when a plain pool at hidden 7168 does (the
    dispatch's `recv_x` at batch 8: both lend; the combine's output at batch 8: neither)."""
    import torch

    from ubep.runtime.shm.outputs import MIN_BYTES, OutputPool

    def lends(pool, rows, hidden) -> bool:
        pool.empty(rows, hidden, torch.bfloat16)
        return bool(pool._blocks)

    edge = MIN_BYTES // (host.HIDDEN * host.BYTES_PER_ELEMENT)
    rows = sorted({r for b in host.BATCHES for r in (b, b * host.TOP_K - 1, b * host.TOP_K,
                                                     b * host.TOP_K + 1)}
                  | {edge - 1, edge, edge + 1, edge + 2})
    got = []
    for r in rows:
        small = OutputPool()
        hostchunks.lend_as_at(small, host.TINY_HIDDEN)
        big = lends(OutputPool(), r, host.HIDDEN)
        assert lends(small, r, host.TINY_HIDDEN) == big, r
        assert not lends(OutputPool(), r, host.TINY_HIDDEN) or big, r   # never less
        got.append(big)
    assert any(got) and not all(got)
    assert lends(OutputPool(), 64, host.HIDDEN) and not lends(OutputPool(), 8, host.HIDDEN)
    with pytest.raises(ValueError, match="hidden=0"):
        hostchunks.lend_as_at(OutputPool(), 0)


def test_output_pool_names_a_system_without_one():
    """`output_pool` finds a shm system's pool through its Buffer and path; anything else
    is an error naming `system`."""
    from types import SimpleNamespace

    from ubep.runtime.shm.outputs import OutputPool

    pool = OutputPool()
    fake = SimpleNamespace(buf=SimpleNamespace(_backend=SimpleNamespace(
        _path=SimpleNamespace(_lend=pool))))
    assert hostchunks.output_pool(fake) is pool
    with pytest.raises(TypeError, match="system="):
        hostchunks.output_pool(SimpleNamespace(buf=None))


def _pools_rank(rank, world):
    from ubep.bench.config import BenchConfig
    from ubep.bench.systems import make_system

    cfg = BenchConfig(ranks=(world,), hiddens=(host.TINY_HIDDEN,), batches=(8,),
                      top_k=host.TOP_K, experts=host.EXPERTS, systems=tuple(host.SYSTEMS))
    out = {}
    for name in host.SYSTEMS:
        s = make_system(name, cfg, host.TINY_HIDDEN)
        try:
            pool = hostchunks.output_pool(s)
            before = pool._min
            hostchunks.lend_as_at(pool, host.TINY_HIDDEN)
            out[name] = (before, pool._min)
        finally:
            s.close()
    return out


def test_every_shm_system_of_the_validation_has_a_pool_to_scale():
    """The real shm systems (one-worker and direct path, two ranks): `output_pool` reaches
    each one's pool, and `lend_as_at` scales its threshold by 64 / 7168, rounded up."""
    from ubep.runtime.shm.outputs import MIN_BYTES
    from ubep.testing import run_ranks

    for got in run_ranks(_pools_rank, 2):
        assert sorted(got) == sorted(host.SYSTEMS)
        for before, after in got.values():
            assert before == MIN_BYTES
            assert after == -(-MIN_BYTES * host.TINY_HIDDEN // host.HIDDEN)
