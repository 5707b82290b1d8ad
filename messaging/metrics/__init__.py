"""Metrics of the message log and cursor servers (issue 16): families read from the parts'
counters at scrape time, exported as Prometheus text (stdlib), through `prometheus_client` when
the ``metrics`` extra is installed, over HTTP (``twopc serve … --metrics HOST:PORT``), and online
through the ``stats`` administrative request (``twopc stats --connect``).

The coordinator's own metrics stay in `coordinator.metrics` (stdlib); `prometheus` here registers
a `TransactionManager`'s as a `prometheus_client` collector.
"""

from ._families import COUNTER, GAUGE, Family, from_value, render_text, to_value
from ._http import MetricsEndpoint
from ._servers import cursor_families, log_families

__all__ = [
    "COUNTER",
    "GAUGE",
    "Family",
    "MetricsEndpoint",
    "cursor_families",
    "from_value",
    "log_families",
    "render_text",
    "to_value",
]
