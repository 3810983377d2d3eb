"""ubep: expert-parallel dispatch/combine for Mixture-of-Experts models (the UBEP design).

The door is `Buffer`; `get_dispatch_layout` counts a routing; `ubep.reference` is the
oracle every executor is tested against; `ubep.plan` plans, `ubep.runtime` executes for
real, `ubep.sim` executes on a model of a superpod fabric.
"""

from ubep.buffer import Buffer
from ubep.errors import (
    BrokenBufferError,
    PeerDiedError,
    PeerTimeoutError,
    RankRemovedError,
    ShmCapacityError,
    ShmError,
    StoreHostDiedError,
    UbepError,
)
from ubep.handle import DispatchHandle, DispatchResult
from ubep.layout import DispatchLayout, get_dispatch_layout
from ubep.options import BufferConfig
from ubep.plan.topology import Topology
from ubep.runtime.memory_model import SyncInfo, sync_info
from ubep.stats import Interval, Stats, chrome_trace, write_chrome_trace

__version__ = "0.1.0"

__all__ = [
    "Buffer", "BufferConfig", "DispatchHandle", "DispatchResult", "DispatchLayout",
    "get_dispatch_layout", "Stats", "Interval", "chrome_trace", "write_chrome_trace", "Topology",
    "UbepError", "PeerTimeoutError", "PeerDiedError", "BrokenBufferError", "ShmError",
    "ShmCapacityError", "RankRemovedError", "StoreHostDiedError", "sync_info", "SyncInfo",
]
