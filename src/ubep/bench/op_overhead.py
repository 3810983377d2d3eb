"""What routing through `ubep.ops` costs an eager call that needs no gradient.

`Buffer.dispatch`/`combine` first decide whether a call must become a `torch.library` operator
(an input requires grad, or `torch.compile` is tracing); the common eager call is recognised
by the inputs' fast check (which also refuses tensors that require grad) and goes straight to
the backend, other eager calls through `dispatch_eager`/`combine_eager` (full checks). This
times the routed call and that eager body, interleaved in one run on the same Buffer and
inputs, and the decision alone (what the routed call adds to the checks both make); it also
times the operator path (the call with an input that requires grad, forward only) for scale.

    python -m ubep.bench.op_overhead [--ranks 2] [--tokens 1] [--hidden 7168] [--iters 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _time(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def _decision_ns(buf, x, idx, w, n: int = 200_000) -> list[float]:
    """ns per call of what `Buffer.dispatch` adds before `dispatch_eager` (same code)."""
    import torch

    # what Buffer.dispatch tests besides the inputs' fast check (buffer.py binds the call to
    # a module name); the check itself is made by the eager body too
    _is_compiling = torch.compiler.is_compiling
    handle = None

    def decide():
        return handle is None and not _is_compiling()

    t0 = time.perf_counter_ns()
    for _ in range(n):
        decide()
    t1 = time.perf_counter_ns()
    for _ in range(n):
        pass
    t2 = time.perf_counter_ns()
    return [((t1 - t0) - (t2 - t1)) / n]


def _rank(rank: int, world: int, backend: str, tokens: int, hidden: int, iters: int) -> dict:
    import torch

    import ubep
    from ubep.testing import make_routing, make_tokens

    with ubep.Buffer(num_experts=8 * world, hidden=hidden, max_tokens_per_rank=max(tokens, 1),
                     backend=backend) as buf:
        x = make_tokens(rank, tokens, hidden, torch.bfloat16)
        idx, w = make_routing(tokens, 8, 8 * world, seed=rank)
        xg = x.float().requires_grad_()
        res = buf.dispatch(x, idx, w)
        out = res.recv_x.clone()
        samples: dict[str, list[float]] = {k: [] for k in (
            "dispatch (routed)", "dispatch (eager body)", "combine (routed)",
            "combine (eager body)", "dispatch as op (grad)")}
        dispatches = [("dispatch (routed)", lambda: buf.dispatch(x, idx, w)),
                      ("dispatch (eager body)", lambda: buf.dispatch_eager(x, idx, w))]
        combines = [("combine (routed)", lambda h: buf.combine(out, h)),
                    ("combine (eager body)", lambda h: buf.combine_eager(out, h))]
        for i in range(iters):
            # the same order on every rank (every call is a collective), A-B then B-A on
            # alternate iterations so that a call's position in the sequence cancels out
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for j in order:
                name, fn = dispatches[j]
                samples[name] += _time(fn, 1)
            for j in order:
                name, fn = combines[j]
                h = buf.dispatch_eager(x, idx, w).handle
                samples[name] += _time(lambda fn=fn, h=h: fn(h), 1)
            if i % 10 == 0:
                samples["dispatch as op (grad)"] += _time(lambda: buf.dispatch(xg, idx, w), 1)
        # the routing decision alone, without communication: the difference of the two
        samples["decision alone (ns)"] = _decision_ns(buf, x, idx, w)
        return {k: statistics.median(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    from ubep.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="shm", choices=("shm", "torch"))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args(argv)
    per_rank = run_ranks(_rank, a.ranks, a.backend, a.tokens, a.hidden, a.iters, timeout_s=1800)
    print(f"median µs per call, {a.ranks} ranks, backend={a.backend}, batch {a.tokens}, "
          f"hidden {a.hidden}, {a.iters} interleaved calls (rank 0 | rank 1 ...)")
    for name in per_rank[0]:
        print(f"  {name:24s} " + " | ".join(f"{r[name]:8.2f}" for r in per_rank))


if __name__ == "__main__":
    main()
