"""Imported once by `ubep.testing`'s forkserver: load (or compile) every shm kernel there.

Rank processes are forked from that server, so each starts with the kernels in memory
instead of loading them from numba's cache (seconds per process on a busy host).
"""

from __future__ import annotations

from ubep.plan.blocks import BlockFormat
from ubep.runtime.shm.kernels.warmup import warm_up, warm_up_direct
from ubep.runtime.shm.region import region_layout

warm_up(lambda: region_layout(world=1, experts_per_rank=2, max_workers=1, hidden=2,
                              max_tokens=1, max_top_k=1, fmt=BlockFormat("tff", 512)), True)
warm_up_direct()
