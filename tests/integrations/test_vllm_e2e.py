"""End to end: vLLM with data parallel 2 + expert parallel through ubep generates the same
greedy tokens as one vLLM engine without expert parallelism (tiny seeded Qwen3-MoE, fp32)."""

import pytest

pytest.importorskip("vllm", reason="needs vLLM (make test-vllm builds its venv)")

from ubep.integrations.vllm.engine import (  # noqa: E402
    TINY_QWEN3_MOE,
    EngineRun,
    make_tiny_checkpoint,
    run_engines,
)

PROMPTS = ((1, 2, 3, 4), (10, 20, 30), (5, 6, 7, 8, 9), (100, 200, 300, 400, 7))
MAX_TOKENS = 8


def moe_layers(config: dict) -> int:
    """The MoE layers a Qwen3-MoE config builds, as its decoder decides (transformers' and
    vLLM's Qwen3-MoE): layer i is sparse unless in `mlp_only_layers`, when the model has
    experts and `(i + 1) % decoder_sparse_step == 0`."""
    dense = set(config.get("mlp_only_layers", ()))
    step = config.get("decoder_sparse_step", 1)
    return sum(1 for i in range(config["num_hidden_layers"])
               if i not in dense and config["num_experts"] > 0 and (i + 1) % step == 0)


@pytest.mark.timeout(1800)
def test_dp2_ep_through_ubep_generates_the_tokens_of_one_engine(tmp_path):
    """Also: every MoE layer of both ranks dispatched through ubep at least once per
    generation step (the prefill gives each request its first token, each decode step one
    more: `MAX_TOKENS` forwards; profiling and dummy forwards add to that), every layer of a
    rank as often as the others (a forward runs them all). Mutation: the plugin's prepare
    bypassed for some forwards (a count below the steps, or layers that differ)."""
    model = str(make_tiny_checkpoint(tmp_path / "tiny-qwen3-moe", seed=0))
    one = run_engines(EngineRun(model=model, dp=1, workloads=(PROMPTS,), max_tokens=MAX_TOKENS))
    ep = run_engines(EngineRun(model=model, dp=2, expert_parallel=True,
                               all2all_backend="ubep", workloads=(PROMPTS,),
                               max_tokens=MAX_TOKENS))
    want, got = one["workloads"][0]["tokens"], ep["workloads"][0]["tokens"]
    assert sorted(want) == list(range(len(PROMPTS)))
    assert all(len(t) == MAX_TOKENS for t in want.values())
    assert got == want
    # and the MoE layers really went through ubep, on both ranks, every forward
    assert sorted(ep["moe_layers"]) == [0, 1]
    for rank, layers in ep["moe_layers"].items():
        assert len(layers) == moe_layers(TINY_QWEN3_MOE), (rank, layers)
        for layer in layers:
            assert layer["prepare_finalize"] == "UbepPrepareAndFinalize", (rank, layer)
            assert layer["dispatches"] >= MAX_TOKENS, (rank, layer)
            assert layer["dispatches"] == layer["combines"], (rank, layer)
        assert len({layer["dispatches"] for layer in layers}) == 1, (rank, layers)
