"""Every input rule: a ValueError/TypeError naming the argument, and the Buffer stays usable."""

import pytest
import torch

import ubep
from ubep.testing import run_ranks

E, H, T, K = 8, 16, 4, 2


@pytest.fixture()
def buf(single_rank_group):
    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=T, max_top_k=4) as b:
        yield b


def _good():
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, -1], [7, 3], [-1, -1]])
    return x, idx, torch.rand(T, K)


def _bad_inputs():
    x, idx, w = _good()
    return [
        ("x must be 2-D", ValueError, (x[0], idx, w)),
        ("x must be a torch.Tensor", TypeError, (x.float().numpy(), idx, w)),
        ("hidden size 8", ValueError, (x[:, :8], idx, w)),
        ("more than max_tokens_per_rank", ValueError,
         (torch.randn(T + 1, H), torch.zeros(T + 1, K, dtype=torch.int64), torch.rand(T + 1, K))),
        ("x has dtype torch.float64", TypeError, (x.double(), idx, w)),
        ("topk_idx must be int32 or int64", TypeError, (x, idx.float(), w)),
        ("topk_idx has 3 rows", ValueError, (x, idx[:3], w)),
        ("expert id 8", ValueError, (x, torch.where(idx == 7, 8, idx), w)),
        ("expert id -2", ValueError, (x, torch.where(idx == 7, -2, idx), w)),
        ("names expert 0 twice", ValueError,
         (x, torch.tensor([[0, 0], [1, 2], [3, 4], [5, 6]]), w)),
        ("more than max_top_k", ValueError,
         (x, torch.arange(T * 5).view(T, 5) % E, torch.rand(T, 5))),
        ("topk_weights has shape", ValueError, (x, idx, w[:, :1])),
        ("topk_weights must be floating", TypeError, (x, idx, (w * 10).long())),
        ("topk_weights must be a torch.Tensor", TypeError, (x, idx, [[1.0]])),
        ("one device", ValueError, (x, idx, w.to("meta"))),
    ]


@pytest.mark.parametrize("match, exc, args", _bad_inputs(),
                         ids=[m for m, _, _ in _bad_inputs()])
def test_dispatch_rejects_bad_input_and_stays_usable(buf, match, exc, args):
    with pytest.raises(exc, match=match):
        buf.dispatch(*args)
    res = buf.dispatch(*_good())            # the next good call works
    assert res.recv_x.shape == (5, H)


def test_combine_rejects_bad_input_and_stays_usable(buf):
    res = buf.dispatch(*_good())
    with pytest.raises(ValueError, match=r"must be \(5, 16\)"):
        buf.combine(res.recv_x[:4], res.handle)
    with pytest.raises(TypeError, match="floating dtype"):
        buf.combine(res.recv_x.to(torch.int32), res.handle)
    with pytest.raises(TypeError, match="handle must be the DispatchHandle"):
        buf.combine(res.recv_x, "handle")
    y = buf.combine(res.recv_x, res.handle)
    assert y.shape == (T, H) and y.dtype == torch.bfloat16


def test_handle_from_another_buffer_is_refused(buf):
    res = buf.dispatch(*_good())
    with ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=T) as other:
        with pytest.raises(ValueError, match="another Buffer"):
            other.combine(res.recv_x, res.handle)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(backend="nccl2"), ValueError, "backend='nccl2' is not one of"),
    (dict(mode="async"), ValueError, "mode='async'"),
    (dict(sync="flag"), ValueError, "sync='flag'"),
    (dict(schedule="greedy"), ValueError, "schedule='greedy'"),
    (dict(hidden=0), ValueError, "hidden=0 must be >= 1"),
    (dict(num_experts=2.5), TypeError, "num_experts must be an int"),
    (dict(workers=2, count_workers=2), ValueError, "count_workers=2 must be < workers=2"),
    (dict(timeout_s=0), ValueError, "timeout_s=0"),
])
def test_buffer_rejects_bad_options(single_rank_group, kwargs, exc, match):
    args = dict(num_experts=E, hidden=H, max_tokens_per_rank=T) | kwargs
    with pytest.raises(exc, match=match):
        ubep.Buffer(**args)


def test_lifecycle(single_rank_group):
    buf = ubep.Buffer(num_experts=E, hidden=H, max_tokens_per_rank=T)
    res = buf.dispatch(*_good())
    buf.close()
    buf.close()                              # idempotent
    assert buf.closed and "closed" in repr(buf)
    with pytest.raises(RuntimeError, match="cannot dispatch after close"):
        buf.dispatch(*_good())
    with pytest.raises(RuntimeError, match="cannot combine after close"):
        buf.combine(res.recv_x, res.handle)


def _indivisible(rank, world):
    import ubep

    try:
        ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_num_experts_must_divide_by_world():
    msgs = run_ranks(_indivisible, 3)
    assert all("num_experts=4 must be divisible by the group size 3" in m for m in msgs)


# -- tensors off the CPU (issue 18 item 10): refused by name and device, before any read ------
def _off_cpu(rank, world):
    import ubep

    errors = []
    with ubep.Buffer(num_experts=4, hidden=8, max_tokens_per_rank=4, max_top_k=2) as buf:
        x = torch.zeros(2, 8)
        idx = torch.tensor([[0, 1], [2, -1]])
        w = torch.ones(2, 2)
        for args in ((x.to("meta"), idx.to("meta"), w.to("meta")),
                     (x.to("meta").requires_grad_(), idx.to("meta"), w.to("meta"))):
            try:
                buf.dispatch(*args)
            except ValueError as e:
                errors.append(str(e))
        res = buf.dispatch(x, idx, w)                 # still usable
        for out in (res.recv_x.to("meta"), res.recv_x.to("meta").requires_grad_()):
            try:
                buf.combine(out, res.handle)
            except ValueError as e:
                errors.append(str(e))
        buf.combine(res.recv_x, res.handle)
    try:
        ubep.get_dispatch_layout(idx.to("meta"), 4, 2)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_tensors_off_cpu_are_refused_naming_the_device():
    for errors in run_ranks(_off_cpu, 2):
        assert len(errors) == 5, errors
        assert all("meta" in e for e in errors)
        assert "x is on device meta" in errors[0] and "x is on device meta" in errors[1]
        assert "expert_out is on device meta" in errors[2]
        assert "expert_out is on device meta" in errors[3]
        assert "topk_idx is a meta tensor" in errors[4]
