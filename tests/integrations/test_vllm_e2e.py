"""End to end: vLLM with data parallel 2 + expert parallel through ubep generates the same
greedy tokens as one vLLM engine without expert parallelism (tiny seeded Qwen3-MoE, fp32)."""

import pytest

pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds its venv)")

from ubep.integrations.vllm.engine import EngineRun, make_tiny_checkpoint, run_engines  # noqa: E402

PROMPTS = ((1, 2, 3, 4), (10, 20, 30), (5, 6, 7, 8, 9), (100, 200, 300, 400, 7))


@pytest.mark.timeout(1800)
def test_dp2_ep_through_ubep_generates_the_tokens_of_one_engine(tmp_path):
    model = str(make_tiny_checkpoint(tmp_path / "tiny-qwen3-moe", seed=0))
    one = run_engines(EngineRun(model=model, dp=1, workloads=(PROMPTS,), max_tokens=8))
    ep = run_engines(EngineRun(model=model, dp=2, expert_parallel=True,
                               all2all_backend="ubep", workloads=(PROMPTS,), max_tokens=8))
    want, got = one["workloads"][0]["tokens"], ep["workloads"][0]["tokens"]
    assert sorted(want) == list(range(len(PROMPTS)))
    assert all(len(t) == 8 for t in want.values())
    assert got == want
    # and the MoE layers really went through ubep, on both ranks, every forward
    for rank, layers in ep["moe_layers"].items():
        assert len(layers) == 2, (rank, layers)
        for layer in layers:
            assert layer["prepare_finalize"] == "UbepPrepareAndFinalize", (rank, layer)
            assert layer["dispatches"] > 0 and layer["dispatches"] == layer["combines"]
