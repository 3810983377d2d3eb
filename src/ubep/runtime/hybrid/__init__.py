"""The hybrid backend: ranks on several hosts, shared memory inside each, torch.distributed
between them (`Buffer(backend="hybrid")`, what `auto` picks across hosts).

`backend.py` runs a call (start there), `network.py` the messages between hosts,
`origins.py` the shared tables that say where a forwarded row came from; the pure layout
(who sends what to whom) is `ubep.plan.hosts`.
"""

from ubep.runtime.hybrid.backend import PARTIAL_DTYPES, HybridBackend

__all__ = ["HybridBackend", "PARTIAL_DTYPES"]
