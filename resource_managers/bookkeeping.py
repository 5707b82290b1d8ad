"""What every resource manager keeps the same way: its name (the branch qualifier of its
xids), its sort key, and the branches it has started and not yet ended.

`MessageLogResource`, `CursorResource`, `RemoteMessageLog`, `RemoteCursor`, `PostgresResource`
and `RedisResource` each wrote this out; here it is once, so the rules stay one: a name is checked
when the resource is made, an xid of another branch is refused (`InvalidXidError`) before anything
is done with it, a branch is started at most once, and ending it (`_take`) closes it so a late
``send`` or ``receive`` on the handle the application still holds is refused rather than lost.

The table holds any kind of branch state (``T``): the database resources keep richer branches
(a connection, a buffered write set) that they end their own way, so only `_take` and `_drop`,
which close what they end, ask for a branch with a ``closed`` flag.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from coordinator.errors import (
    IllegalStateError,
    InvalidXidError,
    ProgrammingError,
    TransientError,
)
from coordinator.xid import Xid, is_sub_branch_of, validate_resource_name


class _Closable(Protocol):
    closed: bool


T = TypeVar("T")
B = TypeVar("B", bound=_Closable)


class Branches(Generic[T]):
    """A resource's name, sort key and table of active branches (of type ``T``).

    ``_sub_branches``: whether xids of sub-branches (``<name>~<tag>``, begun by another process
    for this resource, as Spark executors do) belong here too."""

    _sub_branches: ClassVar[bool] = True

    def __init__(self, name: str, sort_key: str | None) -> None:
        self._name = validate_resource_name(name)
        self._sort_key = sort_key or self._name
        self._lock = threading.Lock()
        self._branches: dict[Xid, T] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def sort_key(self) -> str:
        return self._sort_key

    def _check(self, xid: Xid) -> Xid:
        """``xid`` if it is a branch of this resource, else `InvalidXidError`."""
        if xid.bqual != self._name and not (
            self._sub_branches and is_sub_branch_of(xid.bqual, self._name)
        ):
            raise InvalidXidError(f"{self._name}: {xid} belongs to branch {xid.bqual!r}")
        return xid

    def _begin(self, xid: Xid, branch: T) -> T:
        """Record ``branch`` as ``xid``'s active one (`IllegalStateError` if it has one)."""
        with self._lock:
            if xid in self._branches:
                raise IllegalStateError(f"{self._name}: branch {xid} is already active")
            self._branches[xid] = branch
        return branch

    def _take(self: Branches[B], xid: Xid) -> B:
        """End ``xid``'s active branch and return it, closed (`IllegalStateError` if none)."""
        branch = self._drop(xid)
        if branch is None:
            raise IllegalStateError(f"{self._name}: no active branch {xid}")
        return branch

    def _drop(self: Branches[B], xid: Xid) -> B | None:
        """End ``xid``'s active branch if it has one (closed); None if not."""
        with self._lock:
            branch = self._branches.pop(self._check(xid), None)
        if branch is not None:
            branch.closed = True
        return branch

    def _get(self, xid: Xid) -> T | None:
        """``xid``'s active branch, or None."""
        with self._lock:
            return self._branches.get(xid)

    def _branch(self, xid: Xid) -> T:
        """``xid``'s active branch, which the caller's work needs (`ProgrammingError` if none)."""
        branch = self._get(xid)
        if branch is None:
            raise ProgrammingError(f"{self._name}: no active branch {xid}")
        return branch

    def _active(self, xid: Xid) -> bool:
        """``xid`` has a branch in its work phase here (started, not prepared or ended)."""
        with self._lock:
            return xid in self._branches


class PreparedGauges:
    """The two gauges a store with prepared branches on a server exports (PostgreSQL's
    `pg_prepared_xacts`, the Redis branch's prepared set): their count and the oldest one's age,
    read through ``prepared_stats``; NaN while the server is unreachable, so one store that is
    down does not break the manager's export."""

    def prepared_stats(self) -> tuple[int, float]:
        raise NotImplementedError

    def gauges(self) -> dict[str, Callable[[], float]]:
        """Read by the manager's metrics (`TransactionManager.register`)."""
        return {
            "prepared_transactions": lambda: self._gauge(0),
            "oldest_prepared_age_seconds": lambda: self._gauge(1),
        }

    def _gauge(self, index: int) -> float:
        try:
            return float(self.prepared_stats()[index])
        except TransientError:
            return math.nan


class _JournalState(Protocol):
    committed: set[str]
    tombstones: dict[str, int]

    def live_records(self, now_ms: int, tombstone_ms: int) -> list[dict[str, Any]]: ...


def carried_records(state: _JournalState, now_ms: int, tombstone_ms: int) -> list[dict[str, Any]]:
    """What a compaction of the message log's or the cursor's journal carries into the new
    segment (`coordinator.journal.Compaction`), by one rule for both: every live record, and the
    rollbacks' tombstones younger than ``tombstone_ms``; the gids of commits are forgotten (a
    commit of one is a repeat only while its record is in the journal). Call it holding the
    store's lock: it updates ``state`` to match what is carried."""
    carry = state.live_records(now_ms, tombstone_ms)
    state.committed.clear()
    state.tombstones = {r["g"]: r["t"] for r in carry if r["k"] == "R"}
    return carry
