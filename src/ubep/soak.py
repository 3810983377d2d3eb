"""`ubep soak`: randomized dispatch/combine against the reference oracle, for as long as asked.

Each session builds one Buffer with a random configuration (backend, mode, sync, direct
False/True/"owned", workers, block size, sizes) on real rank processes and makes a run of
calls whose inputs change every call: dtype, batch size 0..max per rank, top-k, routing
(uniform, skewed, one hot expert, all on one rank's experts, -1 slots, nothing routed),
weighted or not, combine or not. Every rank rebuilds every rank's inputs from the call's
seed and checks its own results against `ubep.reference`: dispatch bit for bit, combine bit
for bit to its backend's contract (`ubep.testing.combine_contract`: the oracle's sums on shm,
per-rank partial sums on torch). Between chunks of sessions /dev/shm is checked for segments
of the job.

    ubep soak --calls 2000            # or --minutes 10; exit 1 on any mismatch, hang,
                                      # error or leaked segment

With `--kill-every N` every Buffer is elastic (`Buffer(elastic=True)`) on 4 ranks (or
`--world`), and every N calls a random active rank SIGKILLs itself at a random point of a
call (until two remain) while the others go on; each survivor checks every call against the
oracle with the dead ranks' slots masked (`reference.masked_routing`): bit for bit from the
call after a death on; in the call a rank died in, the rows between live ranks bit for bit
and the dead rank's all there or none, and combine over exactly the slots it reports summed
(`handle.masked`). A survivor that raises, waits past its deadline or disagrees on
`active_ranks` is counted as a failure.

    ubep soak --kill-every 5 --calls 300
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field

#: routings of `_routing`
KINDS = ("uniform", "skewed", "one_expert", "one_rank", "partial", "unrouted")
DTYPES = ("bfloat16", "float16", "float32", "int8", "uint8", "float8_e4m3fn")
FLOAT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class Tally:
    """What a soak counted; `ok` if nothing went wrong."""

    calls: int = 0
    sessions: int = 0
    mismatches: int = 0
    hangs: int = 0
    errors: int = 0
    leaked: int = 0
    kills: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.hangs or self.errors or self.leaked)

    def add(self, other: Tally) -> None:
        for k in ("calls", "sessions", "mismatches", "hangs", "errors", "leaked", "kills"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.failures.extend(other.failures)

    def add_outcomes(self, other: Tally) -> None:
        """A rank's mismatches, hangs, errors and failures (each rank counts the same calls)."""
        for k in ("mismatches", "hangs", "errors"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.failures.extend(other.failures)


def random_session(rng: random.Random, world: int, calls: int) -> dict:
    """One Buffer configuration and its call count (plain values: shipped to the ranks)."""
    backend = "shm" if rng.random() < 0.85 else "torch"
    mode = rng.choice(("ubep", "ubep", "bsp"))
    # direct: False, True or "owned" (what backend="auto" gives on one host)
    direct = (backend == "shm" and mode == "ubep" and rng.random() < 0.4
              and rng.choice((True, "owned", "owned")))
    sync = rng.choice(("tff", "sw")) if direct else rng.choice(("sw", "tff", "dc", "sp"))
    experts = world * rng.choice((1, 2, 3, 4))
    return dict(
        kw=dict(backend=backend, mode=mode, sync=sync, direct=direct,
                workers=rng.choice((1, 1, 2, 3)), block_bytes=rng.choice((32, 64, 128, 512)),
                num_experts=experts, hidden=rng.randint(1, 80),
                max_tokens_per_rank=rng.choice((1, 3, 8, 17, 32)),
                max_top_k=rng.randint(1, min(4, experts)), timeout_s=20.0),
        calls=calls, seed=rng.getrandbits(31))


def _routing(t: int, k: int, experts: int, world: int, kind: str, g):
    import torch

    idx = torch.full((t, k), -1, dtype=torch.int64)
    if t == 0 or kind == "unrouted":
        return idx
    if kind == "one_expert":
        idx[:, 0] = int(torch.randint(experts, (1,), generator=g))
        return idx
    pool = experts
    base = 0
    if kind == "one_rank":                       # heavy skew: every slot on one rank
        per = experts // world
        base = per * int(torch.randint(world, (1,), generator=g))
        pool = per
    kk = min(k, pool)
    idx[:, :kk] = torch.rand(t, pool, generator=g).argsort(dim=1)[:, :kk] + base
    if kind == "skewed" and pool >= 2 and kk >= 2:
        hot = torch.rand(t, generator=g) < 0.9
        idx[hot, 0], idx[hot, 1] = 0, 1
        if kk > 2:
            rest = torch.rand(t, pool - 2, generator=g).argsort(dim=1)[:, :kk - 2] + 2
            idx[hot, 2:kk] = rest[hot]
    if kind == "partial":
        idx[torch.rand(t, k, generator=g) < 0.35] = -1
    return idx


def call_inputs(session: dict, world: int, i: int):
    """Every rank's `(x, topk_idx, topk_weights)` of call `i`, and (dtype, k, kind, weighted,
    combine): the same on every rank and in the checker."""
    import torch

    kw = session["kw"]
    rng = random.Random(session["seed"] * 100003 + i)
    names = FLOAT_DTYPES if kw["sync"] == "sp" else DTYPES
    dtype = getattr(torch, rng.choice(names))
    k = rng.randint(1, kw["max_top_k"])
    kind = rng.choice(KINDS)
    mx = kw["max_tokens_per_rank"]
    ins = []
    for _ in range(world):
        roll = rng.random()
        t = 0 if roll < 0.1 else mx if roll < 0.25 else rng.randint(0, mx)
        g = torch.Generator().manual_seed(rng.getrandbits(31))
        idx = _routing(t, k, kw["num_experts"], world, kind, g)
        w = torch.rand(t, k, generator=g)
        x = (torch.randn(t, kw["hidden"], generator=g).clamp_(-8, 8) * 4)
        x = x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)
        ins.append((x, idx, w))
    return ins, (dtype, k, kind, rng.random() < 0.7, rng.random() < 0.85)


def _expert(recv_x):
    import torch

    out = torch.bfloat16 if not recv_x.dtype.is_floating_point or recv_x.element_size() == 1 \
        else recv_x.dtype
    return (recv_x.to(torch.float32) * 0.5 + 1.0).to(out)


def _soak_rank(rank: int, world: int, sessions: list[dict], stop_at: float) -> dict:
    """Run `sessions` on this rank; return its tally (as a dict) and per-failure lines."""
    import torch

    import ubep
    from ubep import reference
    from ubep.testing import combine_contract

    tally = Tally()
    for s in sessions:
        if time.time() > stop_at:
            break
        tally.sessions += 1
        kw = s["kw"]
        where = f"session seed {s['seed']} {kw}"
        contract = combine_contract("torch" if kw["backend"] == "torch" else "oracle")
        try:
            buf = ubep.Buffer(**kw)
        except Exception as e:  # noqa: BLE001 - counted and reported, the soak goes on
            tally.errors += 1
            tally.failures.append(f"rank {rank} {where}: Buffer(): {type(e).__name__}: {e}")
            break                # the group may be out of step: fresh processes go on
        failed = False
        try:
            for i in range(s["calls"]):
                ins, (dtype, k, kind, weighted, do_combine) = call_inputs(s, world, i)
                res = buf.dispatch(*ins[rank])
                tally.calls += 1
                refs = reference.dispatch([a[0] for a in ins], [a[1] for a in ins],
                                          [a[2] for a in ins], kw["num_experts"])
                ref = refs[rank]
                same = (res.recv_x.dtype == ref.recv_x.dtype
                        and res.recv_x.shape == ref.recv_x.shape
                        and torch.equal(res.recv_x.contiguous().view(torch.uint8),
                                        ref.recv_x.contiguous().view(torch.uint8))
                        and torch.equal(res.recv_weights, ref.recv_weights)
                        and torch.equal(res.tokens_per_expert.to(torch.int64),
                                        ref.tokens_per_expert)
                        and torch.equal(res.recv_src_rank.to(torch.int64), ref.recv_src_rank)
                        and torch.equal(res.recv_src_token.to(torch.int64), ref.recv_src_token)
                        and torch.equal(res.recv_src_slot.to(torch.int64), ref.recv_src_slot))
                if not same:
                    tally.mismatches += 1
                    tally.failures.append(f"rank {rank} {where} call {i} ({dtype}, k={k}, "
                                          f"{kind}): dispatch differs from the reference")
                if not do_combine:
                    continue
                out = _expert(res.recv_x)
                if kw["direct"] and i % 3 == 0:        # zero copy: write into shared memory
                    cb = buf.get_combine_buffer(res.handle, out.dtype)
                    cb.copy_(out)
                    out = cb
                y = buf.combine(out, res.handle, weighted=weighted)
                # bit for bit to the backend's combine contract (`testing.check_case`'s):
                # the oracle's sums (shm), per-rank partial sums (torch)
                ref_y = contract([_expert(d.recv_x) for d in refs], refs, [a[1] for a in ins],
                                 [a[2] for a in ins], weighted=weighted)[rank]
                if y.dtype != ref_y.dtype or y.shape != ref_y.shape or not torch.equal(
                        y.reshape(-1).contiguous().view(torch.uint8),
                        ref_y.reshape(-1).view(torch.uint8)):
                    tally.mismatches += 1
                    tally.failures.append(f"rank {rank} {where} call {i} ({dtype}, k={k}, "
                                          f"{kind}, weighted={weighted}): combine differs")
        except ubep.PeerTimeoutError as e:
            tally.hangs += 1
            tally.failures.append(f"rank {rank} {where}: {e}")
            failed = True
        except Exception as e:  # noqa: BLE001
            tally.errors += 1
            tally.failures.append(f"rank {rank} {where}: {type(e).__name__}: {e}")
            failed = True
        finally:
            buf.close()
        if failed:               # a failed call may leave the process group out of step too:
            break                # the rest of this chunk runs on fresh processes
    return tally.__dict__


# -- --kill-every: elastic sessions where ranks die -----------------------------------------------
def elastic_session(rng: random.Random, world: int, calls: int, kill_every: int) -> dict:
    """An elastic session (`random_session`'s configuration with `elastic=True`, sync not
    sp) and its deaths: every `kill_every` calls, `(call, victim, phase, delay_s)`, victims
    drawn from the ranks still active, until two remain."""
    s = random_session(rng, world, calls)
    kw = s["kw"]
    kw.update(elastic=True, timeout_s=10.0, max_tokens_per_rank=max(kw["max_tokens_per_rank"], 3))
    if kw["sync"] == "sp":
        kw["sync"] = rng.choice(("tff", "sw", "dc"))
    alive, kills = list(range(world)), []
    for at in range(kill_every, calls, kill_every):
        if len(alive) <= 2:
            break
        victim = alive.pop(rng.randrange(len(alive)))
        kills.append((at, victim, rng.choice(("dispatch", "combine", "between")),
                      0.0 if rng.random() < 0.3 else rng.uniform(0, 2e-3)))
    s["kills"] = kills
    return s


def _same_rows(got, want) -> bool:
    import torch

    return all(torch.equal(a, b) for a, b in zip(got, want))


def _rows_from(res, ranks) -> tuple:
    """(origins [3, n], row bytes) of `res`'s rows whose source is in `ranks`, in order."""
    import torch

    src = res.recv_src_rank.to(torch.int64)
    keep = torch.isin(src, torch.tensor(sorted(ranks), dtype=torch.int64))
    return (torch.stack([src[keep], res.recv_src_token.to(torch.int64)[keep],
                         res.recv_src_slot.to(torch.int64)[keep]]),
            res.recv_x[keep].contiguous().view(torch.uint8))


def _elastic_rank(rank: int, world: int, session: dict, stop_at: float) -> dict:
    """One elastic session on this rank (see `elastic_session`); its tally as a dict."""
    import os
    import signal
    import threading

    import torch

    import ubep
    from ubep import reference

    tally = Tally(sessions=1)
    kw = session["kw"]
    kills = {at: (victim, phase, delay) for at, victim, phase, delay in session["kills"]}
    where = f"session seed {session['seed']} {kw} kills {session['kills']}"
    per = kw["num_experts"] // world
    try:
        buf = ubep.Buffer(**kw)
    except Exception as e:  # noqa: BLE001 - counted and reported
        tally.errors += 1
        tally.failures.append(f"rank {rank} {where}: Buffer(): {type(e).__name__}: {e}")
        return tally.__dict__
    active = torch.ones(world, dtype=torch.bool)
    try:
        for i in range(session["calls"]):
            if time.time() > stop_at:
                break
            ins, (dtype, k, kind, weighted, _) = call_inputs(session, world, i)
            victim, phase, delay = kills.get(i, (None, None, 0.0))
            mine = victim == rank
            if mine and phase == "dispatch":
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            t0 = time.monotonic()
            res = buf.dispatch(*ins[rank])
            if mine and phase == "combine":
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
            if mine and phase == "between":
                os.kill(os.getpid(), signal.SIGKILL)
            out = _expert(res.recv_x)
            y = buf.combine(out, res.handle, weighted=weighted)
            took = time.monotonic() - t0
            if mine:
                time.sleep(120)                 # the timer kills it by then
            tally.calls += 1
            if took > kw["timeout_s"]:
                tally.hangs += 1
                tally.failures.append(f"rank {rank} {where} call {i}: took {took:.1f} s")
            xs, idxs, ws = ([a[0] for a in ins], [a[1] for a in ins], [a[2] for a in ins])
            why = ""
            if victim is None:                  # no death in this call: exact, masked
                refs = reference.dispatch(xs, reference.masked_routing(idxs, active,
                                                                       kw["num_experts"]),
                                          ws, kw["num_experts"])
                ref = refs[rank]
                if not _same_rows((res.recv_x.contiguous().view(torch.uint8),
                                   res.recv_weights, res.tokens_per_expert.to(torch.int64),
                                   res.recv_src_rank.to(torch.int64),
                                   res.recv_src_token.to(torch.int64),
                                   res.recv_src_slot.to(torch.int64)),
                                  (ref.recv_x.contiguous().view(torch.uint8),
                                   ref.recv_weights, ref.tokens_per_expert,
                                   ref.recv_src_rank, ref.recv_src_token,
                                   ref.recv_src_slot)):
                    why = "dispatch differs from the masked oracle"
                off = ~active.repeat_interleave(per)
                want = (idxs[rank] >= 0) & off[idxs[rank].clamp(min=0)]
                if not why and not torch.equal(res.masked, want):
                    why = "masked is not exactly the dead ranks' slots"
            else:                               # the call a rank died in
                active[victim] = False
                refs = reference.dispatch(xs, idxs, ws, kw["num_experts"])
                ref = refs[rank]
                live = {r for r in range(world) if bool(active[r])}
                if not _same_rows(_rows_from(res, live), _rows_from(ref, live)):
                    why = "rows between live ranks differ from the oracle"
                got = _rows_from(res, {victim})
                if not why and got[0].numel() and not _same_rows(got, _rows_from(ref, {victim})):
                    why = "the dead rank's rows are partial"
            if not why:
                routing = [idx if r != rank else idx.masked_fill(res.handle.masked, -1)
                           for r, idx in enumerate(idxs)]
                if victim is None:
                    routing = reference.masked_routing(routing, active, kw["num_experts"])
                ref_y = reference.combine([_expert(d.recv_x) for d in refs], refs, routing, ws,
                                          weighted=weighted)[rank]
                tol = 1e-5 if y.dtype == torch.float32 else 2e-2
                if not torch.allclose(y.float(), ref_y.float(), rtol=tol, atol=tol):
                    why = "combine differs from the oracle over the slots it summed"
            if why:
                tally.mismatches += 1
                tally.failures.append(f"rank {rank} {where} call {i} ({dtype}, k={k}, "
                                      f"{kind}): {why}")
        if not torch.equal(buf.active_ranks, active):
            tally.mismatches += 1
            tally.failures.append(f"rank {rank} {where}: active_ranks "
                                  f"{buf.active_ranks.tolist()} != {active.tolist()}")
    except ubep.PeerTimeoutError as e:
        tally.hangs += 1
        tally.failures.append(f"rank {rank} {where}: {e}")
    except Exception as e:  # noqa: BLE001
        tally.errors += 1
        tally.failures.append(f"rank {rank} {where}: {type(e).__name__}: {e}")
    finally:
        buf.close()
    return tally.__dict__


def soak_kills(*, calls: int | None, minutes: float | None, world: int, seed: int,
               calls_per_session: int, kill_every: int, progress=None) -> Tally:
    """`soak` with `--kill-every`: elastic sessions on fresh processes, one job each."""
    from ubep.testing import RankFailure, run_ranks

    rng = random.Random(seed)
    stop_at = time.time() + minutes * 60 if minutes is not None else float("inf")
    total = Tally()
    n = 0
    while time.time() < stop_at and (calls is None or total.calls < calls):
        n += 1
        left = calls_per_session if calls is None else min(calls_per_session,
                                                           calls - total.calls)
        s = elastic_session(rng, world, max(left, kill_every + 1), kill_every)
        job = f"soakk{os.getpid()}s{n}"
        outs = run_ranks(_elastic_rank, world, s, stop_at, timeout_s=s["calls"] * 4.0 + 120,
                         return_exceptions=True, env={"UBEP_JOB_ID": job})
        got = Tally(sessions=1, kills=len(s["kills"]))
        victims = {v for _, v, _, _ in s["kills"]}
        for r, o in enumerate(outs):
            if isinstance(o, RankFailure):
                if not (r in victims and o.kind == "died"):
                    _count_failure(got, o)
                continue
            t = Tally(**o)
            got.calls = max(got.calls, t.calls)
            got.add_outcomes(t)
        _sweep_leaks(job, got)
        total.add(got)
        if progress is not None:
            progress(total)
    return total


def _count_failure(got: Tally, failure) -> None:
    """A rank that failed (a `RankFailure`): a hang if it ran out of time, else an error."""
    if failure.kind == "timeout":
        got.hangs += 1
    else:
        got.errors += 1
    got.failures.append(str(failure)[:2000])


def _sweep_leaks(job: str, got: Tally) -> None:
    """Count (as leaks and failures) and remove what `job` left in /dev/shm."""
    from ubep.runtime.shm.segments import unlink_name

    left_behind = _job_segments(job)
    got.leaked += len(left_behind)
    got.failures.extend(f"leaked segment /dev/shm/{n}" for n in left_behind)
    for name in left_behind:
        unlink_name(name)


def _job_segments(job: str) -> list[str]:
    from ubep.runtime.shm.segments import SHM_DIR

    try:
        return [n for n in os.listdir(SHM_DIR) if job in n]
    except OSError:
        return []


def soak(*, calls: int | None = None, minutes: float | None = None, world: int = 2,
         seed: int = 0, calls_per_session: int = 50, sessions_per_chunk: int = 8,
         progress=None) -> Tally:
    """Run randomized sessions until `calls` calls were made or `minutes` passed."""
    from ubep.testing import RankFailure, run_ranks

    if calls is None and minutes is None:
        raise ValueError("give calls or minutes (or both)")
    if calls is not None and calls < 1:
        raise ValueError(f"calls={calls} must be >= 1")
    if minutes is not None and not minutes > 0:
        raise ValueError(f"minutes={minutes} must be > 0")
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    rng = random.Random(seed)
    stop_at = time.time() + minutes * 60 if minutes is not None else float("inf")
    total = Tally()
    chunk = 0
    while time.time() < stop_at and (calls is None or total.calls < calls):
        chunk += 1
        left = None if calls is None else calls - total.calls
        sessions = []
        for _ in range(sessions_per_chunk):
            n = calls_per_session if left is None else min(calls_per_session, left)
            if n <= 0:
                break
            sessions.append(random_session(rng, world, rng.randint(1, n) if rng.random() < 0.3
                                           else n))
            if left is not None:
                left -= sessions[-1]["calls"]
        job = f"soak{os.getpid()}c{chunk}"
        budget = sum(s["calls"] for s in sessions) * 2.0 + 120.0
        outs = run_ranks(_soak_rank, world, sessions, stop_at, timeout_s=budget,
                         return_exceptions=True, env={"UBEP_JOB_ID": job})
        got = Tally()
        for r, o in enumerate(outs):
            if isinstance(o, RankFailure):
                _count_failure(got, o)
                continue
            t = Tally(**o)
            if r == 0:
                got.calls, got.sessions = t.calls, t.sessions
            got.add_outcomes(t)
        _sweep_leaks(job, got)
        total.add(got)
        if progress is not None:
            progress(total)
    return total


def _print_progress(t: Tally) -> None:
    kills = f", {t.kills} ranks killed" if t.kills else ""
    print(f"  {t.calls} calls, {t.sessions} buffers{kills}, {t.mismatches} mismatches, "
          f"{t.hangs} hangs, {t.errors} errors, {t.leaked} leaked segments", flush=True)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--calls", type=int, default=None, help="stop after this many dispatches")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks (processes), default 2 (4 with --kill-every)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random configurations")
    ap.add_argument("--calls-per-buffer", type=int, default=50,
                    help="calls made on one Buffer before the next configuration (default 50)")
    ap.add_argument("--kill-every", type=int, default=None, metavar="N",
                    help="elastic Buffers (4 ranks unless --world): every N calls a random "
                         "rank is SIGKILLed inside a call while the others go on")
    ap.add_argument("--quiet", action="store_true", help="print only the summary")


def run(args: argparse.Namespace) -> int:
    """0 if nothing went wrong, 1 on any mismatch, hang, error or leak, 2 on bad arguments."""
    if args.calls is None and args.minutes is None:
        args.calls = 1000
    progress = None if args.quiet else _print_progress
    try:
        if args.kill_every is not None:
            if args.kill_every < 1:
                raise ValueError(f"--kill-every={args.kill_every} must be >= 1")
            world = 4 if args.world is None else args.world
            if world < 3:
                raise ValueError(f"--kill-every needs --world >= 3 (two ranks stay), "
                                 f"got {world}")
            t = soak_kills(calls=args.calls, minutes=args.minutes, world=world, seed=args.seed,
                           calls_per_session=args.calls_per_buffer,
                           kill_every=args.kill_every, progress=progress)
        else:
            t = soak(calls=args.calls, minutes=args.minutes,
                     world=2 if args.world is None else args.world, seed=args.seed,
                     calls_per_session=args.calls_per_buffer, progress=progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in t.failures[:50]:
        print(f"FAIL {line}")
    kills = f"  ranks killed: {t.kills}" if args.kill_every is not None else ""
    print(f"calls: {t.calls}  buffers: {t.sessions}{kills}  mismatches: {t.mismatches}  "
          f"hangs: {t.hangs}  errors: {t.errors}  leaked segments: {t.leaked}")
    return 0 if t.ok else 1


def register(subparsers) -> None:
    """Add `ubep soak` to the `ubep` command line."""
    ap = subparsers.add_parser("soak", help="randomized dispatch/combine against the oracle",
                               description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.set_defaults(func=run)
