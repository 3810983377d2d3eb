"""Outputs on kept memory (`OutputPool`): lent again only once nothing uses them.

The shm paths return `recv_x` and combine's output on memory a pool keeps (no page faults
per call); a result the caller still holds, or any view of it, must never be overwritten
by a later call. Checked on the pool alone and through Buffers against the oracle.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ubep.runtime.shm.outputs import OutputPool
from ubep.testing import Case, check_case, expert_fn, run_ranks


def test_a_held_output_is_not_lent_again():
    pool = OutputPool(keep=2, min_bytes=0)
    a = pool.empty(4, 8, torch.bfloat16)
    b = pool.empty(4, 8, torch.bfloat16)
    assert a.data_ptr() != b.data_ptr()
    c = pool.empty(4, 8, torch.bfloat16)            # both blocks lent: plain torch.empty
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr())
    pa = a.data_ptr()
    del a
    gc.collect()
    d = pool.empty(4, 8, torch.bfloat16)             # a's block is free again
    assert d.data_ptr() == pa


@pytest.mark.parametrize("keep_as", ["view", "numpy", "storage", "reshaped"])
def test_anything_on_an_output_keeps_its_block(keep_as):
    pool = OutputPool(keep=1, min_bytes=0)
    a = pool.empty(16, 32, torch.float32)
    a.fill_(3.0)
    if keep_as == "view":
        held = a[2:5]
    elif keep_as == "numpy":
        held = a.numpy()
    elif keep_as == "storage":
        held = a.untyped_storage()
    else:
        held = a.view(-1, 8)
    pa = a.data_ptr()
    del a
    gc.collect()
    b = pool.empty(16, 32, torch.float32)
    assert b.data_ptr() != pa
    b.fill_(7.0)
    if keep_as == "storage":
        held = torch.empty(0, dtype=torch.float32).set_(held)
    assert (torch.as_tensor(held) == 3.0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8,
                                   torch.uint8, torch.float8_e4m3fn])
def test_outputs_have_the_shape_and_dtype_asked_for(dtype):
    pool = OutputPool(min_bytes=0)
    t = pool.empty(5, 7, dtype)
    assert t.shape == (5, 7) and t.dtype == dtype and t.is_contiguous()
    assert pool.empty(0, 7, dtype).shape == (0, 7)


def test_a_larger_output_replaces_a_free_smaller_block_and_small_ones_stay_with_torch():
    pool = OutputPool(keep=1, min_bytes=1024)
    small = pool.empty(2, 2, torch.float32)          # 16 bytes: torch.empty, no block
    assert pool._blocks == []
    a = pool.empty(1024, 1024, torch.float32)        # 4 MiB
    del a
    gc.collect()
    big = pool.empty(2048, 1024, torch.float32)      # 8 MiB: the free block is replaced
    assert len(pool._blocks) == 1 and pool._blocks[0].nbytes >= big.numel() * 4
    big.fill_(1.0)
    assert small.shape == (2, 2)


# -- through Buffers: results held across later calls stay intact -------------------------------
CASES = [Case(num_experts=8, hidden=1024, top_k=4, tokens=(64, 48), seed=s, dtype=d)
         for s, d in ((1, "bf16"), (2, "fp32"), (3, "bf16"), (4, "fp16"))]


def _held(rank, world, workers):
    import ubep

    outs = []
    with ubep.Buffer(num_experts=8, hidden=1024, max_tokens_per_rank=64, backend="shm",
                     workers=workers, max_top_k=4, timeout_s=30) as buf:
        for case in CASES:                          # every result kept: none is a clone
            x, idx, w = case.inputs(rank)
            res = buf.dispatch(x, idx, w)
            y = buf.combine(expert_fn(res.recv_x), res.handle, weighted=case.weighted)
            outs.append({"recv_x": res.recv_x, "recv_weights": res.recv_weights,
                         "tokens_per_expert": res.tokens_per_expert,
                         "recv_src_rank": res.recv_src_rank,
                         "recv_src_token": res.recv_src_token,
                         "recv_src_slot": res.recv_src_slot, "y": y})
        # a dropped result's memory is lent again, a held one's is not
        ptrs = {o["recv_x"].data_ptr() for o in outs}
        x, idx, w = CASES[0].inputs(rank)
        again = buf.dispatch(x, idx, w)
        reused = again.recv_x.data_ptr() in ptrs
        buf.combine(again.recv_x, again.handle)
        lend = buf._backend._path._lend
        assert lend._blocks                          # blocks kept while open
    assert lend._blocks == []                        # close drops them; outs stay valid
    return outs, reused


@pytest.mark.parametrize("workers", [1, 2])
def test_results_held_across_calls_match_the_oracle(workers):
    outs = run_ranks(_held, 2, workers, timeout_s=120)
    for k, case in enumerate(CASES):
        check_case(case, [o[0][k] for o in outs])
    assert not any(o[1] for o in outs)


# -- calls out of strict alternation (`region.next_epoch`: the windows' parity) -------------------
def _seq_cases(sync):
    """Five cases, rows of 80, 160, 40 (int8/uint8) bytes; sp carries floats only."""
    third = "fp16" if sync == "sp" else "uint8"
    return [Case(num_experts=8, hidden=40, top_k=3, tokens=(12, 9), seed=s, dtype=d)
            for s, d in ((11, "bf16"), (12, "fp32"), (13, third), (14, "bf16"), (15, "fp16"))]


def _sequences(rank, world, kw):
    """Dispatches and combines in orders other than strict alternation: two dispatches
    outstanding then both combined, a handle combined twice, dispatch-only runs; rows of a
    different size on every call. Every result kept and returned for the oracle."""
    import ubep

    cases = _seq_cases(kw["sync"])
    outs = []
    with ubep.Buffer(num_experts=8, hidden=40, max_tokens_per_rank=12, backend="shm",
                     max_top_k=3, timeout_s=30, **kw) as buf:
        epochs = []

        def dispatch(k):
            x, idx, w = cases[k].inputs(rank)
            res = buf.dispatch(x, idx, w)
            epochs.append(("d", res.stats.extra["epoch"]))
            return res

        def combine(k, res):
            y = buf.combine(expert_fn(res.recv_x), res.handle, weighted=cases[k].weighted)
            epochs.append(("c", buf.last_stats.extra["epoch"]))
            return y

        def keep(k, res, y):
            outs.append((k, {"recv_x": res.recv_x, "recv_weights": res.recv_weights,
                             "tokens_per_expert": res.tokens_per_expert,
                             "recv_src_rank": res.recv_src_rank,
                             "recv_src_token": res.recv_src_token,
                             "recv_src_slot": res.recv_src_slot, "y": y}))

        a, b = dispatch(0), dispatch(1)                 # D D C C
        keep(0, a, combine(0, a))
        keep(1, b, combine(1, b))
        c = dispatch(2)                                 # D C C(again) D C
        keep(2, c, combine(2, c))
        keep(2, c, combine(2, c))
        d = dispatch(3)
        dispatch(4)                                     # D D D C (the last two dropped)
        dispatch(0)
        keep(3, d, combine(3, d))
        e = dispatch(4)                                 # and back to alternation
        keep(4, e, combine(4, e))
        a = dispatch(0)
        keep(0, a, combine(0, a))
    # every call of a kind takes the next epoch (the other parity), whatever came between
    last = {}
    for kind, epoch in epochs:
        if kind in last:
            assert epoch == last[kind] + 1, epochs
        last[kind] = epoch
    return outs


@pytest.mark.parametrize("kw", [dict(workers=1, sync="tff"), dict(workers=1, sync="sp"),
                                dict(workers=1, sync="dc", mode="bsp"),
                                dict(workers=2, sync="sw")])
def test_calls_out_of_alternation_match_the_oracle(kw):
    outs = run_ranks(_sequences, 2, kw, timeout_s=120)
    assert len(outs[0]) == len(outs[1]) == 7
    cases = _seq_cases(kw["sync"])
    for (k, o0), (k1, o1) in zip(outs[0], outs[1]):
        assert k == k1
        check_case(cases[k], [o0, o1])
