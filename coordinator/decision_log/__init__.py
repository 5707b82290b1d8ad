"""Decision logs: where a commit decision becomes durable, and where recovery finds it again."""

from __future__ import annotations

from ._base import Decision, DecisionLog, HeuristicRecord, LogStats
from ._file import FileDecisionLog, journal_replay
from ._inspect import inspect_log
from ._memory import MemoryDecisionLog

__all__ = [
    "Decision",
    "DecisionLog",
    "FileDecisionLog",
    "HeuristicRecord",
    "LogStats",
    "MemoryDecisionLog",
    "inspect_log",
    "journal_replay",
]
