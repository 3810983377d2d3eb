import pytest

from ubep.sim import CostParams


@pytest.fixture
def params() -> CostParams:
    """Uncalibrated but plausible constants with contended ports (small cases queue)."""
    return CostParams(port_bw_scale=0.05, window_rows=2)

