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
    run_sync_sweep,
    sweep_table,
    write_sync_sweep,
)
from ubep.runtime import _BACKENDS


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


def test_sweep_runs_every_variant_on_the_torch_backend(tmp_path):
    cfg = SyncSweepConfig(payloads=(64,), iters=3, warmup=1, backend="torch")
    result = run_sync_sweep(cfg, progress=False)
    _check_run(result, cfg)
    paths = write_sync_sweep(result, tmp_path)
    assert paths["png"].stat().st_size > 1000
    assert len(paths["csv"].read_text().splitlines()) == 1 + len(cfg.syncs)


@pytest.mark.skipif("shm" not in _BACKENDS, reason="shm backend not registered yet")
def test_sweep_runs_every_variant_on_the_shm_backend():
    cfg = SyncSweepConfig(payloads=(16, 1024), iters=5, warmup=2, backend="shm")
    _check_run(run_sync_sweep(cfg, progress=False), cfg)


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
    assert "sp +50%" in text and "dc -10%" in text and "5.0 / 6.0" in text
    assert write_sync_sweep(result, tmp_path)["json"].exists()
