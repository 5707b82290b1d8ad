"""Counters and latencies of each phase, readable as a dict and as Prometheus text.

Standard library only: a fixed set of latency buckets per phase is enough to give p50/p99 and a
Prometheus histogram without pulling a client library into the coordinator.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

#: upper bounds in seconds; the last bucket is +Inf
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds
        self.n += 1

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding the q-quantile (None when empty or in +Inf)."""
        if not self.n:
            return None
        rank, seen = q * self.n, 0
        for bound, count in zip(BUCKETS, self.counts, strict=False):
            seen += count
            if seen >= rank:
                return bound
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.n,
            "sum_s": round(self.total, 6),
            "p50_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
        }


class Metrics:
    """Thread-safe counters and per-phase histograms of one transaction manager.

    ``gauges`` are callables read at export time (in-doubt count, oldest in-doubt age), so the
    numbers are always current and cost nothing between reads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.phases: dict[str, Histogram] = {}
        self.gauges: dict[str, Callable[[], float]] = {}

    def incr(self, name: str, by: int = 1) -> None:
        with self._lock:
            self.counters[name] += by

    def observe(self, phase: str, seconds: float) -> None:
        with self._lock:
            hist = self.phases.get(phase)
            if hist is None:
                hist = self.phases[phase] = Histogram()
            hist.observe(seconds)

    def observe_many(self, timings: list[tuple[str, float]]) -> None:
        """`observe` each (phase, seconds) under one acquisition of the lock: a transaction's
        completion records its phases together instead of paying the lock once per phase."""
        with self._lock:
            phases = self.phases
            for phase, seconds in timings:
                hist = phases.get(phase)
                if hist is None:
                    hist = phases[phase] = Histogram()
                hist.observe(seconds)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["phases"] = {name: h.as_dict() for name, h in self.phases.items()}
        for name, read in self.gauges.items():
            out[name] = read()
        return out

    def to_prometheus(self, prefix: str = "twopc") -> str:
        lines: list[str] = []
        with self._lock:
            for name, value in sorted(self.counters.items()):
                metric = f"{prefix}_{name.replace('-', '_')}_total"
                lines += [f"# TYPE {metric} counter", f"{metric} {value}"]
            if self.phases:
                lines.append(f"# TYPE {prefix}_phase_seconds histogram")
            for phase, h in sorted(self.phases.items()):
                metric = f"{prefix}_phase_seconds"
                cumulative = 0
                for bound, count in zip((*BUCKETS, float("inf")), h.counts, strict=True):
                    cumulative += count
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    lines.append(f'{metric}_bucket{{phase="{phase}",le="{le}"}} {cumulative}')
                lines.append(f'{metric}_sum{{phase="{phase}"}} {h.total}')
                lines.append(f'{metric}_count{{phase="{phase}"}} {h.n}')
        for name, read in sorted(self.gauges.items()):
            lines += [f"# TYPE {prefix}_{name} gauge", f"{prefix}_{name} {read()}"]
        return "\n".join(lines) + "\n"
