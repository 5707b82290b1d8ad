"""`CursorResource`: the cursor as a two-phase participant (the delivery side).

``tx.join(cursor)`` returns a `ConsumerBranch`; ``receive(destination, timeout=...)`` hands the
first available message of the destination to this branch alone (its delivery count durably
raised first: by a forced ``H`` record, or already by an earlier branch's forced record that
pre-counted it), waiting on the cursor's condition up to ``timeout`` seconds.

- **prepare**: nothing received votes ``READ_ONLY``. Otherwise one forced ``P`` record makes the
  branch's deletions durable, and pre-counts the next messages of its queues.
  A gid with a tombstone is refused (`BranchRolledBack`).
- **commit** (idempotent): one ``C`` record deletes the messages: forced for a one-phase or a
  recovery's commit, lazy in phase two (`commit_lazily`, `lazy_commit=True`: the coordinator keeps
  its decision until the record is durable). A repeat or an unknown gid is done (None); a gid with
  a tombstone reports ``HEURISTIC_ROLLBACK``. ``one_phase``: the ``C`` record straight from the
  received messages, pre-counting as a ``P`` does.
- **rollback** (idempotent): the messages become available again, in their place, with
  ``redelivered`` and the count raised at their next delivery; a message already delivered
  ``max_deliveries`` times moves to ``<destination>.DLQ`` with the reason, in the same ``R``
  record, which also leaves the tombstone (forced for a prepared branch, lazy otherwise). A gid
  whose commit record is in the journal reports ``HEURISTIC_COMMIT``.
- **recover**: every prepared gid of this resource's name (and one whose lazy commit record is not
  durable yet). **forget** drops a tombstone.

- **carried** (``rides_last_resource``, the default): in a transaction whose logging last
  resource can carry it (`coordinator.carried`), the branch does not prepare: ``stage`` hands the
  coordinator its commit record, which the database's decision row holds, and ``commit_carried``
  applies it after that commit with one lazy record. The consumer then forces one write per
  transaction, the database's commit. After a crash the cursor hands nothing out until the
  node's recovery has restored what the crash lost (`._carried`).

Crash points: ``cursor.<name>.after_receive`` (the message's count is durable, the message not
yet returned), ``cursor.<name>.after_prepare``, ``cursor.<name>.after_commit``,
``cursor.<name>.after_carried_commit``, ``cursor.<name>.carried_durable``; in the `Cursor`,
``cursor.after_precount``, ``cursor.after_credited_take`` and ``cursor.after_carriers``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from coordinator import (
    IllegalStateError,
    InvalidXidError,
    LogCorruptionError,
    Outcome,
    ProgrammingError,
    Vote,
    Xid,
    tracing,
)
from coordinator.crashpoints import crash_point
from coordinator.xid import branches_of
from resource_managers import lazy_commit
from resource_managers.bookkeeping import Branches
from resource_managers.message_log import validate_destination

from ._cursor import Cursor
from ._records import decode
from ._topics import Subscription
from ._values import DEFAULT_MAX_DELIVERIES, BranchRolledBack, Delivery


class ConsumerBranch:
    """One transaction's receipts. Not thread-safe (one transaction)."""

    def __init__(self, resource: CursorResource, xid: Xid) -> None:
        self._resource = resource
        self.xid = xid
        self.deliveries: list[Delivery] = []
        self.closed = False

    def receive(self, destination: str, timeout: float | None = 0.0) -> Delivery | None:
        """The next message of ``destination`` (or of a dead-letter queue, ``<d>.DLQ``), or None
        after ``timeout`` seconds without one (None: wait for ever)."""
        got = self.receive_many(destination, 1, timeout)
        return got[0] if got else None

    def receive_many(
        self, destination: str, max_messages: int, timeout: float | None = 0.0
    ) -> list[Delivery]:
        """Up to ``max_messages`` messages of ``destination`` in order, in one forced record at
        most (none for messages an earlier forced record pre-counted): waits up to ``timeout``
        for the first, then takes what is there. A batch consumer pays one fsync for the lot
        instead of one per message."""
        if self.closed:
            raise IllegalStateError(f"{self._resource.name}: receive after the branch ended")
        validate_destination(destination)
        r = self._resource
        got = r.cursor.take_many(self.xid.to_gid(), destination, max_messages, timeout)
        if got:
            crash_point(f"cursor.{r.name}.after_receive")
            self.deliveries += got
            if tracing.installed() is not None:
                tracing.received(self.xid.gtrid, got[0].headers)
        return got


class CursorResource(Branches[ConsumerBranch]):
    """A `Cursor` as a resource manager. ``name`` is the bqual: keep it stable.

    ``lazy_commit`` (default True): in phase two the commit record (the deletion of the branch's
    messages) is not forced; the cursor's next forced record carries it (or an fsync of its own
    ``lazy_delay`` later), and the coordinator keeps its decision until then
    (`coordinator.lazy_commit`). False: forced before the commit returns.

    ``rides_last_resource`` (default True): in a transaction whose last resource can carry it,
    the branch's commit record rides that resource's commit instead of a forced prepare
    (`coordinator.carried`); False prepares as before."""

    _sub_branches = False  # a cursor's branches are its consumers', never another process's

    def __init__(
        self,
        cursor: Cursor,
        name: str = "cursor",
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        *,
        sort_key: str | None = None,
        lazy_commit: bool = True,
        rides_last_resource: bool = True,
    ) -> None:
        if max_deliveries < 1:
            raise ProgrammingError("max_deliveries must be >= 1")
        super().__init__(name, sort_key)
        self.lazy_commit = lazy_commit
        self.rides_last_resource = rides_last_resource
        self.cursor = cursor
        self.max_deliveries = max_deliveries

    def __repr__(self) -> str:
        return f"CursorResource({self._name!r}, {str(self.cursor.directory)!r})"

    def start(self, xid: Xid) -> ConsumerBranch:
        return self._begin(xid, ConsumerBranch(self, self._check(xid)))

    def prepare(self, xid: Xid) -> Vote:
        self._take(xid)
        if not self.cursor.prepare(xid.to_gid()):
            return Vote.READ_ONLY
        crash_point(f"cursor.{self._name}.after_prepare")
        return Vote.COMMIT

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        gid = self._check(xid).to_gid()
        if one_phase:
            self._take(xid)
            if self.cursor.is_tombstoned(gid):
                raise BranchRolledBack(f"{self._name}: {gid} was rolled back (tombstone)")
            self.cursor.commit_one_phase(gid)
            return None
        with self._lock:
            if xid in self._branches:
                raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
        if self.cursor.is_tombstoned(gid):
            return Outcome.HEURISTIC_ROLLBACK
        if self.cursor.is_prepared(gid):
            self.cursor.commit(gid)
            crash_point(f"cursor.{self._name}.after_commit")
        return None

    def commit_lazily(self, xid: Xid, on_durable: Callable[[], None]) -> Outcome | None:
        """Phase two's commit, its record lazy: `resource_managers.lazy_commit`."""
        return lazy_commit.commit_lazily(
            self.cursor, self._check(xid), on_durable, active=self._active(xid),
            lazy=self.lazy_commit, durable_commit=self.commit, points=f"cursor.{self._name}",
        )  # fmt: skip

    def flush_commits(self) -> None:
        """Lazy commit records durable now (`TransactionManager.close` calls this)."""
        self.cursor.flush_commits()

    # -- carried by the last resource's commit (coordinator.carried) ------------------------------

    def stage(self, xid: Xid) -> bytes | None:
        """Phase one without a record: the branch's commit record, for the decision row."""
        self._take(xid)
        node = xid.node_id
        if node is None:
            raise IllegalStateError(f"{self._name}: {xid} names no coordinator node to carry it")
        return self.cursor.stage(xid.to_gid(), node)

    def commit_carried(self, xid: Xid, payload: bytes, on_durable: Callable[[], None]) -> None:
        gid = self._check(xid).to_gid()
        if not self.cursor.is_staged(gid):  # not staged in this process: as recovery would
            self.restore_carried(xid, payload)
            on_durable()
            return
        points = f"cursor.{self._name}"

        def durable() -> None:
            crash_point(f"{points}.carried_durable")
            on_durable()

        self.cursor.commit_carried(gid, durable, force=not self.lazy_commit)
        crash_point(f"{points}.after_carried_commit")

    def restore_carried(self, xid: Xid, payload: bytes) -> None:
        try:
            record = decode(payload)
        except LogCorruptionError as exc:
            raise InvalidXidError(f"{self._name}: {xid}'s carried payload is unreadable") from exc
        if record["k"] != "C" or record["g"] != xid.to_gid() or "v" in record or "f" in record:
            raise InvalidXidError(f"{self._name}: the carried payload is not {xid}'s")
        self.cursor.restore_carried(record["g"], record)

    def carried_gids(self) -> set[str]:
        return {x.to_gid() for x in branches_of(self.cursor.carried_gids(), self._name)}

    def forget_carried(self, gids: Collection[str]) -> None:
        self.cursor.forget_carried(gids)

    def carried_restored(self, node_id: str) -> None:
        """Recovery of ``node_id`` restored every carried commit its rows hold for this cursor."""
        self.cursor.carried_restored(node_id)

    def rollback(self, xid: Xid) -> Outcome | None:
        gid = self._check(xid).to_gid()
        self._drop(xid)
        if self.cursor.is_committed(gid):
            return Outcome.HEURISTIC_COMMIT
        self.cursor.rollback(gid, self.max_deliveries)
        return None

    def recover(self) -> list[Xid]:
        return branches_of(self.cursor.prepared_gids(), self._name)

    def forget(self, xid: Xid) -> None:
        self.cursor.forget(self._check(xid).to_gid())

    # The subscription surface, so a session can hold a local cursor or a `RemoteCursor` alike.

    def subscribe(self, topic: str, name: str, *, durable: bool = True) -> Subscription:
        return self.cursor.subscribe(topic, name, durable=durable)

    def unsubscribe(self, topic: str, name: str) -> int:
        return self.cursor.unsubscribe(topic, name)

    def subscriptions(self, topic: str | None = None) -> list[Subscription]:
        return self.cursor.subscriptions(topic)

    def attach(self, topic: str, name: str) -> Subscription:
        return self.cursor.attach(topic, name)

    def detach(self, topic: str, name: str) -> None:
        self.cursor.detach(topic, name)

    def gauges(self) -> dict[str, Any]:
        return {
            f"cursor_{self._name}_available": lambda: float(self.cursor.stats().available),
            f"cursor_{self._name}_in_flight": lambda: float(self.cursor.stats().in_flight),
            f"cursor_{self._name}_prepared": lambda: float(self.cursor.stats().prepared),
            f"cursor_{self._name}_duplicates_dropped": lambda: float(
                self.cursor.filter_counts()["duplicate"]
            ),
            f"cursor_{self._name}_out_of_order_dropped": lambda: float(
                self.cursor.filter_counts()["out-of-order"]
            ),
        }
