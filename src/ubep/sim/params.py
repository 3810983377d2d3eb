"""The cost model's constants: one frozen dataclass, every field named with its unit.

The fabric (hop classes, their latency and bandwidth, block size) comes from the
`ubep.Topology`; everything the topology does not say — how fast one core issues stores,
how many it keeps in flight, what a barrier or a flag costs — lives here. The free ones are
fitted by `ubep.sim.calibrate` to the paper's published points; `calibrated(name)` loads the
fitted values shipped in `data/calibration.json`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from importlib import resources

CALIBRATION_FILE = "calibration.json"


def _f(default: float, help: str) -> float:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class CostParams:
    """Per-core, per-port and per-synchronisation costs of the modelled superpod.

    How many rows one worker keeps in flight is not here: it is the topology's
    `staging_rows` (a property of the kernel on that hardware, never fitted).
    """

    stage_bw_GBps: float = _f(12.0, "one worker copying a row into its staging buffer, GB/s "
                              "(the issue cost of a row store)")
    port_bw_scale: float = _f(1.0, "share of a tier's bandwidth one rank's port gets (cm384: "
                              "0.5, two dies share their NPU's link)")
    uplink_bw_scale: float = _f(0.0, "a group's uplink to the outermost switch tier (cm384: a "
                                "board's uplink to the second tier) as a share of its ranks' "
                                "total port bandwidth; 0: not modelled (non-blocking)")
    latency_scale: float = _f(1.0, "multiplies the topology's hop latencies (1 = as published)")
    launch_us: float = _f(5.0, "kernel launch, microseconds")
    phase_fixed_us: float = _f(1.0, "fixed cost of entering one phase or role, microseconds")
    barrier_us: float = _f(5.0, "one SyncAll (all-core barrier inside a rank), microseconds")
    flag_issue_us: float = _f(0.05, "issue cost of one flag or count store (pipelined: the "
                              "worker moves on), microseconds")
    status_count_us: float = _f(0.0, "BSP, as CANN's dispatch kernel: one core counting the "
                                "rank's (token, k) pairs of one expert before writing its "
                                "status (a vector pass over the pairs and a vector-to-scalar "
                                "sync); each core counts its share of the experts one after "
                                "another, before the SyncAll; us")
    poll_us: float = _f(0.05, "one vector pass over the arrived flag/count words after the "
                        "last one landed (polling overlaps the arrivals), microseconds")
    scan_ns_per_entry: float = _f(0.5, "that vector pass, per received count entry, ns")
    copy_bw_GBps: float = _f(20.0, "local copy bandwidth of one worker (reordering), GB/s")
    count_ns_per_pair: float = _f(2.0, "counting one (token, expert) pair, nanoseconds")
    cumsum_ns_per_entry: float = _f(2.0, "one entry of the count prefix sum, nanoseconds")
    signal_us: float = _f(0.3, "release-store + acquire-load of a point-to-point signal, us")
    start_jitter_us: float = _f(0.0, "each rank starts uniformly 0..this late (seeded by the "
                                "workload seed; 0: every rank at once), us")
    sync_batch_rows: int = _f(8, "rows per flag (sw) or per checksum (dc)")
    fence_us: float = _f(0.5, "store fence before a sw flag (beyond draining the window), us")
    detect_ns_per_block: float = _f(5.0, "receiver: check one block's flag/marker bytes, ns")
    checksum_ns_per_block: float = _f(10.0, "dc: checksum one block (sender and receiver), ns")
    rearm_ns_per_block: float = _f(5.0, "sp: rewrite one block's sentinel after use, ns")

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ValueError(f"CostParams.{f.name}={v!r} must be a number >= 0")
        for name in ("sync_batch_rows",):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ValueError(f"CostParams.{name}={getattr(self, name)!r} must be an int >= 1")

    def with_(self, **changes: float) -> CostParams:
        """A copy with `changes` applied (validated again)."""
        return replace(self, **changes)

    @staticmethod
    def help() -> dict[str, str]:
        """Field name -> help text (used by the CLI and the report)."""
        return {f.name: f.metadata["help"] for f in fields(CostParams)}

    @staticmethod
    def zero() -> CostParams:
        """A free machine: no latency, infinite bandwidths, no fixed costs (for tests)."""
        inf = math.inf
        return CostParams(stage_bw_GBps=inf, port_bw_scale=inf, latency_scale=0.0,
                          launch_us=0, phase_fixed_us=0, barrier_us=0, flag_issue_us=0,
                          poll_us=0, scan_ns_per_entry=0, copy_bw_GBps=inf,
                          count_ns_per_pair=0,
                          cumsum_ns_per_entry=0, signal_us=0, fence_us=0,
                          detect_ns_per_block=0, checksum_ns_per_block=0, rearm_ns_per_block=0)


def load_calibration() -> dict:
    """The shipped calibration file as a dict ({} when it has not been written yet)."""
    try:
        text = resources.files("ubep.sim").joinpath("data").joinpath(
            CALIBRATION_FILE).read_text()
    except FileNotFoundError:
        return {}
    return json.loads(text)


def calibrated(topology_name: str = "cm384") -> CostParams:
    """The fitted CostParams for a preset (fitted on cm384; other fabrics reuse the core
    constants, since the paper publishes no points for them, but not cm384's per-die share
    of an NPU's link: their tiers state per-rank bandwidth)."""
    cal = load_calibration()
    fitted = dict(cal.get("params", {}))
    if topology_name != cal.get("topology", "cm384"):
        fitted.pop("port_bw_scale", None)
    known = {f.name for f in fields(CostParams)}
    return CostParams(**{k: v for k, v in fitted.items() if k in known})
