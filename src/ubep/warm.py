"""`ubep warm`: compile every Numba kernel into Numba's on-disk cache, on all cores at once.

Numba compiles a kernel on its first call in an environment that has not cached it (a fresh
clone, a new image): ~90 s for the shm runtime's kernels alone on a 2-core host. A `Buffer`
warms what it needs when it is created, so JIT time never counts against a call's deadline;
but in a job of P ranks on a cold cache every rank compiles the same kernels at once (P
times the work, on the cores the job shares), and a second kernel family waits for the
first. Run this once after installing (`make install` does; so would a deployment image's
build): later processes load the kernels from the cache in a few seconds.

The work is split into jobs that exercise the real entry points on a private 1-rank group
(the same argument types as a P-rank call) and run in separate processes: the shm region
kernels beside the torch backend and the tools (MPI peer, simulator, benchmark flags)
first, then every shm Buffer system and dtype. The lab outside the package (benchmarks/)
compiles its own kernels when it runs. `--only shm torch` warms what an application
uses (the vLLM plugin's venv does that; importing ubep compiles the torch backend's C entry
points, so an shm-only application needs "torch" too).
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta

DTYPES = ("bfloat16", "float32", "float16")


def _one_rank_group():
    """A private 1-rank gloo group (a file store: no port), for the Buffer jobs; a pool
    process keeps the one an earlier job made."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    fd, path = tempfile.mkstemp(prefix="ubep-warm-pg-")
    os.close(fd)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    os.unlink(path)


def _shm_kernels() -> None:
    import ubep._preload  # noqa: F401 - importing it compiles the region kernels


def _torch() -> None:
    """The torch backend's kernels (compiled door on and off) and the AgRs peer's."""
    _buffers(("torch",), DTYPES)


def _tools() -> None:
    """The MPI peer's kernels, the simulator's event queue and the benchmark's flags."""
    from ubep.bench import flags
    from ubep.sim.api import simulate

    _one_rank_group()
    try:
        from mpi4py import MPI
    except ImportError:                     # the MPI peer is optional (ubep[mpi])
        MPI = None
    if MPI is not None:
        from ubep.bench.runner import bench_rank

        for dt in DTYPES:
            bench_rank(0, 1, _bench_config(dt, ("mpi",)), MPI.COMM_SELF)
    simulate("nvl72", tokens_per_rank=2, hidden=64, ranks=8, exact=True)
    flags.warm_up()


def _buffers(systems, dtypes, bench: bool = True) -> None:
    """One dispatch and combine of each Buffer system in `systems` and dtype, through the
    compiled door and through Python (`UBEP_NATIVE=0`), then (`bench`) the bench's peers
    and bounds."""
    import torch

    from ubep.bench.config import BUFFER_SYSTEMS
    from ubep.bench.runner import bench_rank
    from ubep.testing import make_routing, make_tokens

    _one_rank_group()
    idx, w = make_routing(2, 2, 4, seed=1)
    for name in systems:
        backend, mode, direct = BUFFER_SYSTEMS[name]
        # one worker per rank (what P ranks on P cores get) and several: different kernels
        for workers, native, dt in itertools.product(
                (1, 2) if backend == "shm" else (None,), ("1", "0"), dtypes):
            os.environ["UBEP_NATIVE"] = native
            try:
                _call(make_tokens(0, 2, 64, getattr(torch, dt), seed=2), idx, w, out=True,
                      backend=backend, mode=mode, direct=direct, workers=workers)
            finally:
                os.environ.pop("UBEP_NATIVE", None)
    peers = ("agrs",) if "torch" in systems else ()
    for dt in dtypes if bench else ():
        bench_rank(0, 1, _bench_config(dt, (*systems, *peers)))


def _bench_config(dtype: str, systems: tuple[str, ...]):
    """One untimed-size `ubep bench` point on one rank: the systems' bench paths and bounds."""
    from ubep.bench.config import BenchConfig

    return BenchConfig(ranks=(1,), hiddens=(64,), batches=(2,), top_k=2, experts=4,
                       dtype=dtype, systems=systems, iters=1, warmup=0, pin=False, workers=1)


def _shm_buffers_bf16() -> None:
    from ubep.bench.config import BUFFER_SYSTEMS

    _buffers(tuple(n for n in BUFFER_SYSTEMS if n != "torch"), ("bfloat16",))


def _shm_buffers_other() -> None:
    """The other dtypes, then every sync variant and schedule of the multi-worker path."""
    import torch

    from ubep.bench.config import BUFFER_SYSTEMS
    from ubep.options import SCHEDULES, SYNCS
    from ubep.testing import make_routing, make_tokens

    _buffers(tuple(n for n in BUFFER_SYSTEMS if n != "torch"), ("float32", "float16"))
    idx, w = make_routing(2, 2, 4, seed=1)
    x = make_tokens(0, 2, 64, torch.bfloat16, seed=2)
    for mode, sync, schedule in itertools.product(("ubep", "bsp"), SYNCS, SCHEDULES):
        _call(x, idx, w, backend="shm", mode=mode, sync=sync, schedule=schedule, workers=2)


def _call(x, idx, w, out: bool = False, **options) -> None:
    """One dispatch and combine (and one into an `out`) on a small Buffer of `options`."""
    import torch

    import ubep

    with ubep.Buffer(num_experts=4, hidden=64, max_tokens_per_rank=2, max_top_k=2,
                     **options) as buf:
        r = buf.dispatch(x, idx, w)
        if out:
            buf.combine(r.recv_x, r.handle, out=torch.empty_like(x))
        buf.combine(r.recv_x, r.handle)


#: what `--only` can choose: the shared-memory runtime, the torch backend, the tools (MPI
#: peer, simulator, the benchmark's flags)
PARTS = ("shm", "torch", "tools")
#: rounds of (part, job); the jobs of a round run in parallel processes (the second round's
#: find the shm region kernels the first compiled)
ROUNDS: tuple[tuple[tuple[str, Callable[[], None]], ...], ...] = (
    (("shm", _shm_kernels), ("torch", _torch), ("tools", _tools)),
    (("shm", _shm_buffers_bf16), ("shm", _shm_buffers_other)),
)


def compiled_signatures() -> set[tuple[str, str]]:
    """`(kernel, argument types)` of every ubep Numba kernel this process has compiled or
    loaded from the cache: what a warm cache must hold for it."""
    import sys

    from numba.core.registry import CPUDispatcher

    out = set()
    for name, mod in list(sys.modules.items()):
        if name == "ubep" or name.startswith("ubep."):
            for obj in list(vars(mod).values()):
                if isinstance(obj, CPUDispatcher):
                    f = obj.py_func
                    out |= {(f"{f.__module__}.{f.__qualname__}", str(sig))
                            for sig in obj.signatures}
    return out


def _timed(job: Callable[[], None]) -> tuple[str, float]:
    import torch

    torch.set_num_threads(1)
    t = time.perf_counter()
    job()
    return job.__name__.lstrip("_"), time.perf_counter() - t


def warm(procs: int | None = None, parts=PARTS) -> list[tuple[str, float]]:
    """Run the jobs of `parts` (`procs` processes at a time; default: this host's cores);
    returns each job's name and seconds."""
    import multiprocessing as mp

    for p in parts:
        if p not in PARTS:
            raise ValueError(f"parts: {p!r} is not one of {PARTS}")
    procs = procs or len(os.sched_getaffinity(0))
    done = []
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as ex:
        for jobs in ROUNDS:
            done += list(ex.map(_timed, [job for part, job in jobs if part in parts]))
    return done


def _cmd(args: argparse.Namespace) -> int:
    t = time.perf_counter()
    for name, s in warm(args.procs, tuple(args.only)):
        print(f"ubep warm: {name} {s:.1f} s")
    print(f"ubep warm: every kernel in Numba's cache ({time.perf_counter() - t:.1f} s)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("warm", help="compile every kernel into Numba's cache (once per install)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=None,
                   help="processes compiling at once (default: this host's cores)")
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS),
                   help="what to warm (default: all; an application: shm torch)")
    p.set_defaults(func=_cmd)
