"""twopc's coordinator: two-phase commit with presumed abort, a durable decision log, recovery.

Standard library only, and nothing else of twopc: every other package builds on this one.

What users type is exported here: the manager and its transaction, the decision logs, the
resource protocol and its values, and the error tree. Everything else stays importable from its
own module (`coordinator.decision_log.Decision`, `coordinator.states.TxState`,
`coordinator.xid.FORMAT_ID`, ...); `tests/unit/test_public_api.py` pins this list.
"""

from .decision_log import (
    DecisionLog,
    FileDecisionLog,
    MemoryDecisionLog,
)
from .errors import (
    CompletionPending,
    ConfigurationError,
    FencedError,
    HeuristicCommit,
    HeuristicError,
    HeuristicHazard,
    HeuristicMixed,
    HeuristicRollback,
    IllegalStateError,
    InvalidXidError,
    LogCorruptionError,
    LogError,
    LogLockedError,
    LogWriteError,
    NoHeuristicError,
    NoTransactionError,
    OutcomeUnknownError,
    ProgrammingError,
    TransactionError,
    TransactionRolledBack,
    TransactionTimedOut,
    TransientError,
    UnreplayableRecordError,
    UnsettledError,
)
from .manager import InDoubt, TransactionManager, current
from .recovery import RecoveryReport
from .resource import Outcome, Resource, Synchronization, Vote
from .transaction import Transaction
from .xid import Xid

__all__ = [
    "CompletionPending",
    "ConfigurationError",
    "DecisionLog",
    "FencedError",
    "FileDecisionLog",
    "HeuristicCommit",
    "HeuristicError",
    "HeuristicHazard",
    "HeuristicMixed",
    "HeuristicRollback",
    "IllegalStateError",
    "InDoubt",
    "InvalidXidError",
    "LogCorruptionError",
    "LogError",
    "LogLockedError",
    "LogWriteError",
    "MemoryDecisionLog",
    "NoHeuristicError",
    "NoTransactionError",
    "Outcome",
    "OutcomeUnknownError",
    "ProgrammingError",
    "RecoveryReport",
    "Resource",
    "Synchronization",
    "Transaction",
    "TransactionError",
    "TransactionManager",
    "TransactionRolledBack",
    "TransactionTimedOut",
    "TransientError",
    "UnreplayableRecordError",
    "UnsettledError",
    "Vote",
    "Xid",
    "current",
]
