from __future__ import annotations

from coordinator.metrics import Metrics


def test_counters_phases_and_gauges_export() -> None:
    m = Metrics()
    m.incr("begun", 3)
    for seconds in (0.0001, 0.002, 0.003, 20.0):
        m.observe("prepare", seconds)
    m.gauges["in_doubt"] = lambda: 2.0
    d = m.as_dict()
    assert d["begun"] == 3 and d["in_doubt"] == 2.0
    assert d["phases"]["prepare"]["count"] == 4
    assert d["phases"]["prepare"]["p50_s"] == 0.0025
    assert d["phases"]["prepare"]["p99_s"] is None  # in the +Inf bucket
    text = m.to_prometheus()
    assert "twopc_begun_total 3" in text
    assert 'twopc_phase_seconds_bucket{phase="prepare",le="+Inf"} 4' in text
    assert "twopc_in_doubt 2.0" in text
