"""EP decoding on real processes equals the unsplit model: same token ids, close logits.

Each rank decodes its own batch (data-parallel attention, expert-parallel MoE). The
reference is the same seeded model, unsplit, on the same rank's prompts. Logit tolerance:
1e-4 absolute and relative in float32 (the EP path sums each token's K expert rows in
another order than transformers' grouped_mm, so the last bits differ; logits are O(1)).
"""

import pytest
import torch

from ubep.moe.e2e import UNSPLIT, E2EConfig, available_backends, e2e_rank
from ubep.moe.models import make_config
from ubep.testing import run_ranks

BACKENDS = ("gloo", "shm-bsp", "shm-ubep", "shm-direct", "shm-owned")
STEPS = 16
LOGIT_TOL = 1e-4


def _expected_ep_params(arch: str, world: int, params_full: int) -> int:
    """Parameter count once every MoE layer keeps E/P of its routed experts."""
    c = make_config(arch)
    if arch == "qwen3":
        num_experts, moe_layers = c.num_experts, c.num_hidden_layers
    else:
        num_experts = c.n_routed_experts
        moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size  # gate, up, down
    return params_full - moe_layers * (num_experts - num_experts // world) * per_expert


def _decode_all(arch: str, world: int, backends: tuple[str, ...], timeout_s: float):
    cfg = E2EConfig(arch=arch, size="tiny", batches=(3,), steps=STEPS, prompt_len=6,
                    backends=backends, seed=2, keep_logits=True, timeout_s=60.0)
    return run_ranks(e2e_rank, world, cfg, timeout_s=timeout_s)


def _check(reports, arch: str, world: int, backend: str) -> None:
    for rep in reports:
        runs = {r.backend: r.result for r in rep.runs}
        ref, ep = runs[UNSPLIT], runs[backend]
        assert ep.tokens.shape == (3, STEPS + 1)
        assert torch.equal(ep.tokens, ref.tokens), f"rank {rep.rank}: tokens differ"
        torch.testing.assert_close(ep.logits, ref.logits, rtol=LOGIT_TOL, atol=LOGIT_TOL)
        assert (ep.comm_s > 0).all()
        # only this rank's experts are held
        assert rep.params_ep == _expected_ep_params(arch, world, rep.params_full)
        assert rep.local_experts_per_layer and all(
            n == rep.num_experts // world for n in rep.local_experts_per_layer)
    # ranks decode different prompts, so tokens crossed ranks in dispatch, not just locally
    assert not torch.equal(reports[0].runs[0].result.tokens, reports[1].runs[0].result.tokens)


@pytest.fixture(scope="module", params=["qwen3", "deepseek"])
def two_rank_reports(request):
    """One P = 2 run per architecture through every backend built here."""
    backends = tuple(b for b in BACKENDS if b in available_backends())
    return request.param, _decode_all(request.param, 2, backends, timeout_s=240.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ep_decode_matches_unsplit_p2(two_rank_reports, backend):
    arch, reports = two_rank_reports
    if backend not in available_backends():
        pytest.skip(f"{backend}: the shm runtime is not registered in ubep.runtime.backend_names() "
                    f"in this build")
    _check(reports, arch, 2, backend)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek"])     # shared experts and dense layers too
def test_ep_decode_matches_unsplit_p4(arch):
    backends = tuple(b for b in ("gloo", "shm-ubep") if b in available_backends())
    reports = _decode_all(arch, 4, backends, timeout_s=600.0)
    for backend in backends:
        _check(reports, arch, 4, backend)
