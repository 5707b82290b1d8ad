"""twopc's coordinator: two-phase commit with presumed abort, a durable decision log, recovery.

Standard library only, and nothing else of twopc: every other package builds on this one.
"""

from .decision_log import (
    Decision,
    DecisionLog,
    FileDecisionLog,
    HeuristicRecord,
    MemoryDecisionLog,
)
from .errors import (
    CompletionPending,
    ConfigurationError,
    FencedError,
    FrameError,
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
from .states import TxState
from .transaction import Transaction
from .xid import FORMAT_ID, Xid

__all__ = [
    "FORMAT_ID",
    "CompletionPending",
    "ConfigurationError",
    "Decision",
    "DecisionLog",
    "FencedError",
    "FileDecisionLog",
    "FrameError",
    "HeuristicCommit",
    "HeuristicError",
    "HeuristicHazard",
    "HeuristicMixed",
    "HeuristicRecord",
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
    "TxState",
    "UnreplayableRecordError",
    "UnsettledError",
    "Vote",
    "Xid",
    "current",
]
