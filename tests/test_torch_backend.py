"""The torch.distributed backend against the oracle: bit-exact dispatch, P = 2, 3, 4."""

import pytest

from ubep.testing import Case, check_case, run_case, run_ranks


def _cases(world: int) -> list[Case]:
    T = tuple(5 + 3 * r for r in range(world))
    E = 4 * world
    cases = [
        Case(E, 16, 4, T, "uniform", "bf16", seed=1),
        Case(E, 16, 4, T, "skewed", "bf16", seed=2),
        Case(E, 16, 2, T, "one_expert", "fp32", seed=3),
        Case(E, 16, 4, (0,) + T[1:], "uniform", "fp16", seed=4),          # a rank with T = 0
        Case(E, 16, 3, T, "unrouted", "bf16", seed=5),                     # every slot -1
        Case(E, 16, 4, T, "partial", "fp8", seed=6),
        Case(E, 8, 4, T, "uniform", "int8", seed=7),
        Case(E, 8, 4, T, "uniform", "uint8", seed=8, weighted=False),
        Case(2 * world, 24, 2, T, "uniform", "fp32", seed=9),             # 2 experts per rank
    ]
    return cases


def _run_cases(rank, world, cases):
    import ubep

    outs = []
    for case in cases:
        with ubep.Buffer(num_experts=case.num_experts, hidden=case.hidden,
                         max_tokens_per_rank=max(case.tokens), backend="torch") as buf:
            outs.append(run_case(buf, case, rank))
    return outs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_torch_backend_matches_reference(world):
    cases = _cases(world)
    per_rank = run_ranks(_run_cases, world, cases, timeout_s=180)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(world)])


def _reuse(rank, world, cases):
    """One Buffer, many calls with changing routing and batch sizes."""
    import ubep

    with ubep.Buffer(num_experts=cases[0].num_experts, hidden=cases[0].hidden,
                     max_tokens_per_rank=16, backend="torch") as buf:
        return [run_case(buf, c, rank) for c in cases]


def test_torch_backend_buffer_reuse():
    cases = [Case(8, 8, 2, (s % 7, (3 * s) % 11), "uniform", "bf16", seed=s) for s in range(12)]
    per_rank = run_ranks(_reuse, 2, cases)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(2)])
