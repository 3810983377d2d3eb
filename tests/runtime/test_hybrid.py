"""The hybrid backend against the oracle, with hosts told apart by `UBEP_SHM_DOMAIN`.

Ranks here share one machine; each rank's `UBEP_SHM_DOMAIN` puts it in a shared-memory
domain of its own host, so `auto` sees several hosts and the hybrid backend moves rows
between them over gloo, inside them through shared memory. tests/test_emulated_hosts_hybrid.py
runs the same checks on emulated hosts (network namespaces, a private /dev/shm each).
"""

from __future__ import annotations

import os

import pytest
import torch

from ubep import reference
from ubep.testing import Case, expert_fn, run_case, run_ranks, runtime_cases


def host_of(hosts, rank: int) -> int:
    return next(h for h, ranks in enumerate(hosts) if rank in ranks)


def combine_by_host(case: Case, hosts) -> list[torch.Tensor]:
    """The hybrid combine's contract: per (token, host) an fp32 sum in slot order rounded
    to the partial dtype, partials summed in fp32 in host order, rounded once."""
    world = len(case.tokens)
    ins = [case.inputs(r) for r in range(world)]
    ref = reference.dispatch([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                             case.num_experts)
    outs = [expert_fn(d.recv_x) for d in ref]
    dtype = outs[0].dtype
    pdtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    epr = case.num_experts // world
    landed = {}
    for r in range(world):
        d = ref[r]
        for i, key in enumerate(zip(d.recv_src_rank.tolist(), d.recv_src_token.tolist(),
                                    d.recv_src_slot.tolist())):
            landed[key] = (r, i)
    ys = []
    for s in range(world):
        idx, w = ins[s][1].tolist(), ins[s][2]
        y = torch.zeros(len(idx), case.hidden, dtype=torch.float32)
        for t, experts in enumerate(idx):
            parts = {}
            for k, e in enumerate(experts):
                if e < 0:
                    continue
                r, i = landed[(s, t, k)]
                row = outs[r][i].to(torch.float32)
                h = host_of(hosts, e // epr)
                acc = parts.get(h, torch.zeros(case.hidden))
                parts[h] = acc + (w[t, k] * row if case.weighted else row)
            acc = torch.zeros(case.hidden)
            for h in sorted(parts):
                acc = acc + parts[h].to(pdtype).to(torch.float32)
            y[t] = acc
        ys.append(y.to(dtype))
    return ys


def check_hybrid(case: Case, hosts, outs: list[dict]) -> None:
    """Dispatch bit-exact against the oracle; combine bit-exact against the contract."""
    world = len(case.tokens)
    ins = [case.inputs(r) for r in range(world)]
    ref = reference.dispatch([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                             case.num_experts)
    ys = combine_by_host(case, hosts)
    for r in range(world):
        got, want = outs[r], ref[r]
        for name in ("tokens_per_expert", "recv_src_rank", "recv_src_token", "recv_src_slot",
                     "recv_weights"):
            assert torch.equal(got[name], getattr(want, name)), (case, r, name)
        assert torch.equal(got["recv_x"].view(torch.uint8), want.recv_x.view(torch.uint8)), \
            (case, r, "recv_x")
        gy, wy = got["y"], ys[r]
        assert gy.dtype == wy.dtype and torch.equal(gy.view(torch.uint8), wy.view(torch.uint8)),\
            (case, r, "y", (gy.float() - wy.float()).abs().max())


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
            outs.append(out)
        return buf.config.hosts, buf.config.backend_reason, outs


@pytest.mark.parametrize("hosts", [((0, 1), (2, 3)), ((0,), (1, 2), (3,)), ((0, 2), (1, 3))],
                         ids=["2x2", "uneven", "interleaved"])
def test_hybrid_matches_oracle(hosts):
    """Every runtime case, then large batches (the split mode: own rows through shared
    memory while the network moves the rest) and small again (back to the joint mode)."""
    world = sum(len(h) for h in hosts)
    big = Case(num_experts=4 * world, hidden=37, top_k=3, tokens=(1800, 0, 1900, 2000)[:world],
               seed=11)    # > SPLIT_BYTES of bf16 rows on one rank
    cases = [*runtime_cases(world), big, big, runtime_cases(world)[2]]
    res = run_ranks(_run, world, hosts, cases, timeout_s=240)
    for r, (seen, why, _) in enumerate(res):
        assert seen == hosts, (r, seen)
        assert "span" in why
    for i, case in enumerate(cases):
        check_hybrid(case, hosts, [res[r][2][i] for r in range(world)])
    modes = [res[0][2][i]["mode"] for i in range(len(cases))]
    assert modes[-3:] == ["joint", "split", "split"], modes


def _kill(rank, world, hosts, victim, phase, deadline_s):
    import signal
    import threading
    import time

    import ubep
    from ubep.testing import make_routing, make_tokens

    os.environ["UBEP_SHM_DOMAIN"] = f"h{host_of(hosts, rank)}"
    buf = ubep.Buffer(num_experts=4 * world, hidden=64, max_tokens_per_rank=8, max_top_k=4,
                      timeout_s=deadline_s)

    def inputs(i):
        idx, w = make_routing(8, 4, 4 * world, seed=i * 10 + rank)
        return make_tokens(rank, 8, 64, torch.bfloat16, seed=i), idx, w

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
def test_hybrid_peer_on_other_host_killed(phase):
    """A rank on the other host SIGKILLed inside a call: every survivor raises a named error
    (PeerDiedError or PeerTimeoutError) within its deadline; no segment is left."""
    hosts = ((0, 1), (2, 3))
    deadline = 5.0
    out = run_ranks(_kill, 4, hosts, 3, phase, deadline, timeout_s=120,
                    return_exceptions=True)
    for r in (0, 1, 2):
        kind, text, waited = out[r]
        assert kind in ("PeerDiedError", "PeerTimeoutError"), (r, out[r])
        assert waited < deadline + 2.0, (r, out[r])
    assert not [n for n in os.listdir("/dev/shm") if "ubep" in n.lower()]
