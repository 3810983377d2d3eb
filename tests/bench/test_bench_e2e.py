"""`ubep bench` end to end on a tiny config: every available system runs and is written out."""

import csv
import json
import os

import pytest

from ubep.bench.cli import _config_from_args
from ubep.bench.config import BenchConfig
from ubep.cli import build_parser, main

TINY = ["--ranks", "2", "--hidden", "64", "--tokens", "1", "5", "--experts", "4",
        "--top-k", "2", "--iters", "4", "--warmup", "1"]


def _read(out):
    with (out / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    return rows, json.loads((out / "run.json").read_text())


def _check_complete(rows, run, systems):
    """Every system ran (it passed the runner's oracle check) with a row per (batch, op).

    Every system asked for is built here, so none may be missing: the runner drops a system
    that fails its untimed oracle check and lists it as unavailable, which is a failure.
    """
    ran = {r["system"] for r in rows}
    assert {"bound", "raw"} <= ran
    assert not run["unavailable"], run["unavailable"]
    for s in systems:
        assert s in ran, (s, run["unavailable"])
    for s in ran:
        got = {(int(r["batch"]), r["op"]) for r in rows if r["system"] == s}
        assert got == {(b, op) for b in (1, 5) for op in ("dispatch", "combine", "total")}, s
    for r in rows:
        assert float(r["median_us"]) > 0 and float(r["p99_us"]) >= float(r["min_us"])
        assert int(r["samples"]) == 4
        total = float(r["median_us"]) if r["op"] == "total" else None
        if total is not None:
            assert float(r["x_bound"]) > 0
    # the bound moves exactly the routed rows: batch * top_k rows of 64 bf16 at most
    for r in rows:
        if r["system"] == "bound" and r["op"] == "dispatch":
            assert 0 < int(r["bytes_per_rank"]) <= int(r["batch"]) * 2 * 64 * 2


def test_bench_side_by_side(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", *TINY, "--out", str(out)]) == 0
    rows, run = _read(out)
    _check_complete(rows, run, ["shm-owned", "shm-ubep", "shm-direct", "shm-bsp", "torch"])
    assert "torch" in {r["system"] for r in rows}   # gloo is always there
    assert (out / "bench.png").stat().st_size > 0
    md = (out / "bench.md").read_text()
    assert md.count("\n| 5 | torch |") == 1 and "\n| 1 | copy bound |" in md
    with (out / "phases.csv").open() as f:  # the torch backend reports its own phases
        phases = {(r["system"], r["phase"]) for r in csv.DictReader(f)}
    assert {("torch", "dispatch:backend_total"), ("torch", "combine:token_exchange")} <= phases
    assert "| 5 | raw collectives |" in md and "× raw+copy" in md
    assert run["flag_round_trip_us"]["2"] > 0
    # the cross-core copy probe: the smallest batch's dispatch bytes, both copies timed
    xcopy = run["cross_core_copy"]["2"]
    assert xcopy["bytes"] == 1 * 2 * 64 * 2 and xcopy["peer_written_us"] > 0 \
        and xcopy["own_cache_us"] > 0
    # ranks bound to disjoint slices of the usable cores when there are enough of them
    cores = run["rank_cores"]["2"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert all(cores) and not set(cores[0]) & set(cores[1]), cores
    else:
        assert cores == [None, None]


def test_bench_no_pin_leaves_ranks_unbound(tmp_path):
    out = tmp_path / "unbound"
    argv = ["bench", *TINY, "--systems", "shm-owned", "torch", "--no-pin", "--out", str(out)]
    assert main(argv) == 0
    rows, run = _read(out)
    _check_complete(rows, run, ["shm-owned", "torch"])
    assert run["config"]["pin"] is False and run["rank_cores"]["2"] == [None, None]


def test_bench_peers_under_mpiexec(tmp_path, mpi):
    out = tmp_path / "peers"
    assert main(["bench", *TINY, "--peers", "--out", str(out)]) == 0
    rows, run = _read(out)
    _check_complete(rows, run, ["shm-owned", "shm-ubep", "shm-direct", "shm-bsp", "torch",
                                "mpi", "agrs"])
    # each peer beside its own bare collectives: its x raw+copy is taken against them
    got = {(r["system"], r["op"]): r for r in rows if r["ranks"] == "2" and r["batch"] == "5"}
    for peer, raw in (("mpi", "mpi-raw"), ("agrs", "agrs-raw"), ("torch", "raw")):
        assert (raw, "total") in got, raw
        want = float(got[(peer, "total")]["median_us"]) / (
            float(got[(raw, "total")]["median_us"]) + float(got[("bound", "total")]["median_us"]))
        assert float(got[(peer, "total")]["x_raw_copy"]) == pytest.approx(want, rel=1e-3)


def _args(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_bench_options():
    cfg = _config_from_args(_args("--backend", "shm", "--mode", "bsp"))
    assert cfg.systems == ("shm-bsp",)
    cfg = _config_from_args(_args("--peers"))
    assert cfg.systems[-2:] == ("mpi", "agrs") and cfg.hiddens == (2048, 7168)
    assert cfg.batches == (1, 8, 16, 64, 128)
    with pytest.raises(ValueError, match="--mode needs --backend shm"):
        _config_from_args(_args("--mode", "ubep"))
    with pytest.raises(ValueError, match="experts=6 must be divisible"):
        BenchConfig(ranks=(4,), experts=6, top_k=2)
    with pytest.raises(ValueError, match="system 'nccl'"):
        BenchConfig(systems=("nccl",))
    assert _config_from_args(_args()).expert == "clone"
    assert _config_from_args(_args("--expert", "identity")).expert == "identity"


def test_demo_config_is_the_deepseek_like_default():
    from ubep.bench.cli import demo_config

    cfg = demo_config()
    assert (cfg.hiddens, cfg.dtype, cfg.top_k, cfg.ranks) == ((7168,), "bfloat16", 8, (2,))
    assert cfg.batches[0] == 1 and cfg.batches[-1] == 128


def test_oracle_check_catches_one_flipped_byte():
    """The runner's check drops a system whose dispatch differs from the oracle by one byte."""
    import dataclasses

    import torch

    from ubep import reference
    from ubep.bench.systems import check_dispatch
    from ubep.testing import make_routing, make_tokens

    xs = [make_tokens(r, 5, 16, torch.bfloat16, seed=1) for r in range(2)]
    routes = [make_routing(5, 2, 4, kind="uniform", seed=r) for r in range(2)]
    ref = reference.dispatch(xs, [i for i, _ in routes], [w for _, w in routes], 4)[0]
    assert ref.recv_x.numel() and check_dispatch("s", ref, ref) is None
    flipped = ref.recv_x.clone()
    flipped.view(torch.uint8).view(-1)[7] ^= 1
    bad = dataclasses.replace(ref, recv_x=flipped)
    assert check_dispatch("s", bad, ref) == "s: recv_x differs from the oracle"
    token = ref.recv_src_token.clone()
    token[0] += 1
    assert "recv_src_token" in check_dispatch("s", dataclasses.replace(ref, recv_src_token=token),
                                              ref)


def test_the_deepep_ll_preset_is_deepeps_low_latency_shape():
    cfg = _config_from_args(_args("--preset", "deepep-ll"))
    assert (cfg.batches, cfg.hiddens, cfg.top_k, cfg.experts) == ((128,), (7168,), 8, 256)
    assert cfg.fp8 and cfg.dtype == "bfloat16" and cfg.ranks == (2,)
    assert cfg.systems == ("shm-owned", "shm-ubep", "shm-direct", "shm-bsp", "torch")
    # a flag beside the preset overrides its value
    assert _config_from_args(_args("--preset", "deepep-ll", "--tokens", "1")).batches == (1,)
    with pytest.raises(ValueError, match="fp8 runs the Buffer systems only"):
        _config_from_args(_args("--preset", "deepep-ll", "--peers"))
    with pytest.raises(ValueError, match="multiple of 128"):
        BenchConfig(hiddens=(64,), fp8=True)
    with pytest.raises(ValueError, match="fp8 needs expert='clone'"):
        BenchConfig(fp8=True, expert="identity")


def test_bench_fp8_dispatch_with_scales(tmp_path):
    """fp8 rows and their scales dispatched (each checked against the oracle byte for byte
    before timing), combine in bf16; the copy bound moves the fp8 bytes and the scales."""
    out = tmp_path / "fp8"
    assert main(["bench", "--ranks", "2", "--hidden", "256", "--tokens", "1", "5",
                 "--experts", "4", "--top-k", "2", "--iters", "4", "--warmup", "1", "--fp8",
                 "--systems", "shm-owned", "shm-bsp", "torch", "--out", str(out)]) == 0
    rows, run = _read(out)
    assert not run["unavailable"], run["unavailable"]
    assert {r["system"] for r in rows} == {"shm-owned", "shm-bsp", "torch", "bound"}
    for r in rows:
        if r["system"] == "bound" and r["op"] == "dispatch":   # 256 fp8 bytes + 2 scales
            assert int(r["bytes_per_rank"]) % (256 + 2 * 4) == 0
        if r["system"] == "bound" and r["op"] == "combine":     # 256 bf16 channels
            assert int(r["bytes_per_rank"]) % (256 * 2) == 0
    assert "fp8 e4m3 rows + scales, bfloat16 combine" in (out / "bench.md").read_text()


def test_oracle_check_of_fp8_rows_catches_a_flipped_scale():
    import dataclasses
    from types import SimpleNamespace

    import torch

    from ubep import reference
    from ubep.bench.runner import oracle_rows
    from ubep.bench.systems import check_dispatch
    from ubep.quant import per_token_cast_to_fp8
    from ubep.testing import make_routing, make_tokens

    xs = [per_token_cast_to_fp8(make_tokens(r, 5, 256, torch.bfloat16, seed=1))
          for r in range(2)]
    routes = [make_routing(5, 2, 4, kind="uniform", seed=r) for r in range(2)]
    idxs, ws = [i for i, _ in routes], [w for _, w in routes]
    ref = reference.dispatch([oracle_rows(x) for x in xs], idxs, ws, 4)[0]
    rows = reference.dispatch([x for x, _ in xs], idxs, ws, 4)[0]
    scales = reference.dispatch([s for _, s in xs], idxs, ws, 4)[0].recv_x
    got = SimpleNamespace(**{f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)},
                          recv_x_scales=scales)
    assert rows.recv_x.numel() and check_dispatch("s", got, ref) is None
    flipped = scales.clone()
    flipped.view(torch.uint8).view(-1)[3] ^= 1
    got.recv_x_scales = flipped
    assert check_dispatch("s", got, ref) == "s: recv_x or recv_x_scales differs from the oracle"
