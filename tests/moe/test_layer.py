"""Single-process checks of the EP layer, the model builders and the decode loop."""

import pytest
import torch

from ubep.moe import (
    EPMoE,
    buffer_for,
    build_model,
    convert_to_ep,
    ep_layers,
    greedy_decode,
    make_prompts,
    moe_blocks,
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek"])
def test_build_model_is_seeded(arch):
    a, b = build_model(arch, seed=3), build_model(arch, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(_bytes(sa[k]), _bytes(sb[k])), k
    c = build_model(arch, seed=4)
    name = next(n for n in sa if n.endswith("experts.gate_up_proj"))
    assert not torch.equal(sa[name], c.state_dict()[name])


def test_deepseek_router_bias_is_set():
    model = build_model("deepseek")
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)


def test_bad_arch_and_size():
    with pytest.raises(ValueError, match="arch='mixtral'"):
        build_model("mixtral")
    with pytest.raises(ValueError, match="size='huge'"):
        build_model("qwen3", "huge")


@pytest.mark.parametrize("arch", ["qwen3", "deepseek"])
def test_experts_change_the_tokens(arch):
    """The routed experts must matter, or a token-equality test of EP checks nothing."""
    model = build_model(arch)
    prompts = make_prompts(model.config.vocab_size, 2, 8)
    base = greedy_decode(model, prompts, 8)
    for _, block in moe_blocks(model):
        with torch.no_grad():
            block.experts.down_proj.zero_()
    assert not torch.equal(base.tokens, greedy_decode(model, prompts, 8).tokens)


@pytest.mark.parametrize("arch,rank", [("qwen3", 1), ("deepseek", 0)])
def test_epmoe_keeps_only_its_experts(arch, rank):
    model = build_model(arch)
    _, block = moe_blocks(model)[0]
    full_gate_up = block.experts.gate_up_proj.detach().clone()
    full_down = block.experts.down_proj.detach().clone()
    layer = EPMoE(block, rank=rank, world_size=2)
    e = full_gate_up.shape[0] // 2
    assert layer.num_local_experts == e and layer.experts.num_experts == e
    assert torch.equal(_bytes(layer.experts.gate_up_proj), _bytes(full_gate_up[rank * e:][:e]))
    assert torch.equal(_bytes(layer.experts.down_proj), _bytes(full_down[rank * e:][:e]))
    assert (layer.shared_experts is not None) == (arch == "deepseek")


def test_epmoe_rejects_bad_blocks_and_splits():
    model = build_model("qwen3")
    with pytest.raises(TypeError, match="MoE block"):
        EPMoE(model.model.layers[0].self_attn, rank=0, world_size=2)
    _, block = moe_blocks(model)[0]
    with pytest.raises(ValueError, match="world_size=3"):
        EPMoE(block, rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank=2"):
        EPMoE(block, rank=2, world_size=2)
    layer = EPMoE(block, rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="no Buffer"):
        layer(torch.zeros(1, 1, model.config.hidden_size))


def test_convert_needs_moe_blocks():
    with pytest.raises(ValueError, match="no MoE block"):
        convert_to_ep(torch.nn.Linear(4, 4), buffer=None)


def test_greedy_decode_rejects_bad_args():
    model = build_model("qwen3")
    with pytest.raises(ValueError, match="prompt_ids"):
        greedy_decode(model, torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="steps=-1"):
        greedy_decode(model, torch.zeros(1, 4, dtype=torch.int64), -1)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek"])
def test_one_rank_ep_decodes_like_the_model(arch, single_rank_group):
    """P = 1: the whole EP path (router, dispatch, grouped experts, combine) in-process."""
    model = build_model(arch, seed=1)
    prompts = make_prompts(model.config.vocab_size, 3, 6, seed=1)
    ref = greedy_decode(model, prompts, 12)
    with buffer_for(model, max_tokens_per_rank=3 * 6) as buf:
        assert (buf.num_experts, buf.config.hidden, buf.config.max_top_k) == (
            16, model.config.hidden_size, 4)
        convert_to_ep(model, buf)
        ep = greedy_decode(model, prompts, 12)
    assert len(ep_layers(model)) == len(moe_blocks(model))
    assert torch.equal(ep.tokens, ref.tokens)
    torch.testing.assert_close(ep.logits, ref.logits, rtol=1e-4, atol=1e-4)
    assert (ep.comm_s > 0).all() and (ep.experts_s > 0).all()
    assert (ep.comm_s + ep.experts_s < ep.step_s).all()


def test_greedy_decoder_call_order():
    from ubep.moe.decode import GreedyDecoder

    model = build_model("qwen3")
    dec = GreedyDecoder(model, make_prompts(model.config.vocab_size, 1, 4))
    with pytest.raises(RuntimeError, match="prefill"):
        dec.step()
    with pytest.raises(RuntimeError, match="prefill"):
        dec.result()
    dec.prefill()
    with pytest.raises(RuntimeError, match="already"):
        dec.prefill()
    dec.step()
    res = dec.result()
    assert res.tokens.shape == (1, 2) and res.step_s.shape == (1,) and res.logits.shape[1] == 2
    assert torch.equal(res.tokens, greedy_decode(model, dec.prompt_ids, 1).tokens)
