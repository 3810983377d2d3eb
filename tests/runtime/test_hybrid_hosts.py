"""The hybrid backend on emulated hosts: network namespaces joined by veth (or a bridge), a
private /dev/shm each (`ubep.testing.run_hosts`). What tests/runtime/test_hybrid.py checks
with hosts told apart by `UBEP_SHM_DOMAIN`, here with hosts that really share nothing but a
link: the oracle, the network bytes, a killed rank, `auto`'s choice. Needs root and `ip`.
"""

from __future__ import annotations

import pytest
import torch
from test_hybrid import _kill, check_hybrid

from ubep.native import load_native
from ubep.testing import Case, Counted, hosts_available, run_case, run_hosts, runtime_cases


@pytest.fixture(autouse=True)
def _need_hosts():
    ok, why = hosts_available()
    if not ok:
        pytest.skip(why)


def _cases(rank, world, cases):
    import ubep

    most = max(max(c.tokens) for c in cases) or 1
    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=most, max_top_k=max(c.top_k for c in cases),
                     timeout_s=30) as buf:
        # the door (the flat torch backend's) takes small flat calls whole; stats as ours
        door = buf._door_dispatch = Counted(buf._door_dispatch) if buf._door else None
        outs = []
        for case in cases:
            out = run_case(buf, case, rank)
            out["mode"] = buf.last_stats.extra["mode"]
            outs.append(out)
            x, idx, w = case.inputs(rank)
            res = buf.dispatch(x, idx, w)
            out["net"] = (res.stats.extra["mode"], res.stats.bytes_sent_network)
            buf.combine(res.recv_x.float(), res.handle)
        return (buf.config.backend, buf.config.backend_reason, buf.config.hosts, outs,
                door.took if door else 0)


def _expected_network_bytes(case: Case, hosts, rank: int, mode: str) -> int:
    """Counted from the routing: one row per (token, other host holding one of its experts);
    in flat mode one per (token, rank on another host holding one of its experts)."""
    world = len(case.tokens)
    host_of = {r: h for h, rs in enumerate(hosts) for r in rs}
    epr = case.num_experts // world
    _, idx, _ = case.inputs(rank)
    rows = 0
    for experts in idx.tolist():
        far = {e // epr for e in experts if e >= 0 and host_of[e // epr] != host_of[rank]}
        rows += len(far) if mode == "flat" else len({host_of[r] for r in far})
    return rows * case.hidden * case.torch_dtype().itemsize


@pytest.mark.parametrize("ranks_per_host", [2, (1, 2, 1)], ids=["2x2", "uneven-3-hosts"])
def test_hybrid_on_emulated_hosts(ranks_per_host):
    """Every runtime case bit-exact against the oracle (combine: its mode's contract), in the
    three modes; dispatch's network bytes exactly one row per (token, other host with one of
    its experts) (flat mode: per rank there); auto picks hybrid and lists the hosts; no
    host's /dev/shm keeps anything."""
    world = 4
    big = Case(num_experts=4 * world, hidden=37, top_k=2, tokens=(3600, 7, 3700, 0), seed=11)
    to_one = Case(num_experts=4 * world, hidden=37, top_k=1, tokens=(3600, 7, 3700, 0),
                  routing="one_expert")     # a flat call's largest count to one peer: 3700
    cases = [*runtime_cases(world), big, to_one, big]
    res = run_hosts(_cases, cases, ranks_per_host=ranks_per_host, timeout_s=300,
                    check_leaks=True)
    hosts = res.hosts
    for r, (backend, why, seen, _, _) in enumerate(res):
        assert backend == "hybrid" and seen == hosts, (r, backend, why)
        assert f"span {len(hosts)} shared-memory domains" in why
    # (a rank whose calls of a shape all had no tokens may never pass the door's check)
    assert sum(o[4] for o in res) > 0 or load_native() is None
    for i, case in enumerate(cases):
        outs = [res[r][3][i] for r in range(world)]
        check_hybrid(case, hosts, outs)
        for r in range(world):
            mode, nbytes = outs[r]["net"]
            assert nbytes == _expected_network_bytes(case, hosts, r, mode), (case, r, mode)
    modes = {m for i in range(len(cases)) for m in (res[0][3][i]["net"][0], res[0][3][i]["mode"])}
    assert modes == {"flat", "joint", "split"}, modes


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_hybrid_rank_on_other_host_killed(phase):
    """A rank on host 1 SIGKILLed inside a call: every survivor raises PeerDiedError or
    PeerTimeoutError within its deadline, and neither host's /dev/shm keeps anything."""
    deadline = 5.0
    res = run_hosts(_kill, ((0, 1), (2, 3)), 3, phase, deadline, 2100, ranks_per_host=2,
                    timeout_s=120, return_exceptions=True)
    for r in (0, 1, 2):
        kind, text, waited = res[r]
        assert kind in ("PeerDiedError", "PeerTimeoutError"), (r, res[r])
        assert waited < deadline + 2.0, (r, res[r])
    assert res.leaks == {}


def test_bytes_sent_network_skewed():
    """A skewed routing with many tokens: the count of network rows still exact."""
    case = Case(num_experts=16, hidden=64, top_k=4, tokens=(32, 0, 17, 5), routing="skewed",
                seed=9)
    res = run_hosts(_cases, [case], ranks_per_host=2, timeout_s=300, check_leaks=True)
    for r in range(4):
        mode, nbytes = res[r][3][0]["net"]
        assert nbytes == _expected_network_bytes(case, res.hosts, r, mode)
    assert torch.is_tensor(res[0][3][0]["y"])
