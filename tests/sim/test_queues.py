"""The vectorised FIFO equals a one-item-at-a-time server."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.sim.queues import fifo_depart


def _loop(queue, arrive, service):
    out = np.zeros(arrive.size)
    busy: dict[int, float] = {}
    for k in sorted(range(arrive.size), key=lambda k: (arrive[k], k)):
        t = max(arrive[k], busy.get(int(queue[k]), -np.inf)) + service[k]
        busy[int(queue[k])] = out[k] = t
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(0, 5)),
                min_size=1, max_size=40))
def test_fifo_depart_matches_a_plain_server(items):
    q = np.array([i[0] for i in items])
    a = np.array([float(i[1]) for i in items])
    s = np.array([float(i[2]) * 0.5 for i in items])
    np.testing.assert_allclose(fifo_depart(q, a, s), _loop(q, a, s), atol=1e-9)
