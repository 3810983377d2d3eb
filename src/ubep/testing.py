"""Run a function on P real processes with an initialized gloo process group.

Used by the test suite and the benchmarks. Processes come from a forkserver that has
already imported torch and ubep, so starting ranks is cheap; the TCP store lives in the
calling process, so no port is raced for.

    from ubep.testing import run_ranks
    results = run_ranks(my_fn, 2, arg)      # my_fn(rank, world_size, arg) on each rank

`run_hosts` does the same on emulated hosts (`ubep.emulated_hosts`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ubep.emulated_hosts import HostResults, hosts_available, run_hosts  # noqa: F401
from ubep.rank_processes import (  # noqa: F401 - RankFailedError, RankFailure re-exported
    RankFailedError,
    RankFailure,
    RankLaunch,
    default_threads,
    raise_first,
    run_processes,
)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              return_exceptions: bool = False, env: dict[str, str] | None = None,
              pg_timeout_s: float = 60.0, threads_per_rank: int | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return each rank's result.

    `fn` must be importable (a module-level function) and its result picklable. A rank that
    raises makes this raise `RankFailedError` with its traceback (the first failing rank);
    with `return_exceptions=True` failures come back as `RankFailure` entries instead, which
    is how tests check that a peer's death makes the others fail cleanly. Ranks still running
    after `timeout_s` are killed and reported as timed out. Each rank uses
    `threads_per_rank` torch intra-op threads (default: this process's cores // world_size,
    at least 1, as torchrun gives each local rank one OpenMP thread).
    """
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    threads = threads_per_rank or default_threads(world_size)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=pg_timeout_s))
    env = dict(env or {})
    env.setdefault("UBEP_JOB_ID", f"t{os.getpid()}x{int(time.time() * 1e3) % 100000}")
    launch = RankLaunch("127.0.0.1", store.port, env, pg_timeout_s, threads)
    outcomes = run_processes(fn, args, [launch] * world_size, timeout_s)
    if not return_exceptions:
        raise_first(outcomes)
    return outcomes


@contextlib.contextmanager
def one_rank_group(timeout_s: float = 60.0) -> Iterator[None]:
    """A world-size-1 gloo default group in this process (a file store: no port), destroyed
    on exit: what a single-process benchmark of a Buffer needs (no peer, so no wait)."""
    import torch.distributed as dist

    fd, path = tempfile.mkstemp(prefix="ubep-pg-")
    os.close(fd)
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))
        try:
            yield
        finally:
            dist.destroy_process_group()
    finally:
        if os.path.exists(path):
            os.unlink(path)


# -- workloads for tests and benchmarks ------------------------------------------------------

ROUTINGS = ("uniform", "skewed", "one_expert", "unrouted", "partial")


def williams_orders(n: int) -> list[list[int]]:
    """Orders of `n` ways, one per round, balanced for what runs just before: each way is
    first once per cycle and follows each other way once (twice for odd `n`, whose cycle
    is 2n rounds: the n rows and their mirrors), as in a Williams Latin square."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(f + r) % n for f in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 and n > 1 else rows


def alternate(ways: dict[str, Callable[[], Any]], rounds: int, block: int = 20,
              barrier: Callable[[], Any] | None = None) -> dict[str, list[int]]:
    """ns per call of each of `ways`, run in turns of `block` calls, `rounds` turns each.

    Each turn starts after `barrier()` (default: the default process group's, so every rank
    turns together). The host's drift (this project's VM flips between speed states ~1.6x
    apart every few seconds) then hits every way alike: the A/B a noisy host needs. The
    rounds' orders form a Williams design: over every n rounds (2n for an odd number n of
    ways) each way goes first equally often and follows every other way exactly as often,
    so none inherits one other's caches, link state or leftover work more than the rest."""
    import torch.distributed as dist

    barrier = barrier or dist.barrier
    perf = time.perf_counter_ns
    times: dict[str, list[int]] = {name: [] for name in ways}
    items = list(ways.items())
    orders = williams_orders(len(items))
    for r in range(rounds):
        for name, call in (items[i] for i in orders[r % len(orders)]):
            barrier()
            for _ in range(block):
                t = perf()
                call()
                times[name].append(perf() - t)
    return times


def print_turns(per_rank: list[dict[str, list[int]]], label: str) -> dict[str, float]:
    """Print each way's median and p90 of `alternate`'s times, call by call the slowest
    rank's, and the last way's median over the first's; return the medians (µs)."""
    import numpy as np

    med = {}
    for name in per_rank[0]:
        t = np.max([np.asarray(r[name]) for r in per_rank], axis=0) / 1e3
        med[name] = float(np.median(t))
        print(f"{label} {name}: median {med[name]:.1f} µs, p90 {np.percentile(t, 90):.1f} µs "
              f"({len(t)} calls, slowest of {len(per_rank)} rank(s))")
    first, *_, last = med
    print(f"{label} {last}/{first}: {med[last] / med[first]:.3f}")
    return med


class Counted:
    """A callable that counts its answers: a result (`took`) or NotImplemented (`declined`), as
    `ubep.native`'s doors answer; the tests wrap a Buffer's door entries in it to see which
    calls the compiled path took."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn, self.took, self.declined = fn, 0, 0

    def __call__(self, *args: Any) -> Any:
        r = self.fn(*args)
        if r is NotImplemented:
            self.declined += 1
        else:
            self.took += 1
        return r


def make_routing(num_tokens: int, top_k: int, num_experts: int, *, kind: str = "uniform",
                 seed: int = 0):
    """`(topk_idx [T, K] int64, topk_weights [T, K] float32)` for a named routing.

    kinds: "uniform" (K distinct experts per token, uniformly), "skewed" (80% of tokens pick
    their first two experts among experts 0 and 1), "one_expert" (every token's slot 0 is
    expert 0, the other slots -1), "unrouted" (every slot -1), "partial" (uniform with ~30%
    of slots set to -1).
    """
    import torch

    if kind not in ROUTINGS:
        raise ValueError(f"kind={kind!r} is not one of {ROUTINGS}")
    k = min(top_k, num_experts)
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((num_tokens, top_k), -1, dtype=torch.int64)
    if num_tokens and kind in ("uniform", "skewed", "partial"):
        idx[:, :k] = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :k]
        if kind == "skewed" and num_experts >= 2 and k >= 2:
            hot = torch.rand(num_tokens, generator=g) < 0.8
            rest = torch.rand(num_tokens, num_experts - 2, generator=g).argsort(dim=1)[:, :k - 2]
            idx[hot, 0], idx[hot, 1] = 0, 1
            idx[hot, 2:k] = rest[hot] + 2
        if kind == "partial":
            idx[torch.rand(num_tokens, top_k, generator=g) < 0.3] = -1
    elif kind == "one_expert":
        idx[:, 0] = 0
    weights = torch.rand(num_tokens, top_k, generator=g).to(torch.float32)
    return idx, weights


def make_tokens(rank: int, num_tokens: int, hidden: int, dtype, *, seed: int = 0):
    """`[T, hidden]` rows of `dtype`, finite, each carrying its origin.

    Element 0 holds the source rank and element 1 the token index (mod 16, exactly
    representable in every float type); the rest is seeded noise, so a misrouted or torn row
    differs from the reference in its bytes.
    """
    import torch

    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype.is_floating_point:
        x = torch.randn(num_tokens, hidden, generator=g).clamp_(-8, 8)
        if hidden >= 2:
            x[:, 0] = rank
            x[:, 1] = torch.arange(num_tokens) % 16
        return x.to(dtype)
    info = torch.iinfo(dtype)
    x = torch.randint(max(info.min, -100), min(info.max, 100) + 1, (num_tokens, hidden),
                      generator=g, dtype=torch.int64)
    if hidden >= 2:
        x[:, 0], x[:, 1] = rank, torch.arange(num_tokens) % 16
    return x.to(dtype)


# -- cases checked against the reference oracle -------------------------------------------------

_DTYPES = {
    "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int8": "int8", "uint8": "uint8",
    "fp8": "float8_e4m3fn",
}


@dataclass(frozen=True)
class Case:
    """One dispatch+combine scenario, reproducible on every rank and in the checking process.

    `tokens[r]` is rank r's token count; inputs come from `make_routing`/`make_tokens`
    seeded by (seed, rank), so the parent can rebuild every rank's inputs for the oracle.
    """

    num_experts: int
    hidden: int
    top_k: int
    tokens: tuple[int, ...]
    routing: str = "uniform"
    dtype: str = "bf16"
    seed: int = 0
    weighted: bool = True

    def torch_dtype(self):
        import torch

        return getattr(torch, _DTYPES[self.dtype])

    def inputs(self, rank: int):
        """`(x, topk_idx, topk_weights)` of `rank`."""
        idx, w = make_routing(self.tokens[rank], self.top_k, self.num_experts,
                              kind=self.routing, seed=self.seed * 1000 + rank)
        x = make_tokens(rank, self.tokens[rank], self.hidden, self.torch_dtype(), seed=self.seed)
        return x, idx, w


def runtime_cases(world: int) -> list[Case]:
    """The scenarios every executor is checked on at `world` ranks: each dtype, uniform,
    skewed, all-to-one and partial routing, a rank with no tokens, all ranks with none, an
    unweighted combine. Rows of 37 elements (37-148 bytes: not multiples of 8)."""
    e, h = 4 * world, 37
    return [
        Case(num_experts=e, hidden=h, top_k=2, tokens=(3,) * world),
        Case(num_experts=e, hidden=h, top_k=3, tokens=(5,) + (0,) * (world - 1), dtype="fp32"),
        Case(num_experts=e, hidden=h, top_k=4, tokens=tuple(range(7, 7 + world)),
             routing="skewed", dtype="fp16", seed=2),
        Case(num_experts=e, hidden=h, top_k=2, tokens=(16,) * world, routing="one_expert", seed=3),
        Case(num_experts=e, hidden=h, top_k=3, tokens=(6,) * world, routing="partial",
             dtype="int8", seed=4),
        Case(num_experts=e, hidden=h, top_k=3, tokens=(6,) * world, dtype="fp8", seed=5,
             weighted=False),
        Case(num_experts=e, hidden=h, top_k=2, tokens=(0,) * world, seed=6),
    ]


def expert_fn(recv_x):
    """The stand-in expert of the tests: a deterministic function of the row, floating out."""
    import torch

    out_dtype = recv_x.dtype if recv_x.dtype in (torch.bfloat16, torch.float16,
                                                 torch.float32) else torch.bfloat16
    return (recv_x.to(torch.float32) * 0.5 + 1.0).to(out_dtype)


def run_case(buf, case: Case, rank: int) -> dict:
    """Dispatch and combine `case` on this rank through `buf`; return what the oracle checks."""
    x, idx, w = case.inputs(rank)
    res = buf.dispatch(x, idx, w)
    y = buf.combine(expert_fn(res.recv_x), res.handle, weighted=case.weighted)
    # a copy: with Buffer(direct=True) recv_x is a view that the next dispatch overwrites
    return {"recv_x": res.recv_x.clone(), "recv_weights": res.recv_weights,
            "tokens_per_expert": res.tokens_per_expert, "recv_src_rank": res.recv_src_rank,
            "recv_src_token": res.recv_src_token, "recv_src_slot": res.recv_src_slot, "y": y}


#: combine contracts by name (`check_case`): "oracle", the fp32 sum in slot order rounded
#: once (the shm backend); "torch", per-rank partial sums (the torch backend on CPU: each
#: partial in the output dtype for bf16/fp16/fp32, else fp32; the source sums them in
#: ascending rank order and rounds a bf16 result as `embedding_bag` does, ties away)
COMBINE_CONTRACTS = ("oracle", "torch")
#: how far the torch backend's device path (rows moved and summed by torch ops:
#: `embedding_bag` with each weight split into two 16-bit halves, on GPUs and with
#: `HOST_MOVES_ROWS=False` on CPU) may be from the "torch" contract, in units in the last
#: place of the output dtype at the magnitude of `sum |w * row|` (`check_case`'s `ulps`):
#: measured with torch 2.13's CPU `embedding_bag` (1 ulp for 16-bit outputs: a partial
#: rounded the other way at a tie or by the split weight; up to 3 for fp32, whose sums it
#: orders and fuses its own way)
TORCH_DEVICE_PATH_ULPS = {"bfloat16": 1, "float16": 1, "float32": 4}


def combine_contract(contract: str | Callable[..., list]) -> Callable[..., list]:
    """The reference function of a combine contract: a name of `COMBINE_CONTRACTS`, or a
    function with `reference.combine`'s arguments and result (returned as it is)."""
    import functools

    from ubep import reference

    if callable(contract):
        return contract
    if contract == "oracle":
        return reference.combine
    if contract == "torch":
        return functools.partial(reference.combine_partials, bf16_ties_away=True)
    raise ValueError(f"contract={contract!r} is not one of {COMBINE_CONTRACTS} or a function")


def ulp(x, dtype):
    """One unit in the last place of `dtype` at the magnitude of `x` (a float64 tensor):
    `eps * 2**floor(log2 |x|)`, the subnormal spacing below the normal range, 1 for integers."""
    import torch

    if not dtype.is_floating_point:
        return torch.ones_like(x)
    fi = torch.finfo(dtype)
    mag = x.abs().clamp_min(fi.smallest_normal)
    return fi.eps * torch.exp2(torch.floor(torch.log2(mag)))


def check_case(case: Case, outs: list[dict], *, contract: str | Callable[..., list] = "oracle",
               ulps: int | dict[str, int] = 0) -> None:
    """Raise AssertionError unless every rank's `run_case` output matches the oracle and the
    combine contract its path states.

    Dispatch must match bit for bit (rows compared as bytes). Combine must match its
    `contract` (`combine_contract`: "oracle" for the shm backend, "torch" for the torch
    backend, or a function such as `functools.partial(reference.combine_partials,
    group_of_rank=hosts)`) bit for bit; `ulps` > 0 is for a path that cannot be (its docs
    state its bound): each element within `ulps` units in the last place of the output dtype
    at the magnitude of its `sum |w * row|` (the scale its rounding errors have, however much
    the terms cancel). `ulps` may name a bound per output dtype (`{"bfloat16": 1, ...}`, as
    `TORCH_DEVICE_PATH_ULPS`; a dtype not named: 0).
    """
    import torch

    from ubep import reference

    want_combine = combine_contract(contract)
    world = len(case.tokens)
    ins = [case.inputs(r) for r in range(world)]
    idxs, ws = [i[1] for i in ins], [i[2] for i in ins]
    ref = reference.dispatch([i[0] for i in ins], idxs, ws, case.num_experts)
    expert_outs = [expert_fn(d.recv_x) for d in ref]
    ref_y = want_combine(expert_outs, ref, idxs, ws, weighted=case.weighted)
    if ulps:    # the magnitude: fp32 sums of |w * row| (fp32 rows: no rounding of the sum)
        scale = reference.combine([o.abs().to(torch.float32) for o in expert_outs], ref, idxs,
                                  [w.abs() for w in ws], weighted=case.weighted)
    for r in range(world):
        got, want = outs[r], ref[r]
        where = f"{case} rank {r}"
        for name in ("tokens_per_expert", "recv_src_rank", "recv_src_token", "recv_src_slot"):
            if not torch.equal(got[name].to(torch.int64), getattr(want, name)):
                raise AssertionError(f"{where}: {name} {got[name].tolist()} != "
                                     f"reference {getattr(want, name).tolist()}")
        gx, wx = got["recv_x"], want.recv_x
        if gx.dtype != wx.dtype or gx.shape != wx.shape or not torch.equal(
                gx.contiguous().view(torch.uint8), wx.contiguous().view(torch.uint8)):
            raise AssertionError(f"{where}: recv_x differs from the reference "
                                 f"({gx.dtype} {tuple(gx.shape)} vs {wx.dtype} {tuple(wx.shape)})")
        if not torch.equal(got["recv_weights"], want.recv_weights):
            raise AssertionError(f"{where}: recv_weights differ from the reference")
        gy, wy = got["y"], ref_y[r]
        n_ulps = ulps.get(str(gy.dtype).removeprefix("torch."), 0) if isinstance(ulps, dict) \
            else ulps
        if gy.dtype != wy.dtype or gy.shape != wy.shape:
            raise AssertionError(f"{where}: combine output is {gy.dtype} {tuple(gy.shape)}, "
                                 f"the contract's {wy.dtype} {tuple(wy.shape)}")
        if n_ulps == 0:
            # as bytes (an empty y may have any strides)
            gb, wb = (t.reshape(-1).contiguous().view(torch.uint8) for t in (gy, wy))
            if not torch.equal(gb, wb):
                raise AssertionError(f"{where}: combine output differs from contract "
                                     f"{contract!r} ({int((gb != wb).sum())} bytes differ)")
            continue
        g, w = gy.to(torch.float64), wy.to(torch.float64)
        unit = ulp(torch.maximum(scale[r].to(torch.float64), w.abs()), gy.dtype)
        off = (g - w).abs() / unit
        if (off > n_ulps).any():
            raise AssertionError(f"{where}: combine output off contract {contract!r} by more "
                                 f"than {n_ulps} ulp(s) at {int((off > n_ulps).sum())} "
                                 f"elements, up to {float(off.max()):.2f}")
