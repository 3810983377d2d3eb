"""`ubep.compat.deep_ep.Buffer` passes the checks of DeepEP's own tests, re-created on CPU ranks.

`_intranode` follows DeepEP's `tests/test_intranode.py` (layout, normal dispatch with and
without top-k, bf16 / random / fp8 rows, `num_worst_tokens`, cached dispatch, unweighted
combine of rows and weights), `_low_latency` its `tests/test_low_latency.py` (padded layout,
counts, source info and layout ranges, bf16 and fp8 with and without rounded scales, weighted
combine with and without zero copy). On top of DeepEP's checks, every received row is
compared bit for bit with the row its source sent (all rows gathered), and the token index
is encoded in the payload.
"""

import pytest
import torch
import torch.distributed as dist

from ubep.testing import run_ranks

HIDDEN = 256


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure: 1 - cosine similarity of (x + 1, y + 1), in fp64."""
    a, b = x.double() + 1, y.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def _intranode(rank, world, backend="torch"):
    from ubep.compat import deep_ep
    from ubep.quant import per_token_cast_back, per_token_cast_to_fp8

    torch.manual_seed(rank)
    num_tokens, num_topk, num_experts = 9, 3, 4 * world
    per_rank = num_experts // world
    buffer = deep_ep.Buffer(None, int(1e9), 0, backend=backend, max_tokens_per_rank=64)
    x = torch.ones(num_tokens, HIDDEN, dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn(num_tokens, HIDDEN, dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)
    scores = torch.randn(num_tokens, num_experts).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False)[1]
    topk_idx[0, 1] = -1                                   # one unrouted slot
    topk_weights = torch.ones(num_tokens, num_topk) * rank
    topk_weights_pure_rand = torch.randn(num_tokens, num_topk)

    # the layout, by hand
    rank_of = torch.where(topk_idx >= 0, topk_idx // per_rank, -1)
    is_token_in_rank = torch.stack([(rank_of == r).any(1) for r in range(world)], dim=1)
    num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
    num_tokens_per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)])
    num_tokens_per_expert = num_tokens_per_expert.to(torch.int32)
    gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_num_tokens_per_rank)
    gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_num_tokens_per_expert)

    ref_rank, rdma, ref_expert, ref_in_rank, event = buffer.get_dispatch_layout(
        topk_idx, num_experts)
    assert rdma is None
    assert torch.equal(ref_rank, num_tokens_per_rank)
    assert torch.equal(ref_expert, num_tokens_per_expert)
    assert torch.equal(ref_in_rank, is_token_in_rank)

    def check_data(check_x, rank_prefix_matrix):
        assert torch.equal(check_x.amin(dim=1), check_x.amax(dim=1))
        start = 0
        for i in range(world):
            end = int(rank_prefix_matrix[i][rank])
            assert int((check_x[start:end, :].int() - i).sum()) == 0
            start = end

    checked = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    args = dict(x=current_x, num_tokens_per_rank=num_tokens_per_rank,
                                is_token_in_rank=is_token_in_rank,
                                num_tokens_per_expert=num_tokens_per_expert,
                                config=deep_ep.Config(20, 8, 256), async_finish=async_mode)
                    if with_topk:
                        args.update(topk_idx=topk_idx, topk_weights=(
                            topk_weights_pure_rand if current_x is x_pure_rand else topk_weights))
                    if previous_mode:
                        args.update(previous_event=buffer.capture())
                    recv_x, recv_topk_idx, recv_topk_weights, num_list, handle, event = \
                        buffer.dispatch(**args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x

                    rank_prefix_matrix = handle[0]
                    assert int(gbl_num_tokens_per_rank[rank]) == recv_x.size(0)
                    assert gbl_num_tokens_per_expert.view(world, -1)[rank].tolist() == num_list
                    if current_x is not x_pure_rand:
                        check_data(recv_x, rank_prefix_matrix)
                    else:          # bit for bit: row i is token recv_src_idx[i] of its source
                        everyone = _gather(x_pure_rand, world)
                        src_rank = torch.repeat_interleave(
                            torch.arange(world),
                            torch.diff(rank_prefix_matrix[:, rank], prepend=torch.zeros(1)).long())
                        want = torch.stack([everyone[s][t] for s, t in
                                            zip(src_rank.tolist(), handle[3].tolist())]) \
                            if recv_x.size(0) else recv_x
                        assert torch.equal(recv_x, want)
                    recv_topk_weights_clone = None
                    if with_topk:
                        assert int((recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (
                            recv_topk_idx < per_rank))).sum()) == recv_topk_idx.numel()
                        for i, count in enumerate(num_list):
                            assert int(recv_topk_idx.eq(i).sum()) == count
                        recv_topk_weights_clone = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:
                            recv_topk_weights[recv_topk_idx.eq(-1)] = recv_topk_weights.amax(
                                dim=1, keepdim=True).expand_as(recv_topk_weights)[
                                    recv_topk_idx.eq(-1)]
                            check_data(recv_topk_weights, rank_prefix_matrix)

                        # num_worst_tokens: padded outputs, empty list, same rows first
                        worst = num_tokens * world
                        w_x, w_idx, w_w, empty, _, event = buffer.dispatch(
                            **args, num_worst_tokens=worst)
                        w_x = per_token_cast_back(*w_x) if isinstance(w_x, tuple) else w_x
                        assert len(empty) == 0
                        assert worst == w_x.size(0) == w_idx.size(0) == w_w.size(0)
                        assert torch.equal(recv_x, w_x[:recv_x.size(0)])
                        assert torch.equal(recv_topk_idx, w_idx[:recv_x.size(0)])
                        assert torch.equal(recv_topk_weights_clone, w_w[:recv_x.size(0)])
                        assert bool(torch.all(w_idx[recv_x.size(0):] == -1))
                    else:          # cached dispatch: the handle's layout, no top-k
                        cached_args = dict(x=current_x, handle=handle, async_finish=async_mode)
                        if previous_mode:
                            cached_args.update(previous_event=buffer.capture())
                        again, none1, none2, none3, none4, event = buffer.dispatch(**cached_args)
                        assert none1 is none2 is none3 is none4 is None
                        again = per_token_cast_back(*again) if isinstance(again, tuple) else again
                        assert torch.equal(again, recv_x)

                    combine_args = dict(x=recv_x, handle=handle, async_finish=async_mode)
                    if with_topk:
                        combine_args.update(topk_weights=recv_topk_weights)
                    if previous_mode:
                        combine_args.update(previous_event=buffer.capture())
                    combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                    check_x = combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    assert calc_diff(check_x, ref_x) < 5e-6
                    if with_topk:
                        check_w = combined_topk_weights if current_x is x_pure_rand else (
                            combined_topk_weights / is_token_in_rank.sum(dim=1).unsqueeze(1))
                        ref_w = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        ref_w = torch.where(topk_idx >= 0, ref_w, 0.0) \
                            if current_x is x_pure_rand else ref_w
                        assert calc_diff(check_w, ref_w) < 1e-9
                    checked += 1
    buffer.destroy()
    return checked


@pytest.mark.parametrize("world,backend", [(2, "torch"), (3, "torch"), (2, "shm")])
def test_intranode_checks_of_deep_ep(world, backend):
    assert run_ranks(_intranode, world, backend, timeout_s=300) == [24] * world


def _low_latency(rank, world, backend="torch"):
    from ubep.compat import deep_ep
    from ubep.quant import per_token_cast_back

    torch.manual_seed(rank)
    num_tokens, num_topk, num_experts = 6, 3, 4 * world
    num_local_experts = num_experts // world
    buffer = deep_ep.Buffer(None, 0, int(1e9), low_latency_mode=True,
                            num_qps_per_rank=num_local_experts, backend=backend)
    rank_offset = 128
    x = torch.ones(num_tokens, HIDDEN, dtype=torch.bfloat16) * (rank - rank_offset)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    x_list = [x, torch.randn(num_tokens, HIDDEN, dtype=torch.bfloat16) * 0.1]
    scores = torch.randn(num_tokens, num_experts).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1]
    topk_weights = torch.randn(num_tokens, num_topk).abs()
    topk_idx[1, 2] = -1
    topk_idx[4, 0] = -1
    all_topk_idx = torch.stack(_gather(topk_idx, world))

    checked = 0
    for current_x in x_list:
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                for round_scale in ((False, True) if use_fp8 else (False,)):
                    stats = torch.zeros(num_local_experts, dtype=torch.int)
                    packed_recv_x, packed_recv_count, handle, event, hook = \
                        buffer.low_latency_dispatch(
                            current_x, topk_idx, num_tokens, num_experts, use_fp8=use_fp8,
                            round_scale=round_scale, cumulative_local_expert_recv_stats=stats,
                            async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
                    hook() if return_recv_hook else event.current_stream_wait()
                    shape = (num_local_experts, world * num_tokens, HIDDEN)
                    if use_fp8:
                        packed_recv_x = (packed_recv_x[0], packed_recv_x[1].contiguous())
                        assert packed_recv_x[0].shape == shape
                        assert packed_recv_x[0].dtype == torch.float8_e4m3fn
                        simulated_gemm_x = per_token_cast_back(
                            packed_recv_x[0].view(-1, HIDDEN),
                            packed_recv_x[1].view(-1, HIDDEN // 128)).view(shape)
                    else:
                        assert packed_recv_x.shape == shape
                        simulated_gemm_x = packed_recv_x.clone()
                    for i in range(num_local_experts):
                        expert_id = rank * num_local_experts + i
                        recv_x = per_token_cast_back(packed_recv_x[0][i], packed_recv_x[1][i]) \
                            if use_fp8 else packed_recv_x[i]
                        recv_count, src_info, layout_range = (
                            packed_recv_count[i], handle[0][i], handle[1][i])
                        int_mask = (2 ** 32) - 1
                        n_valid = int(recv_count)
                        assert int(stats[i]) == n_valid
                        assert n_valid == int((layout_range & int_mask).sum())
                        assert n_valid == int((all_topk_idx == expert_id).sum())
                        if n_valid == 0 or current_x is not x:
                            continue
                        recv_x = recv_x[:n_valid]
                        amin = recv_x[:, :-128].amin(dim=-1)
                        src_info = src_info[:n_valid]
                        assert torch.equal(amin, recv_x[:, :-128].amax(dim=-1))
                        if round_scale:
                            assert calc_diff(recv_x[:, -1], src_info.view(-1)) < 0.007
                        else:
                            assert int((recv_x[:, -128:] - src_info.view(-1, 1) % num_tokens
                                        ).sum()) == 0
                        for j in range(world):
                            begin = int(layout_range[j] >> 32)
                            count = int(layout_range[j] & int_mask)
                            if not round_scale:
                                assert int((amin == j - rank_offset).sum()) == int(
                                    (all_topk_idx[j] == expert_id).sum())
                                assert int((recv_x[begin:begin + count, :-128] - j + rank_offset
                                            ).sum()) == 0
                    for zero_copy in (False, True):
                        if zero_copy:
                            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = \
                                simulated_gemm_x
                        out = torch.empty(num_tokens, HIDDEN, dtype=torch.bfloat16)
                        combined_x, event, hook = buffer.low_latency_combine(
                            simulated_gemm_x, topk_idx, topk_weights, handle,
                            async_finish=not return_recv_hook, zero_copy=zero_copy,
                            return_recv_hook=return_recv_hook, out=out)
                        hook() if return_recv_hook else event.current_stream_wait()
                        assert combined_x.data_ptr() == out.data_ptr()
                        ref = current_x * topk_weights.masked_fill(topk_idx == -1, 0).sum(
                            dim=1).view(-1, 1)
                        assert int(torch.isnan(combined_x).sum()) == 0
                        if not round_scale:
                            diff = calc_diff(ref, combined_x)
                            assert diff < (9e-4 if use_fp8 else 1e-5), (diff, use_fp8, zero_copy)
                        checked += 1
    buffer.destroy()
    return checked


@pytest.mark.parametrize("world,backend", [(2, "torch"), (3, "torch"), (2, "shm")])
def test_low_latency_checks_of_deep_ep(world, backend):
    assert run_ranks(_low_latency, world, backend, timeout_s=300) == [24] * world


def _misuse(rank, world):
    from ubep.compat import deep_ep

    errors = []
    buffer = deep_ep.Buffer(None)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, -1], [1, 3], [-1, -1]])
    for call in (lambda: buffer.dispatch(x),                        # no layout, no handle
                 lambda: buffer.combine(x, ("not", "a", "handle")),
                 lambda: buffer.low_latency_dispatch(x, idx, 4, 4, use_ue8m0=True),
                 lambda: buffer.low_latency_dispatch(x, idx, 2, 4),
                 lambda: deep_ep.Buffer(None, comm=object()),
                 lambda: buffer.low_latency_dispatch(x.float().requires_grad_(), idx, 4, 4)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    buffer.destroy()
    return errors


def test_misuse_is_named():
    for errors in run_ranks(_misuse, 2):
        assert len(errors) == 6
        assert "num_tokens_per_rank is required" in errors[0]
        assert "handle must be the handle" in errors[1]
        assert "use_ue8m0" in errors[2]
        assert "num_max_dispatch_tokens_per_rank=2" in errors[3]
        assert "comm=" in errors[4]
        assert "does not carry gradients" in errors[5]
