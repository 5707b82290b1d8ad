"""The coordinator's public surface is what users type, pinned: a name added or dropped here is a
decision, not an accident. Internals stay importable from their own modules."""

from __future__ import annotations

import importlib

import coordinator

#: the manager, its transaction, the logs, the resource protocol and its values
CORE = {
    "TransactionManager", "Transaction", "current", "InDoubt", "RecoveryReport",
    "DecisionLog", "FileDecisionLog", "MemoryDecisionLog",
    "Resource", "Synchronization", "Vote", "Outcome", "Xid",
    "CompletionPending",  # a warning, not an error: the commit was decided, phase two lags
}  # fmt: skip
#: the error tree users catch
ERRORS = {
    "TransactionError", "TransactionRolledBack", "TransactionTimedOut", "OutcomeUnknownError",
    "UnsettledError", "TransientError", "FencedError",
    "HeuristicError", "HeuristicCommit", "HeuristicRollback", "HeuristicMixed", "HeuristicHazard",
    "LogError", "LogCorruptionError", "LogLockedError", "LogWriteError", "UnreplayableRecordError",
    "ConfigurationError", "ProgrammingError", "IllegalStateError", "InvalidXidError",
    "NoTransactionError", "NoHeuristicError",
}  # fmt: skip


def test_the_coordinator_exports_what_users_type() -> None:
    assert set(coordinator.__all__) == CORE | ERRORS
    assert len(coordinator.__all__) == len(set(coordinator.__all__))


def test_every_error_exported_is_in_the_tree() -> None:
    for name in ERRORS:
        assert issubclass(getattr(coordinator, name), coordinator.TransactionError), name


def test_internals_stay_importable_from_their_modules() -> None:
    for module, name in (
        ("coordinator.decision_log", "Decision"),
        ("coordinator.decision_log", "HeuristicRecord"),
        ("coordinator.errors", "FrameError"),
        ("coordinator.states", "TxState"),
        ("coordinator.xid", "FORMAT_ID"),
    ):
        assert hasattr(importlib.import_module(module), name), (module, name)
        assert name not in coordinator.__all__


def test_every_package_exports_only_names_it_has() -> None:
    for package in (
        "coordinator", "resource_managers.postgres", "resource_managers.redis",
        "resource_managers.message_log", "resource_managers.cursor", "messaging.remote",
        "messaging.session", "messaging.transfer", "spark_integration",
    ):  # fmt: skip
        module = importlib.import_module(package)
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, (package, missing)
