"""Branches carried by the last resource's commit: a prepare that is a row, not a forced record.

With a logging last resource (`coordinator.last_resource`) the commit point is the last
resource's own local commit. A store whose prepared state is small and self-contained (the
message log's staged messages) need not force a prepare record of its own before it: it hands
that state to the coordinator as bytes (``stage``), the last resource writes the bytes into the
decision row inside the commit that decides, and after the commit the store applies them with a
lazy record (``commit_carried``). The data is durable from the commit point on, in the row; the
store's record only has to reach disk before the row goes, which the end latch
(`coordinator.lazy_commit.EndLatch`) orders. One forced write per transaction instead of two:
what an outbox table costs, with the store keeping its own semantics.

The cost is on recovery's side. A store that crashed before its lazy record was durable has no
trace of the branch at all (no prepare record), so it cannot list it: recovery reads the rows
instead (`CarryingLastResource.carried_of`) and hands each payload back (``restore_carried``).
To tell a lost apply from one that happened, the store *remembers* the gid of every carried
commit until the coordinator says the row is gone (``forget_carried``); recovery reads the
remembered gids first and the rows second, so a gid it finds remembered with no row had its row
deleted before the read, and may be forgotten.

A transaction whose staging fails (a tombstone, a doomed branch) rolls back like a no vote; a
last resource that failed to commit leaves nothing anywhere (``rollback`` drops what was staged);
one whose answer was lost leaves the row, or no row, to decide, as for every other branch.

The store's contract (`rides` tells whether a resource has it):

``stage(xid) -> bytes | None``
    Phase one without a record: check the branch as prepare would, keep it in memory, and return
    what recovery needs to commit it (None: read-only, nothing to carry). Raising votes no.
``commit_carried(xid, payload, on_durable)``
    After the commit point: commit the staged branch with a lazy record that also remembers the
    gid; ``on_durable()`` once that record is on disk (never, if it never is: the row stays).
``restore_carried(xid, payload)``
    Recovery, for a row whose gid the store does not remember: commit ``payload`` durably and
    remember the gid before returning.
``carried_gids() -> set[str]``
    The gids of carried commits remembered and not forgotten.
``forget_carried(gids)``
    Their rows are gone: stop remembering them (a lazy record; a lost one is forgotten again by
    the next recovery pass).
``rides_branch(xid) -> bool`` (optional)
    False: this branch prepares instead (its payload would be large); asked before staging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeGuard, runtime_checkable

from ._verbs import CARRY, verbs_of
from .xid import Xid


@runtime_checkable
class CarriedBranches(Protocol):
    """A store whose branch can ride the last resource's commit (see the module docstring)."""

    name: str

    def stage(self, xid: Xid) -> bytes | None: ...

    def commit_carried(self, xid: Xid, payload: bytes, on_durable: Callable[[], None]) -> None: ...

    def restore_carried(self, xid: Xid, payload: bytes) -> None: ...

    def carried_gids(self) -> set[str]: ...

    def forget_carried(self, gids: Collection[str]) -> None: ...


@runtime_checkable
class CarryingLastResource(Protocol):
    """A last resource whose decision row can hold carried branches' payloads."""

    def carries_branches(self) -> bool:
        """True if this resource's decision rows hold payloads (asked per transaction)."""

    def carried_of(self, node_id: str) -> dict[str, dict[str, bytes]]:
        """Every commit row of ``node_id`` with carried branches: gtrid -> branch -> payload."""

    def end_decision(self, gtrid: str, then: Callable[[], None] | None = None) -> None:
        """As `LastResource.end_decision`; ``then`` runs once the row's deletion committed."""


class ForgetGate:
    """Holds the live path's forgets back while a recovery pass reads and acts on the rows.

    A pass reads the remembered gids, then the rows, then restores. A carried commit still in
    memory at the first read (not yet remembered) may become durable, see its row deleted by a
    later commit and its gid forgotten before the pass gets to that row, which the pass read
    while it existed: the restore would then find the gid neither staged nor remembered and
    apply the payload a second time. Recovery therefore holds this gate from its first read to
    its last restore, and every forget of the live path that comes meanwhile waits until then:
    the store still remembers the gid, and its ``restore_carried`` answers "already there".
    One gate per manager (its transactions and its recovery)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds = 0
        self._queued: list[Callable[[], None]] = []

    @contextmanager
    def holding(self) -> Iterator[None]:
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                queued, self._queued = (self._queued, []) if self._holds == 0 else ([], [])
            for forget in queued:
                forget()

    def forget(self, forget: Callable[[], None]) -> None:
        """Run ``forget`` now, or once no pass holds the gate."""
        with self._lock:
            if self._holds:
                self._queued.append(forget)
                return
        forget()


def rides(resource: object) -> TypeGuard[CarriedBranches]:
    """True for a store that offers ``stage`` and has not been told not to ride."""
    return bool(verbs_of(resource) & CARRY) and getattr(resource, "rides_last_resource", False)


def rides_branch(resource: CarriedBranches, xid: Xid) -> bool:
    """Whether this branch of a riding store rides: a store may prepare a branch whose payload
    would cost the last resource more than its own prepare record (``rides_branch(xid)``,
    optional; the message log's large branches)."""
    choose = getattr(resource, "rides_branch", None)
    return True if choose is None else bool(choose(xid))


def holds(resource: object) -> TypeGuard[CarryingLastResource]:
    """True for a last resource whose decision rows can be read for payloads (whether or not it
    may write new ones: `carries`)."""
    return callable(getattr(resource, "carried_of", None))


def carries(resource: object) -> TypeGuard[CarryingLastResource]:
    """True for a last resource that can hold carried payloads in its decision rows."""
    answer = getattr(resource, "carries_branches", None)
    return callable(answer) and bool(answer())
