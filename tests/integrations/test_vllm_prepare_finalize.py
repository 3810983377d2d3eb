"""`UbepPrepareAndFinalize` in-process on 2 ranks, through vLLM's own interface classes.

One MoE layer: prepare (dispatch) -> per-row expert matmuls -> finalize (combine into the
output tensor), under linear and round-robin expert maps, both weight-and-reduce rules and
both ubep backends; the output must match the layer computed without expert parallelism.
With `ubep.native` built (`make test-vllm` builds it), prepare's dispatches go through its
compiled door once their shape has run (on the torch backend a shape includes how many tokens
ride the first collective, the previous call's most: the third call here). Where the extension
is required (`UBEP_REQUIRE_NATIVE=1`, as `make test-vllm` sets) or loads, every Buffer here
must open its door and the door must take calls; only with it off are those checks skipped.
"""

import os

import pytest
import torch

from ubep.testing import run_ranks

pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds its venv)")

E, H, K = 8, 32, 2


def _owner(placement: str, world: int) -> list[int]:
    per = E // world
    return [g // per if placement == "linear" else g % world for g in range(E)]


def _inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(5 + rank, H, generator=g)
    logits = torch.randn(5 + rank, E, generator=g)
    w, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return x, ids.to(torch.int32), w / w.sum(dim=-1, keepdim=True)


def _experts() -> torch.Tensor:
    return torch.randn(E, H, H, generator=torch.Generator().manual_seed(7)) / H**0.5


def _layer(rank, world, combos):
    import torch.distributed as dist
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceContiguous,
        TopKWeightAndReduceNoOP,
    )

    import ubep
    from ubep.integrations.vllm.prepare_finalize import UbepPrepareAndFinalize
    from ubep.native import load_native, status
    from ubep.testing import Counted

    # the door is checked wherever ubep.native is required or built; skipped only with it off
    native = bool(os.environ.get("UBEP_REQUIRE_NATIVE")) or load_native() is not None

    x, ids, w = _inputs(rank)
    experts = _experts()
    outs = []
    for placement, rule, backend in combos:
        owner = _owner(placement, world)
        held = [g for g in range(E) if owner[g] == rank]
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[held] = torch.arange(len(held), dtype=torch.int32)
        with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=8, max_top_k=K,
                         backend=backend) as buf:
            door = comb = None
            if native:                      # count the compiled calls
                assert buf._door is not None, (backend, status())
                door = buf._door_dispatch = Counted(buf._door_dispatch)
                comb = buf._door_combine = Counted(buf._door_combine)
            pf = UbepPrepareAndFinalize(buf, dist.group.WORLD)
            for _ in range(3):   # the later calls reuse the gathered placement
                a, scale, meta, rows_ids, rows_w = pf.prepare(
                    x, w, ids, E, expert_map, False, FUSED_MOE_UNQUANTIZED_CONFIG, False)
                assert scale is None and rows_ids.shape == (a.shape[0], 1)
                assert rows_ids.dtype == ids.dtype and rows_w.shape == (a.shape[0], 1)
                # every row's expert is held here, and the counts describe the rows
                assert bool((expert_map[rows_ids.view(-1).long()] >= 0).all())
                assert int(meta.expert_num_tokens.sum()) == a.shape[0]
                rows = torch.bmm(a.unsqueeze(1), experts[rows_ids.view(-1).long()]).squeeze(1)
                if rule == "noop":        # experts that weight (and reduce) their rows
                    rows = rows * rows_w
                    impl = TopKWeightAndReduceNoOP()
                else:
                    impl = TopKWeightAndReduceContiguous()
                out = torch.full_like(x, float("nan"))
                pf.finalize(out, rows, w, ids, False, impl)
            outs.append(out)
            assert pf.num_dispatches == pf.num_combines == 3
            if native:              # finalize's combine into vLLM's output too
                assert door.took >= 1, (placement, rule, backend, door.declined)
                assert comb.took >= 1, (placement, rule, backend, comb.declined)
    return outs


def test_one_moe_layer_through_ubep_matches_no_expert_parallelism():
    combos = [(p, r, b) for p in ("linear", "round_robin") for r in ("noop", "contiguous")
              for b in ("shm", "torch")]
    per_rank = run_ranks(_layer, 2, combos, timeout_s=240)
    experts = _experts()
    head = torch.randn(H, 512, generator=torch.Generator().manual_seed(3))
    for rank in range(2):
        x, ids, w = _inputs(rank)
        want = torch.einsum("tk,tkh->th", w,
                            torch.einsum("th,tkhj->tkj", x, experts[ids.long()]))
        for combo, got in zip(combos, per_rank[rank]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(combo))
            # the check the end-to-end test makes on tokens: same greedy pick
            assert torch.equal((got @ head).argmax(-1), (want @ head).argmax(-1)), combo
