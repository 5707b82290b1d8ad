"""A cursor served by ``twopc serve cursor``, enlisted in a local transaction as a resource
manager of its own (role ``consumer``).

**A consumer branch's connection**: from its first receive until it ends (prepare, one-phase
commit, rollback) a consumer branch keeps one connection, because the server rolls back what a
connection started when it ends. If that connection breaks, the branch is gone (its messages are
someone else's by now): later receives, the prepare and a one-phase commit raise `BranchLost`
(a `TransactionRolledBack`). The count of messages received travels with the prepare, so a
server that lost the branch (restarted) says so instead of voting read-only.

What a broken connection means to the other verbs is explained in `_resource`; the cursor's
administration (subscriptions, dead letters, attachments) lives in `_cursor_admin`.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from coordinator import tracing
from coordinator.errors import IllegalStateError, OutcomeUnknownError, ProgrammingError
from coordinator.resource import Outcome, Vote
from coordinator.xid import Xid
from messaging.auth import SharedSecret, TlsConfig
from messaging.connection import Address
from messaging.frames import FrameType, Value
from resource_managers.cursor import Delivery
from resource_managers.message_log import validate_destination

from ._cursor_admin import CursorAdmin
from ._loop_link import Link

# import CursorAdmin
from ._replies import Result, _deliveries, _outcome, _vote
from ._resource import _Lost, _Unsent
from .protocol import (
    CONSUMER_ROLE,
    MAX_RECEIVE_BATCH,
    MAX_RECEIVE_WAIT,
    BranchLost,
    RemoteUnavailable,
)

T = TypeVar("T")


class RemoteConsumerBranch:
    """One transaction's receipts from a remote cursor. One thread drives it (one transaction);
    the coordinator's reaper may roll it back meanwhile."""

    def __init__(self, resource: RemoteCursor, xid: Xid) -> None:
        self._resource = resource
        self.xid = xid
        self.deliveries: list[Delivery] = []
        self.closed = False
        #: the connection broke: the server rolled the branch back
        self.lost = False
        #: a receive was sent: the server may hold a branch on ``conn``
        self.started = False
        self.conn: Link | None = None
        self.lock = threading.Lock()

    @property
    def received(self) -> int:
        return len(self.deliveries)

    def receive(self, destination: str, timeout: float | None = 0.0) -> Delivery | None:
        """The next message of ``destination`` (or of ``<d>.DLQ``), or None after ``timeout``
        seconds without one (None: wait for ever)."""
        got = self.receive_many(destination, 1, timeout)
        return got[0] if got else None

    def receive_many(
        self, destination: str, max_messages: int, timeout: float | None = 0.0
    ) -> list[Delivery]:
        """Up to ``max_messages`` (at most 10,000 at a time) messages of ``destination`` in
        order: waits up to ``timeout`` for the first, then takes what is there."""
        validate_destination(destination)
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise ProgrammingError("max_messages must be an integer >= 1")
        if timeout is not None and not timeout >= 0:
            raise ProgrammingError("timeout must be >= 0 seconds or None")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while True:
                left = MAX_RECEIVE_WAIT if deadline is None else deadline - time.monotonic()
                wait = max(0.0, min(left, MAX_RECEIVE_WAIT))
                got = self._resource._receive(
                    self, destination, min(max_messages, MAX_RECEIVE_BATCH), wait
                )
                if got and tracing.installed() is not None:
                    tracing.received(self.xid.gtrid, got[0].headers)
                if got or (deadline is not None and time.monotonic() >= deadline):
                    return got


class RemoteCursor(CursorAdmin[RemoteConsumerBranch]):
    """A cursor served by ``twopc serve cursor``, as a resource manager (role ``consumer``), and
    its administration: subscriptions (JMS), dead letters and non-transactional queues
    (MSMQ), the same calls as on a local `Cursor` (see `CursorAdmin`, which also explains
    why attachments live on one connection, and `messaging.remote.admin`).

    ``name`` is the bqual (the server keeps one resource per name, with its own
    ``max_deliveries``): keep it stable. ``secret``, ``client_id`` and ``tls`` as for
    `RemoteMessageLog` (its own key, or None with a client certificate, under a clients file)."""

    _role = CONSUMER_ROLE

    def __init__(
        self,
        address: Address,
        secret: SharedSecret | None,
        *,
        name: str = "cursor",
        client_id: str = "twopc-client",
        tls: ssl.SSLContext | TlsConfig | None = None,
        server_hostname: str | None = None,
        timeout: float = 30.0,
        sort_key: str | None = None,
        lazy_commit: bool = True,
    ) -> None:
        super().__init__(
            address, secret, name=name, client_id=client_id, tls=tls,
            server_hostname=server_hostname, timeout=timeout, sort_key=sort_key,
            lazy_commit=lazy_commit,
        )  # fmt: skip
        self._init_admin()

    # -- branches ------------------------------------------------------------------------------

    def start(self, xid: Xid) -> RemoteConsumerBranch:
        return self._begin(xid, RemoteConsumerBranch(self, self._check(xid)))

    def _lost(self, branch: RemoteConsumerBranch, why: str) -> BranchLost:
        branch.lost = True
        if branch.conn is not None:
            branch.conn.close()  # the server sees the end and rolls the branch back
            branch.conn = None
        return BranchLost(
            f"{self._name}: branch {branch.xid} is lost ({why}); the server rolled it back and "
            "its messages are available again",
            gtrid=branch.xid.gtrid,
        )

    def _receive(
        self, branch: RemoteConsumerBranch, destination: str, most: int, wait: float
    ) -> list[Delivery]:
        """One ``XA_START`` receive on the branch's connection (pinned at the first)."""
        if branch.closed:
            raise IllegalStateError(f"{self._name}: receive after the branch ended")
        if branch.lost:
            raise self._lost(branch, "its connection broke earlier")
        args: dict[str, Value] = {
            "op": "receive", "destination": destination, "max": most, "timeout": wait,
        }  # fmt: skip
        for attempt in (1, 2):
            if branch.conn is None:
                branch.conn = self._pool.acquire()
            try:
                got = self._exchange(
                    branch.conn, FrameType.XA_START, branch.xid, args, _deliveries, wait=wait
                )
            except _Unsent as exc:
                if branch.started:
                    raise self._lost(branch, f"connection broke: {exc}") from exc
                branch.conn = None  # the server never heard of the branch: it is intact
                if attempt == 2:
                    raise RemoteUnavailable(f"{self._name}: receive not sent: {exc}") from exc
                continue
            except _Lost as exc:
                raise self._lost(branch, f"no answer to a receive: {exc}") from exc
            except BaseException:
                branch.started = True  # an error answer: the server may hold the branch
                raise
            branch.started = True
            break
        if branch.closed:  # rolled back meanwhile (the reaper): these were given back too
            raise self._lost(branch, "rolled back while receiving")
        branch.deliveries += got
        return got

    def _finish(
        self, branch: RemoteConsumerBranch, verb: FrameType, args: dict[str, Value],
        decode: Callable[[Result], T],
    ) -> T:  # fmt: skip
        """The verb that ends ``branch`` on its pinned connection, which is then free again
        (unless it broke: `_exchange` closed it, and the server rolls back what it held)."""
        conn, branch.conn = branch.conn, None
        assert conn is not None
        try:
            return self._exchange(conn, verb, branch.xid, args, decode)
        finally:
            self._pool.release(conn)

    def prepare(self, xid: Xid) -> Vote:
        branch = self._take(xid)
        with branch.lock:
            if branch.lost:
                raise self._lost(branch, "its connection broke earlier")
            if branch.conn is None:
                return Vote.READ_ONLY  # never received: the server holds nothing
            args: dict[str, Value] = {"received": branch.received}
            try:
                return self._finish(branch, FrameType.XA_PREPARE, args, _vote)
            except (_Unsent, _Lost) as exc:
                raise self._lost(branch, f"connection broke at prepare: {exc}") from exc

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if not one_phase:
            if self._active(xid):
                raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
            return self._commit_prepared(self._check(xid))
        branch = self._take(xid)
        with branch.lock:
            if branch.lost:
                raise self._lost(branch, "its connection broke earlier")
            if branch.conn is None:
                return None
            args: dict[str, Value] = {"one_phase": True, "received": branch.received}
            try:
                return self._finish(branch, FrameType.XA_COMMIT, args, _outcome)
            except _Unsent as exc:  # the server never read it; it rolls back on the close
                raise self._lost(branch, f"connection broke at commit: {exc}") from exc
            except _Lost as exc:
                branch.lost = True
                raise OutcomeUnknownError(
                    f"{self._name}: no answer to the one-phase commit of {xid} ({exc}); it may "
                    "have committed",
                    gtrid=xid.gtrid,
                ) from exc

    def rollback(self, xid: Xid) -> Outcome | None:
        branch = self._drop(xid)
        if branch is None:
            return self._rollback_remote(xid)
        if not branch.lock.acquire(blocking=False):  # a receive is running (the reaper calls)
            return self._rollback_remote(xid)
        try:
            if branch.conn is None and not branch.lost:
                return None  # never received: the server holds nothing
            if branch.conn is not None:
                try:
                    return self._finish(branch, FrameType.XA_ROLLBACK, {}, _outcome)
                except (_Unsent, _Lost):
                    pass  # closed: the server rolls back what it held there
            return self._rollback_remote(xid)  # leave the tombstone all the same
        finally:
            branch.lock.release()
