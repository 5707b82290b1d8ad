"""Lazy commit records: a branch's commit record need not be forced while the decision lives on.

Phase two tells each branch to commit. A store that forces its commit record there pays one fsync
on the caller's path that protects nothing recovery could not rebuild: while the coordinator
keeps the decision (a COMMIT record without END, or a last resource's commit row), a crash that
loses the branch's commit record leaves the branch prepared, and recovery commits it again from
the decision. So a resource may write its commit record lazily — carried to disk by the next
forced record of its journal, or by an fsync of its own shortly after — provided the coordinator
forgets the decision only once that record is durable.

The contract, one optional method (`commits_lazily` tells whether a resource has it):

``commit_lazily(xid, on_durable)``
    What ``commit(xid)`` of a prepared branch does, except that it may return before its record
    is durable. ``on_durable()`` is then called exactly once, on any thread, once it is — at once
    if there was nothing to write (a repeat, a heuristic answer). If the record never becomes
    durable (the process dies, the journal fails) it is never called, and the decision stays for
    recovery. Until then the branch must stay visible to `Resource.recover` as prepared, and a
    plain ``commit(xid)`` of it (recovery's) must return only once it is durable: recovery ends a
    decision once no branch lists its gtrid, so a record still in memory must not hide it.

``flush_commits()`` (optional)
    Make every lazy commit record durable now and run their callbacks: `TransactionManager.close`
    calls it before closing the decision log, so a clean stop leaves no decision to re-drive.

Only phase two on the coordinator's own path uses it: recovery, one-phase commits and remote
callers (which end their decision on the reply) always call the durable ``commit``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from ._verbs import LAZY, verbs_of
from .crashpoints import crash_point
from .resource import Outcome
from .xid import Xid


class LazyCommitter(Protocol):
    def commit_lazily(self, xid: Xid, on_durable: Callable[[], None]) -> Outcome | None: ...


def commits_lazily(resource: object) -> LazyCommitter | None:
    """The resource, if its class offers `commit_lazily` (`_verbs`: answered once per class)."""
    return resource if verbs_of(resource) & LAZY else None  # type: ignore[return-value]


class EndLatch:
    """Runs the transaction's end (END record, or the last resource's row clean-up) once every
    lazily committed branch is durable and phase two has finished: whichever comes last."""

    __slots__ = ("_end", "_lock", "_pending")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0
        self._end: Callable[[], object] | None = None

    def hold(self) -> Callable[[], None]:
        """One branch's ``on_durable``: call it once."""
        with self._lock:
            self._pending += 1
        return self._release

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1
            end = self._end if self._pending == 0 else None
            if end is not None:
                self._end = None
        if end is not None:
            crash_point("tm.before_deferred_end")
            end()

    def arm(self, end: Callable[[], object]) -> bool:
        """Run ``end`` now if nothing is pending (True), else when the last branch is durable."""
        with self._lock:
            if self._pending:
                self._end = end
                return False
        end()
        return True
