"""Counters and latencies of each phase, readable as a dict and as Prometheus text.

Standard library only: a fixed set of latency buckets per phase is enough to give p50/p99 and a
Prometheus histogram without pulling a client library into the coordinator.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: upper bounds in seconds; the last bucket is +Inf
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


#: what each counter counts, for the ``# HELP`` lines (a counter not listed gets a generic one)
COUNTER_HELP = {
    "begun": "transactions begun",
    "outcome_committed": "transactions ended committed",
    "outcome_commit_pending": "transactions committed with a branch left to recovery",
    "outcome_read_only": "transactions whose every branch voted read-only",
    "outcome_rolled_back": "transactions ended rolled back",
    "outcome_heuristic_mixed": "transactions ended with a heuristic mixed outcome",
    "outcome_heuristic_rollback": "transactions ended with a heuristic rollback",
    "outcome_heuristic_hazard": "transactions ended with a heuristic hazard",
    "outcome_unknown": "transactions whose outcome is unknown (log or one-phase failure)",
    "one_phase": "commits that took the one-phase path",
    "read_only": "commits where every branch voted read-only",
    "last_resource_commits": "commit points that were a last resource's commit",
    "carried_decisions": "COMMIT rows carried in a participant's one-phase commit",
    "async_phase_two": "phase twos run after commit() returned",
    "commit_unreachable": "phase-two commits left to recovery (branch unreachable)",
    "rollback_unreachable": "rollbacks left to recovery (branch unreachable)",
    "timeouts": "transactions the reaper marked rollback-only",
    "abandoned": "transactions the reaper rolled back itself",
    "retries": "tm.run retries",
    "recovery_passes": "recovery passes run",
    "recovered_commits": "branches recovery committed",
    "presumed_aborts": "branches recovery rolled back (presumed abort)",
    "recovery_failures": "recovery steps that failed and will be retried",
}
#: the gauges the manager itself registers; a resource's gauges get a generic line
GAUGE_HELP = {
    "in_doubt": "committed transactions whose phase two is not finished",
    "oldest_in_doubt_age_seconds": "age of the oldest in-doubt transaction",
}
PHASE_HELP = "duration of each phase of commit (commit, prepare, decision, commit_phase, recovery)"


def counter_help(name: str) -> str:
    return COUNTER_HELP.get(name, f"{name.replace('_', ' ')} (counter)")


def gauge_help(name: str) -> str:
    if name in GAUGE_HELP:
        return GAUGE_HELP[name]
    if name.startswith("resource_"):
        return f"a gauge a resource exports ({name.removeprefix('resource_')})"
    return name.replace("_", " ")


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


@dataclass(frozen=True)
class Snapshot:
    """`Metrics.snapshot`: ``phases`` maps a phase to (per-bucket counts, the last one +Inf;
    sum of seconds; count)."""

    counters: dict[str, int]
    phases: dict[str, tuple[list[int], float, int]]
    gauges: dict[str, float]


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

    def snapshot(self) -> Snapshot:
        """Counters, each phase's histogram and the gauges' values, read at once: what an
        exporter (`to_prometheus`, a `prometheus_client` collector) turns into families."""
        with self._lock:
            counters = dict(self.counters)
            phases = {p: (list(h.counts), h.total, h.n) for p, h in self.phases.items()}
        return Snapshot(counters, phases, {name: read() for name, read in self.gauges.items()})

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["phases"] = {name: h.as_dict() for name, h in self.phases.items()}
        for name, read in self.gauges.items():
            out[name] = read()
        return out

    def to_prometheus(self, prefix: str = "twopc") -> str:
        """The Prometheus text format (version 0.0.4): every family with its ``# HELP`` and
        ``# TYPE`` line, so a scraper and a human both know what a number means."""
        lines: list[str] = []
        with self._lock:
            for name, value in sorted(self.counters.items()):
                metric = f"{prefix}_{name.replace('-', '_')}_total"
                lines += [
                    f"# HELP {metric} {counter_help(name)}",
                    f"# TYPE {metric} counter",
                    f"{metric} {value}",
                ]
            if self.phases:
                lines.append(f"# HELP {prefix}_phase_seconds {PHASE_HELP}")
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
            metric = f"{prefix}_{name}"
            lines += [f"# HELP {metric} {gauge_help(name)}", f"# TYPE {metric} gauge",
                      f"{metric} {read()}"]  # fmt: skip
        return "\n".join(lines) + "\n"
