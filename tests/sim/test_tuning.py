"""The tuning cache: record, look up, survive a bad file; the cost model prefers its choice."""

import pytest

from ubep import tuning
from ubep.plan.costmodel import choose_count_workers


def test_record_and_lookup_round_trip(tmp_path):
    path = tmp_path / "sub" / "tuning.json"
    assert tuning.lookup("cm384", 48, 64, 128, path=path) is None
    tuning.record("cm384", 48, 64, 128, 5, latency_us=80.0, source="test", path=path)
    tuning.record("cm384", 48, 64, 8, 9, latency_us=30.0, source="test", path=path)
    assert tuning.lookup("cm384", 48, 64, 128, path=path) == 5
    assert tuning.lookup("cm384", 48, 64, 8, path=path) == 9
    assert tuning.lookup("nvl72", 48, 64, 8, path=path) is None
    assert choose_count_workers(48, 64, 8, 128, tuned=5) == 5
    assert choose_count_workers(4, 64, 8, 128, tuned=9) != 9     # out of range: the formula
    with pytest.raises(ValueError, match="count_workers=48"):
        tuning.record("cm384", 48, 64, 8, 48, latency_us=1.0, source="test", path=path)


def test_unreadable_cache_is_empty(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text("{not json")
    assert tuning.load(path) == {}
    assert tuning.lookup("cm384", 48, 64, 128, path=path) is None
