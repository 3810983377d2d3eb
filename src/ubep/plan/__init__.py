"""Pure, deterministic planning: the fabric model (`Topology`) and the token schedulers.

`make_plan(topk_idx, topology=..., rank=..., ...)` turns one rank's routing into a `Plan`:
plain numpy arrays saying which worker sends which (token, slot) to which rank, in what
order. Every executor (shm runtime, simulator) reads only the Plan. No I/O here, except
`Topology.host()`, which reads /sys once (plan/hostinfo.py).
"""

from ubep.plan.costmodel import choose_count_workers
from ubep.plan.planner import Plan, WorkerMapper, make_plan
from ubep.plan.schedule import SCHEDULES
from ubep.plan.search import quaternary_search
from ubep.plan.topology import PRESETS, Tier, Topology

__all__ = ["Topology", "Tier", "PRESETS", "Plan", "WorkerMapper", "make_plan", "SCHEDULES",
           "choose_count_workers", "quaternary_search"]
