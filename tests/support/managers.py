"""`make_manager`: a `TransactionManager` for a unit test, closed by the test's `managers` list.

No background threads unless a test asks for them: recovery and the reaper run when the test calls
them, so what a test sees does not depend on a timer. The `managers` fixture (tests/conftest.py)
yields the list and closes every manager in it after the test.
"""

from __future__ import annotations

from typing import Any

from coordinator import MemoryDecisionLog, TransactionManager
from coordinator.decision_log import DecisionLog


def make_manager(
    made: list[TransactionManager],
    resources: list[Any],
    log: DecisionLog | None = None,
    node_id: str = "node-1",
    **options: Any,
) -> TransactionManager:
    """A manager over ``resources`` and ``log`` (a fresh memory log if None), added to ``made``."""
    options.setdefault("recovery_interval", None)
    options.setdefault("reaper_interval", None)
    tm = TransactionManager(node_id, log or MemoryDecisionLog(), resources, **options)
    made.append(tm)
    return tm
