"""`Buffer(backend="auto")`, the default: shm on one host with room, hybrid across hosts,
torch otherwise.

The choice is recorded in `Buffer.config` and in every call's stats, and whichever backend
runs is checked against the oracle. "Another host" and "no room" are made by giving each rank
a different shared-memory identity or a tiny free size; the backends then run for real.
"""

import functools

import pytest

from ubep import reference
from ubep.testing import Case, check_case, run_case, run_ranks

CASES = [Case(8, 16, 4, (5, 7), "uniform", "bf16", seed=1),
         Case(8, 16, 2, (3, 0), "skewed", "fp32", seed=2)]


def _run(rank, world, pretend, kw):
    import ubep
    from ubep.runtime import auto

    if pretend == "other_host":
        key = auto.host_memory_key()
        auto.host_memory_key = lambda: (*key[:2], key[2] + rank)
    elif pretend == "no_room":
        auto._shm_free_bytes = lambda: 4096
    try:
        buf = ubep.Buffer(num_experts=8, hidden=16, max_tokens_per_rank=16, timeout_s=60, **kw)
    except ValueError as e:
        return {"error": str(e)}
    with buf:
        outs = []
        for case in CASES:
            outs.append(run_case(buf, case, rank))
            outs[-1]["mode"] = buf.last_stats.extra.get("mode")
        c = buf.config
        return {"backend": c.backend, "requested": c.requested_backend,
                "reason": c.backend_reason, "stats": buf.last_stats.backend, "outs": outs,
                "direct": c.direct, "mode": c.mode,
                "stats_direct": buf.last_stats.extra.get("direct"), "hosts": c.hosts}


def _check(per_rank):
    """Against the combine contract of the backend that ran (the torch one sums per rank)."""
    backend = per_rank[0]["backend"]
    for i, case in enumerate(CASES):
        outs = [r["outs"][i] for r in per_rank]
        contract = "torch" if backend == "torch" else "oracle"
        if backend == "hybrid":     # its mode's: flat is torch's, else per-host partials
            hosts = per_rank[0]["hosts"]
            group = [next(h for h, rs in enumerate(hosts) if r in rs) for r in range(2)]
            contract = ("torch" if outs[0]["mode"] == "flat" else
                        functools.partial(reference.combine_partials, group_of_rank=group))
        check_case(case, outs, contract=contract)


def test_auto_picks_shm_owned_on_one_host():
    per_rank = run_ranks(_run, 2, None, {})
    for r in per_rank:
        assert (r["backend"], r["requested"], r["stats"]) == ("shm", "auto", "shm")
        assert (r["direct"], r["stats_direct"], r["mode"]) == ("owned", "owned", "ubep")
        assert "this host" in r["reason"] and "direct='owned'" in r["reason"]
    _check(per_rank)


@pytest.mark.parametrize("kw, direct", [({"mode": "ubep"}, False), ({"mode": "bsp"}, False),
                                        ({"sync": "dc"}, False), ({"direct": False}, False),
                                        ({"count_workers": 1}, False),
                                        ({"direct": True}, True)])
def test_auto_keeps_a_mechanism_the_caller_asked_for(kw, direct):
    per_rank = run_ranks(_run, 2, None, kw)
    for r in per_rank:
        assert (r["backend"], r["direct"]) == ("shm", direct)
        assert r["mode"] == kw.get("mode", "ubep")
        assert "direct='owned'" not in r["reason"]
    _check(per_rank)


def test_auto_picks_hybrid_across_hosts():
    per_rank = run_ranks(_run, 2, "other_host", {})
    for r in per_rank:
        assert (r["backend"], r["requested"], r["stats"]) == ("hybrid", "auto", "hybrid")
        assert r["hosts"] == ((0,), (1,))
        assert "span 2 shared-memory domains" in r["reason"]
    _check(per_rank)


@pytest.mark.parametrize("pretend, why", [("no_room", "MiB free")])
def test_auto_falls_back_to_torch(pretend, why):
    per_rank = run_ranks(_run, 2, pretend, {})
    for r in per_rank:
        assert (r["backend"], r["requested"], r["stats"]) == ("torch", "auto", "torch")
        assert why in r["reason"]
    _check(per_rank)


def test_auto_direct_needs_shm():
    per_rank = run_ranks(_run, 2, None, {"direct": True})
    assert all(r["backend"] == "shm" for r in per_rank)
    _check(per_rank)
    errors = run_ranks(_run, 2, "other_host", {"direct": True})
    for r in errors:
        assert "direct=True needs the shm backend" in r["error"]
        assert "span 2 shared-memory domains" in r["error"]


def test_explicit_backend_is_recorded():
    per_rank = run_ranks(_run, 2, "other_host", {"backend": "torch"})
    for r in per_rank:
        assert (r["backend"], r["requested"], r["reason"]) == ("torch", "torch", "asked for")
    _check(per_rank)
