"""`prometheus_client` collectors (the ``metrics`` extra: ``pip install twopc[metrics]``).

- `ManagerCollector`: a `TransactionManager`'s metrics (counters, the phase histogram, gauges),
  with the same names and help as `coordinator.metrics.Metrics.to_prometheus`, so an application
  that already runs `prometheus_client` registers its manager instead of serving that text:
  ``register_manager(tm)``.
- `FamiliesCollector`: any `Family` source, e.g. a server's ``families``; what
  ``twopc serve … --metrics`` registers.

Collectors read at scrape time and count nothing themselves: registering one costs a
transaction nothing. They are duck-typed (``collect``), not subclasses, so the coordinator's
types stay free of the client library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from coordinator.metrics import BUCKETS, PHASE_HELP, Metrics, counter_help, gauge_help

from ._families import COUNTER, Family


class FamiliesCollector:
    """Collects what ``source()`` returns at each scrape."""

    def __init__(self, source: Callable[[], list[Family]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        for f in self.source():
            labels = sorted({k for got, _ in f.samples for k, _ in got})
            kind = CounterMetricFamily if f.kind == COUNTER else GaugeMetricFamily
            metric = kind(f.name, f.help, labels=labels)
            for got, value in f.samples:
                as_dict = dict(got)
                metric.add_metric([as_dict.get(k, "") for k in labels], value)
            yield metric


class ManagerCollector:
    """A manager's `Metrics` as Prometheus families (``prefix`` as in ``to_prometheus``)."""

    def __init__(self, metrics: Metrics, prefix: str = "twopc") -> None:
        self.metrics = metrics
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        snap = self.metrics.snapshot()
        p = self.prefix
        for name, value in sorted(snap.counters.items()):
            metric = CounterMetricFamily(f"{p}_{name.replace('-', '_')}", counter_help(name))
            metric.add_metric([], value)
            yield metric
        if snap.phases:
            hist = HistogramMetricFamily(f"{p}_phase_seconds", PHASE_HELP, labels=["phase"])
            for phase, (counts, total, _n) in sorted(snap.phases.items()):
                cumulative, buckets = 0, []
                for bound, count in zip((*BUCKETS, float("inf")), counts, strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                hist.add_metric([phase], buckets, total)
            yield hist
        for name, reading in sorted(snap.gauges.items()):
            yield GaugeMetricFamily(f"{p}_{name}", gauge_help(name), value=reading)


def register_manager(
    tm: Any, registry: CollectorRegistry = REGISTRY, prefix: str = "twopc"
) -> ManagerCollector:
    """Register ``tm.metrics`` (a `TransactionManager`'s) with ``registry``; the collector, to
    unregister later."""
    collector = ManagerCollector(tm.metrics, prefix)
    registry.register(collector)
    return collector
