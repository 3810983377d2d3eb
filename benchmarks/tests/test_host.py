"""The host model from first principles: its microbenchmark table, the passes each path makes
over rows, footprints, faulted pages, per-call overheads. No bench run and no timed
assertion here (`python -m benchmarks validate-host` is a benchmark, not a test)."""

import math
import os

import pytest

from benchmarks import host, hostbench
from benchmarks.hostbench import CopyTable
from ubep.bench.systems import page_aligned

R = host.HIDDEN * host.BYTES_PER_ELEMENT


def flat_table(ns: float = 0.05, touch_ns: float = 1.0) -> CopyTable:
    """Every pass costs `ns` per byte at every footprint (first touch: `touch_ns`)."""
    fps = (1 << 16, 1 << 20, 1 << 24, 1 << 28)
    return CopyTable(R, fps, {(p, n): (touch_ns if p == "first_touch" else ns,) * len(fps)
                              for p in hostbench.PASSES for n in (1, 2)})


def cache_table() -> CopyTable:
    """A cache-like table: cheap up to 4 MiB, four times dearer from 32 MiB on."""
    fps = (1 << 16, 1 << 22, 1 << 25, 1 << 28)
    return CopyTable(R, fps, {(p, n): (0.02, 0.02, 0.08, 0.08) for p in hostbench.PASSES
                              for n in (1, 2)})


def test_table_reproduces_its_points_interpolates_and_never_gets_cheaper_with_footprint():
    fps = (1 << 16, 1 << 20, 1 << 24)
    noisy = CopyTable(R, fps, {("copy", 2): (0.02, 0.06, 0.05)})   # a dip: timing noise
    assert noisy.cost_ns_per_byte("copy", 1 << 16) == pytest.approx(0.02)
    assert noisy.cost_ns_per_byte("copy", 1 << 20) == pytest.approx(0.06)
    assert noisy.cost_ns_per_byte("copy", 1 << 24) == pytest.approx(0.06)   # running max
    assert noisy.cost_ns_per_byte("copy", 1 << 18) == pytest.approx(0.04)   # log-linear
    assert noisy.cost_ns_per_byte("copy", 10) == pytest.approx(0.02)        # clamped
    assert noisy.cost_ns_per_byte("copy", 1 << 30) == pytest.approx(0.06)
    grid = [1 << k for k in range(10, 32)]
    costs = [cache_table().cost_ns_per_byte("record_read", f) for f in grid]
    assert costs == sorted(costs)
    t = cache_table()
    assert CopyTable.from_dict(t.to_dict()) == t


def test_footprints_count_the_buffers_each_path_cycles_through():
    b = 16
    rows = b * host.TOP_K
    direct = host.footprint_bytes("shm-direct", b)
    assert direct == b * R + rows * (R + 16) + b * R
    single = host.footprint_bytes("shm-ubep", b)
    assert single == host.footprint_bytes("shm-bsp", b)          # the same one-worker path
    # the peer's rows through windows (header + row as tff blocks, and the row alone), as
    # many sets as the epoch rule uses, and a second recv_x (the bench keeps the previous)
    wire_d, wire_c = hostbench.record_wire_bytes(R), hostbench.record_wire_bytes(R, 0)
    remote = round(rows * host.remote_share(b))
    assert host.window_copies() in (1, 2)
    assert single - direct == host.window_copies() * remote * (wire_d + wire_c) + rows * R \
        - 16 * rows
    for s in host.SYSTEMS:
        fp = [host.footprint_bytes(s, b) for b in (1, 8, 16, 128)]
        assert fp == sorted(fp)


def test_remote_share_is_the_routings():
    for b in (1, 8, 128):
        assert 0.3 < host.remote_share(b) < 0.7      # uniform over 2 ranks: about half


def test_direct_dispatch_costs_its_rows_once_at_the_tables_price():
    ns, rtt = 0.05, 0.2
    for b in (1, 8, 16, 128):
        p = host.call_params("shm-direct", "dispatch", host.HIDDEN, b, flat_table(ns), rtt)
        got = host.predict("shm-direct", "dispatch", host.HIDDEN, b, p)
        rows = b * host.TOP_K                       # uniform over 2 ranks: each sends b*k
        assert got == pytest.approx(rows * R * ns / 1e3, rel=0.03, abs=2 * rtt), b


def test_one_worker_dispatch_writes_the_peers_rows_then_reads_every_row():
    """send the peer's rows as records, then read each received row into place (the peer's
    out of the window, my own from x): serial on one worker."""
    ns, rtt = 0.05, 0.2
    share = host.remote_share(128)
    for system in ("shm-ubep", "shm-bsp"):
        p = host.call_params(system, "dispatch", host.HIDDEN, 128, flat_table(ns), rtt)
        got = host.predict(system, "dispatch", host.HIDDEN, 128, p)
        rows = 128 * host.TOP_K
        assert got == pytest.approx((share + 1) * rows * R * ns / 1e3, rel=0.05), system


def test_each_side_weights_its_passes_by_the_rows_they_apply_to():
    fps = (1 << 16, 1 << 28)
    costs = {p: float(2 ** i) for i, p in enumerate(hostbench.PASSES)}
    t = CopyTable(R, fps, {(p, n): (c, c) for p, c in costs.items() for n in (1, 2)})
    c = costs
    sh = host.remote_share(16)
    ns = {(s, op, side): host.pass_ns_per_byte(s, op, side, 16, t, 1 << 20)
          for s in host.SYSTEMS for op in ("dispatch", "combine") for side in ("send", "recv")}
    # the one-worker path: the peer's rows cross cores (the exchange passes), mine do not
    assert ns[("shm-ubep", "dispatch", "send")] == pytest.approx(
        sh * c["record_write_fanout_peer"])
    assert ns[("shm-ubep", "dispatch", "recv")] == pytest.approx(
        sh * c["record_read_peer"] + (1 - sh) * c["copy_fanout"])
    assert ns[("shm-bsp", "combine", "send")] == pytest.approx(sh * c["record_write_peer"])
    assert ns[("shm-bsp", "combine", "recv")] == pytest.approx(
        sh * c["reduce_blocks_peer"] + (1 - sh) * c["reduce_scatter"])
    # direct: every row once, to its expert-major place, then read back where it lies
    assert ns[("shm-direct", "dispatch", "send")] == pytest.approx(c["copy_scatter"])
    assert ns[("shm-direct", "combine", "send")] == pytest.approx(c["reduce_scatter"])
    assert ns[("shm-direct", "dispatch", "recv")] == ns[("shm-direct", "combine", "recv")] == 0


def test_row_passes_are_timed_passes_and_cross_cores_exactly_for_the_peers_rows():
    """Every pass the model charges is one the microbenchmark times; the one-worker path's
    rows for the peer (written into the peer's window, read out of mine) are priced by the
    cross-core exchange passes, its own rows and the direct path's rows (read back by the
    rank that wrote them) never are."""
    for (path, _), sides in host.ROW_PASSES.items():
        for side in sides.values():
            for p, rows in side:
                assert p in hostbench.PASSES
                assert (p in hostbench.CROSS_CORE) == (path == "single" and rows == "remote")
    assert set(hostbench.CROSS_CORE) == {p for x in ("dispatch_peer", "combine_peer")
                                         for p in hostbench.EXCHANGES[x]}


def test_an_exchange_pass_may_be_cheaper_at_a_larger_footprint():
    """Lines in the peer's private cache cost more than lines already in the shared one, and
    an exchange round's fixed costs (the wait for the peer's rows) are shared by more rows
    at a larger footprint: every exchange pass keeps its measured shape (the direct one's
    too); every pass one process cycles is a running maximum."""
    fps = (1 << 18, 1 << 22, 1 << 26)
    t = CopyTable(R, fps, {(p, 2): (0.5, 0.05, 0.1) for p in hostbench.PASSES})
    assert set(hostbench.EXCHANGE_PASSES) == set(hostbench.PASSES) - set(hostbench.CYCLED)
    assert {"copy_scatter", "reduce_scatter"} <= set(hostbench.EXCHANGE_PASSES)
    for p in hostbench.PASSES:
        got = [t.cost_ns_per_byte(p, f) for f in fps]
        want = [0.5, 0.05, 0.1] if p in hostbench.EXCHANGE_PASSES else [0.5, 0.5, 0.5]
        assert got == pytest.approx(want), p


def test_the_direct_exchange_never_moves_less_than_a_token():
    """At the hidden-64 footprints (a few KB) the direct exchange still moves one token's 8
    rows of 14 KB: its price per byte there is a one-token round's, fixed costs included,
    which is why a running maximum must not carry it to the larger footprints."""
    buf = page_aligned(1 << 21)
    small = host.footprint_bytes("shm-direct", 8, host.TINY_HIDDEN)
    assert small < 8 * R
    assert hostbench._exchange_setup("direct", small, R, buf, buf, 0)[2] == 8 * R
    big = host.footprint_bytes("shm-direct", 8)
    assert hostbench._exchange_setup("direct", big, R, buf, buf, 0)[2] == 64 * R


def test_expert_places_lay_rows_out_expert_major():
    """Each token's 8 rows go to 8 distinct experts of 16; the places are a permutation,
    each expert's rows one run in token order (as the runtime's receive areas)."""
    import numpy as np

    n = 8 * 50
    places = hostbench.expert_places(n)
    assert sorted(places.tolist()) == list(range(n))
    assert hostbench.expert_places(n).tolist() == places.tolist()      # seeded
    order = np.argsort(places)            # row (t*8 + j) at each place, in place order
    tokens = order // 8
    runs = np.split(tokens, np.flatnonzero(np.diff(tokens) <= 0) + 1)
    assert 8 <= len(runs) <= 16           # one increasing run per expert (at most 16)
    # a token's rows are 8 different runs (experts)
    run_of_place = np.repeat(np.arange(len(runs)), [len(r) for r in runs])
    for t in range(50):
        assert len(set(run_of_place[places[t * 8:(t + 1) * 8]].tolist())) == 8
    assert hostbench.expert_places(13).shape == (8,)   # whole tokens only


def test_exchange_rounds_are_the_same_for_every_process_and_bounded():
    for f in hostbench.FOOTPRINTS:
        r = hostbench.exchange_rounds(f, 0.02)
        assert 5 <= r <= 50 and r == hostbench.exchange_rounds(f, 0.02)
    assert hostbench.exchange_rounds(1 << 18, 0.02) >= hostbench.exchange_rounds(1 << 27, 0.02)


def test_microbenchmark_buffers_are_on_small_pages_like_the_runtimes():
    """numpy advises huge pages for its large arrays; the runtime's shared memory has none,
    so the timed buffers are shared mappings too."""
    a = page_aligned(8 << 20)
    assert a.nbytes == 8 << 20 and a.ctypes.data % 4096 == 0 and not a.any()
    addr = a.ctypes.data
    with open("/proc/self/maps") as f:              # "lo-hi perms ...": shared = "s"
        perms = [ln.split()[1] for ln in f
                 if int(ln.split("-")[0], 16) <= addr < int(ln.split()[0].split("-")[1], 16)]
    assert perms and perms[0][3] == "s"


def test_predictions_grow_with_batch_and_direct_is_cheapest():
    for table in (flat_table(), cache_table()):
        for op in ("dispatch", "combine"):
            lat = {s: [host.predict(s, op, host.HIDDEN, b,
                                    host.call_params(s, op, host.HIDDEN, b, table, 0.2))
                       for b in host.BATCHES] for s in host.SYSTEMS}
            for s, v in lat.items():
                assert v == sorted(v) and v[0] > 0, (s, op, v)
            # one copy per row instead of up to two: faster once rows dominate (batch 8 on;
            # at batch 1 the direct combine's wait for the peer's publish can outweigh it)
            assert all(d < u for d, u in zip(lat["shm-direct"][1:], lat["shm-ubep"][1:]))


def test_a_footprint_past_the_cache_costs_the_dearer_bytes():
    """The cache table is 4x dearer from 32 MiB: the batch-128 one-worker call (80+ MB)
    costs what it costs where every byte is dear, the batch-1 one (0.6 MB) what it costs
    where every byte is cheap."""
    def lat(table, b):
        p = host.call_params("shm-ubep", "dispatch", host.HIDDEN, b, table, 0.2)
        return host.predict("shm-ubep", "dispatch", host.HIDDEN, b, p)

    assert host.footprint_bytes("shm-ubep", 1) < (1 << 22) < (1 << 25) < \
        host.footprint_bytes("shm-ubep", 128)
    assert lat(cache_table(), 1) == pytest.approx(lat(flat_table(0.02), 1))
    assert lat(cache_table(), 128) == pytest.approx(lat(flat_table(0.08), 128))


def test_faulted_pages_cost_the_first_touch_price():
    table, rtt = flat_table(touch_ns=1.0), 0.2
    base = host.call_params("shm-ubep", "dispatch", host.HIDDEN, 16, table, rtt)
    faulted = host.call_params("shm-ubep", "dispatch", host.HIDDEN, 16, table, rtt,
                               faults=100)
    assert faulted.launch_us - base.launch_us == pytest.approx(100 * hostbench.PAGE * 1.0
                                                               / 1e3)


def test_per_call_overhead_is_what_the_model_leaves_unexplained_at_each_batch():
    """Where moving rows costs nothing (every pass free, no flag latency) a call is its
    overhead alone: the hidden-64 medians (30 + batch µs) are the per-call overheads, and
    each hidden-7168 prediction is that overhead, whatever the path. Expected values by
    hand, not from the model."""
    free, rtt = flat_table(0.0, 0.0), 0.0
    med = {}
    for system in host.SYSTEMS:
        for op in ("dispatch", "combine"):
            for b in host.BATCHES:
                med[(system, host.TINY_HIDDEN, b, op)] = 30.0 + b
                med[(system, host.HIDDEN, b, op)] = 100.0
    hc = host.constants(med, rtt, free)
    assert set(hc.call_us) == {(s, op, b) for s in host.SYSTEMS for op in ("dispatch", "combine")
                               for b in host.BATCHES}
    assert all(v == pytest.approx(30.0 + b) for (_, _, b), v in hc.call_us.items())
    rows = host.validate(med, hc)
    assert len(rows) == len(host.SYSTEMS) * len(host.BATCHES) * 2
    for r in rows:
        assert r["predicted_us"] == pytest.approx(30.0 + r["batch"])
        assert r["error"] == pytest.approx((30.0 + r["batch"] - 100.0) / 100.0)
    # rows that cost something: every prediction lies above its overhead, more so at hidden
    # 7168 than the hidden-64 call the overhead came from
    for r in host.validate(med, host.constants(med, 0.2, flat_table())):
        assert r["predicted_us"] > r["call_us"] > 0
    md = host.markdown_table(rows).splitlines()
    assert len(md) == 2 + len(host.SYSTEMS) * len(host.BATCHES) + 2
    assert md[2].startswith("| shm-bsp | 1 | ") and md[-1].endswith(f"of {len(rows)}")


@pytest.mark.host_timing
def test_microbenchmark_times_every_pass_alone_and_in_pairs():
    """A tiny grid of the real microbenchmark (the runtime's kernels, two processes):
    every point is a positive, finite cost per byte. One footprint, below what the direct
    exchange's smallest round (one token's rows) spans: its shared buffers are sized for
    that round (they were sized for twice the footprint only, and a process crashed)."""
    fps = (1 << 16,)
    t = hostbench.measure(passes=hostbench.PASSES, footprints=fps, seconds=0.001,
                          procs=(1, 2), rounds=1)
    assert set(t.ns_per_byte) == {(p, n) for p in hostbench.PASSES for n in (1, 2)}
    for v in t.ns_per_byte.values():
        assert len(v) == len(fps) and all(0 < x < math.inf for x in v)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("ubep-hostbench")]


def test_an_exchange_reads_what_the_peer_wrote():
    """The one-worker exchanges' read halves find every record complete (tff flags of the
    round's epoch) and sums of ones: the write went where the read looks."""
    import numpy as np

    for name in ("dispatch_peer", "combine_peer"):
        a, b = page_aligned(1 << 20), page_aligned(1 << 20)
        # process A (own a) writes into its peer's b; process B (own b) reads b
        write, _, n = hostbench._exchange_setup(name, 1 << 18, R, a, b)
        _, read, _ = hostbench._exchange_setup(name, 1 << 18, R, b, a)
        assert n > 0
        write(7)
        assert np.any(b) and not np.any(a)
        got = read(7)
        assert got == 0 or got is None       # dispatch: no record missing its flags
        if name == "dispatch_peer":
            assert read(8) > 0               # flags of another round: all missing


def test_direct_places_are_the_runtimes_expert_major_layout_of_both_sources():
    import numpy as np

    t_n = 16
    dest, place, rows = hostbench.direct_places(t_n)
    n = t_n * hostbench.FAN
    assert dest.shape == place.shape == (2, n) and rows.sum() == 2 * n
    # source 0's routing is expert_places'
    idx0 = np.argsort(np.random.default_rng(0).random((t_n, 16)), axis=1)[:, :8].ravel()
    assert (dest[0] == idx0 // 8).all()
    for d in (0, 1):
        got = sorted(place[dest == d].tolist())
        assert got == list(range(rows[d]))           # every row of d's area, once
        # walking d's area in order: experts ascending, source 0 before 1, tokens ascending
        idx = np.stack([np.argsort(np.random.default_rng(s).random((t_n, 16)),
                                   axis=1)[:, :8].ravel() for s in (0, 1)])
        src, row = np.nonzero(dest == d)
        keys = sorted(zip(place[src, row], idx[src, row], src, row))
        walk = [(e, s, r) for _, e, s, r in keys]
        assert walk == sorted(walk)
        assert all(e // 8 == d for e, _, _ in walk)


def test_direct_exchange_puts_rows_in_the_destinations_area_with_their_meta_words():
    """Two ranks in two threads (the kernels release the GIL): each write returns once the
    peer's rows for it arrived; every row is in its destination's area with its meta word;
    each rank's sums of its tokens' rows (ones, weight 0.5, 8 rows) are 4.0."""
    import threading

    import numpy as np

    fp = 1 << 19
    bufs = [page_aligned(4 * fp), page_aligned(4 * fp)]
    ex = [hostbench._exchange_setup("direct", fp, R, bufs[me], bufs[1 - me], me)
          for me in (0, 1)]
    errors = []

    def run(me):
        try:
            ex[me][0](5)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(me,)) for me in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in ts)
    n = ex[0][2] // R
    dest, place, rows = hostbench.direct_places(n // hostbench.FAN)
    slot = -(-(int(rows.max()) * (R + 16)) // hostbench.PAGE) * hostbench.PAGE
    for d in (0, 1):
        area = bufs[d][d * slot:]
        meta = area[int(rows.max()) * R:].view(np.int64)
        q = np.sort(place[dest == d])
        assert (meta[2 * q + 1] == 5).all()           # every row for d: its meta word
        rows_d = area[:rows[d] * R].reshape(rows[d], R).view(np.uint16)
        assert (rows_d == 0x3F80).all()               # rows of ones, all landed
    for me in (0, 1):                                 # 8 rows of 1.0 at weight 0.5: 4.0
        assert (ex[me][1](5) == 0x4080).all()
    # alone: both destinations' areas in my buffer, nothing to wait for, the same sums
    alone = page_aligned(4 * fp)
    write, read, _ = hostbench._exchange_setup("direct", fp, R, alone, alone, 0)
    write(3)
    assert (read(3) == 0x4080).all()


def test_record_layout_matches_the_runtime():
    # a dispatch record: 16-byte header + row, 504 payload bytes per 512-byte block
    assert hostbench.record_wire_bytes(R) == math.ceil((R + 16) / 504) * 512
    assert hostbench.record_wire_bytes(128, 0) == 512


def test_spin_barrier_passes_when_all_arrived_and_names_a_missing_peer_by_deadline():
    words = page_aligned(4096)
    alone = hostbench.SpinBarrier(words.ctypes.data, 0, 1)
    alone.wait()
    alone.wait()
    assert words.view("int64")[0] == 2
    words.view("int64")[1] = 3                  # the other process is one round ahead
    pair = hostbench.SpinBarrier(words.ctypes.data, 0, 2, timeout_s=0.05)
    pair.wait()
    pair.wait()
    pair.wait()
    with pytest.raises(TimeoutError, match="process 0"):
        pair.wait()                             # round 4: the other never arrives


def _points(value: float) -> dict:
    return {(s, h, b, o): value for s in host.SYSTEMS for h in (host.TINY_HIDDEN, host.HIDDEN)
            for b in host.BATCHES for o in ("dispatch", "combine")}


def test_the_model_times_exactly_its_passes_at_the_validations_footprints():
    used = {p for sides in host.ROW_PASSES.values() for ps in sides.values() for p, _ in ps}
    assert set(host.model_passes()) == used <= set(hostbench.PASSES)
    assert "first_touch" in host.model_passes(faults=True)
    fps = host.model_footprints()
    assert list(fps) == sorted(set(fps))
    for s in host.SYSTEMS:
        for b in host.BATCHES:
            assert host.footprint_bytes(s, b) in fps
            assert host.footprint_bytes(s, b, host.TINY_HIDDEN) in fps
    # a table timed at exactly these footprints prices every call at a timed point
    t = CopyTable(R, fps, {(p, 2): tuple(float(i + 1) for i in range(len(fps)))
                           for p in host.model_passes()})
    f = host.footprint_bytes("shm-direct", 128)
    assert t.cost_ns_per_byte("copy_scatter", f) == float(fps.index(f) + 1)


def test_the_table_shows_the_runs_ranges():
    med = _points(100.0)
    rows = host.validate(med, host.constants(med, 0.2, flat_table()))
    assert "[" not in host.markdown_table(rows)             # one run: no ranges
    for r in rows:
        r.update(predicted_lo_us=50.0, predicted_hi_us=70.0, measured_lo_us=90.0,
                 measured_hi_us=300.0)
    assert "[50-70] / 100 [90-300] (" in host.markdown_table(rows)


def test_the_model_runs_the_benchs_own_routing():
    """`host.predict` plans the routing `ubep bench` runs at that batch and hidden (its
    `bench_inputs`), and the passes are weighted by that routing's share of rows for the peer:
    the share of the planner's sends that leave their rank, counted here from the plans."""
    import numpy as np

    from ubep.bench.config import BenchConfig
    from ubep.bench.runner import bench_inputs
    from ubep.sim.api import SimConfig, prepare

    for b, h in ((1, host.HIDDEN), (1, host.TINY_HIDDEN), (8, host.HIDDEN)):
        cfg = BenchConfig(ranks=(2,), hiddens=(h,), batches=(b,), top_k=host.TOP_K,
                          experts=host.EXPERTS, systems=tuple(host.SYSTEMS))
        want = np.stack([bench_inputs(cfg, r, b, h)[1].numpy() for r in range(host.RANKS)])
        got = host.bench_topk(b, h)
        assert got.shape == (host.RANKS, b, host.TOP_K) and np.array_equal(got, want)
        prep = prepare(host.host_topology(), SimConfig(
            tokens_per_rank=b, hidden=h, top_k=host.TOP_K, num_experts=host.EXPERTS,
            mode="ubep", op="dispatch"), topk=got)
        assert np.array_equal(prep.topk, want)
        sent = remote = 0
        for r, plan in enumerate(prep.plans):
            dests = [int(d) for d in np.asarray(plan.sends)[:, 2]]
            sent += len(dests)
            remote += sum(d != r for d in dests)
            # every (token, expert) of the bench's routing is one send, to its expert's rank
            per_rank = host.EXPERTS // host.RANKS
            assert sorted(dests) == sorted(int(e) // per_rank for e in want[r].ravel())
        assert sent == want.size
        assert host.remote_share(b, h) == pytest.approx(remote / sent)


def test_prepare_names_a_routing_of_the_wrong_shape_or_experts():
    import numpy as np

    from ubep.sim.api import SimConfig, prepare

    cfg = SimConfig(tokens_per_rank=2, hidden=64, top_k=2, num_experts=4, op="dispatch")
    topo = host.host_topology()
    with pytest.raises(ValueError, match="topk must be an integer array of shape"):
        prepare(topo, cfg, topk=np.zeros((2, 3, 2), np.int64))
    with pytest.raises(ValueError, match="topk must hold expert ids"):
        prepare(topo, cfg, topk=np.full((2, 2, 2), 4, np.int64))
    ok = prepare(topo, cfg, topk=np.array([[[0, 1], [2, 3]], [[3, 2], [1, 0]]]))
    assert ok.topk.shape == (2, 2, 2)


def test_the_window_exchanges_lie_apart_and_run_in_the_benchs_order():
    """Dispatch and combine windows of each parity: separate parts of the buffers (as the
    runtime's windows), together within the footprint; rounds cycle through all four."""
    import numpy as np

    f = 1 << 21
    own, peer = page_aligned(2 * f), page_aligned(2 * f)
    ws = hostbench.window_setups(f, R, own, peer, 0, copies=2)
    assert list(ws) == [("dispatch_peer", 0), ("combine_peer", 0), ("dispatch_peer", 1),
                        ("combine_peer", 1)]
    spans = []
    for k, (write, _, n) in ws.items():
        before = peer.copy()
        write(5)
        hit = np.flatnonzero(peer != before)
        assert hit.size and n > 0, k
        spans.append((hit[0], hit[-1]))
    spans.sort()
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))       # no overlap
    assert spans[-1][1] < f
    order = hostbench.bench_order(list(ws), 4, warmup=2)
    assert [k for k, _ in order] == list(ws) * 3
    assert [t for _, t in order] == [False] * 4 + [True] * 8        # first cycle untimed


def test_the_bench_order_times_the_calls_a_bench_chunk_times():
    """A call is a dispatch window then its combine window, the parities in turn; `warmup`
    untimed calls, then `calls` timed ones (a chunk's 3 + 10)."""
    keys = ["d0", "c0", "d1", "c1"]
    order = hostbench.bench_order(keys, 10, warmup=3)
    assert len(order) == 2 * 13
    assert [k for k, _ in order[:8]] == keys * 2
    assert [k for k, _ in order[6:10]] == ["d1", "c1", "d0", "c0"]   # call 4 is parity 1
    assert [t for _, t in order] == [False] * 6 + [True] * 20
    assert hostbench.bench_order(keys, 1, warmup=0) == [("d0", True), ("c0", True)]
    for bad in ({"calls": 0}, {"calls": 1, "warmup": -1}, {"calls": 1, "per_call": 0}):
        with pytest.raises(ValueError, match="must be >= "):
            hostbench.bench_order(keys, **{"warmup": 2, **bad})


def test_an_exchange_times_the_rounds_after_its_warmup(monkeypatch):
    """`time_exchange(warmup=w, rounds=n)`: w + n rounds with consecutive epochs, each a
    write then a read between barriers; the medians come from the last n only (each round's
    times here are its epoch, so which rounds went in is exact)."""
    calls = []

    class Barrier:
        waits = 0

        def wait(self):
            Barrier.waits += 1

    real = hostbench._timed_round

    def timed_round(write, read, epoch, barrier):
        real(write, read, epoch, barrier)
        return 1000 * epoch, 10 * epoch

    monkeypatch.setattr(hostbench, "_timed_round", timed_round)
    setup = (lambda e: calls.append(("w", e)), lambda e: calls.append(("r", e)), 1000)
    w, r = hostbench.time_exchange("direct", 1, R, None, None, 0.0, Barrier(), setup=setup,
                                   epoch0=7, warmup=3, rounds=4)
    assert calls == [(h, 7 + i) for i in range(7) for h in ("w", "r")]
    assert Barrier.waits == 2 * 7
    assert (w, r) == (11.5, 0.115)          # epochs 10..13: median 11.5 (x1000, x10) / 1000 B
    with pytest.raises(ValueError, match="rounds=0"):
        hostbench.time_exchange("direct", 1, R, None, None, 0.0, Barrier(), setup=setup,
                                warmup=1, rounds=0)


def test_rounds_are_timed_in_the_given_order_with_fresh_epochs():
    calls = []

    class Barrier:
        waits = 0

        def wait(self):
            Barrier.waits += 1

    def setup(name):
        return (lambda e: calls.append((name, "w", e)), lambda e: calls.append((name, "r", e)),
                1000)

    order = hostbench.bench_order(["x", "y"], 2, warmup=1)
    got = hostbench.time_rounds({p: setup(p) for p in "xy"}, order, Barrier(), epoch0=10)
    assert Barrier.waits == 2 * len(order)
    # each round: the write then the read of one exchange, both with the round's own epoch
    assert calls == [c for i, (p, _) in enumerate(order) for c in ((p, "w", 10 + i),
                                                                   (p, "r", 10 + i))]
    assert {k: len(v) for k, v in got.items()} == {"x": 2, "y": 2}
    assert all(w >= 0 and r >= 0 for v in got.values() for w, r in v)


def test_window_passes_come_from_their_own_exchanges_rounds():
    """One process alone (its peer buffer is its own): every pass of the four priced."""
    f = 1 << 20
    buf = page_aligned(4 * f)

    class Alone:
        def wait(self):
            pass

    ns = hostbench.time_windows(f, R, buf, buf, 0.0, Alone(), 0, copies=2)
    want = {p for n in hostbench.WINDOWS for p in hostbench.EXCHANGES[n]}
    assert set(ns) == want and all(v > 0 for v in ns.values())


def test_each_combine_window_sends_back_what_its_dispatch_received():
    """As the runtime's combine sends `expert_out` (the dispatch's `recv_x`): one process
    alone, its dispatch reads its records (bytes of 1) into the rows its combine then
    sends, in place of the bf16 ones the combine's rows held before."""
    import numpy as np

    f = 1 << 20
    buf = page_aligned(4 * f)
    ws = hostbench.window_setups(f, R, buf, buf, 0, copies=1)
    (dw, dr, _), (cw, _, _) = ws[("dispatch_peer", 0)], ws[("combine_peer", 0)]
    before = buf.copy()
    cw(3)
    sent = np.flatnonzero(buf != before)
    assert set(np.unique(buf[sent])) >= {0x80, 0x3F}        # bf16 1.0 = 0x3F80
    dw(4)
    assert dr(4) == 0                                        # every record complete
    cw(5)
    rows_sent = buf[sent]
    assert np.count_nonzero(rows_sent == 0x01) > 0.9 * np.count_nonzero(rows_sent == 0x80) + 1
    with pytest.raises(ValueError, match="rows must be uint8"):
        hostbench._exchange_setup("combine_peer", f, R, buf, buf, rows=np.zeros((1, R), np.uint8))


def test_faults_are_free_when_the_table_did_not_time_first_touch():
    """The validation's tables time only the row passes; a stray fault counted then must
    not stop the pricing (the CLI says faults are priced at 0)."""
    full = flat_table()
    rows_only = CopyTable(R, full.footprints, {k: v for k, v in full.ns_per_byte.items()
                                               if k[0] != "first_touch"})
    args = ("shm-ubep", "combine", host.HIDDEN, 128)
    bare = host.call_params(*args, rows_only, 0.2, 5.0)
    assert host.call_params(*args, rows_only, 0.2, 5.0, faults=0.025).launch_us == \
        pytest.approx(bare.launch_us) == pytest.approx(5.0)
    assert host.call_params(*args, full, 0.2, 5.0, faults=2.0).launch_us > 5.0
