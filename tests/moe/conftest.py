"""One torch thread in this folder's tests: the host has 2 shared cores, and idle OpenMP
threads that spin while other processes run slow the tiny models' forwards by 10x."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("transformers") is None:
    # ubep.moe needs transformers>=5 (the moe extra): nothing here can run
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
