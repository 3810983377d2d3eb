"""The collectives the torch backend (and its elastic recovery) call: `all_to_all_single`
on the process group object, and a wait that polls a host-side collective before it blocks.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def _options(async_op: bool):
    opts = dist.AllToAllOptions()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    return opts


#: the options each call of `all_to_all` passes (sync, async): made once, as the wrapper
#: would make them per call
_A2A_OPTS = (_options(False), _options(True))


def all_to_all(group, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
               input_splits: list[int], async_op: bool = False):
    """`dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
    async_op=async_op)` called on the process group object itself: the same collective on
    any backend (gloo, NCCL, MPI), without the Python wrapper's checks, logging decorator
    and torch-function dispatch, which cost 15-20 µs a call on this 2-core VM (gloo, 2 ranks,
    medians of 300 interleaved: 16 B 97 vs 113 µs, 28 KB 87 vs 105 µs). `group` is a
    ProcessGroup (not None); where it has no `all_to_all_single` (older torch), the wrapper.
    `ubep bench`'s raw-collectives line replays the backend's calls through this too."""
    fn = getattr(group, "all_to_all_single", None)
    if fn is None:
        return dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                      async_op=async_op)
    work = fn(output, input, output_splits, input_splits, _A2A_OPTS[async_op])
    if async_op:
        return work
    if work is not None:    # as the wrapper: a backend may have synchronised already
        wait(work, group)
    return None


#: how long `wait` polls a host-side collective before it blocks in `work.wait()`, seconds
POLL_S = 2e-3
#: process-group backends whose collectives run on host threads (polling them is cheap)
HOST_BACKENDS = ("gloo",)


def wait(work, group) -> None:
    """`work.wait()` of an `all_to_all_single`; on a gloo group, after polling
    `is_completed()` for up to `POLL_S`, yielding the core between polls.

    `wait()` blocks the caller on a condition variable: gloo's thread that completes the
    collective must then wake it, and on a VM whose core went idle meanwhile that wake-up
    costs tens of µs. A caller that yields instead stays runnable, so gloo's threads get the
    core whenever they need it and the caller sees the completion on its next poll.
    Side by side (2 ranks, gloo, this 2-core VM, `all_to_all_single`, medians of 600):
    16 B 83 -> 64 µs, 56 KiB 120 -> 109 µs, 1.75 MiB 1,160 -> 1,156 µs. A pure spin
    (no yield) starves gloo's threads (p90 3.3 ms). `wait()` still ends every wait: it
    raises the collective's error and keeps the group's timeout. NCCL and other device
    groups are not polled: their `wait()` does not block the host. Only for a collective
    that gloo completes on its own threads (all-to-all, all-gather, all-reduce): a gloo
    reduce-scatter completes inside `wait()`, and a poll of it would spin its whole window
    (`test_gloo_all_to_all_completes_without_wait` holds the property this relies on)."""
    if group.name() in HOST_BACKENDS:
        end = time.perf_counter() + POLL_S
        while not work.is_completed() and time.perf_counter() < end:
            os.sched_yield()
    work.wait()
