"""The AgRs peer (vLLM's all-gather + reduce-scatter EP) against the oracle.

Dispatch bit for bit. Combine: each rank's partial sums (fp32, slot order, rounded to the
output dtype to nearest even: `reference.combine_partials`, a group per rank), summed by the
reduce-scatter in the output dtype, as vLLM does: one addition at P = 2 (the partials'
contract bit for bit), P - 1 additions each rounded, in the ring's order, beyond (within
P - 1 ulps of it, `check_case`'s `ulps`). Unequal token counts per rank, -1 slots, P = 2, 3.
"""

import pytest

from ubep import reference
from ubep.testing import Case, check_case, expert_fn, run_ranks


def _run(rank, world, cases):
    from ubep.bench.agrs_peer import AgRsPeer

    outs = []
    for case in cases:
        peer = AgRsPeer(case.num_experts)
        x, idx, w = case.inputs(rank)
        d = peer.dispatch(x, idx, w, max(case.tokens))
        y = peer.combine(expert_fn(d.recv_x), d, weighted=case.weighted)
        outs.append({"recv_x": d.recv_x, "recv_weights": d.recv_weights,
                     "tokens_per_expert": d.tokens_per_expert, "recv_src_rank": d.recv_src_rank,
                     "recv_src_token": d.recv_src_token, "recv_src_slot": d.recv_src_slot,
                     "y": y})
    return outs


@pytest.mark.parametrize("world", [2, 3])
def test_agrs_peer_matches_reference(world):
    T = tuple(5 + 3 * r for r in range(world))
    cases = [Case(4 * world, 16, 4, T, "uniform", "bf16", seed=1),
             Case(4 * world, 16, 4, (0,) + T[1:], "skewed", "bf16", seed=2),
             Case(4 * world, 8, 3, T, "partial", "fp32", seed=3),
             Case(2 * world, 8, 2, T, "uniform", "fp16", seed=4, weighted=False)]
    per_rank = run_ranks(_run, world, cases, timeout_s=180)
    for i, case in enumerate(cases):
        check_case(case, [per_rank[r][i] for r in range(world)],
                   contract=reference.combine_partials, ulps=0 if world == 2 else world - 1)
