"""Shared fixtures: a one-rank gloo group in the test process for single-process checks."""

from __future__ import annotations

import tempfile
from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def single_rank_group():
    """Initialize a world-size-1 gloo default group once per test session."""
    if not dist.is_initialized():
        with tempfile.NamedTemporaryFile(prefix="ubep-pg-", delete=False) as f:
            path = f.name
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
    yield dist.group.WORLD
