"""What this machine offers a host topology: NUMA nodes and usable cores, read from /sys.

The one place in `plan/` that reads the system; everything else in `plan/` is pure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class HostInfo:
    """NUMA nodes (each a tuple of usable CPU ids) and the usable core count."""

    nodes: tuple[tuple[int, ...], ...]
    num_cores: int

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def describe(self) -> str:
        return f"{self.num_cores} cores on {self.num_nodes} NUMA node(s)"


def parse_cpulist(text: str) -> tuple[int, ...]:
    """`"0-3,8,10-11"` -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


@lru_cache(maxsize=1)
def discover_host(sys_root: str = "/sys/devices/system/node") -> HostInfo:
    """Read NUMA nodes from `sys_root`; one node holding every usable core if absent."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    allowed = set(usable)
    nodes: list[tuple[int, ...]] = []
    root = Path(sys_root)
    try:
        entries = sorted((p for p in root.glob("node[0-9]*") if p.name[4:].isdigit()),
                         key=lambda p: int(p.name[4:]))
        for p in entries:
            cpus = tuple(c for c in parse_cpulist((p / "cpulist").read_text()) if c in allowed)
            if cpus:
                nodes.append(cpus)
    except OSError:
        nodes = []
    if not nodes:
        nodes = [tuple(usable)]
    return HostInfo(nodes=tuple(nodes), num_cores=len(usable))
