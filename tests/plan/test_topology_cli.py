"""`ubep topology`: show a preset, validate files, errors naming the key."""

from __future__ import annotations

from ubep.cli import main

GOOD = """
name = "two-level"
num_ranks = 8
workers_per_rank = 2
atomic_block_bytes = 64
flag_bytes = 8
local_latency_ns = 20
local_bandwidth_GBps = 20
[[tiers]]
name = "pair"
ranks_per_group = 2
latency_ns = 100
bandwidth_GBps = 10
[[tiers]]
name = "all"
latency_ns = 300
bandwidth_GBps = 5
"""


def test_show_cm384_prints_tiers_and_the_picture(capsys):
    assert main(["topology", "show", "cm384"]) == 0
    out = capsys.readouterr().out
    for word in ("npu", "board", "pod", "2500", "929", "218", "groups of 16 ranks",
                 "legend: 0=local 1=npu 2=board 3=pod"):
        assert word in out


def test_show_a_small_file_draws_every_pair(tmp_path, capsys):
    path = tmp_path / "t.toml"
    path.write_text(GOOD)
    assert main(["topology", "show", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("  0 1 2")]
    assert rows == [["0", "1", "2", "2", "2", "2", "2", "2"]]


def test_validate_names_the_bad_key(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(GOOD.replace("latency_ns = 300", "latency_ns = 'slow'"))
    assert main(["topology", "validate", str(path)]) == 2
    assert "tiers[1].latency_ns" in capsys.readouterr().out.replace("\n", "")
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    assert main(["topology", "validate", str(good)]) == 0
    assert main(["topology", "show", "nvl73"]) == 2


def test_list_names_the_presets(capsys):
    assert main(["topology", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("cm384", "nvl72", "nvl576", "ib-cluster", "host"))


def test_plan_shows_each_workers_hop_mix(capsys):
    argv = ["topology", "plan", "cm384", "--ranks", "32", "--workers", "5", "--tokens", "20",
            "--mode", "bsp"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "5 token" in out and "sends=160" in out
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.count("│") == 7]
    totals = [int(r[-1]) for r in rows]
    assert len(totals) == 5 and sum(totals) == 160 and max(totals) - min(totals) <= 1
    assert main(argv + ["--rank", "99"]) == 2


def test_show_cluster_draws_hosts_and_the_network(capsys):
    assert main(["topology", "show", "cluster", "--ranks", "24"]) == 0
    out = capsys.readouterr().out
    for word in ("3 hosts", "host 0", "host 2", "ranks 16-23", "other host", "400 Gb/s",
                 "4 us one-way", "legend: 0=local 1=host 2=other host"):
        assert word in out, word


def test_show_an_uneven_cluster_file(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('name = "uneven"\nhost_groups = [[0, 3], [1, 2, 4]]\nnic_gbps = 100\n'
                    'nic_latency_us = 2\nintra_host = "nvl72"\n')
    assert main(["topology", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ranks 0, 3" in out and "ranks 1-2, 4" in out and "2,3" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  0 2 2 1")]
    assert rows == [["0", "2", "2", "1", "2"]]
    assert main(["topology", "show", str(path), "--ranks", "6"]) == 2
    assert "cannot be rescaled" in capsys.readouterr().out.replace("\n", " ")
