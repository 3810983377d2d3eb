import pytest

from ubep.sim import CostParams


@pytest.fixture
def params() -> CostParams:
    """Uncalibrated but plausible constants: contended ports, latency-stalled issue."""
    return CostParams(port_bw_scale=0.05, window_rows=2, issue_latency_fraction=0.3)

