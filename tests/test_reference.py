"""The oracle on cases computed by hand."""

import torch

from ubep import reference


def _hand_case():
    x0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    x1 = torch.tensor([[5.0, 6.0]])
    idx0 = torch.tensor([[1, 2], [0, -1]])
    idx1 = torch.tensor([[2, 1]])
    w0 = torch.tensor([[0.5, 0.25], [1.0, 0.0]])
    w1 = torch.tensor([[0.1, 0.2]])
    return [x0, x1], [idx0, idx1], [w0, w1]


def test_dispatch_by_hand():
    xs, idxs, ws = _hand_case()
    r0, r1 = reference.dispatch(xs, idxs, ws, num_experts=4)
    # rank 0 owns experts 0, 1: expert 0 <- (src 0, t 1); expert 1 <- (src 0, t 0), (src 1, t 0)
    assert torch.equal(r0.recv_x, torch.tensor([[3.0, 4.0], [1.0, 2.0], [5.0, 6.0]]))
    assert r0.tokens_per_expert.tolist() == [1, 2]
    assert r0.recv_src_rank.tolist() == [0, 0, 1]
    assert r0.recv_src_token.tolist() == [1, 0, 0]
    assert r0.recv_src_slot.tolist() == [0, 0, 1]
    assert torch.equal(r0.recv_weights, torch.tensor([1.0, 0.5, 0.2]))
    # rank 1 owns experts 2, 3: expert 2 <- (src 0, t 0, slot 1), (src 1, t 0, slot 0)
    assert torch.equal(r1.recv_x, torch.tensor([[1.0, 2.0], [5.0, 6.0]]))
    assert r1.tokens_per_expert.tolist() == [2, 0]
    assert r1.recv_src_rank.tolist() == [0, 1]
    assert r1.recv_src_slot.tolist() == [1, 0]
    assert torch.equal(r1.recv_weights, torch.tensor([0.25, 0.1]))


def test_combine_by_hand():
    xs, idxs, ws = _hand_case()
    d = reference.dispatch(xs, idxs, ws, num_experts=4)
    # each destination adds 100 * (its rank + 1), so a row sent back to the wrong place shows
    outs = [d[r].recv_x + 100.0 * (r + 1) for r in range(2)]
    y0, y1 = reference.combine(outs, d, idxs, ws, weighted=True)
    row = lambda v, r: torch.tensor(v) + 100.0 * (r + 1)  # noqa: E731
    assert torch.equal(y0[0], 0.5 * row([1.0, 2.0], 0) + 0.25 * row([1.0, 2.0], 1))
    assert torch.equal(y0[1], 1.0 * row([3.0, 4.0], 0))
    assert torch.equal(y1[0], 0.1 * row([5.0, 6.0], 1) + 0.2 * row([5.0, 6.0], 0))
    y0u, _ = reference.combine(outs, d, idxs, ws, weighted=False)
    assert torch.equal(y0u[0], row([1.0, 2.0], 0) + row([1.0, 2.0], 1))


def test_unrouted_tokens_get_zeros_and_dtype_is_kept():
    xs = [torch.ones(3, 4, dtype=torch.bfloat16)]
    idxs = [torch.tensor([[-1, -1], [0, -1], [-1, -1]])]
    ws = [torch.ones(3, 2)]
    d = reference.dispatch(xs, idxs, ws, num_experts=2)
    assert d[0].recv_x.shape == (1, 4) and d[0].recv_x.dtype == torch.bfloat16
    (y,) = reference.combine([d[0].recv_x], d, idxs, ws)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[0], torch.zeros(4, dtype=torch.bfloat16))
    assert torch.equal(y[1], torch.ones(4, dtype=torch.bfloat16))


def test_token_to_two_experts_of_one_rank_appears_twice():
    xs = [torch.arange(4.0).view(2, 2), torch.zeros(0, 2)]
    idxs = [torch.tensor([[0, 1], [1, 3]]), torch.zeros(0, 2, dtype=torch.int64)]
    ws = [torch.ones(2, 2), torch.zeros(0, 2)]
    r0, r1 = reference.dispatch(xs, idxs, ws, num_experts=4)
    assert r0.recv_src_token.tolist() == [0, 0, 1]      # expert 0: t0; expert 1: t0, t1
    assert r0.tokens_per_expert.tolist() == [1, 2]
    assert r1.recv_src_token.tolist() == [1] and r1.tokens_per_expert.tolist() == [0, 1]


def _one_token(value: list[float], experts: list[int], world: int = 2, dtype=torch.bfloat16):
    """One token of rank 0 (unweighted) to `experts` (2 per rank): slot k's expert output is
    `value[k]`, in every element."""
    xs = [torch.zeros(1 if r == 0 else 0, 2, dtype=dtype) for r in range(world)]
    k = len(experts)
    idxs = [torch.tensor([experts]) if r == 0 else torch.zeros(0, k, dtype=torch.int64)
            for r in range(world)]
    ws = [torch.ones(1 if r == 0 else 0, k) for r in range(world)]
    d = reference.dispatch(xs, idxs, ws, num_experts=2 * world)
    outs = [torch.tensor([[value[k]] * 2 for k in d[r].recv_src_slot.tolist()],
                         dtype=dtype).reshape(-1, 2) for r in range(world)]
    return outs, d, idxs, ws


def _three_slots(value: list[float]):
    """Slots 0 and 2 on rank 0 (experts 0, 1), slot 1 on rank 1 (expert 2), bf16."""
    return _one_token(value, [0, 2, 1])


def test_combine_partials_by_hand():
    """Rows 1, 2^-8, 2^-8 (slots 0, 1, 2). The oracle sums them in fp32: 1 + 2^-7, exact in
    bf16. Per-rank partials: rank 0's 1 + 2^-8 is a bf16 tie, to even 1; rank 1's 2^-8; their
    sum 1 + 2^-8 a tie again: 1 to even, 1 + 2^-7 away from zero. Partials kept in fp32, or
    one group for both ranks: the oracle's sum."""
    args = _three_slots([1.0, 2.0**-8, 2.0**-8])
    (oracle,) = reference.combine(*args, weighted=False)[:1]
    (even,) = reference.combine_partials(*args, weighted=False)[:1]
    (away,) = reference.combine_partials(*args, weighted=False, bf16_ties_away=True)[:1]
    (one,) = reference.combine_partials(*args, weighted=False, group_of_rank=[0, 0])[:1]
    (fp32,) = reference.combine_partials(*args, weighted=False,
                                         partial_dtype=torch.float32)[:1]
    big = torch.full((1, 2), 1.0 + 2.0**-7, dtype=torch.bfloat16)
    assert torch.equal(oracle, big) and torch.equal(away, big)
    assert torch.equal(even, torch.ones(1, 2, dtype=torch.bfloat16))
    assert torch.equal(one, big) and torch.equal(fp32, big)


def test_combine_partials_sums_groups_in_ascending_order():
    """fp32 rows 1, 2^-24, 2^-24 on ranks 0, 1, 2, one slot each. In rank order the partials
    add to 1 (1 + 2^-24 is a tie, to even, twice); with rank 0 the last group (groups 2, 0,
    1), 2^-24 + 2^-24 comes first and the sum is 1 + 2^-23."""
    args = _one_token([1.0, 2.0**-24, 2.0**-24], [0, 2, 4], world=3, dtype=torch.float32)
    (by_rank,) = reference.combine_partials(*args, weighted=False)[:1]
    (by_group,) = reference.combine_partials(*args, weighted=False, group_of_rank=[2, 0, 1])[:1]
    assert torch.equal(by_rank, torch.ones(1, 2))
    assert torch.equal(by_group, torch.full((1, 2), 1.0 + 2.0**-23))


def test_combine_partials_with_one_group_is_the_oracle():
    from ubep.testing import expert_fn, runtime_cases

    for case in runtime_cases(3):
        ins = [case.inputs(r) for r in range(3)]
        xs, idxs, ws = ([i[k] for i in ins] for k in range(3))
        d = reference.dispatch(xs, idxs, ws, case.num_experts)
        outs = [expert_fn(r.recv_x) for r in d]
        want = reference.combine(outs, d, idxs, ws, weighted=case.weighted)
        got = reference.combine_partials(outs, d, idxs, ws, weighted=case.weighted,
                                         group_of_rank=[7, 7, 7])
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), case


def test_combine_partials_needs_a_group_per_rank():
    import pytest

    args = _three_slots([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="group_of_rank has 3 entries for 2 ranks"):
        reference.combine_partials(*args, group_of_rank=[0, 1, 2])
