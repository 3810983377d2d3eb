"""The `host` model: the simulator's engine with this machine's constants, checked against
`ubep bench` on this machine (`ubep simulate --validate-host`).

Constants come from microbenchmarks, not from fitting the points being predicted:

* copy bandwidth: one core copying 14 KB rows (numpy) into a buffer of a dispatch's size;
  a row store into a peer's shared memory and a reorder copy both cost row / bandwidth;
* flag round trip: the bench's own ping-pong between the two ranks (`run.json`); a store
  becomes visible to the peer half a round trip after it was written;
* per-call overhead: what each system's call costs beyond the model's data movement, from
  the same bench run at a negligible payload (hidden 64, batches 1-128: at most 256 KB):
  the smallest of (measured median - the model's time for that call).

Ranks are processes sharing one host's memory: one hop class, no port limit (memory
bandwidth is not the bottleneck of a single-core copy), one worker per rank on 2 cores,
one row in flight per worker (a copy is synchronous). Then the engine predicts the bench
medians of shm-bsp, shm-ubep and shm-direct at hidden 7168 bf16, top-8, P=2.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

SYSTEMS = {"shm-bsp": ("bsp", False), "shm-ubep": ("ubep", False),
           "shm-direct": ("ubep", True)}
BATCHES = (1, 8, 16, 128)
HIDDEN, TINY_HIDDEN, TOP_K, EXPERTS, RANKS = 7168, 64, 8, 16, 2
BENCH_LOCK = "/tmp/ubep-bench.lock"


@dataclass(frozen=True)
class HostConstants:
    """The microbenchmarked constants of this host."""

    copy_GBps: float
    flag_rtt_us: float
    call_us: dict            # (system, op) -> per-call overhead, us

    def to_dict(self) -> dict:
        return {"copy_GBps": self.copy_GBps, "flag_rtt_us": self.flag_rtt_us,
                "call_us": {f"{s}:{o}": v for (s, o), v in self.call_us.items()}}


def measure_copy_GBps(row_bytes: int = HIDDEN * 2, rows: int = 1024, repeats: int = 15
                      ) -> float:
    """One core copying `rows` rows of `row_bytes` one by one into a buffer of their size;
    the fastest of `repeats` passes (the core's capability, not the share a busy host
    leaves it), GB/s."""
    src = np.random.default_rng(0).integers(0, 255, size=(rows, row_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    order = np.random.default_rng(1).permutation(rows)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in order:
            dst[i] = src[i]
        times.append(time.perf_counter() - t)
    return rows * row_bytes / float(np.min(times)) / 1e9


def run_bench(out: Path, iters: int = 30, python: str | None = None) -> Path:
    """Run `ubep bench` (P=2, hidden 64 and 7168 bf16, top-8, batches 1/8/16/128, the
    three shm systems) under the bench lock; returns its output folder."""
    cmd = ["flock", BENCH_LOCK, python or sys.executable, "-m", "ubep.cli", "bench",
           "--ranks", str(RANKS), "--hidden", str(TINY_HIDDEN), str(HIDDEN),
           "--tokens", *map(str, BATCHES), "--top-k", str(TOP_K), "--experts", str(EXPERTS),
           "--systems", *SYSTEMS, "--iters", str(iters), "--warmup", "5", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def read_bench(out: Path) -> tuple[dict, float]:
    """`{(system, hidden, batch, op): median us}` and the flag round trip of a bench run."""
    med = {}
    with (out / "bench.csv").open() as f:
        for r in csv.DictReader(f):
            if r["system"] in SYSTEMS and r["op"] in ("dispatch", "combine"):
                med[(r["system"], int(r["hidden"]), int(r["batch"]), r["op"])] = \
                    float(r["median_us"])
    run = json.loads((out / "run.json").read_text())
    rtt = float(run.get("flag_round_trip_us", {}).get(str(RANKS), 0.0) or 0.0)
    return med, rtt


def host_topology():
    """Two ranks of this host, one worker each, one row in flight per worker."""
    from ubep.plan.topology import Tier, Topology

    return Topology(name="host", num_ranks=RANKS, workers_per_rank=1, atomic_block_bytes=64,
                    flag_bytes=8, tiers=(Tier("host", RANKS, 100.0, 10.0),),
                    local_latency_ns=100.0, local_bandwidth_GBps=10.0, staging_rows=1,
                    description="this host, for --validate-host")


def host_params(copy_GBps: float, flag_rtt_us: float, launch_us: float = 0.0):
    """`CostParams` of the host model (see the module docstring)."""
    from ubep.sim.params import CostParams

    return CostParams(stage_bw_GBps=copy_GBps, copy_bw_GBps=copy_GBps,
                      port_bw_scale=math.inf,
                      latency_scale=(flag_rtt_us / 2) / 0.1,   # topology hop: 100 ns
                      launch_us=launch_us, phase_fixed_us=0.0, barrier_us=0.0,
                      flag_issue_us=0.0, poll_us=0.0, scan_ns_per_entry=0.0,
                      signal_us=0.0, uplink_bw_scale=0.0)


def predict(system: str, op: str, hidden: int, batch: int, params) -> float:
    """The model's latency of one call, us."""
    from ubep.sim.api import SimConfig, execute, prepare

    mode, direct = SYSTEMS[system]
    cfg = SimConfig(tokens_per_rank=batch, hidden=hidden, top_k=TOP_K, num_experts=EXPERTS,
                    bytes_per_element=2, mode=mode, sync="tff",
                    schedule="static" if mode == "bsp" else "hierarchical", op=op,
                    direct=direct)
    return execute(prepare(host_topology(), cfg, params=params), params).latency_us


def constants(med: dict, rtt: float, copy_GBps: float) -> HostConstants:
    """Per-call overheads from the tiny points (hidden 64, every batch: a few KB): the least
    a call costs beyond the model's data movement (the smallest of measured minus model,
    since on a busy host single medians carry scheduler waits)."""
    base = host_params(copy_GBps, rtt)
    call = {}
    for system in SYSTEMS:
        for op in ("dispatch", "combine"):
            call[(system, op)] = max(0.0, min(
                med[(system, TINY_HIDDEN, b, op)] - predict(system, op, TINY_HIDDEN, b, base)
                for b in BATCHES if (system, TINY_HIDDEN, b, op) in med))
    return HostConstants(copy_GBps=copy_GBps, flag_rtt_us=rtt, call_us=call)


def validate(med: dict, hc: HostConstants) -> list[dict]:
    """Predicted vs measured for every system, batch and op at hidden 7168."""
    rows = []
    for system in SYSTEMS:
        for batch in BATCHES:
            for op in ("dispatch", "combine"):
                p = replace(host_params(hc.copy_GBps, hc.flag_rtt_us),
                            launch_us=hc.call_us[(system, op)])
                pred = predict(system, op, HIDDEN, batch, p)
                meas = med.get((system, HIDDEN, batch, op))
                rows.append({"system": system, "batch": batch, "op": op,
                             "predicted_us": pred, "measured_us": meas,
                             "error": (pred - meas) / meas if meas else float("nan")})
    return rows
