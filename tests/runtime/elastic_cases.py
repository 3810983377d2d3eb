"""Rank functions and oracle checks for the elastic tests (`test_elastic.py`, the torch ones).

Every rank rebuilds every rank's inputs from the call's seed, so a survivor checks its own
results against `ubep.reference` with the dead rank masked (`reference.masked_routing`)
without asking anyone. Expert outputs are a function of the row and its global expert
(`expert_rows`), so a combine's expected sums are known on the token's own rank too, for
exactly the slots the combine says it summed (`handle.masked`).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from ubep import reference
from ubep.testing import make_routing, make_tokens

HIDDEN = 32
TOKENS = 6
TOP_K = 3


def inputs(world: int, experts: int, i: int, seed: int = 0, tokens: int = TOKENS):
    """Every rank's `(x, topk_idx, topk_weights)` of call `i` (bf16 rows, `tokens` each)."""
    out = []
    for r in range(world):
        idx, w = make_routing(tokens, TOP_K, experts, seed=seed * 7919 + i * 31 + r)
        out.append((make_tokens(r, tokens, HIDDEN, torch.bfloat16, seed=seed + i), idx, w))
    return out


def expert_rows(recv_x: torch.Tensor, tokens_per_expert: torch.Tensor, first_expert: int
                ) -> torch.Tensor:
    """The stand-in experts: global expert e maps a row x to x * (1 + e / 8) (bf16)."""
    e = first_expert + torch.repeat_interleave(
        torch.arange(tokens_per_expert.numel()), tokens_per_expert.to(torch.int64))
    return (recv_x.float() * (1 + e.float() / 8)[:, None]).to(recv_x.dtype)


def expected_y(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
               masked: torch.Tensor) -> torch.Tensor:
    """The oracle's combine of one rank's tokens over the slots not `masked`: the fp32 sum in
    slot order of w * expert(x), rounded once."""
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0 or bool(masked[t, k]):
                continue
            row = (x[t].float() * (1 + e / 8)).to(x.dtype).float()
            acc = acc + w[t, k].float() * row
        y[t] = acc
    return y.to(x.dtype)


def dispatch_matches(res, ref) -> bool:
    return (torch.equal(res.recv_x.view(torch.uint8), ref.recv_x.view(torch.uint8))
            and torch.equal(res.recv_weights, ref.recv_weights)
            and torch.equal(res.tokens_per_expert.to(torch.int64), ref.tokens_per_expert)
            and torch.equal(res.recv_src_rank.to(torch.int64), ref.recv_src_rank)
            and torch.equal(res.recv_src_token.to(torch.int64), ref.recv_src_token)
            and torch.equal(res.recv_src_slot.to(torch.int64), ref.recv_src_slot))


def rows_from(res_or_ref, ranks: set[int]):
    """(origins, rows) of the received rows whose source is in `ranks`, in order."""
    src = res_or_ref.recv_src_rank.to(torch.int64)
    keep = torch.tensor([int(s) in ranks for s in src], dtype=torch.bool)
    orig = torch.stack([src[keep], res_or_ref.recv_src_token.to(torch.int64)[keep],
                        res_or_ref.recv_src_slot.to(torch.int64)[keep]])
    return orig, res_or_ref.recv_x[keep].view(torch.uint8)


def check_call(rank: int, world: int, experts: int, ins, res, y, active: torch.Tensor,
               exact: bool, victim: int, bits: bool = True) -> str:
    """'' if this rank's dispatch `res` and combine `y` of a call with inputs `ins` are right:
    `exact` (a call after the death): bit for bit the oracle with the inactive ranks masked,
    `masked` marking exactly their slots; else (the call the death happened in) the rows
    from live ranks exact, the victim's all there or none, `masked` only on the victim's
    experts. The combine always sums exactly the slots `handle.masked` leaves (bit for bit
    if `bits`, else to the torch backend's rounding: partial sums rounded per rank)."""
    per = experts // world
    xs, idxs, ws = [a[0] for a in ins], [a[1] for a in ins], [a[2] for a in ins]
    if exact:
        ref = reference.dispatch(xs, reference.masked_routing(idxs, active, experts), ws,
                                 experts)[rank]
        if not dispatch_matches(res, ref):
            return "dispatch differs from the masked oracle"
        want = (idxs[rank] >= 0) & ~active.repeat_interleave(per)[idxs[rank].clamp(min=0)]
        if not torch.equal(res.masked, want):
            return f"masked {res.masked.tolist()} != {want.tolist()}"
    else:
        full = reference.dispatch(xs, idxs, ws, experts)[rank]
        live = set(range(world)) - {victim}
        got, want = rows_from(res, live), rows_from(full, live)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            return "rows between live ranks differ from the oracle"
        gv, wv = rows_from(res, {victim}), rows_from(full, {victim})
        if gv[0].numel() and not (torch.equal(gv[0], wv[0]) and torch.equal(gv[1], wv[1])):
            return f"the victim's rows are partial: {gv[0].shape[1]} of {wv[0].shape[1]}"
        on_victim = (idxs[rank] >= 0) & (idxs[rank] // per == victim)
        if bool((res.masked & ~on_victim).any()):
            return "masked holds slots of live ranks"
    mask = res.handle.masked
    want_y = expected_y(xs[rank], idxs[rank], ws[rank], mask)
    if bits:
        same = torch.equal(y.view(torch.int16), want_y.view(torch.int16))
    else:       # partial sums rounded per rank: within a few bf16 units of the token's scale
        scale = want_y.float().abs().amax(1, keepdim=True) + 1
        same = bool(((y.float() - want_y.float()).abs() <= 2e-2 * scale).all())
    if not same:
        return f"combine differs from the oracle over the slots it summed ({mask.tolist()})"
    return ""


def kill_later(delay_s: float) -> threading.Timer:
    """SIGKILL this process after `delay_s` (a timer thread), started."""
    t = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL))
    t.daemon = True
    t.start()
    return t


def elastic_trial(rank: int, world: int, kw: dict, victim: int, kill_at: int, phase: str,
                  delay_s: float, calls: int, seed: int, deadline_s: float,
                  tokens: int = TOKENS) -> dict:
    """One elastic job: `calls` dispatch+combine pairs of `tokens` per rank; `victim` SIGKILLs
    itself `delay_s` into call `kill_at`'s `phase`. A survivor checks every call and reports
    what it saw (and the backend that ran)."""
    import ubep

    experts = 2 * world
    buf = ubep.Buffer(num_experts=experts, hidden=HIDDEN, max_tokens_per_rank=tokens,
                      max_top_k=TOP_K, timeout_s=deadline_s, elastic=True, **kw)
    errors, slowest, seen = [], 0.0, []
    try:
        for i in range(calls):
            ins = inputs(world, experts, i, seed, tokens)
            if rank == victim and i == kill_at and phase == "dispatch":
                kill_later(delay_s)
            before = buf.active_ranks
            t0 = time.monotonic()
            res = buf.dispatch(*ins[rank])
            if rank == victim and i == kill_at and phase == "combine":
                kill_later(delay_s)
            if rank == victim and i == kill_at and phase == "between":
                os.kill(os.getpid(), signal.SIGKILL)    # after its dispatch, before combine
            out = expert_rows(res.recv_x, res.tokens_per_expert, rank * (experts // world))
            y = buf.combine(out, res.handle)
            slowest = max(slowest, time.monotonic() - t0)
            if rank == victim and i >= kill_at:
                time.sleep(60)                      # the timer kills it by then
            # the call the victim died in: exact between live ranks only (its rows of that
            # call may have arrived, even where this rank knew of the death at the start)
            exact = i != kill_at
            after = buf.active_ranks
            if bool(before.all()) and not bool(after.all()):
                # where this rank learned of the death: inside call i (a wait), and whether
                # it dropped something (rows of the victim, or combine slots beyond masked)
                seen.append((i, bool(res.masked.any()),
                             bool((res.handle.masked & ~res.masked).any()),
                             "_full" in res.handle.__dict__))
            why = check_call(rank, world, experts, ins, res, y, after, exact, victim,
                             bits=buf.config.backend == "shm")
            if why:
                errors.append(f"call {i}: {why}")
        # the torch backend's recovery: calls its compiled path took, calls it replayed
        el = getattr(buf._backend, "recovery", None)
        return dict(errors=errors, active=buf.active_ranks.tolist(), slowest=slowest,
                    load=buf.expert_load().tolist(), seen=seen, backend=buf.config.backend,
                    compiled=el.compiled_calls if el else 0, replays=el.replays if el else 0)
    finally:
        buf.close()


def drain_trial(rank: int, world: int, kw: dict, removed: int, calls: int, seed: int,
                deadline_s: float) -> dict:
    """A planned drain: after call 1 every rank but `removed` calls `set_active_ranks`
    without it; `removed` then tries a dispatch (refused: `RankRemovedError`) and closes. The
    others check every call against the oracle (exact, the removed rank masked after the
    drain) and report their `expert_load`."""
    import ubep

    experts = 2 * world
    buf = ubep.Buffer(num_experts=experts, hidden=HIDDEN, max_tokens_per_rank=TOKENS,
                      max_top_k=TOP_K, timeout_s=deadline_s, elastic=True, **kw)
    errors, load = [], torch.zeros(experts // world, dtype=torch.int64)
    try:
        for i in range(calls):
            ins = inputs(world, experts, i, seed)
            if i == 2:
                keep = torch.ones(world, dtype=torch.bool)
                keep[removed] = False
                if rank == removed:
                    t0 = time.monotonic()
                    try:
                        buf.dispatch(*ins[rank])
                        return dict(errors=["the removed rank's dispatch was not refused"])
                    except ubep.RankRemovedError as e:
                        try:
                            buf.dispatch(*ins[rank])
                            return dict(errors=["a second call was not refused"])
                        except ubep.RankRemovedError:
                            pass
                        return dict(errors=[], refused=str(e), took=time.monotonic() - t0)
                buf.set_active_ranks(keep)
            res = buf.dispatch(*ins[rank])
            load += res.tokens_per_expert.to(torch.int64)
            out = expert_rows(res.recv_x, res.tokens_per_expert, rank * (experts // world))
            y = buf.combine(out, res.handle)
            why = check_call(rank, world, experts, ins, res, y, buf.active_ranks, True, removed,
                             bits=buf.config.backend == "shm")
            if why:
                errors.append(f"call {i}: {why}")
        try:
            buf.set_active_ranks(torch.ones(world, dtype=torch.bool))
            errors.append("set_active_ranks brought a removed rank back")
        except ValueError as e:
            if "may only remove ranks" not in str(e):
                errors.append(f"set_active_ranks: {e}")
        got = buf.expert_load(reset=True)
        if not torch.equal(got, load):
            errors.append(f"expert_load {got.tolist()} != {load.tolist()}")
        if buf.expert_load().any():
            errors.append("expert_load(reset=True) did not reset")
        return dict(errors=errors, active=buf.active_ranks.tolist())
    finally:
        buf.close()


def assert_survivors(out: list, victim: int, deadline_s: float, where: str) -> None:
    """A killed trial's outcome: the victim died; every survivor raised nothing, agrees that
    only the victim left, and never waited past the deadline."""
    from ubep.testing import RankFailure

    assert isinstance(out[victim], RankFailure) and out[victim].kind == "died", (where, out)
    want = [r != victim for r in range(len(out))]
    for r, o in enumerate(out):
        if r == victim:
            continue
        assert not isinstance(o, RankFailure), (where, o)
        assert o["errors"] == [], (where, r, o["errors"])
        assert o["active"] == want, (where, r, o["active"])
        assert o["slowest"] <= deadline_s, (where, r, o["slowest"])


def assert_drained(out: list, removed: int, deadline_s: float) -> None:
    """A planned drain's outcome: the removed rank's next call was refused in time; the
    others raised nothing and agree on who is left."""
    from ubep.testing import RankFailure

    gone = out[removed]
    assert not isinstance(gone, RankFailure), gone
    assert gone["errors"] == [] and "removed by set_active_ranks" in gone["refused"]
    assert gone["took"] <= deadline_s
    want = [r != removed for r in range(len(out))]
    for r, o in enumerate(out):
        if r != removed:
            assert not isinstance(o, RankFailure), o
            assert o["errors"] == [], (r, o["errors"])
            assert o["active"] == want, (r, o["active"])


def calls_until_store_host_dies(buf, rank: int, world: int, conn, tokens: int = TOKENS) -> None:
    """Three calls on elastic `buf`; rank 0 (the store's host) SIGKILLs itself before the
    second. Each survivor sends on `conn` what it met: `("StoreHostDiedError", message,
    seconds the call took)`, or `("no error",)`."""
    import ubep

    for i in range(3):
        if rank == 0 and i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        ins = inputs(world, 2 * world, i, tokens=tokens)
        t0 = time.monotonic()
        try:
            res = buf.dispatch(*ins[rank])
            buf.combine(res.recv_x, res.handle)
        except ubep.StoreHostDiedError as e:
            conn.send(("StoreHostDiedError", str(e), time.monotonic() - t0))
            return
    conn.send(("no error",))
