"""The shm runtime against the oracle: modes x sync variants x workers x block sizes.

Dispatch must match bit for bit, combine to fp32-accumulation tolerance (`check_case`).
Each test runs many Buffers and cases inside one `run_ranks` call to save process start-up.
"""

from __future__ import annotations

import itertools

import pytest

from ubep.testing import Case, check_case, run_case, run_ranks, runtime_cases

SP_DTYPES = ("bf16", "fp16", "fp32")


def _usable(case: Case, sync: str) -> bool:
    return sync != "sp" or case.dtype in SP_DTYPES


def _run(rank, world, configs, cases):
    import ubep

    outs = []
    for kw in configs:
        got = []
        with ubep.Buffer(num_experts=cases[0].num_experts, hidden=max(c.hidden for c in cases),
                         max_tokens_per_rank=16, backend="shm", max_top_k=8, timeout_s=30,
                         **kw) as buf:
            for case in cases:
                if _usable(case, kw["sync"]):
                    got.append(run_case(buf, case, rank))
        outs.append(got)
    return outs


def _check_all(world, configs, cases):
    outs = run_ranks(_run, world, configs, cases, timeout_s=280)
    checked = 0
    for ci, kw in enumerate(configs):
        usable = [c for c in cases if _usable(c, kw["sync"])]
        for k, case in enumerate(usable):
            try:
                check_case(case, [o[ci][k] for o in outs])
            except AssertionError as e:
                raise AssertionError(f"{kw}: {e}") from None
            checked += 1
    assert checked == sum(len([c for c in cases if _usable(c, kw["sync"])]) for kw in configs)


def _configs(modes, syncs, workers, blocks):
    return [dict(mode=m, sync=s, workers=w, block_bytes=b)
            for m, s, w, b in itertools.product(modes, syncs, workers, blocks)]


def test_two_ranks_every_variant_mode_workers_and_block_size():
    _check_all(2, _configs(("ubep", "bsp"), ("sw", "tff", "dc", "sp"), (1, 2), (512, 64)),
               runtime_cases(2))


def test_three_ranks_three_workers():
    configs = _configs(("ubep", "bsp"), ("tff", "dc"), (1, 3), (128,))
    configs.append(dict(mode="ubep", sync="sp", workers=3, block_bytes=128, count_workers=2))
    _check_all(3, configs, runtime_cases(3))


@pytest.mark.slow
def test_four_ranks():
    _check_all(4, _configs(("ubep", "bsp"), ("sw", "tff", "sp"), (1, 2), (512,)), runtime_cases(4))


def _schedules(rank, world, cases):
    import ubep

    outs = []
    for schedule, workers in (("static", 1), ("balanced", 2), ("hierarchical", 3)):
        with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                         max_tokens_per_rank=16, backend="shm", schedule=schedule,
                         workers=workers, timeout_s=30) as buf:
            outs.append([run_case(buf, c, rank) for c in cases])
    return outs


def test_schedules_deliver_the_same_rows():
    cases = [Case(num_experts=8, hidden=16, top_k=4, tokens=(9, 4), seed=11),
             Case(num_experts=8, hidden=16, top_k=2, tokens=(12, 12), routing="skewed", seed=12)]
    outs = run_ranks(_schedules, 2, cases, timeout_s=200)
    for s in range(3):
        for k, case in enumerate(cases):
            check_case(case, [o[s][k] for o in outs])
