"""The sync-variant sweep (Fig. 10): config checks, a real run, the table, plot and files."""

import argparse

import pytest

from ubep.bench.sync_sweep import (
    DEFAULT_PAYLOADS,
    SweepPoint,
    SyncSweepConfig,
    SyncSweepResult,
    add_sync_sweep_args,
    config_from_args,
    load_sync_sweep,
    run_sync_sweep,
    sweep_table,
    write_sync_sweep,
)
from ubep.runtime import backend_names


def test_defaults_cover_16_bytes_to_16_kilobytes():
    cfg = SyncSweepConfig()
    assert cfg.payloads[0] == 16 and cfg.payloads[-1] == 16 * 1024
    assert cfg.syncs == ("sw", "tff", "dc", "sp") and cfg.ranks == 2
    assert cfg.hidden(16) == 8                     # bf16: 8 elements = 16 B per pair


@pytest.mark.parametrize("kwargs, match", [
    ({"payloads": ()}, "payloads"),
    ({"payloads": (15,)}, "payload 15"),
    ({"payloads": (16,), "rows_per_pair": 3}, "rows_per_pair"),
    ({"syncs": ("sw", "xx")}, "syncs"),
    ({"syncs": ("sw", "sw")}, "twice"),
    ({"backend": "nccl"}, "backend='nccl'"),
    ({"ranks": 1}, "ranks=1"),
    ({"iters": 0}, "iters=0"),
    ({"dtype": "int8"}, "dtype='int8'"),
])
def test_bad_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncSweepConfig(**kwargs)


def test_command_line_options_build_the_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int)          # a bench option that must not clash
    add_sync_sweep_args(parser)
    args = parser.parse_args(["--sync-sweep", "--sweep-payloads", "16,64", "--sweep-syncs",
                              "sw,tff", "--sweep-iters", "5", "--sweep-backend", "torch"])
    cfg = config_from_args(args)
    assert args.sync_sweep and cfg.payloads == (16, 64) and cfg.syncs == ("sw", "tff")
    assert cfg.iters == 5 and cfg.backend == "torch"
    assert config_from_args(parser.parse_args([])).payloads == DEFAULT_PAYLOADS
    with pytest.raises(ValueError, match="--sweep-payloads"):
        config_from_args(parser.parse_args(["--sweep-payloads", "16,x"]))


def _check_run(result, cfg):
    assert not result.unavailable, result.unavailable
    assert {(p.payload_bytes, p.sync) for p in result.points} == {
        (pl, v) for pl in cfg.payloads for v in cfg.syncs}
    for p in result.points:
        assert p.iters == cfg.iters
        assert 0 < p.min_us <= p.median_us <= p.p99_us


@pytest.mark.skipif("shm" not in backend_names(), reason="shm backend not registered yet")
def test_sweep_runs_every_variant_on_the_shm_backend():
    cfg = SyncSweepConfig(payloads=(1024,), iters=5, warmup=2, backend="shm")
    result = run_sync_sweep(cfg, progress=False)
    _check_run(result, cfg)
    for p in result.points:     # the runtime's own phase times come along
        assert p.phases_us and all(us >= 0 for us in p.phases_us.values())


def test_table_and_gain_from_recorded_points(tmp_path):
    from rich.console import Console

    cfg = SyncSweepConfig(payloads=(16, 32), iters=1)
    medians = {("sw", 16): 10.0, ("tff", 16): 6.0, ("dc", 16): 7.0, ("sp", 16): 5.0,
               ("sw", 32): 10.0, ("tff", 32): 12.0, ("dc", 32): 11.0, ("sp", 32): 13.0}
    points = [SweepPoint(pl, v, m, m + 1, m - 1, m, 1) for (v, pl), m in medians.items()]
    result = SyncSweepResult(cfg, points, {}, "test", 0.0)
    assert result.fastest(16) == "sp" and result.fastest(32) == "sw"
    assert result.gain_over_sw(16) == ("sp", pytest.approx(0.5))
    assert result.gain_over_sw(32) == ("dc", pytest.approx(-0.1))
    console = Console(record=True, width=160)
    console.print(sweep_table(result))
    text = console.export_text()
    assert "sp +50%" in text and "dc -10%" in text and "5.00 / 6.00" in text
    back = load_sync_sweep(write_sync_sweep(result, tmp_path)["json"])
    assert back.points == result.points and back.config == cfg and back.metric == "dispatch"


# -- the block formats alone (ping-pong) ---------------------------------------------------------

def _threads_pingpong(sync, block_bytes, payload, rounds=50):
    """Both sides of the ping-pong as two threads of this process (nogil kernels)."""
    import threading

    import numpy as np

    from ubep.bench.sync_pingpong import _pingpong
    from ubep.plan.blocks import SENTINEL_I64, BlockFormat
    from ubep.runtime.shm.region import FMT_CODES

    fmt = BlockFormat(sync, block_bytes)
    win = fmt.wire_bytes(payload)
    mem = np.zeros(2 * (win + 64) // 8, np.int64)
    if sync == "sp":                           # arm the marker word of every block
        for d in (0, 1):
            for blk in range(win // block_bytes):
                mem[(d * (win + 64) + (blk + 1) * block_bytes) // 8 - 1] = SENTINEL_I64
    base = mem.ctypes.data
    a, b = base, base + win + 64
    rng = np.random.default_rng(payload)
    src = [rng.integers(0, 1 << 60, payload // 8 + 1, dtype=np.int64) for _ in range(2)]
    dst = [np.zeros_like(s) for s in src]
    done = [0, 0]
    stamps = np.zeros(rounds, np.int64)

    def side(i):
        out_w, in_w = (a, b) if i == 0 else (b, a)
        done[i] = _pingpong(out_w, out_w + win, in_w, in_w + win, FMT_CODES[sync], block_bytes,
                            src[i], dst[i], payload // 8, i == 0, rounds, 1, 50_000_000,
                            stamps)

    threads = [threading.Thread(target=side, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return done, src, dst, stamps


@pytest.mark.parametrize("sync", ["sw", "tff", "dc", "sp"])
@pytest.mark.parametrize("block_bytes, payload", [(64, 200), (512, 16), (512, 1512)])
def test_pingpong_formats_deliver_every_byte(sync, block_bytes, payload):
    done, src, dst, stamps = _threads_pingpong(sync, block_bytes, payload)
    assert done == [50, 50]
    n = payload // 8
    # the last round (epoch 50) sent src XOR 50 each way
    assert (dst[0][:n] == src[1][:n] ^ 50).all() and (dst[1][:n] == src[0][:n] ^ 50).all()
    assert (stamps > 0).all()


def test_pingpong_sweep_on_two_ranks(tmp_path):
    from ubep.bench.sync_sweep import run_sync_pingpong

    cfg = SyncSweepConfig(payloads=(16, 2048), pingpong_rounds=20, pingpong_runs=2)
    result = run_sync_pingpong(cfg)
    assert result.metric == "pingpong"
    assert {(p.payload_bytes, p.sync) for p in result.points} == {
        (pl, v) for pl in cfg.payloads for v in cfg.syncs}
    for p in result.points:
        assert p.iters == 40 and 0 < p.min_us <= p.median_us <= p.p99_us
    paths = write_sync_sweep(result, tmp_path)
    assert paths["png"].name == "sync_pingpong.png" and paths["png"].stat().st_size > 1000


def test_command_runs_and_writes_files(tmp_path, capsys):
    from ubep.bench.sync_sweep import main

    rc = main(["--sweep-payloads", "32", "--sweep-iters", "2", "--sweep-warmup", "0",
               "--sweep-backend", "torch", "--sweep-kind", "dispatch", "--sweep-syncs", "sw,sp",
               "--sweep-out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "sync guarantee here" in out and "32 B" in out
    rows = (tmp_path / "sync_sweep.csv").read_text().splitlines()
    assert [r.split(",")[:2] for r in rows[1:]] == [["32", "sw"], ["32", "sp"]]
    for r in rows[1:]:
        median, p99, low = (float(v) for v in r.split(",")[2:5])
        assert 0 < low <= median <= p99
    assert (tmp_path / "sync_sweep.png").stat().st_size > 1000
    assert main(["--sweep-payloads", "7", "--sweep-out", str(tmp_path)]) == 2
