"""`torch.compile(fullgraph=True)` of `EPMoE`: one graph holding the ubep operators, and the
eager result, forward and backward, on real ranks.

The compile backend is "aot_eager": Dynamo, AOTAutograd (forward and backward graphs) and the
fake kernels, i.e. everything ubep must support; inductor's code generation takes minutes on
this host's two loaded cores and adds nothing ubep-specific (the ubep operators stay extern
calls). A compile counter checks that the layer compiled as exactly one graph.
"""

import pytest
import torch

from ubep.testing import run_ranks


def _layer(arch, rank, world, backend):
    import ubep
    from ubep.moe import EPMoE, build_model, moe_blocks

    model = build_model(arch)
    model.set_experts_implementation("grouped_mm")   # transformers' traceable experts
    _, block = moe_blocks(model)[0]
    buf = ubep.Buffer(num_experts=16, hidden=64, max_tokens_per_rank=16, max_top_k=4,
                      backend=backend)
    return EPMoE(block, rank=rank, world_size=world, buffer=buf), buf


def _compiled_equals_eager(rank, world, arch, backend, train):
    from torch._dynamo.testing import CompileCounterWithBackend

    (eager, b1), (comp, b2) = (_layer(arch, rank, world, backend) for _ in range(2))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(comp, fullgraph=True, backend=counter)
    g = torch.Generator().manual_seed(rank)
    out = []
    for shape in ((2, 3, 64),):
        h = torch.randn(*shape, generator=g)
        grad_y = torch.randn(*shape, generator=g)
        got = []
        for fn, mod in ((eager, eager), (compiled, comp)):
            mod.zero_grad()
            hh = h.clone().requires_grad_(train)
            with torch.set_grad_enabled(train):
                y = fn(hh)
            if train:
                (y * grad_y).sum().backward()
                grads = {n: p.grad.clone() for n, p in mod.named_parameters()
                         if p.grad is not None}
                got.append((y.detach(), hh.grad, grads))
            else:
                got.append((y, None, {}))
        out.append(got)
    graph_ops = [str(n.target) for gm in counter.graphs for n in gm.graph.nodes]
    b1.close()
    b2.close()
    return out, counter.frame_count, graph_ops


@pytest.mark.parametrize("arch,backend,train", [("qwen3", "shm", False),
                                                ("deepseek", "torch", True)])
def test_compiled_epmoe_matches_eager(arch, backend, train):
    per_rank = run_ranks(_compiled_equals_eager, 2, arch, backend, train, timeout_s=600)
    for out, frames, graph_ops in per_rank:
        assert frames == 1          # one graph: no break
        assert any("ubep.dispatch" in op for op in graph_ops), graph_ops
        assert any("ubep.combine" in op for op in graph_ops)
        for (ye, ge, pe), (yc, gc, pc) in out:
            assert torch.equal(ye, yc)
            if train:
                assert torch.equal(ge, gc)
                assert pe.keys() == pc.keys() and len(pe) >= 4    # router and experts
                for n in pe:
                    assert torch.equal(pe[n], pc[n]), n
