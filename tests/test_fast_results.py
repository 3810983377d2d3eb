"""The hot path's cheap result objects behave like the plain ones.

`DeferredStats` builds its `Stats` on first read; `new_handle` / `new_dispatch_result` leave
row origins and weights as numpy until read. Users must not be able to tell the difference.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import asdict

import numpy as np
import pytest
import torch

from ubep.handle import DispatchHandle, DispatchResult, new_dispatch_result, new_handle
from ubep.stats import DeferredStats, Interval, Stats


def _stats(op: str, t: float) -> Stats:
    return Stats(op=op, backend="shm", mode="ubep", rank=1, total_us=t,
                 phases_us={"send": t / 2}, intervals=[Interval(1, 0, "send", 0.0, t / 2)],
                 extra={"epoch": 3})


def test_deferred_stats_build_once_and_equal_the_plain_stats():
    calls = []

    def build(op, t):
        calls.append(op)
        return _stats(op, t)

    st = DeferredStats.of(build, "dispatch", 10.0)
    assert calls == []                               # nothing built yet
    assert st.total_us == 10.0 and st.phases_us == {"send": 5.0}
    assert st == _stats("dispatch", 10.0) and isinstance(st, Stats)
    assert calls == ["dispatch"]                     # built once
    st.total_us = 11.0                               # writable like Stats
    assert st.total_us == 11.0
    assert asdict(st)["total_us"] == 11.0
    assert "total_us=11.0" in repr(st)
    for clone in (pickle.loads(pickle.dumps(st)), copy.deepcopy(st)):
        assert type(clone) is Stats and clone == st
    assert st.busy_us_per_worker() == {(1, 0): 5.0}
    assert calls == ["dispatch"]


def test_lazy_result_fields_are_tensors_sharing_the_numpy_memory():
    origins = np.arange(6, dtype=np.int64).reshape(3, 2)
    weights = np.array([0.5, 0.25], np.float32)
    idx = torch.zeros(1, 2, dtype=torch.int64)
    h = new_handle(7, 1, 1, 2, 4, idx, torch.ones(1, 2), origins, state=None)
    r = new_dispatch_result(torch.zeros(2, 4), weights, torch.tensor([2]), h, None)
    assert isinstance(h, DispatchHandle) and isinstance(r, DispatchResult)
    assert "recv_weights" not in vars(r)
    assert torch.equal(r.recv_weights, torch.tensor([0.5, 0.25]))
    assert torch.equal(h.recv_src_rank, torch.tensor([0, 1]))
    assert torch.equal(h.recv_src_slot, torch.tensor([4, 5]))
    assert r.recv_src_token is h.recv_src_token           # the handle's tensors, as eagerly
    origins[1, 0] = 42                                     # same memory, no copy
    assert int(r.recv_src_token[0]) == 42
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = r.nope
    with pytest.raises(AttributeError):
        _ = h.nope


def test_tokens_per_expert_given_as_numpy_is_an_int64_tensor_on_read():
    idx = torch.zeros(1, 2, dtype=torch.int64)
    h = new_handle(7, 1, 1, 2, 4, idx, torch.ones(1, 2), np.zeros((3, 2), np.int64), state=None)
    tpe = np.array([2, 0], np.int64)
    r = new_dispatch_result(torch.zeros(2, 4), np.ones(2, np.float32), tpe, h, None)
    assert "tokens_per_expert" not in vars(r)
    assert r.tokens_per_expert.dtype == torch.int64
    assert torch.equal(r.tokens_per_expert, torch.tensor([2, 0]))
    assert r.tokens_per_expert is r.tokens_per_expert      # made once
    # a tensor passed in is kept as is
    given = torch.tensor([1, 1])
    assert new_dispatch_result(torch.zeros(2, 4), np.ones(2, np.float32), given, h,
                               None).tokens_per_expert is given
