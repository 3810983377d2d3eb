"""Run a benchmark: launch the ranks, gather their times, summarise per system and point.

`run_bench(cfg)` launches `ubep.bench.runner.bench_rank` on P processes for every P of the
config, through `ubep.testing.run_ranks` or, when the MPI peer is asked for, `mpiexec`
(the same function runs in both, so every system shares processes and iterations).
Per iteration the time of an operation is the max over ranks; warm-up is excluded.
"""

from __future__ import annotations

import functools
import os
import pickle
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ubep.bench.config import BOUND, RAW, RAW_OF, BenchConfig

OPS = ("dispatch", "combine", "total")


def mpiexec_path() -> Path:
    """The `mpiexec` of the MPICH wheel, next to this interpreter."""
    return Path(sys.executable).parent / "mpiexec"


def mpi_missing_reason() -> str | None:
    """Why MPI is not installed here (mpi4py, or MPICH's `mpiexec` next to this interpreter),
    or None if both are: what the `dev` and `mpi` extras install."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as e:
        return f"mpi4py is not installed ({e}); pip install -e '.[mpi]'"
    if not mpiexec_path().exists():
        return f"no mpiexec at {mpiexec_path()} (pip install mpich)"
    return None


#: `mpiexec -n 2` probes before MPI counts as broken, and each one's limit, seconds: on a
#: loaded host starting two interpreters that import mpi4py has taken tens of seconds
MPI_PROBES = 3
MPI_PROBE_TIMEOUT_S = 120.0
#: the pause between two probes, seconds
MPI_PROBE_PAUSE_S = 1.0


@functools.cache
def mpi_unavailable_reason() -> str | None:
    """Why the MPI peer cannot run here, or None if it can: not installed
    (`mpi_missing_reason`), or `mpiexec -n 2` failed `MPI_PROBES` times in a row (each
    within `MPI_PROBE_TIMEOUT_S`; the last failure is named). Probes once per process."""
    missing = mpi_missing_reason()
    if missing is not None:
        return missing
    probe = [str(mpiexec_path()), "-n", "2", sys.executable, "-c",
             "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"]
    why = ""
    for attempt in range(MPI_PROBES):
        if attempt:
            time.sleep(MPI_PROBE_PAUSE_S)
        try:
            proc = subprocess.run(probe, capture_output=True, text=True,
                                  timeout=MPI_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"does not run here: {e}"
            continue
        if proc.returncode == 0:
            return None
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        why = f"failed here (exit {proc.returncode}): {tail[0][:200]}"
    return f"`mpiexec -n 2` {why} ({MPI_PROBES} tries)"


def machine_info() -> dict:
    """Cores, CPU model, load and versions: what a reader needs to weigh the numbers."""
    import torch

    from ubep.native import status

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu_model": model, "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__,
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "native": status()}
    try:
        from mpi4py import MPI
        info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001 - optional
        pass
    return info


@dataclass
class BenchResult:
    """Everything one run measured; `rows` is the summary, one dict per (point, system, op)."""

    config: BenchConfig
    rows: list[dict] = field(default_factory=list)
    samples: dict = field(default_factory=dict)   # (system, P, hidden, batch) -> [3, iters] µs
    #: (system, P, hidden, batch) -> [turns] µs: each turn's first call, dispatch+combine, max
    #: over ranks; kept out of `samples` (`runner._timed_loop`; empty when block is 1)
    leads: dict = field(default_factory=dict)
    unavailable: dict = field(default_factory=dict)  # system -> reason
    rtt_us: dict = field(default_factory=dict)    # P -> flag round trip, µs
    cores: dict = field(default_factory=dict)     # P -> each rank's cores (None: unbound)
    #: P -> (bytes, µs to copy them as another core just wrote them, µs from own cache)
    xcopy: dict = field(default_factory=dict)
    #: (system, P, hidden, batch) -> [ranks, 4, iters] int64 ns: each timed iteration's
    #: dispatch start and end, combine start and end on every rank (`time.perf_counter_ns`)
    spans: dict = field(default_factory=dict)
    #: P -> each rank's `probe.result()` when `run_bench` was given a probe
    probes: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)     # (P, hidden, batch) -> (dispatch, combine) B
    #: one dict per (system, P, hidden, batch, "<op>:<phase>"): the backend's own phase times,
    #: median over iterations of the max over ranks (Buffer systems only)
    phase_rows: list[dict] = field(default_factory=list)
    machine: dict = field(default_factory=dict)
    elapsed_s: float = 0.0


def _launch_run_ranks(cfg: BenchConfig, world: int, timeout_s: float, probe) -> list[dict]:
    from ubep.bench.runner import bench_rank
    from ubep.testing import run_ranks

    return run_ranks(bench_rank, world, cfg, None, probe, timeout_s=timeout_s)


def _launch_mpiexec(cfg: BenchConfig, world: int, timeout_s: float, probe) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="ubep-bench-") as tmp:
        cfg_path, out_path = Path(tmp, "config.pkl"), Path(tmp, "out.pkl")
        cfg_path.write_bytes(pickle.dumps((cfg, probe)))
        env = {**os.environ, "UBEP_JOB_ID": f"m{os.getpid()}x{int(time.time() * 1e3) % 100000}"}
        cmd = [str(mpiexec_path()), "-n", str(world), sys.executable, "-m",
               "ubep.bench.runner", str(cfg_path), str(out_path)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise RuntimeError(f"mpiexec -n {world} bench ran past {timeout_s:g}s; "
                               f"output:\n{log[-3000:]}") from None
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"mpiexec -n {world} bench failed (exit {proc.returncode}):\n"
                               f"{log[-3000:]}")
        results = pickle.loads(out_path.read_bytes())
    for status, payload in results:
        if status != "ok":
            raise RuntimeError(f"bench rank failed under mpiexec:\n{payload}")
    return [payload for _, payload in results]


def run_bench(cfg: BenchConfig, *, timeout_s: float = 1200.0, progress=None,
              probe=None) -> BenchResult:
    """Measure every system of `cfg` at every point; see the module docstring.

    `progress(message)` is called before each launch, if given. `probe` (picklable) runs on
    every rank around the timed points (`ubep.bench.runner.bench_rank`); each rank's result
    lands in `BenchResult.probes`.
    """
    t_start = time.monotonic()
    res = BenchResult(config=cfg, machine=machine_info())
    want_mpi = "mpi" in cfg.systems
    run_cfg = cfg
    if want_mpi:
        why = mpi_unavailable_reason()
        if why:
            res.unavailable["mpi"] = why
            run_cfg = BenchConfig(**{**cfg.to_dict(),
                                     "systems": tuple(s for s in cfg.systems if s != "mpi")})
            want_mpi = False
    for world in cfg.ranks:
        if progress:
            progress(f"P={world}: {', '.join(run_cfg.systems)} + bound, hidden "
                     f"{list(cfg.hiddens)}, batch {list(cfg.batches)}")
        launch = _launch_mpiexec if want_mpi else _launch_run_ranks
        per_rank = launch(run_cfg, world, timeout_s, probe)
        collect(res, world, per_rank)
    summarise(res)
    res.elapsed_s = time.monotonic() - t_start
    return res


def collect(res: BenchResult, world: int, per_rank: list[dict]) -> None:
    """Add the ranks' results of the run at `world` ranks (`bench_rank`'s, in rank order) to
    `res`: per iteration, the max over ranks."""
    first = per_rank[0]
    for name, why in first["unavailable"].items():
        res.unavailable.setdefault(name, why)
    rtts = [v for v in (first.get("rtt_us"), first.get("rtt_us_end")) if v is not None]
    res.rtt_us[world] = min(rtts) if rtts else 0.0
    res.cores[world] = [r.get("cpu") for r in per_rank]
    if first.get("xcopy") is not None:
        res.xcopy[world] = tuple(first["xcopy"])
    if all(r.get("probe") is not None for r in per_rank):
        res.probes[world] = [r["probe"] for r in per_rank]
    for (hidden, batch) in first["bytes"]:
        res.bytes[(world, hidden, batch)] = tuple(
            max(r["bytes"][(hidden, batch)][i] for r in per_rank) for i in range(2))
    for key in first["times"]:
        name, hidden, batch = key
        t = np.max(np.stack([r["times"][key] for r in per_rank]), axis=0)  # max over ranks
        if name == BOUND:  # copy time + one flag round trip per dispatch+combine
            t = t + res.rtt_us[world] / 2
        res.samples[(name, world, hidden, batch)] = np.vstack([t, t.sum(0, keepdims=True)])
        spans = [r.get("spans", {}).get(key) for r in per_rank]
        if all(v is not None for v in spans):
            res.spans[(name, world, hidden, batch)] = np.stack(spans)
        lead = [r.get("leads", {}).get(key) for r in per_rank]
        if all(v is not None and len(v) for v in lead):
            res.leads[(name, world, hidden, batch)] = np.max(np.stack(lead), axis=0)
    for (name, hidden, batch), first_iters in first.get("phases", {}).items():
        iters = [r["phases"][(name, hidden, batch)] for r in per_rank]
        for key in sorted(first_iters[0]) if first_iters else ():
            per_iter = [max(rank_iters[i].get(key, 0.0) for rank_iters in iters)
                        for i in range(len(first_iters))]
            res.phase_rows.append({"system": name, "ranks": world, "hidden": hidden,
                                   "batch": batch, "phase": key,
                                   "median_us": float(np.median(per_iter))})


def _op_bytes(nbytes: tuple, op: str) -> int | None:
    """Bytes the copy bound moves per rank for `op` (the max over ranks), None if unknown."""
    if op == "total":
        return None if None in nbytes else sum(nbytes)
    return nbytes[OPS.index(op)]


def summarise(res: BenchResult) -> None:
    """Fill `res.rows` from `res.samples`: per (point, system, op) the median, p99, mean and
    min, and the ratios to shm-ubep, to the copy bound and to raw collectives + copy bound."""
    cfg = res.config
    med = {k: np.median(v, axis=1) for k, v in res.samples.items()}
    for (name, world, hidden, batch), t in sorted(res.samples.items(),
                                                  key=lambda kv: (kv[0][1:], kv[0][0])):
        ubep_med = med.get(("shm-ubep", world, hidden, batch))
        bound_med = med.get((BOUND, world, hidden, batch))
        raw_med = med.get((RAW_OF.get(name, RAW), world, hidden, batch))
        nbytes = res.bytes.get((world, hidden, batch), (None, None))
        for i, op in enumerate(OPS):
            m = float(np.median(t[i]))
            res.rows.append({
                "system": name, "ranks": world, "hidden": hidden, "batch": batch, "op": op,
                "median_us": m, "p99_us": float(np.percentile(t[i], 99)),
                "mean_us": float(t[i].mean()), "min_us": float(t[i].min()),
                "samples": t.shape[1],
                "x_ubep": m / ubep_med[i] if ubep_med is not None else None,
                "x_bound": m / bound_med[i] if bound_med is not None else None,
                # against bare collectives plus one copy pass: the torch backend's (the
                # AgRs peer's for it and its own line)
                "x_raw_copy": m / (raw_med[i] + bound_med[i])
                if raw_med is not None and bound_med is not None else None,
                "dtype": cfg.dtype, "top_k": cfg.top_k, "experts": cfg.experts,
                "bytes_per_rank": _op_bytes(nbytes, op),
                "rtt_us": res.rtt_us.get(world),
            })
