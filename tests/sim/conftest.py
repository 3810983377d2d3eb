import pytest

from ubep.sim import CostParams


@pytest.fixture
def params() -> CostParams:
    """Uncalibrated but plausible constants: contended ports and second-tier uplinks."""
    return CostParams(port_bw_scale=0.05, uplink_bw_scale=0.3, stage_bw_GBps=4.0)

