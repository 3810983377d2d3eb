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
