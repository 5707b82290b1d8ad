"""`MessageLogResource`: the message log as a two-phase participant (the capture side).

``tx.join(mlog)`` returns a `ProducerBranch`; ``send`` stages a message in it, validated and
checked against the destination's limit at once, so a refusal never reaches prepare.

- **prepare**: nothing staged votes ``READ_ONLY``. Otherwise one forced ``P`` record holds the
  persistent messages (non-persistent ones stay in memory), and the branch is prepared. A gid with
  a tombstone is refused: recovery rolled it back while this process still worked on it.
- **commit** (idempotent): one forced ``C`` record gives each message its stream number; the
  messages then become visible to readers, in number order. A repeat, or a gid this log never
  prepared, is already done (None). A gid with a tombstone was rolled back: ``HEURISTIC_ROLLBACK``.
  ``one_phase``: prepare and commit in one forced ``1`` record.
- **rollback** (idempotent): discards the branch and leaves a tombstone (``R``, lazy). A gid whose
  commit record is still in the journal reports ``HEURISTIC_COMMIT``.
- **recover**: every prepared gid of this resource's name, whatever its age. **forget** drops a
  tombstone.

Crash points: ``mlog.<name>.after_prepare`` (the ``P`` record is durable, the vote not returned),
``mlog.<name>.after_append`` (the ``C`` record is durable, the messages not yet visible),
``mlog.<name>.after_commit`` (visible, the commit not returned).
"""

from __future__ import annotations

import threading
from typing import Any

from coordinator import (
    IllegalStateError,
    InvalidXidError,
    Outcome,
    ProgrammingError,
    Vote,
    Xid,
)
from coordinator.crashpoints import crash_point
from coordinator.xid import branches_of, is_sub_branch_of, validate_resource_name

from ._log import BranchRolledBack, MessageLog
from ._records import InvalidMessageError, Message, new_message


class ProducerBranch:
    """One transaction's messages, staged until prepare. Not thread-safe (one transaction)."""

    def __init__(self, resource: MessageLogResource, xid: Xid) -> None:
        self._resource = resource
        self.xid = xid
        self.messages: list[Message] = []
        self.closed = False

    def send(
        self,
        destination: str,
        body: bytes,
        headers: dict[str, str] | None = None,
        persistent: bool = True,
        ttl: float | None = None,
    ) -> str:
        """Stage a message; return its id. Refusals stage nothing: `InvalidMessageError` (bad
        destination, headers, body, or larger than the log's ``max_message_bytes``),
        `DestinationFullError` (a `TransientError`: the destination is at its limit)."""
        if self.closed:
            raise IllegalStateError(f"{self._resource.name}: send after the branch ended")
        log = self._resource.log
        message = new_message(
            destination, body=body, headers=headers, persistent=persistent, ttl=ttl,
            now_ms=log.clock(),
        )  # fmt: skip
        if message.size > log.max_message_bytes:
            raise InvalidMessageError(
                f"message of {message.size} bytes (body and headers) exceeds the limit of "
                f"{log.max_message_bytes}; nothing was staged"
            )
        staged = sum(1 for m in self.messages if m.destination == message.destination)
        log.check_room(message.destination, staged + 1)
        self.messages.append(message)
        return message.message_id


class MessageLogResource:
    """A `MessageLog` as a resource manager. ``name`` is the bqual: keep it stable."""

    def __init__(self, log: MessageLog, name: str = "mlog", *, sort_key: str | None = None):
        self._name = validate_resource_name(name)
        self._sort_key = sort_key or self._name
        self.log = log
        self._lock = threading.Lock()
        self._branches: dict[Xid, ProducerBranch] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def sort_key(self) -> str:
        return self._sort_key

    def __repr__(self) -> str:
        return f"MessageLogResource({self._name!r}, {str(self.log.directory)!r})"

    def start(self, xid: Xid) -> ProducerBranch:
        self._check(xid)
        branch = ProducerBranch(self, xid)
        with self._lock:
            if xid in self._branches:
                raise IllegalStateError(f"{self._name}: branch {xid} is already active")
            self._branches[xid] = branch
        return branch

    def prepare(self, xid: Xid) -> Vote:
        branch = self._take(xid)
        gid = xid.to_gid()
        if self.log.is_tombstoned(gid):
            raise BranchRolledBack(f"{self._name}: {gid} was rolled back (tombstone); no prepare")
        if not branch.messages:
            return Vote.READ_ONLY
        self.log.prepare(gid, branch.messages)
        crash_point(f"mlog.{self._name}.after_prepare")
        return Vote.COMMIT

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        gid = self._check(xid).to_gid()
        if one_phase:
            branch = self._take(xid)
            if self.log.is_tombstoned(gid):
                raise BranchRolledBack(f"{self._name}: {gid} was rolled back (tombstone)")
            if branch.messages:
                self.log.commit(gid, branch.messages)
            return None
        with self._lock:
            if xid in self._branches:
                raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
        if self.log.is_tombstoned(gid):
            return Outcome.HEURISTIC_ROLLBACK
        if self.log.is_prepared(gid):
            self.log.commit(gid, after_append=f"mlog.{self._name}.after_append")
            crash_point(f"mlog.{self._name}.after_commit")
        return None

    def rollback(self, xid: Xid) -> Outcome | None:
        gid = self._check(xid).to_gid()
        with self._lock:
            branch = self._branches.pop(xid, None)
        if branch is not None:
            branch.closed = True
        if self.log.is_committed(gid):
            return Outcome.HEURISTIC_COMMIT
        self.log.rollback(gid)
        return None

    def recover(self) -> list[Xid]:
        return branches_of(self.log.prepared_gids(), self._name, sub_branches=True)

    def forget(self, xid: Xid) -> None:
        self.log.forget(self._check(xid).to_gid())

    def gauges(self) -> dict[str, Any]:
        return {
            f"mlog_{self._name}_pending": lambda: float(self.log.stats().pending),
            f"mlog_{self._name}_prepared": lambda: float(self.log.stats().prepared),
        }

    def _take(self, xid: Xid) -> ProducerBranch:
        with self._lock:
            branch = self._branches.pop(self._check(xid), None)
        if branch is None:
            raise IllegalStateError(f"{self._name}: no active branch {xid}")
        branch.closed = True
        return branch

    def _check(self, xid: Xid) -> Xid:
        if xid.bqual != self._name and not is_sub_branch_of(xid.bqual, self._name):
            raise InvalidXidError(f"{self._name}: {xid} belongs to branch {xid.bqual!r}")
        return xid
