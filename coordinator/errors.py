"""The twopc error tree, split by who must act.

- `ProgrammingError`: the caller misused the API; fix the code (an illegal state change, a bad xid).
- `TransientError`: nothing happened that a retry cannot fix; `TransactionManager.run` retries it.
- `TransactionRolledBack`: the transaction did not commit, and every branch was (or will be, by
  recovery) rolled back. Safe to retry the whole unit of work.
- `OutcomeUnknownError`: we cannot say whether it committed (Jepsen's indeterminate ``:info``).
  Never retry blindly: the work may already be applied.
- `HeuristicError`: a participant decided on its own, against the coordinator; a human must look.
- `LogError`: the decision log cannot be trusted or written; the manager refuses to go on rather
  than guess.
- `FrameError`: a malformed message on the wire; one connection is dropped, nothing else.

Every error has a stable ``code`` that ``docs/errors.md`` explains, and every error pickles with its
attributes intact, because Spark ships exceptions between processes.
"""

from __future__ import annotations

from typing import Any


class TransactionError(Exception):
    """Root of every error twopc raises."""

    code = "twopc"

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message)
        self.message = message
        for key, value in details.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException's default reduce passes only args; the keyword details live in __dict__.
        return (self.__class__, (self.message,), dict(self.__dict__))

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}" if self.message else f"[{self.code}]"


class ProgrammingError(TransactionError):
    code = "programming"


class IllegalStateError(ProgrammingError):
    """A call that the transaction's current state does not accept."""

    code = "illegal-state"


class InvalidXidError(ProgrammingError, ValueError):
    """An xid, gid, node id or resource name that breaks the XA and PostgreSQL limits."""

    code = "invalid-xid"


class NoTransactionError(ProgrammingError):
    code = "no-transaction"


class NoHeuristicError(ProgrammingError):
    """Forgetting a heuristic outcome that the log does not hold (a typo, or already forgotten):
    refused, so nothing is written and the real record, if any, stays."""

    code = "no-heuristic"


class ConfigurationError(ProgrammingError):
    """A manager or resource set up so that it cannot keep its promises."""

    code = "configuration"


class TransientError(TransactionError):
    """Retrying the whole transaction is safe and may succeed (serialization failure, timeout)."""

    code = "transient"


class UnsettledError(TransientError):
    """Nothing was done: an earlier attempt of this manager may still hold its work (a
    completion still waiting for a branch, a rollback not confirmed), and going on now would
    overtake it (a consumer would receive the messages behind the held ones first). Retry once
    `TransactionManager.settle` returns True."""

    code = "unsettled"


class TransactionRolledBack(TransactionError):
    """The transaction rolled back; ``reason`` says why (vote, timeout, rollback-only, error)."""

    code = "rolled-back"
    reason: str = "unknown"


class TransactionTimedOut(TransactionRolledBack, TransientError):
    code = "timed-out"
    reason = "timeout"


class OutcomeUnknownError(TransactionError):
    """Committed or not, we cannot tell now; recovery settles it and `twopc status` shows it."""

    code = "outcome-unknown"


class HeuristicError(TransactionError):
    """A participant completed on its own against the decision; recorded, kept until forgotten."""

    code = "heuristic"


class HeuristicMixed(HeuristicError):
    """Some branches committed, others were rolled back by someone else."""

    code = "heuristic-mixed"


class HeuristicRollback(HeuristicError):
    """The decision was commit but every branch had been rolled back by someone else."""

    code = "heuristic-rollback"


class HeuristicCommit(HeuristicError):
    """The decision was rollback but a branch had been committed by someone else."""

    code = "heuristic-commit"


class HeuristicHazard(HeuristicError):
    """A branch's outcome cannot be known (its record is gone); it may have gone either way."""

    code = "heuristic-hazard"


class LogError(TransactionError):
    code = "log"


class LogCorruptionError(LogError):
    """A record in the middle of the log fails its checksum; the file is kept untouched."""

    code = "log-corrupt"


class UnreplayableRecordError(LogCorruptionError):
    """A record that passed its checksum but that its owner cannot apply on replay (it does not
    decode, or applying it fails). Attributes ``path``, ``segment``, ``offset``, ``record`` (the
    start of the payload, printable) and ``reason``. Nothing was changed on disk; ``twopc journal
    quarantine`` moves the record aside."""

    code = "log-unreplayable"
    path: str
    segment: int
    offset: int
    record: str
    reason: str


class LogLockedError(LogError):
    """Another live manager holds this log directory."""

    code = "log-locked"


class LogWriteError(LogError):
    """A write or fsync failed; ``durable`` says whether the record may be on disk anyway."""

    code = "log-write"
    durable: bool | None = None


class FencedError(TransactionError):
    """This coordinator lost the right to decide (its lease was taken over, its deadline passed)."""

    code = "fenced"


class FrameError(TransactionError):
    """A malformed, oversized or unauthenticated frame on the wire."""

    code = "bad-frame"


class CompletionPending(UserWarning):
    """Committed, but a branch could not be told yet; recovery finishes it. Not an error."""
