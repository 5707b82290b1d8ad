"""The decision log contract: what a coordinator must be able to find again after a crash.

Presumed abort keeps the log small: nothing is written before every branch has voted, one-phase
and all-read-only transactions write nothing, and the absence of a COMMIT record means abort. So a
log holds three kinds of facts:

- ``COMMIT(gtrid, branches, deadline)``: forced. Once ``log_commit`` returns, the transaction is
  committed, whatever crashes next. This is the commit point.
- ``END(gtrid)``: not forced. Every branch has been told; recovery may stop re-driving it. Losing an
  END costs one idempotent re-commit, never correctness.
- ``HEURISTIC(gtrid, branch, outcome)``: forced. A branch completed against the decision; it stays
  until an operator forgets it, so the evidence is never lost.

Implementations: `FileDecisionLog` (journal files, the embedded default) and the SQL log (in
``resource_managers``), which adds a node lease so another host can take over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Decision:
    """A forced COMMIT decision.

    ``branches`` are the resource names (bquals) that voted to commit, in commit order. ``deadline``
    is wall-clock seconds since the epoch after which this coordinator may no longer write the
    decision: recovery elsewhere may already have presumed abort (fencing by time, as Atomikos'
    ``OltpLogImp``); None means no deadline. ``carried``: the branches a last resource's commit
    carries as payloads (`coordinator.carried`), (name, payload) pairs; only a last resource's
    decision row holds them, a decision log never sees any.
    """

    gtrid: str
    branches: tuple[str, ...]
    deadline: float | None = None
    written_at: float = 0.0
    carried: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True)
class HeuristicRecord:
    """One branch that completed against the decision (``outcome`` is an `Outcome` value)."""

    gtrid: str
    branch: str
    outcome: str
    detail: str = ""
    recorded_at: float = 0.0


@dataclass
class LogStats:
    """Counters every log exposes for metrics and benchmarks."""

    forced_records: int = 0
    lazy_records: int = 0
    fsyncs: int = 0
    bytes_written: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class DecisionLog(Protocol):
    """Durable storage of commit decisions. One live manager per log (a directory lock or a lease).

    Obligations:
    - ``log_commit`` returns only once the record is durable. If it raises `LogWriteError` with
      ``durable=False`` the record is certainly not in the log and the caller may abort; with
      ``durable=None`` the record may or may not be there, so the caller must not roll anything
      back and must leave the outcome to recovery. Past ``decision.deadline`` it raises
      `FencedError` without writing.
    - ``pending`` and ``heuristics`` reflect every record written by this or any earlier process
      on this log, whatever it was killed in the middle of.
    - Writing the same COMMIT or END twice is harmless (recovery may repeat itself).
    - ``check_owner`` raises `FencedError` once this process may no longer decide for its node
      (the SQL log's lease was taken over). Recovery asks before every presumed abort: a fenced
      coordinator must not roll back branches that now belong to the node's new owner.
    """

    def log_commit(self, decision: Decision) -> None: ...

    def log_end(self, gtrid: str) -> None: ...

    def log_heuristic(self, record: HeuristicRecord) -> None: ...

    def forget_heuristic(self, gtrid: str, branch: str | None = None) -> None: ...

    def pending(self) -> list[Decision]: ...

    def heuristics(self) -> list[HeuristicRecord]: ...

    def stats(self) -> LogStats: ...

    def check_owner(self) -> None: ...

    def close(self) -> None: ...
