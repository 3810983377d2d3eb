"""The paper's roles in the shm runtime (mode "ubep", 2-4 workers per rank, oversubscribed
on a small host): oracle equality on every sync variant and schedule, count and token roles
that overlap in time, and no barrier.

Each test runs its Buffers inside one `run_ranks` call to save process start-up.
"""

from __future__ import annotations

import pytest

from ubep.testing import Case, check_case, run_case, run_ranks, runtime_cases

SYNCS = ("sw", "tff", "dc", "sp")
SP_DTYPES = ("bf16", "fp16", "fp32")


def _configs() -> list[dict]:
    """Every sync variant at 2, 3 and 4 workers; the schedules and count-group sizes vary."""
    out = []
    for workers, schedule, count_workers in ((2, "hierarchical", None), (3, "balanced", 2),
                                             (4, "hierarchical", 2), (4, "static", 3)):
        for sync in SYNCS:
            out.append(dict(workers=workers, schedule=schedule, count_workers=count_workers,
                            sync=sync, block_bytes=64 if sync == "dc" else 512))
    return out


def _usable(case: Case, sync: str) -> bool:
    return sync != "sp" or case.dtype in SP_DTYPES


def _oracle(rank, world, configs, cases):
    import ubep

    outs = []
    for kw in configs:
        with ubep.Buffer(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
                         max_tokens_per_rank=16, backend="shm", mode="ubep", max_top_k=8,
                         timeout_s=60, **kw) as buf:
            outs.append([run_case(buf, c, rank) for c in cases if _usable(c, kw["sync"])])
    return outs


def test_roles_match_the_oracle_on_every_sync_variant_with_2_to_4_workers():
    configs, cases = _configs(), runtime_cases(2)
    outs = run_ranks(_oracle, 2, configs, cases, timeout_s=400)
    for ci, kw in enumerate(configs):
        usable = [c for c in cases if _usable(c, kw["sync"])]
        assert len(outs[0][ci]) == len(usable)
        for k, case in enumerate(usable):
            try:
                check_case(case, [o[ci][k] for o in outs])
            except AssertionError as e:
                raise AssertionError(f"{kw}: {e}") from None


def _trace(rank, world, mode, calls):
    import ubep
    from ubep.testing import make_routing, make_tokens

    out = []
    with ubep.Buffer(num_experts=16, hidden=256, max_tokens_per_rank=64, backend="shm",
                     mode=mode, workers=4, count_workers=2, timeout_s=60) as buf:
        idx, w = make_routing(64, 4, 16, seed=rank)
        x = make_tokens(rank, 64, 256, ubep_dtype())
        for _ in range(calls):
            res = buf.dispatch(x, idx, w)
            buf.combine(res.recv_x, res.handle)
            comb, st = buf.last_stats, res.stats
            out.append(dict(
                roles=(st.extra["count_workers"], st.extra["token_workers"]),
                barriers=(st.extra["barriers"], comb.extra["barriers"]),
                ivs=[(iv.worker, iv.name, iv.start_us, iv.end_us) for iv in st.intervals],
                combine=[(iv.worker, iv.name) for iv in comb.intervals]))
    return out


def ubep_dtype():
    import torch

    return torch.bfloat16


@pytest.mark.parametrize("mode", ["ubep", "bsp"])
def test_count_and_token_roles_overlap_and_no_barrier_runs(mode):
    calls = 12
    outs = run_ranks(_trace, 2, mode, calls, timeout_s=200)
    for rank_out in outs:
        if mode == "bsp":       # the baseline's phases: barriers, no roles (the contrast)
            assert all(o["roles"] == (0, 4) and o["barriers"][0] > 0 for o in rank_out)
            continue
        assert all(o["roles"] == (2, 2) for o in rank_out)
        assert all(o["barriers"] == (0, 0) for o in rank_out)     # never a barrier
        overlapped = 0
        for o in rank_out:
            by = {}
            for w, name, a, b in o["ivs"]:
                by.setdefault((w, name), []).append((a, b))
            count = {w for w, _ in by if w < 2}
            token = {w for w, _ in by if w >= 2}
            assert count == {0, 1} and token == {2, 3}
            # count workers: counts out, sources' counts in, their share of CalCumSum
            assert all((w, p) in by for w in (0, 1)
                       for p in ("send_counts", "wait_counts", "offsets"))
            # token workers: their own slice (no central plan), rows, then reordering
            assert all((w, p) in by for w in (2, 3)
                       for p in ("map", "send_rows", "wait_offsets", "reorder"))
            assert not any(name == "plan" for _, name, _, _ in o["ivs"])
            first_send = min(by[(w, "send_rows")][0][0] for w in (2, 3))
            last_offsets = max(by[(w, "offsets")][0][1] for w in (0, 1))
            overlapped += first_send < last_offsets
            # combine: count workers send the hellos, token workers map and send rows
            comb = set(o["combine"])
            assert {(0, "send_flags"), (1, "send_flags"), (2, "map"), (3, "map"),
                    (2, "send_rows"), (3, "send_rows")} <= comb
        # token workers send while the count group still works on the offsets (scheduling
        # on a busy 2-core host can serialize a call now and then, not every call)
        assert overlapped >= calls // 2, f"roles overlapped in {overlapped}/{calls} calls"


def _tuned_roles(rank, world, cache):
    import os

    import torch

    import ubep
    from ubep.plan.costmodel import balance_count_workers

    os.environ["UBEP_TUNING_CACHE"] = cache
    with ubep.Buffer(num_experts=4, hidden=16, max_tokens_per_rank=8, backend="shm",
                     workers=4, timeout_s=60) as buf:
        out = {}
        for t in (3, 5):                       # 3 was tuned, 5 was not
            x = torch.randn(t, 16)
            idx = torch.stack([torch.randperm(4)[:2] for _ in range(t)])
            res = buf.dispatch(x, idx, torch.rand(t, 2))
            out[t] = (res.stats.extra["count_workers"],
                      balance_count_workers(4, 4, 2, t, ranks=world))
        return out


def test_a_choice_recorded_by_ubep_tune_is_the_one_the_runtime_uses(tmp_path):
    from ubep import tuning
    from ubep.plan import Topology
    from ubep.plan.costmodel import balance_count_workers

    cache = str(tmp_path / "tuning.json")
    name = Topology.resolve(None, 2).name
    formula = balance_count_workers(4, 4, 2, 3, ranks=2)
    tuned = 1 if formula != 1 else 2           # differs from what Eq. 4 would pick
    tuning.record(name, 4, 4, 3, tuned, latency_us=1.0, source="test", path=tmp_path /
                  "tuning.json")
    assert tuning.choices(name, 4, 4, path=tmp_path / "tuning.json") == {3: tuned}
    for rank_out in run_ranks(_tuned_roles, 2, cache, timeout_s=120):
        assert rank_out[3][0] == tuned
        assert rank_out[5][0] == rank_out[5][1]   # no entry: the cost model's own choice
