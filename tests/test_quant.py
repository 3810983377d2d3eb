"""fp8 rows with their scales, and cached re-dispatch (`handle=`), in the native API.

Checked against the oracle: the fp8 rows (as bytes) and the scales each land exactly where
`ubep.reference.dispatch` puts them; a re-dispatch with `handle=` lands rows in the original
dispatch's order.
"""

import pytest
import torch

import ubep.reference as ref
from ubep.quant import per_token_cast_back, per_token_cast_to_fp8
from ubep.testing import make_routing, make_tokens, run_ranks

HIDDEN, E_PER_RANK, TOP_K = 256, 2, 3


def _inputs(rank, world):
    x = make_tokens(rank, 4 + 3 * rank, HIDDEN, torch.float32, seed=5)
    idx, w = make_routing(x.shape[0], TOP_K, E_PER_RANK * world, kind="partial", seed=rank)
    return x, idx, w


def _ranks(rank, world, backend):
    import os

    import ubep

    if backend == "hybrid":
        os.environ["UBEP_SHM_DOMAIN"] = f"host{rank}"   # each rank a host of its own
    x, idx, w = _inputs(rank, world)
    x_fp8, scales = per_token_cast_to_fp8(x)
    with ubep.Buffer(num_experts=E_PER_RANK * world, hidden=HIDDEN, max_tokens_per_rank=16,
                     max_top_k=TOP_K, backend=backend) as buf:
        res = buf.dispatch((x_fp8, scales), idx, w)
        again = buf.dispatch(x, handle=res.handle)               # cached: same order
        again_q = buf.dispatch((x_fp8, scales), handle=again.handle)
        y = buf.combine(per_token_cast_back(res.recv_x, res.recv_x_scales, torch.float32),
                        res.handle, weighted=False)
        try:
            buf.dispatch(x, idx, w, handle=res.handle)
        except ValueError as e:
            both = str(e)
        return dict(recv=res.recv_x.view(torch.uint8), scales=res.recv_x_scales,
                    again=again.recv_x, again_q=again_q.recv_x.view(torch.uint8),
                    again_s=again_q.recv_x_scales, y=y, both=both)


@pytest.mark.parametrize("backend", ["torch", "shm", "hybrid"])
def test_scales_travel_with_their_rows_and_handle_redispatches(backend):
    world = 2
    ins = [_inputs(r, world) for r in range(world)]
    q = [per_token_cast_to_fp8(x) for x, _, _ in ins]
    idxs, ws = [i for _, i, _ in ins], [w for _, _, w in ins]
    want_rows = ref.dispatch([a for a, _ in q], idxs, ws, E_PER_RANK * world)
    want_scales = ref.dispatch([s for _, s in q], idxs, ws, E_PER_RANK * world)
    want_x = ref.dispatch([x for x, _, _ in ins], idxs, ws, E_PER_RANK * world)
    deq = [per_token_cast_back(a, s, torch.float32) for a, s in q]
    want_y = ref.combine([per_token_cast_back(d.recv_x, s.recv_x, torch.float32)
                          for d, s in zip(want_rows, want_scales)],
                         want_rows, idxs, ws, weighted=False)
    got = run_ranks(_ranks, world, backend)
    for r in range(world):
        g = got[r]
        assert torch.equal(g["recv"], want_rows[r].recv_x.view(torch.uint8))
        assert torch.equal(g["scales"], want_scales[r].recv_x)
        assert torch.equal(g["again"], want_x[r].recv_x)
        assert torch.equal(g["again_q"], g["recv"]) and torch.equal(g["again_s"], g["scales"])
        if backend == "hybrid":     # fp32 partials per host, summed in host order
            assert torch.allclose(g["y"], want_y[r], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(g["y"], want_y[r])
        assert "either handle=" in g["both"]
        # the cast itself: per 128 channels, within fp8's relative precision
        assert torch.allclose(deq[r], ins[r][0], rtol=0.07, atol=1e-3)
