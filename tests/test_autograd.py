"""Gradients through dispatch and combine equal those of the same computation in pure torch.

Every rank computes `loss_r = <y_r, G_r>` after dispatch -> an expert function that uses
`recv_x`, `recv_weights` and a per-rank parameter -> combine, and calls `backward()`. The
oracle runs the same computation for all ranks at once with `ubep.reference` (written in
differentiable torch ops) on `sum_r loss_r`. Inputs are small dyadic numbers, so every sum is
exact in fp32 and the gradients must match bit for bit.
"""

import pytest
import torch

import ubep.reference as ref
from ubep.testing import run_ranks

E_PER_RANK, HIDDEN, TOP_K = 2, 8, 3


def _inputs(rank: int, world: int, num_tokens: int, seed: int):
    """Dyadic x, weights, expert scale and upstream gradient of `rank` (seeded)."""
    g = torch.Generator().manual_seed(seed * 101 + rank)
    E = E_PER_RANK * world
    x = torch.randint(-8, 9, (num_tokens, HIDDEN), generator=g).float() / 4
    idx = torch.rand(num_tokens, E, generator=g).argsort(dim=1)[:, :TOP_K]
    idx[torch.rand(num_tokens, TOP_K, generator=g) < 0.25] = -1      # some slots unrouted
    w = torch.randint(1, 8, (num_tokens, TOP_K), generator=g).float() / 8
    scale = torch.randint(-4, 5, (HIDDEN,), generator=g).float() / 2
    grad_y = torch.randint(-4, 5, (num_tokens, HIDDEN), generator=g).float() / 4
    return x, idx, w, scale, grad_y


def _expert(recv_x, recv_weights, scale, use_recv_weights):
    out = recv_x * scale + recv_x * recv_x / 8
    if use_recv_weights:
        out = out + recv_weights.unsqueeze(1) * recv_x
    return out


def _tokens(world):
    return [5 + 2 * r for r in range(world)]


def _oracle(world, seed, weighted, use_recv_weights):
    ins = [_inputs(r, world, _tokens(world)[r], seed) for r in range(world)]
    xs = [i[0].clone().requires_grad_() for i in ins]
    ws = [i[2].clone().requires_grad_() for i in ins]
    scales = [i[3].clone().requires_grad_() for i in ins]
    idxs = [i[1] for i in ins]
    d = ref.dispatch(xs, idxs, ws, E_PER_RANK * world)
    outs = [_expert(d[r].recv_x, d[r].recv_weights, scales[r], use_recv_weights)
            for r in range(world)]
    ys = ref.combine(outs, d, idxs, ws, weighted=weighted)
    loss = sum((y * i[4]).sum() for y, i in zip(ys, ins))
    loss.backward()
    return [dict(y=ys[r].detach(), gx=xs[r].grad, gw=ws[r].grad, gs=scales[r].grad)
            for r in range(world)]


VARIANTS = [(True, False), (False, True), (True, True)]   # (weighted, use_recv_weights)


def _ranks(rank, world, backend, seed):
    import ubep

    out = []
    with ubep.Buffer(num_experts=E_PER_RANK * world, hidden=HIDDEN, max_tokens_per_rank=16,
                     max_top_k=TOP_K, backend=backend) as buf:
        assert backend != "auto" or buf.config.direct == "owned"
        for weighted, use_recv_weights in VARIANTS + VARIANTS[:1]:  # again: Buffer reuse
            x, idx, w, scale, grad_y = _inputs(rank, world, _tokens(world)[rank], seed)
            x.requires_grad_()
            w.requires_grad_()
            scale.requires_grad_()
            res = buf.dispatch(x, idx, w)
            assert res.recv_x.grad_fn is not None
            expert_out = _expert(res.recv_x, res.recv_weights, scale, use_recv_weights)
            y = buf.combine(expert_out, res.handle, weighted=weighted)
            assert y.grad_fn is not None
            (y * grad_y).sum().backward()
            out.append(dict(y=y.detach(), gx=x.grad, gw=w.grad, gs=scale.grad))
    return out


@pytest.mark.parametrize("world,backend", [(2, "torch"), (3, "torch"), (2, "shm"), (3, "shm"),
                                           (2, "auto"), (3, "auto")])   # auto: direct="owned"
def test_gradients_match_reference(world, backend):
    got = run_ranks(_ranks, world, backend, 1)
    for i, variant in enumerate(VARIANTS + VARIANTS[:1]):
        want = _oracle(world, 1, *variant)
        for r in range(world):
            for k in ("y", "gx", "gw", "gs"):
                assert torch.equal(got[r][i][k], want[r][k]), (variant, r, k)


def _mixed(rank, world):
    """x without grad (eager path), expert parameters with grad: only combine is an op."""
    import ubep

    with ubep.Buffer(num_experts=E_PER_RANK * world, hidden=HIDDEN, max_tokens_per_rank=16,
                     max_top_k=TOP_K, backend="shm") as buf:
        x, idx, w, scale, grad_y = _inputs(rank, world, _tokens(world)[rank], 2)
        scale.requires_grad_()
        res = buf.dispatch(x, idx, w)
        assert res.recv_x.grad_fn is None
        y = buf.combine(_expert(res.recv_x, res.recv_weights, scale, False), res.handle)
        (y * grad_y).sum().backward()
        return scale.grad


def test_gradient_to_expert_parameters_only():
    want = _oracle(2, 2, True, False)
    got = run_ranks(_mixed, 2)
    for r in range(2):
        assert torch.equal(got[r], want[r]["gs"])


def _direct_refuses(rank, world):
    import ubep

    with ubep.Buffer(num_experts=4, hidden=HIDDEN, max_tokens_per_rank=16, max_top_k=TOP_K,
                     backend="shm", direct=True) as buf:
        x, idx, w, _, _ = _inputs(rank, world, 4, 3)
        try:
            buf.dispatch(x.requires_grad_(), idx, w)
        except ValueError as e:
            msg = str(e)
        else:
            msg = ""
        with torch.no_grad():                   # the Buffer is still usable
            res = buf.dispatch(x, idx, w)
            y = buf.combine(res.recv_x.clone(), res.handle, weighted=False)
        return msg, y.shape


def test_direct_refuses_gradients_clearly():
    for msg, shape in run_ranks(_direct_refuses, 2):
        assert "Buffer(direct=True) cannot carry gradients" in msg
        assert shape == (4, HIDDEN)
