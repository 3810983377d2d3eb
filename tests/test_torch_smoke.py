import torch

from ubep.testing import make_routing, make_tokens, run_ranks


def _rank(rank, world, E, T, K, H):
    import ubep
    idx, w = make_routing(T, K, E, seed=rank)
    x = make_tokens(rank, T, H, torch.bfloat16)
    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=T) as buf:
        res = buf.dispatch(x, idx, w)
        y = buf.combine(res.recv_x, res.handle)
    return res.recv_x, res.recv_src_rank, res.recv_src_token, y


def test_smoke():
    out = run_ranks(_rank, 2, 4, 5, 2, 8)
    assert len(out) == 2
    print(out[0][1], out[0][2])
