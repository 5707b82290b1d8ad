from __future__ import annotations

import pytest

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


def test_prometheus_text_has_help_and_type_for_every_family() -> None:
    """Every family a scraper reads says what it is (``# HELP``) and of which kind (``# TYPE``),
    and the text parses with prometheus_client's own parser when that is installed."""
    m = Metrics()
    m.incr("begun")
    m.incr("outcome_committed")
    m.observe("commit", 0.002)
    m.gauges["in_doubt"] = lambda: 0.0
    m.gauges["resource_pg_prepared"] = lambda: 1.0
    text = m.to_prometheus()
    typed = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    helped = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    assert typed == helped
    assert set(typed) == {
        "twopc_begun_total", "twopc_outcome_committed_total", "twopc_phase_seconds",
        "twopc_in_doubt", "twopc_resource_pg_prepared",
    }  # fmt: skip
    assert "# HELP twopc_begun_total transactions begun" in text
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert families["twopc_begun"].type == "counter"
    assert families["twopc_begun"].samples[0].value == 1.0
    assert families["twopc_phase_seconds"].type == "histogram"
    doc = families["twopc_in_doubt"].documentation
    assert doc == "committed transactions whose phase two is not finished"


def test_a_manager_registers_as_a_prometheus_collector_with_the_text_exports_names() -> None:
    """`register_manager` exposes what `to_prometheus` prints: same families, kinds, values."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from coordinator import MemoryDecisionLog, TransactionManager
    from messaging.metrics.prometheus import register_manager

    tm = TransactionManager("metrics-1", MemoryDecisionLog(), [],
                            recovery_interval=None, reaper_interval=None)  # fmt: skip
    try:
        for _ in range(3):
            with tm.transaction():
                pass
        tm.metrics.observe("commit", 0.003)
        registry = prometheus_client.CollectorRegistry(auto_describe=False)
        register_manager(tm, registry)
        scraped = prometheus_client.generate_latest(registry).decode()
        ours = tm.metrics.to_prometheus()
    finally:
        tm.close()

    def shape(text: str) -> dict[str, tuple[str, str, dict[str, float]]]:
        return {
            f.name: (f.type, f.documentation,
                     {s.name + str(sorted(s.labels.items())): s.value for s in f.samples
                      if not s.name.endswith("_created")})
            for f in text_string_to_metric_families(text)
        }  # fmt: skip

    assert shape(scraped) == shape(ours)
    assert shape(scraped)["twopc_begun"][2] == {"twopc_begun_total[]": 3.0}
