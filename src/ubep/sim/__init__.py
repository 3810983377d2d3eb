"""Superpod simulator: runs `ubep.plan` plans on a calibrated model of a fabric.

    from ubep.sim import simulate
    r = simulate("cm384", ranks=64, tokens_per_rank=128, hidden=7168, top_k=8,
                 bytes_per_element=1, mode="ubep")
    r.latency_us, r.bandwidth_GBps, r.phases_us, r.stats(0)
"""

from ubep.sim.api import Prepared, SimConfig, execute, prepare, simulate
from ubep.sim.metrics import SimResult
from ubep.sim.params import CostParams, calibrated

__all__ = ["simulate", "prepare", "execute", "SimConfig", "Prepared", "SimResult",
           "CostParams", "calibrated"]
