"""One torch thread in this folder's tests: the host has 2 shared cores, and idle OpenMP
threads that spin while other processes run slow the tiny models' forwards by 10x."""

import pytest
import torch

pytest.importorskip("transformers", reason="ubep.moe needs transformers>=5 (the moe extra)")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
