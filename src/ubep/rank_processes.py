"""Ranks as real processes: start them, run `fn` in a gloo group, collect what each answers.

Shared by `ubep.testing.run_ranks` (ranks on this host) and `ubep.emulated_hosts.run_hosts`
(ranks on emulated hosts). Processes come from one forkserver that has already imported
torch and ubep, so starting a rank is cheap. Each rank joins the default process group through
a TCP store that someone else holds (the caller, or a keeper process on an emulated host), so
a rank's death does not take the store with it.

Results travel as `torch.save` bytes: that copies tensors (any view, any dtype), where
multiprocessing's torch reducers would share them through fds that vanish when the rank exits.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait
from typing import Any


class RankFailedError(RuntimeError):
    """A rank raised; carries that rank's traceback."""

    def __init__(self, rank: int, tb: str):
        self.rank, self.traceback = rank, tb
        super().__init__(f"rank {rank} failed:\n{tb}")


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure, returned instead of raised when `return_exceptions=True`."""

    rank: int
    kind: str        # "exception" | "died" | "timeout"
    message: str     # the exception's type and text, traceback, or exit status

    def __str__(self) -> str:
        return f"rank {self.rank} {self.kind}: {self.message}"


@dataclass(frozen=True)
class RankLaunch:
    """What one rank process needs besides `fn` and its arguments.

    `store_host:store_port` is the TCP store of the group (a client: someone else holds it);
    `env` is set before torch.distributed starts; `enter`, if given, runs first in the new
    process (an emulated host's `join_host`)."""

    store_host: str
    store_port: int
    env: dict[str, str] = field(default_factory=dict)
    pg_timeout_s: float = 60.0
    threads: int = 1
    enter: Callable[[], None] | None = None
    name: str = "ubep-rank"


_ctx: mp.context.BaseContext | None = None
_RUNNER_MODULES = ("pytest", "hypothesis")


def dumps(obj: Any) -> bytes:
    """`obj` as torch.save bytes."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    """The object `dumps` wrote."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def context() -> mp.context.BaseContext:
    """The forkserver context every rank process comes from (torch and ubep preloaded)."""
    global _ctx
    if _ctx is None:
        ctx = mp.get_context("forkserver")
        # a rank unpickles `fn` by importing its module; a test module imports pytest (and
        # hypothesis), ~0.4 s a rank on every start unless the forkserver holds them already
        runners = [m for m in _RUNNER_MODULES if m in sys.modules]
        ctx.set_forkserver_preload(["torch", "torch.distributed", "ubep", "ubep._preload",
                                    *runners])
        _ctx = ctx
    return _ctx


def default_threads(world_size: int) -> int:
    """Torch intra-op threads per rank: this process's cores // ranks, at least 1 (torchrun
    gives each local rank one OpenMP thread)."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def _rank_main(fn, rank: int, world_size: int, args: tuple, conn, launch: RankLaunch) -> None:
    try:
        if launch.enter is not None:
            launch.enter()
        os.environ.update(launch.env)
        import torch
        import torch.distributed as dist

        # as torchrun does (OMP_NUM_THREADS=1 per local rank): intra-op threads of several
        # ranks on a few cores spin-wait after each parallel region and starve the peer ranks
        torch.set_num_threads(launch.threads)
        timeout = timedelta(seconds=launch.pg_timeout_s)
        store = dist.TCPStore(launch.store_host, launch.store_port, world_size + 1,
                              is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        try:
            result = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure; report the failure
                pass
        conn.send_bytes(dumps(("ok", result)))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        try:
            msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            conn.send_bytes(dumps(("exception", msg)))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()


def run_processes(fn: Callable[..., Any], args: tuple, launches: Sequence[RankLaunch],
                  timeout_s: float) -> list[Any]:
    """Run `fn(rank, len(launches), *args)` on one process per launch; each rank's result or
    `RankFailure`, by rank. Ranks still running after `timeout_s` are killed ("timeout"); a
    rank that exits without answering (SIGKILL, `os._exit`) is "died". Every process has
    exited when this returns."""
    ctx = context()
    world_size = len(launches)
    procs, conns = [], []
    outcomes: list[Any] = [None] * world_size
    done = [False] * world_size
    try:
        for rank, launch in enumerate(launches):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"{launch.name}{rank}",
                            args=(fn, rank, world_size, args, child, launch))
            conns.append(parent)
            p.start()
            child.close()
            procs.append(p)
        deadline = time.monotonic() + timeout_s
        while not all(done) and (left := deadline - time.monotonic()) > 0:
            # one blocking wait for any rank's answer or exit: no periodic wake-up of this
            # process, which would take a core from the ranks (benchmarks run under it)
            mp_wait([w for r in range(world_size) if not done[r]
                     for w in (conns[r], procs[r].sentinel)], timeout=left)
            for r in range(world_size):
                if done[r]:
                    continue
                if conns[r].poll(0):
                    try:
                        status, payload = loads(conns[r].recv_bytes())
                    except EOFError:
                        procs[r].join(1.0)
                        status, payload = "died", exit_status(procs[r].exitcode)
                    outcomes[r] = payload if status == "ok" else RankFailure(r, status, payload)
                    done[r] = True
                elif not procs[r].is_alive() and not conns[r].poll(0):
                    outcomes[r] = RankFailure(r, "died", exit_status(procs[r].exitcode))
                    done[r] = True
        for r in range(world_size):
            if not done[r]:
                outcomes[r] = RankFailure(r, "timeout", f"still running after {timeout_s:g}s")
    finally:
        for p in procs:
            if p.is_alive():
                p.join(2.0)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5.0)
        for c in conns:
            c.close()
    return outcomes


def exit_status(exitcode: int | None) -> str:
    """A process's exit code in words: "exit code 3", "killed by SIGKILL"."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            pass
    return f"exit code {exitcode}"


def raise_first(outcomes: Sequence[Any]) -> None:
    """Raise `RankFailedError` for the first `RankFailure` among `outcomes`, if any."""
    for o in outcomes:
        if isinstance(o, RankFailure):
            raise RankFailedError(o.rank, f"[{o.kind}] {o.message}")
