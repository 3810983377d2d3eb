"""The hybrid backend against the oracle, with hosts told apart by `UBEP_SHM_DOMAIN`.

Ranks here share one machine; each rank's `UBEP_SHM_DOMAIN` puts it in a shared-memory
domain of its own host, so `auto` sees several hosts and the hybrid backend moves rows
between them over gloo, inside them through shared memory. tests/test_emulated_hosts_hybrid.py
runs the same checks on emulated hosts (network namespaces, a private /dev/shm each).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from ubep import reference
from ubep.native import load_native
from ubep.testing import Case, check_case, run_case, run_ranks, runtime_cases


def host_of(hosts, rank: int) -> int:
    return next(h for h, ranks in enumerate(hosts) if rank in ranks)


def contract(mode: str, hosts, world: int):
    """The combine contract of a hybrid call in `mode`: the torch backend's in flat mode,
    else per-host partials in the output dtype summed in host order (docs/multihost.md)."""
    if mode == "flat":
        return "torch"
    return functools.partial(reference.combine_partials,
                             group_of_rank=[host_of(hosts, r) for r in range(world)])


def check_hybrid(case: Case, hosts, outs: list[dict]) -> None:
    """Dispatch bit-exact against the oracle; combine bit-exact against the contract of the
    mode the call ran in (the same on every rank)."""
    modes = {o["mode"] for o in outs}
    assert len(modes) == 1, modes
    check_case(case, outs, contract=contract(modes.pop(), hosts, len(case.tokens)))


def _run(rank, world, hosts, cases):
    import ubep

    os.environ["UBEP_SHM_DOMAIN"] = f"h{host_of(hosts, rank)}"
    most = max(max(c.tokens) for c in cases) or 1
    e = cases[0].num_experts
    with ubep.Buffer(num_experts=e, hidden=cases[0].hidden, max_tokens_per_rank=most,
                     max_top_k=max(c.top_k for c in cases), timeout_s=20) as buf:
        assert buf.config.backend == "hybrid", buf.config.backend_reason
        outs = []
        for case in cases:
            out = run_case(buf, case, rank)
            out["mode"] = buf.last_stats.extra["mode"]
            out["chunks"] = buf.last_stats.extra.get("chunks", 1)
            outs.append(out)
        # how many costs this rank keeps for the latest batch's bucket, per family
        p = buf._backend._picker
        outs[-1]["costs"] = {flat: len(v) for (b, flat), v in p._cost.items() if b == p.bucket}
        return buf.config.hosts, buf.config.backend_reason, outs


@pytest.mark.parametrize("hosts", [((0, 1), (2, 3)), ((0,), (1, 2), (3,)), ((0, 2), (1, 3))],
                         ids=["2x2", "uneven", "interleaved"])
def test_hybrid_matches_oracle(hosts):
    """Every runtime case, then large batches (the split mode: own rows through shared
    memory while the network moves the rest, in chunks past 2 * SPLIT_BYTES) and small
    again (back to the joint mode)."""
    world = sum(len(h) for h in hosts)
    # batches past FLAT_BYTES and SPLIT_BYTES of bf16 rows on one rank: joint, then split
    mid = Case(num_experts=4 * world, hidden=37, top_k=3, tokens=(900, 0, 1000, 20)[:world],
               seed=12)
    big = Case(num_experts=4 * world, hidden=37, top_k=2, tokens=(3600, 0, 3700, 5)[:world],
               seed=11)
    # a flat call's largest count to one peer picks the next mode: all tokens to one rank
    # make it the batch (then split), uniform routing runs there after
    to_one = dataclasses.replace(big, routing="one_expert", top_k=1)
    # past 2 * SPLIT_BYTES: the next call's forwarded rows come in several chunks
    huge = Case(num_experts=4 * world, hidden=37, top_k=3, tokens=(7600, 0, 7200, 7)[:world],
                seed=13)
    cases = [*runtime_cases(world), mid, mid, to_one, big, big, huge, huge, huge, huge,
             runtime_cases(world)[2]]
    res = run_ranks(_run, world, hosts, cases, timeout_s=240)
    for r, (seen, why, _) in enumerate(res):
        assert seen == hosts, (r, seen)
        assert "span" in why
    for i, case in enumerate(cases):
        check_hybrid(case, hosts, [res[r][2][i] for r in range(world)])
    modes = [res[0][2][i]["mode"] for i in range(len(cases))]
    assert {"flat", "joint", "split"} <= set(modes), modes
    assert max(res[0][2][i]["chunks"] for i in range(len(cases))) > 1


def test_hybrid_measured_modes_agree():
    """A steady large batch for more than REPROBE calls: the ranks measure both families
    (flat and hierarchical), pick one from their costs and re-measure the other; on every
    call every rank ran the same mode (`check_hybrid`) and moved the oracle's rows."""
    from ubep.runtime.hybrid.modes import REPROBE, SAMPLES

    hosts = ((0, 1), (2, 3))
    case = Case(num_experts=16, hidden=37, top_k=2, tokens=(2000, 40, 1900, 3), seed=21)
    cases = [dataclasses.replace(case, seed=21 + i) for i in range(REPROBE + 8)]
    res = run_ranks(_run, 4, hosts, cases, timeout_s=240)
    for i, c in enumerate(cases):
        check_hybrid(c, hosts, [res[r][2][i] for r in range(4)])
    modes = {res[0][2][i]["mode"] for i in range(len(cases))}
    assert "flat" in modes and modes & {"joint", "split"}, modes
    # both families timed, the flat one too (its timed calls run in Python: the Buffer's
    # compiled door takes only flat calls no one times)
    for r in range(4):
        assert res[r][2][-1]["costs"] == {True: SAMPLES, False: SAMPLES}, (r, res[r][2][-1])


def _kill(rank, world, hosts, victim, phase, deadline_s, batch=8):
    import signal
    import threading
    import time

    import ubep
    from ubep.testing import make_routing, make_tokens

    os.environ["UBEP_SHM_DOMAIN"] = f"h{host_of(hosts, rank)}"
    buf = ubep.Buffer(num_experts=4 * world, hidden=64, max_tokens_per_rank=batch, max_top_k=4,
                      timeout_s=deadline_s)

    def inputs(i):
        idx, w = make_routing(batch, 4, 4 * world, seed=i * 10 + rank)
        return make_tokens(rank, batch, 64, torch.bfloat16, seed=i), idx, w

    res = buf.dispatch(*inputs(0))
    buf.combine(res.recv_x, res.handle)
    if rank == victim:
        timer = threading.Timer(0.0005, os.kill, (os.getpid(), signal.SIGKILL))
        if phase == "dispatch":
            timer.start()
        res = buf.dispatch(*inputs(1))
        if phase == "combine":
            timer.start()
        buf.combine(res.recv_x, res.handle)
        time.sleep(60)
    t0 = time.monotonic()
    try:
        for i in range(1, 6):
            t0 = time.monotonic()
            res = buf.dispatch(*inputs(i))
            t0 = time.monotonic()
            buf.combine(res.recv_x, res.handle)
    except (ubep.PeerDiedError, ubep.PeerTimeoutError) as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        buf.close()
    return "no error", "", 0.0


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
@pytest.mark.parametrize("batch", [8, 2100], ids=["flat", "split"])
def test_hybrid_peer_on_other_host_killed(phase, batch):
    """A rank on the other host SIGKILLed inside a call (small batches: the flat exchange;
    large: the hierarchical one): every survivor raises a named error (PeerDiedError or
    PeerTimeoutError) within its deadline; no segment is left."""
    hosts = ((0, 1), (2, 3))
    deadline = 5.0
    out = run_ranks(_kill, 4, hosts, 3, phase, deadline, batch, timeout_s=120,
                    return_exceptions=True)
    for r in (0, 1, 2):
        kind, text, waited = out[r]
        assert kind in ("PeerDiedError", "PeerTimeoutError"), (r, out[r])
        assert waited < deadline + 2.0, (r, out[r])
    assert not [n for n in os.listdir("/dev/shm") if "ubep" in n.lower()]


def _door_then_measured(rank, world, hosts):
    import ubep
    from ubep.runtime.hybrid.modes import REPROBE, SAMPLES
    from ubep.testing import Counted, make_routing, make_tokens

    os.environ["UBEP_SHM_DOMAIN"] = f"h{host_of(hosts, rank)}"
    with ubep.Buffer(num_experts=4 * world, hidden=7168, max_tokens_per_rank=128) as buf:
        assert buf._door is not None
        d = buf._door_dispatch = Counted(buf._door_dispatch)
        c = buf._door_combine = Counted(buf._door_combine)
        p = buf._backend._picker
        record = p.record       # flat measures cheaper: the ranks choose it, whatever this
        p.record = lambda b, flat, us: record(b, flat, 100.0 if flat else 120.0)  # host does
        took, modes = [], []
        for i in range(12 + 2 * (SAMPLES + 1) + 1 + 2 * REPROBE):
            batch = 4 if i < 12 else 96
            idx, w = make_routing(batch, 8, 4 * world, seed=10 * i + rank)
            x = make_tokens(rank, batch, 7168, torch.bfloat16, seed=i)
            before = (d.took, c.took)
            res = buf.dispatch(x, idx, w)
            buf.combine(res.recv_x, res.handle)
            took.append((d.took - before[0], c.took - before[1]))
            modes.append(res.stats.extra["mode"])
        costs = {flat: len(v) for (b, flat), v in p._cost.items() if b == p.bucket}
        return took, modes, costs


def test_the_door_takes_the_flat_calls_no_one_times():
    """With `ubep.native`, the Buffer's compiled door (the flat torch backend's) takes a run
    of small flat calls whole, and a run where flat measured cheaper but for its last call
    before each re-measurement; the calls the ranks time (a new batch's hierarchical calls,
    the flat probe, those last calls: dispatch and combine) run through the backend, and
    every cost is measured."""
    from ubep.runtime.hybrid.modes import REPROBE, SAMPLES

    if load_native() is None:
        pytest.skip("ubep.native not built")
    hosts = ((0, 1), (2, 3))
    n = SAMPLES + 1
    for took, modes, costs in run_ranks(_door_then_measured, 4, hosts, timeout_s=300):
        assert all(m == "flat" for m in modes[1:12]), modes
        assert all(t == (1, 1) for t in took[5:12]), took         # the small flat run
        # the first large call runs as the last small one chose; then the new batch explored
        explore = modes[13:13 + 2 * n + 1]
        assert explore == ["split"] * n + ["flat"] * n + ["split"], modes
        assert all(t == (0, 0) for t in took[13:13 + 2 * n + 1]), took    # timed
        chosen = list(range(13 + 2 * n + 1, len(modes)))
        hier = [i for i in chosen if modes[i] != "flat"]
        # a re-measurement per REPROBE calls (costs within 1.5x: a first hierarchical call,
        # then the measured one)
        assert hier == [h + k for h in hier[::2] for k in range(2)] and len(hier) == 4, modes
        for i in chosen:
            if modes[i] == "flat":
                left = min([h - i for h in hier if h > i], default=len(modes))
                if left == 1:               # timed: the cost the re-measurement carries
                    assert took[i] == (0, 0), (i, took, modes)
                else:       # (its combine too, but where the dispatch left phase 2 to Python)
                    assert took[i][0] == 1, (i, took, modes)
        assert sum(t[1] for t in took[13 + 2 * n + 1:]) > REPROBE, took
        assert costs == {True: SAMPLES, False: SAMPLES}, costs
