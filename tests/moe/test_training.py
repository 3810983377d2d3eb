"""Training through ubep: an `EPMoE` layer's gradients equal the original block's.

Each rank holds its own tokens. The original transformers block, run in one process on every
rank's tokens with `loss = sum_r <y_r, G_r>`, gives the reference gradients. With expert
parallelism each rank runs `EPMoE` on its tokens and calls `backward()` on its own `loss_r`:
then rank r's expert weights must hold the reference gradient of experts `[r*E/P, (r+1)*E/P)`,
its input the reference gradient of its tokens, and the router's gradients, summed over
ranks (as data parallelism would), the reference router gradient.
"""

import pytest
import torch

from ubep.testing import run_ranks


def _tokens(rank: int, shape=(2, 3, 64)):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _reference(arch, world):
    from ubep.moe import build_model, moe_blocks

    _, block = moe_blocks(build_model(arch))[0]
    block.train()
    ins = [_tokens(r) for r in range(world)]
    xs = [h.clone().requires_grad_() for h, _ in ins]
    loss = sum((block(x) * g).sum() for x, (_, g) in zip(xs, ins))
    loss.backward()
    grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    return [x.grad for x in xs], grads


def _ep(rank, world, arch, backend):
    import torch.distributed as dist

    import ubep
    from ubep.moe import EPMoE, build_model, moe_blocks

    _, block = moe_blocks(build_model(arch))[0]
    buf = ubep.Buffer(num_experts=16, hidden=64, max_tokens_per_rank=8, max_top_k=4,
                      backend=backend)
    layer = EPMoE(block, rank=rank, world_size=world, buffer=buf).train()
    h, g = _tokens(rank)
    x = h.clone().requires_grad_()
    (layer(x) * g).sum().backward()
    grads = {}
    for n, p in layer.named_parameters():
        if p.grad is None:
            continue
        if n.startswith("experts."):
            grads[n] = p.grad                      # this rank's slice
        else:                                      # replicated: summed over ranks
            total = p.grad.clone()
            dist.all_reduce(total)
            grads[n] = total
    buf.close()
    return x.grad, grads


@pytest.mark.parametrize("arch,backend", [("qwen3", "shm"), ("deepseek", "torch")])
def test_epmoe_gradients_equal_the_original_block(arch, backend):
    world = 2
    want_x, want = _reference(arch, world)
    got = run_ranks(_ep, world, arch, backend, timeout_s=300)
    per_rank = 16 // world
    for r, (gx, grads) in enumerate(got):
        torch.testing.assert_close(gx, want_x[r], rtol=1e-5, atol=1e-6)
        assert any(n.startswith("experts.") for n in grads) and "gate.weight" in grads
        for n, grad in grads.items():
            ref = want[n]
            if n.startswith("experts."):
                ref = ref[r * per_rank:(r + 1) * per_rank]
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6, msg=n)
