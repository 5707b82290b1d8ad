"""The decision log's facts and how records change them, plus `MemoryDecisionLog`.

`LogState` is the single definition of what a sequence of records means; the file log rebuilds it
by replaying its journal and the memory log simply keeps it, so the two cannot drift apart. Every
record applies idempotently, because replay after a crashed rollover repeats records and recovery
may write the same COMMIT or END twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import FencedError, LogWriteError

from ._base import Decision, HeuristicRecord, LogStats

Clock = Callable[[], float]


@dataclass(frozen=True)
class End:
    """Every branch of ``gtrid`` has been told; recovery may stop re-driving it."""

    gtrid: str


@dataclass(frozen=True)
class Forget:
    """An operator dealt with the heuristic outcome of ``branch`` (every branch if None)."""

    gtrid: str
    branch: str | None = None


Record = Decision | End | HeuristicRecord | Forget


class LogState:
    """Pending decisions (COMMIT without END) and live heuristics, in the order first seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, Decision] = {}
        self._heuristics: dict[tuple[str, str], HeuristicRecord] = {}

    def apply(self, record: Record) -> None:
        with self._lock:
            if isinstance(record, Decision):
                self._pending[record.gtrid] = record
            elif isinstance(record, End):
                self._pending.pop(record.gtrid, None)
            elif isinstance(record, HeuristicRecord):
                self._heuristics[(record.gtrid, record.branch)] = record
            else:
                self._forget(record)

    def _forget(self, record: Forget) -> None:
        for key in [key for key in self._heuristics if key[0] == record.gtrid]:
            if record.branch is None or record.branch == key[1]:
                del self._heuristics[key]

    def pending(self) -> list[Decision]:
        with self._lock:
            return list(self._pending.values())

    def heuristics(self) -> list[HeuristicRecord]:
        with self._lock:
            return list(self._heuristics.values())

    def live_records(self) -> list[Record]:
        """Every record a compacted log must still hold: the rest only cancel each other out."""
        with self._lock:
            return [*self._pending.values(), *self._heuristics.values()]


def admit(decision: Decision, clock: Clock) -> Decision:
    """Fence a decision by its deadline, and stamp when it was written if the caller did not.

    Past the deadline, recovery elsewhere may already have presumed abort and rolled branches back;
    a COMMIT written now would contradict it, so we refuse before writing anything.
    """
    now = clock()
    if decision.deadline is not None and now > decision.deadline:
        raise FencedError(
            f"decision for {decision.gtrid} is {now - decision.deadline:.3f}s past its deadline; "
            "not written",
            gtrid=decision.gtrid,
            deadline=decision.deadline,
        )
    if decision.written_at:
        return decision
    return Decision(decision.gtrid, decision.branches, decision.deadline, now, decision.carried)


class MemoryDecisionLog:
    """`DecisionLog` semantics with no durability: a crash forgets everything. Tests, benchmarks."""

    def __init__(self, *, clock: Clock = time.time) -> None:
        self._state = LogState()
        self._clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._forced = 0
        self._lazy = 0

    def log_commit(self, decision: Decision) -> None:
        self._write(admit(decision, self._clock), forced=True)

    def log_end(self, gtrid: str) -> None:
        self._write(End(gtrid), forced=False)

    def log_heuristic(self, record: HeuristicRecord) -> None:
        self._write(record, forced=True)

    def forget_heuristic(self, gtrid: str, branch: str | None = None) -> None:
        self._write(Forget(gtrid, branch), forced=True)

    def pending(self) -> list[Decision]:
        return self._state.pending()

    def heuristics(self) -> list[HeuristicRecord]:
        return self._state.heuristics()

    def stats(self) -> LogStats:
        with self._lock:
            return LogStats(forced_records=self._forced, lazy_records=self._lazy)

    def check_owner(self) -> None:
        """Never fenced: a memory log belongs to its process."""

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def _write(self, record: Record, *, forced: bool) -> None:
        with self._lock:
            if self._closed:
                raise LogWriteError("decision log is closed; nothing was written", durable=False)
            if forced:
                self._forced += 1
            else:
                self._lazy += 1
        self._state.apply(record)
