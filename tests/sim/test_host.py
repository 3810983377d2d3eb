"""The host model: constants in, predictions out (no bench run here: that is
`ubep simulate --validate-host`, a benchmark, not a test)."""

import pytest

from ubep.sim import host


def test_host_predictions_grow_with_payload_and_direct_copies_once():
    p = host.host_params(copy_GBps=8.0, flag_rtt_us=0.2)
    for system in host.SYSTEMS:
        lat = [host.predict(system, "dispatch", host.HIDDEN, b, p) for b in host.BATCHES]
        assert lat == sorted(lat) and lat[0] > 0, (system, lat)
    ubep = host.predict("shm-ubep", "dispatch", host.HIDDEN, 128, p)
    direct = host.predict("shm-direct", "dispatch", host.HIDDEN, 128, p)
    rows = 128 * host.TOP_K * host.HIDDEN * 2
    assert direct < ubep                             # one copy instead of two
    assert direct >= rows / (8.0 * 1e3)               # at least one copy of its rows


def test_per_call_overhead_is_what_the_model_leaves_unexplained():
    p = host.host_params(copy_GBps=8.0, flag_rtt_us=0.2)
    med = {}
    for system in host.SYSTEMS:
        for op in ("dispatch", "combine"):
            for b in host.BATCHES:
                med[(system, host.TINY_HIDDEN, b, op)] = \
                    host.predict(system, op, host.TINY_HIDDEN, b, p) + 30.0 + b
                med[(system, host.HIDDEN, b, op)] = 100.0
    hc = host.constants(med, 0.2, 8.0)
    assert all(v == pytest.approx(31.0) for v in hc.call_us.values())
    rows = host.validate(med, hc)
    assert len(rows) == len(host.SYSTEMS) * len(host.BATCHES) * 2
    assert all(r["measured_us"] == 100.0 and r["predicted_us"] > 31.0 for r in rows)
