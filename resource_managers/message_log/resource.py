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
- **rollback** (idempotent): discards the branch and leaves a tombstone (``R``: forced for a
  branch whose prepare is on disk, since the coordinator then forgets it; lazy otherwise). A
  gid whose commit record is still in the journal reports ``HEURISTIC_COMMIT``.
- **recover**: every prepared gid of this resource's name, whatever its age. **forget** drops a
  tombstone.

Crash points: ``mlog.<name>.after_prepare`` (the ``P`` record is durable, the vote not returned),
``mlog.<name>.after_append`` (the ``C`` record is durable, the messages not yet visible),
``mlog.<name>.after_commit`` (visible, the commit not returned).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from coordinator import (
    InvalidXidError,
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

from ._base import BranchRolledBack
from ._log import MessageLog
from ._records import Message, decode, to_message
from ._staging import BranchDoomed, StagingBranch

#: a producer branch whose message bodies add up to more prepares instead of riding (see
#: `MessageLogResource`)
DEFAULT_CARRY_BYTES = 8 * 1024


class ProducerBranch(StagingBranch):
    """One transaction's messages for a local `MessageLog`, staged until prepare."""

    def __init__(self, resource: MessageLogResource, xid: Xid) -> None:
        super().__init__(xid)
        self.name = resource.name
        self._log = resource.log

    def _now_ms(self) -> int:
        return self._log.clock()

    def _max_bytes(self) -> int:
        return self._log.max_message_bytes

    def _check_room(self, destination: str, count: int) -> None:
        self._log.check_room(destination, count)


class MessageLogResource(Branches[ProducerBranch]):
    """A `MessageLog` as a resource manager. ``name`` is the bqual: keep it stable.

    ``lazy_commit`` (default True): in phase two the commit record is not forced; the next forced
    record of the log carries it (or an fsync of its own ``lazy_delay`` later), and the
    coordinator keeps its decision until then (`coordinator.lazy_commit`). The transaction's
    messages become visible to the transfer once the record is durable, a moment after the
    commit returns. False: forced, visible when the commit returns.

    ``rides_last_resource`` (default True): in a transaction whose last resource can carry it
    (a PostgreSQL last resource, `coordinator.carried`), the branch writes no prepare record:
    its messages travel in the last resource's decision row, committed with the application's
    rows, and the log commits them after it with one lazy record. One forced write per
    transaction instead of two. False: the branch prepares as with any other coordinator.

    ``carry_bytes`` (default 8 KiB): a branch whose message bodies add up to more prepares
    instead of riding. A payload travels through the database as a ``bytea`` (written to its
    WAL and its TOAST table, deleted again later), which costs more than the log's own group-
    committed prepare record once it holds more than a few kilobytes (`bench/messaging.py` at
    100 messages per transaction)."""

    def __init__(
        self,
        log: MessageLog,
        name: str = "mlog",
        *,
        sort_key: str | None = None,
        lazy_commit: bool = True,
        rides_last_resource: bool = True,
        carry_bytes: int = DEFAULT_CARRY_BYTES,
    ):
        super().__init__(name, sort_key)
        if isinstance(carry_bytes, bool) or not isinstance(carry_bytes, int) or carry_bytes < 0:
            raise ProgrammingError(f"carry_bytes must be an int >= 0, not {carry_bytes!r}")
        self.lazy_commit = lazy_commit
        self.rides_last_resource = rides_last_resource
        self.carry_bytes = carry_bytes
        self.log = log

    def __repr__(self) -> str:
        return f"MessageLogResource({self._name!r}, {str(self.log.directory)!r})"

    def start(self, xid: Xid) -> ProducerBranch:
        return self._begin(xid, ProducerBranch(self, self._check(xid)))

    def prepare(self, xid: Xid, *, after: Sequence[str] = ()) -> Vote:
        """``after``: branches of this resource and coordinator node whose commit was decided
        before this branch's transaction began (`commit_earlier`)."""
        branch, gid = self._voting(xid)
        earlier = self.commit_earlier(xid, after)
        if not branch.messages:
            vote = Vote.READ_ONLY
        else:
            self.log.prepare(gid, branch.messages)  # forced: it carries the earlier commits too
            crash_point(f"mlog.{self._name}.after_prepare")
            _captured(branch.messages)
            vote = Vote.COMMIT
        if earlier:
            self.log.flush_commits()  # durable before the answer, whatever this branch wrote
        return vote

    # -- carried by the last resource's commit (coordinator.carried) ------------------------------

    def rides_branch(self, xid: Xid) -> bool:
        """Whether this branch rides (its bodies within ``carry_bytes``) or prepares."""
        branch = self._get(xid)
        if branch is None:  # not active here: prepare answers for it
            return False
        total = 0
        for message in branch.messages:
            total += len(message.body)
            if total > self.carry_bytes:
                return False
        return True

    def stage(self, xid: Xid) -> bytes | None:
        """Phase one without a record: the checks of `prepare`, the messages kept in memory."""
        branch, gid = self._voting(xid)
        if not branch.messages:
            return None
        return self.log.stage(gid, branch.messages)

    def commit_carried(self, xid: Xid, payload: bytes, on_durable: Callable[[], None]) -> None:
        gid = self._check(xid).to_gid()
        if not self.log.is_staged(gid):  # not staged in this process: as recovery would
            self.restore_carried(xid, payload)
            on_durable()
            return
        points = f"mlog.{self._name}"

        def durable() -> None:
            crash_point(f"{points}.carried_durable")
            on_durable()

        messages = self.log.staged_messages(gid)
        self.log.commit_carried(gid, durable, force=not self.lazy_commit)
        crash_point(f"{points}.after_carried_commit")
        _captured(messages)

    def restore_carried(self, xid: Xid, payload: bytes) -> None:
        record = decode(payload)
        if record["k"] != "P" or record["g"] != xid.to_gid():
            raise InvalidXidError(f"{self._name}: the carried payload is not {xid}'s")
        self.log.restore_carried(record["g"], [to_message(m) for m in record["m"]])

    def carried_gids(self) -> set[str]:
        return {x.to_gid() for x in branches_of(self.log.carried_gids(), self._name)}

    def forget_carried(self, gids: Collection[str]) -> None:
        self.log.forget_carried(gids)

    def _voting(self, xid: Xid) -> tuple[StagingBranch, str]:
        """The branch leaving its active state for phase one, and its gid; raises the no vote
        of a branch rolled back meanwhile (its tombstone) or doomed by a refused send."""
        branch = self._take(xid)
        gid = xid.to_gid()
        if self.log.is_tombstoned(gid):
            raise BranchRolledBack(f"{self._name}: {gid} was rolled back (tombstone); no prepare")
        if branch.doomed is not None:
            raise BranchDoomed(f"{self._name}: {gid}: {branch.doomed}")
        return branch, gid

    def commit_earlier(self, xid: Xid, gids: Sequence[str]) -> bool:
        """Commit the branches ``gids`` still prepared here, before ``xid`` takes numbers.

        A remote producer names in each prepare (and one-phase commit) the branches whose
        commit it issued and has not seen confirmed (`messaging.remote`). Their decision is
        commit, made before ``xid``'s transaction began; a commit lost with a crash of this log,
        or with a broken connection, would otherwise be applied by recovery after ``xid``'s,
        and the producer's later messages would be numbered before its earlier ones. Each is
        committed lazily, so the next forced record (``xid``'s prepare) carries it. Only branches
        of the same resource and coordinator node as ``xid`` may be named (`InvalidXidError`).
        True if any was committed here."""
        node = xid.node_id
        earlier = []
        for gid in gids:
            other = self._check(Xid.from_gid(gid))
            if node is None or other.node_id != node:
                raise InvalidXidError(
                    f"{self._name}: {xid} may name only earlier branches of its own coordinator "
                    "node"
                )
            earlier.append(other)
        committed = False
        for other in earlier:
            gid = other.to_gid()
            if self.log.is_tombstoned(gid) or not self.log.is_prepared(gid):
                continue  # committed already (or rolled back by an operator): nothing to order
            self.log.commit_lazily(gid, _nothing)
            committed = True
        if committed:
            crash_point(f"mlog.{self._name}.after_earlier_commits")
        return committed

    def commit(
        self, xid: Xid, one_phase: bool = False, *, after: Sequence[str] = ()
    ) -> Outcome | None:
        """``after``: as `prepare`'s, for a one-phase commit."""
        gid = self._check(xid).to_gid()
        if one_phase:
            branch = self._take(xid)
            if self.log.is_tombstoned(gid):
                raise BranchRolledBack(f"{self._name}: {gid} was rolled back (tombstone)")
            if branch.doomed is not None:
                raise BranchDoomed(f"{self._name}: {gid}: {branch.doomed}")
            earlier = self.commit_earlier(xid, after)
            if branch.messages:
                self.log.commit(gid, branch.messages)
                _captured(branch.messages)
            if earlier:
                self.log.flush_commits()
            return None
        if self._active(xid):
            raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
        if self.log.is_tombstoned(gid):
            return Outcome.HEURISTIC_ROLLBACK
        if self.log.is_prepared(gid):
            self.log.commit(gid, after_append=f"mlog.{self._name}.after_append")
            crash_point(f"mlog.{self._name}.after_commit")
        return None

    def commit_lazily(self, xid: Xid, on_durable: Callable[[], None]) -> Outcome | None:
        """Phase two's commit, its record lazy: `resource_managers.lazy_commit`."""
        return lazy_commit.commit_lazily(
            self.log, self._check(xid), on_durable, active=self._active(xid), lazy=self.lazy_commit,
            durable_commit=self.commit, points=f"mlog.{self._name}",
        )  # fmt: skip

    def flush_commits(self) -> None:
        """Lazy commit records (and the carried commits' pending forgets) durable now
        (`TransactionManager.close` calls this)."""
        self.log.flush_forgets()
        self.log.flush_commits()

    def rollback(self, xid: Xid) -> Outcome | None:
        gid = self._check(xid).to_gid()
        self._drop(xid)
        if self.log.drop_staged(gid):  # carried, never written: nothing to leave behind
            return None
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


def _nothing() -> None:
    """An earlier branch's ``on_durable``: its own phase-two commit reports to the coordinator."""


def _captured(messages: list[Message]) -> None:
    """The log holds these messages durably: a step of their senders' traces."""
    if tracing.installed() is not None:
        for m in messages:
            tracing.message_event("log.capture", m.headers, destination=m.destination)
