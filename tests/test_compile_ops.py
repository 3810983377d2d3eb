"""`torch.compile(fullgraph=True)` of a function that calls `Buffer.dispatch`/`combine`:
one graph with the ubep operators, the eager result (no transformers needed; the MoE layer
is in tests/moe/test_compile.py)."""

import pytest
import torch

from ubep.testing import make_routing, make_tokens, run_ranks


def _compiled(rank, world, backend, direct):
    from torch._dynamo.testing import CompileCounterWithBackend

    import ubep

    with ubep.Buffer(num_experts=4 * world, hidden=16, max_tokens_per_rank=8, max_top_k=3,
                     backend=backend, direct=direct) as buf:
        scale = torch.arange(16.0) + rank

        def layer(x, idx, w):
            res = buf.dispatch(x, idx, w)
            return buf.combine(res.recv_x * scale, res.handle)

        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(layer, fullgraph=True, backend=counter)
        out = []
        for seed in range(2):                       # a second routing: no recompile
            x = make_tokens(rank, 6, 16, torch.float32, seed=seed)
            idx, w = make_routing(6, 3, 4 * world, kind="partial", seed=seed * 10 + rank)
            out.append((layer(x, idx, w), compiled(x, idx, w)))
        ops = [str(n.target) for g in counter.graphs for n in g.graph.nodes]
        return out, counter.frame_count, ops


@pytest.mark.parametrize("backend,direct", [("torch", False), ("shm", True)])
def test_fullgraph_compile_gives_the_eager_result(backend, direct):
    for out, frames, ops in run_ranks(_compiled, 2, backend, direct, timeout_s=300):
        assert frames == 1
        assert "ubep.dispatch" in ops and "ubep.combine" in ops
        for eager, compiled in out:
            assert torch.equal(eager, compiled)
