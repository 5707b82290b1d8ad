"""Remote resources: a message log or a cursor in another process (``twopc serve log|cursor``),
enlisted in a local transaction as resource managers of their own.

`RemoteMessageLog` and `RemoteCursor` implement the `Resource` protocol by speaking the XA verbs
(see `service` for the table) over authenticated framed connections. What needs care is what a
broken connection means, because the answer decides what the coordinator may conclude:

- **Nothing was sent** (the connection could not be made, or the send failed: the server cannot
  have read a whole frame): the call can be made again on a fresh connection, once.
- **Sent, no answer**: the server may have acted. Idempotent verbs (phase-two commit, rollback,
  recover, forget) are sent once more on a fresh connection, then raise `RemoteUnavailable` (a
  `TransientError`): the coordinator leaves the branch to recovery, which calls again; no outcome
  is made up. A prepare is not repeated: it raises, which votes no. A one-phase commit is not
  repeated either and raises `OutcomeUnknownError`: it may have committed.
- **A consumer branch's connection**: from its first receive until it ends (prepare, one-phase
  commit, rollback) a consumer branch keeps one connection, because the server rolls back what a
  connection started when it ends. If that connection breaks, the branch is gone (its messages are
  someone else's by now): later receives, the prepare and a one-phase commit raise `BranchLost`
  (a `TransactionRolledBack`). The count of messages received travels with the prepare, so a
  server that lost the branch (restarted) says so instead of voting read-only.

A producer branch stages its messages here, validated as `ProducerBranch.send` validates them
(the destination's room is the server's to check, at prepare), and ships them with the prepare:
one round trip per transaction, and an abandoned transaction costs the server nothing. Expiry
times (``ttl``) are computed on this machine's clock.

Connections are pooled (thread-safe, a few idle ones kept, dead ones noticed before use).
"""

from __future__ import annotations

import itertools
import logging
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TypeVar

from coordinator.errors import (
    FrameError,
    IllegalStateError,
    InvalidXidError,
    OutcomeUnknownError,
    ProgrammingError,
)
from coordinator.resource import Outcome, Vote
from coordinator.xid import Xid, branches_of, is_sub_branch_of, validate_resource_name
from messaging.auth import SharedSecret
from messaging.connection import Address, Connection, connect
from messaging.frames import FrameType, Value, XaReply, XaRequest
from resource_managers.cursor import Delivery, Subscription
from resource_managers.message_log import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BranchDoomed,
    InvalidMessageError,
    StagingBranch,
    validate_destination,
)

from .protocol import (
    CONSUMER_ROLE,
    MAX_RECEIVE_BATCH,
    MAX_RECEIVE_WAIT,
    PRODUCER_ROLE,
    BadRequestError,
    BranchLost,
    RemoteUnavailable,
    delivery_from_value,
    error_from_reply,
    message_to_value,
    outcome_from_value,
    subscription_from_value,
    vote_from_value,
)

log = logging.getLogger("twopc.remote")

T = TypeVar("T")
_R = TypeVar("_R", bound="_RemoteResource")
Result = Mapping[str, Value]


class _Unsent(Exception):
    """The request never reached the server whole: nothing happened there."""


class _Lost(Exception):
    """The request was sent and no valid answer came: the server may have acted."""


class _Bad(Exception):
    """A reply of the wrong shape: the server broke the protocol."""


class _Pool:
    """Authenticated connections to one server: a few idle ones kept, dead ones dropped."""

    def __init__(
        self,
        address: Address,
        secret: SharedSecret,
        *,
        client_id: str,
        role: str,
        tls: ssl.SSLContext | None,
        server_hostname: str | None,
        timeout: float,
        max_idle: int = 4,
    ) -> None:
        self.address = address
        self._secret = secret
        self._client_id = client_id
        self._role = role
        self._tls = tls
        self._server_hostname = server_hostname
        self._timeout = timeout
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._closed = False

    def acquire(self) -> Connection:
        """An idle connection that still looks alive, or a new one. `RemoteUnavailable` if the
        server cannot be reached; an authentication failure (`AuthError`) is raised as it is:
        a wrong secret or role is a configuration error, not something to retry."""
        while True:
            with self._lock:
                if self._closed:
                    raise IllegalStateError(f"connections to {self.address} are closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if _alive(conn):
                return conn
            conn.close()
        try:
            return connect(
                self.address, self._secret, self._client_id, self._role, tls=self._tls,
                server_hostname=self._server_hostname, timeout=self._timeout,
            )  # fmt: skip
        except OSError as exc:
            raise RemoteUnavailable(
                f"cannot reach {self._role} service at {self.address}: {exc}"
            ) from exc

    def release(self, conn: Connection) -> None:
        with self._lock:
            if not conn.closed and not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _alive(conn: Connection) -> bool:
    """An idle connection has nothing to read; if it has (EOF, a refusal), it is dead."""
    if conn.closed:
        return False
    try:
        return not conn.readable()
    except (OSError, ValueError):
        return False


class _RemoteResource:
    """What both remote resources share: the pool, the request loop, the idempotent verbs."""

    _role: str

    def __init__(
        self,
        address: Address,
        secret: SharedSecret,
        *,
        name: str,
        client_id: str,
        tls: ssl.SSLContext | None,
        server_hostname: str | None,
        timeout: float,
        sort_key: str | None,
    ) -> None:
        if not timeout > 0:
            raise ProgrammingError("timeout must be > 0 seconds")
        self._name = validate_resource_name(name)
        self._sort_key = sort_key or self._name
        self.timeout = timeout
        self._pool = _Pool(
            address, secret, client_id=client_id, role=self._role, tls=tls,
            server_hostname=server_hostname, timeout=timeout,
        )  # fmt: skip
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    @property
    def sort_key(self) -> str:
        return self._sort_key

    @property
    def address(self) -> Address:
        return self._pool.address

    def __repr__(self) -> str:
        host, port = self._pool.address
        return f"{type(self).__name__}({self._name!r}, '{host}:{port}')"

    def close(self) -> None:
        """Close the idle connections; branches in flight keep theirs until they end."""
        self._pool.close()

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, xid: Xid) -> Xid:
        if xid.bqual != self._name and not is_sub_branch_of(xid.bqual, self._name):
            raise InvalidXidError(f"{self._name}: {xid} belongs to branch {xid.bqual!r}")
        return xid

    # -- one request -----------------------------------------------------------------------

    def _exchange(
        self,
        conn: Connection,
        verb: FrameType,
        xid: Xid | None,
        args: dict[str, Value],
        decode: Callable[[Result], T],
        *,
        wait: float = 0.0,
    ) -> T:
        """Send one request on ``conn`` and decode its answer. Raises `_Unsent`, `_Lost` (the
        connection is closed then: out of step, it cannot be trusted) or the server's error."""
        request = XaRequest(verb, next(self._ids), xid, {"rm": self._name, **args})
        try:
            conn.send(request)
        except OSError as exc:
            conn.close()
            raise _Unsent(str(exc)) from exc
        try:
            reply = conn.recv(timeout=wait + self.timeout)  # TimeoutError is an OSError
        except (OSError, FrameError) as exc:
            conn.close()
            raise _Lost(f"{verb.name}: {exc!r}") from exc
        if not isinstance(reply, XaReply) or reply.request_id != request.request_id:
            conn.close()  # EOF (None), the server's refusal, or out of step
            raise _Lost(f"expected the reply to {verb.name}, got {reply!r}"[:300])
        if reply.status != "ok":
            raise error_from_reply(reply)  # an answer: the connection is still in step
        try:
            return decode(reply.result)
        except (_Bad, KeyError) as exc:
            conn.close()
            raise _Lost(f"malformed reply to {verb.name}: {exc!r}") from exc

    def _call(
        self,
        verb: FrameType,
        xid: Xid | None,
        args: dict[str, Value],
        decode: Callable[[Result], T],
        *,
        idempotent: bool,
    ) -> T:
        """One request on a pooled connection. Nothing sent: one more try. Sent and lost: one
        more try if ``idempotent``, else `_Lost` for the caller to judge."""
        for attempt in (1, 2):
            conn = self._pool.acquire()
            try:
                result = self._exchange(conn, verb, xid, args, decode)
            except _Unsent as exc:
                if attempt == 2:
                    raise RemoteUnavailable(f"{self._name}: {verb.name} not sent: {exc}") from exc
                continue
            except _Lost as exc:
                if not idempotent:
                    raise
                if attempt == 2:
                    raise RemoteUnavailable(
                        f"{self._name}: no answer to {verb.name} ({exc}); recovery will ask again"
                    ) from exc
                continue
            except BaseException:
                self._pool.release(conn)
                raise
            self._pool.release(conn)
            return result
        raise AssertionError("unreachable")

    # -- the idempotent verbs --------------------------------------------------------------

    def _commit_prepared(self, xid: Xid) -> Outcome | None:
        return self._call(FrameType.XA_COMMIT, xid, {"one_phase": False}, _outcome, idempotent=True)

    def _rollback_remote(self, xid: Xid) -> Outcome | None:
        return self._call(FrameType.XA_ROLLBACK, xid, {}, _outcome, idempotent=True)

    def recover(self) -> list[Xid]:
        gids = self._call(FrameType.XA_RECOVER, None, {}, _gids, idempotent=True)
        return branches_of(gids, self._name, sub_branches=True)

    def forget(self, xid: Xid) -> None:
        self._call(FrameType.XA_FORGET, self._check(xid), {}, lambda r: None, idempotent=True)


def _outcome(result: Result) -> Outcome | None:
    try:
        return outcome_from_value(result["outcome"])
    except BadRequestError as exc:
        raise _Bad(exc.message) from exc


def _vote(result: Result) -> Vote:
    try:
        return vote_from_value(result["vote"])
    except BadRequestError as exc:
        raise _Bad(exc.message) from exc


def _gids(result: Result) -> list[str]:
    xids = result["xids"]
    if not isinstance(xids, list) or not all(isinstance(g, str) for g in xids):
        raise _Bad("xids must be a list of strings")
    return [g for g in xids if isinstance(g, str)]


def _deliveries(result: Result, least: int = 1) -> list[Delivery]:
    values = result["deliveries"]
    if not isinstance(values, list):
        raise _Bad("deliveries must be a list")
    try:
        return [delivery_from_value(v, least=least) for v in values]
    except (BadRequestError, InvalidMessageError) as exc:
        raise _Bad(exc.message) from exc


def _dead_letters(result: Result) -> list[Delivery]:
    return _deliveries(result, least=0)  # a rejected message was never handed out


def _subscription(result: Result) -> Subscription:
    try:
        return subscription_from_value(result["subscription"])
    except BadRequestError as exc:
        raise _Bad(exc.message) from exc


def _subscriptions(result: Result) -> list[Subscription]:
    values = result["subscriptions"]
    if not isinstance(values, list):
        raise _Bad("subscriptions must be a list")
    try:
        return [subscription_from_value(v) for v in values]
    except BadRequestError as exc:
        raise _Bad(exc.message) from exc


def _number(key: str) -> Callable[[Result], int]:
    def decode(result: Result) -> int:
        value = result[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _Bad(f"{key} must be an integer >= 0")
        return value

    return decode


def _flag(result: Result) -> bool:
    value = result["transactional"]
    if not isinstance(value, bool):
        raise _Bad("transactional must be a bool")
    return value


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- the producer ------------------------------------------------------------------------------


class RemoteProducerBranch(StagingBranch):
    """One transaction's messages for a remote log, staged here until prepare; the server checks
    the destination's limit (`DestinationFullError`) at prepare."""

    def __init__(self, resource: RemoteMessageLog, xid: Xid) -> None:
        super().__init__(xid)
        self.name = resource.name
        self._limit = resource.max_message_bytes

    def _now_ms(self) -> int:
        return _now_ms()

    def _max_bytes(self) -> int:
        return self._limit


class RemoteMessageLog(_RemoteResource):
    """A message log served by ``twopc serve log``, as a resource manager (role ``producer``).

    ``name`` is the bqual (the server keeps one resource per name): keep it stable, and unique
    among the clients of one log unless they share a coordinator node id. ``max_message_bytes``
    is checked at ``send``; the server checks its own limit again."""

    _role = PRODUCER_ROLE

    def __init__(
        self,
        address: Address,
        secret: SharedSecret,
        *,
        name: str = "mlog",
        client_id: str = "twopc-client",
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        sort_key: str | None = None,
    ) -> None:
        super().__init__(
            address, secret, name=name, client_id=client_id, tls=tls,
            server_hostname=server_hostname, timeout=timeout, sort_key=sort_key,
        )  # fmt: skip
        if max_message_bytes < 1:
            raise ProgrammingError("max_message_bytes must be >= 1")
        self.max_message_bytes = max_message_bytes
        self._branches: dict[Xid, RemoteProducerBranch] = {}

    def start(self, xid: Xid) -> RemoteProducerBranch:
        branch = RemoteProducerBranch(self, self._check(xid))
        with self._lock:
            if xid in self._branches:
                raise IllegalStateError(f"{self._name}: branch {xid} is already active")
            self._branches[xid] = branch
        return branch

    def _take(self, xid: Xid) -> RemoteProducerBranch:
        with self._lock:
            branch = self._branches.pop(self._check(xid), None)
        if branch is None:
            raise IllegalStateError(f"{self._name}: no active branch {xid}")
        branch.closed = True
        return branch

    def prepare(self, xid: Xid) -> Vote:
        branch = self._take(xid)
        if branch.doomed is not None:
            raise BranchDoomed(f"{self._name}: {xid}: {branch.doomed}")
        if not branch.messages:
            return Vote.READ_ONLY
        args: dict[str, Value] = {"messages": [message_to_value(m) for m in branch.messages]}
        try:
            return self._call(FrameType.XA_PREPARE, xid, args, _vote, idempotent=False)
        except _Lost as exc:  # the server may have prepared: voting no makes it roll back
            raise RemoteUnavailable(
                f"{self._name}: no answer to the prepare of {xid} ({exc}); it rolls back"
            ) from exc

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if not one_phase:
            with self._lock:
                if xid in self._branches:
                    raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
            return self._commit_prepared(self._check(xid))
        branch = self._take(xid)
        if branch.doomed is not None:
            raise BranchDoomed(f"{self._name}: {xid}: {branch.doomed}")
        if not branch.messages:
            return None
        args: dict[str, Value] = {
            "one_phase": True,
            "messages": [message_to_value(m) for m in branch.messages],
        }
        try:
            return self._call(FrameType.XA_COMMIT, xid, args, _outcome, idempotent=False)
        except _Lost as exc:
            raise OutcomeUnknownError(
                f"{self._name}: no answer to the one-phase commit of {xid} ({exc}); it may have "
                "committed",
                gtrid=xid.gtrid,
            ) from exc

    def rollback(self, xid: Xid) -> Outcome | None:
        with self._lock:
            branch = self._branches.pop(self._check(xid), None)
        if branch is not None:  # never shipped: the server has never heard of it
            branch.closed = True
            return None
        return self._rollback_remote(xid)


# -- the consumer ------------------------------------------------------------------------------


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
        self.conn: Connection | None = None
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
                if got or (deadline is not None and time.monotonic() >= deadline):
                    return got


class RemoteCursor(_RemoteResource):
    """A cursor served by ``twopc serve cursor``, as a resource manager (role ``consumer``), and
    its administration: subscriptions (seed 003), dead letters and non-transactional queues
    (seed 004), the same calls as on a local `Cursor` (see `messaging.remote.admin`).

    ``name`` is the bqual (the server keeps one resource per name, with its own
    ``max_deliveries``): keep it stable.

    **Attachments live on one connection.** The server counts a subscriber as connected while
    the connection that attached it is open, and detaches when it ends, however it ends: a
    ``kill -9`` of this process, a network failure, `close`. So `attach` (and a non-durable
    `subscribe`, whose subscription lives as long as it is attached) goes over this client's
    *subscriber connection*, which it opens on first use and keeps out of the pool, idle, until
    nothing is attached through it any more; `detach` goes over it too (the server refuses a
    detach from any other connection). If that connection ends (the server restarted), every
    attachment made through it has ended with it: `attached` is then empty, and a subscriber
    attaches again. Administrative calls that change something and get no answer are not
    repeated and raise `OutcomeUnknownError` (it may have been done); reads, a durable
    `subscribe` and `set_transactional` are repeated once, as recover is."""

    _role = CONSUMER_ROLE

    def __init__(
        self,
        address: Address,
        secret: SharedSecret,
        *,
        name: str = "cursor",
        client_id: str = "twopc-client",
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        timeout: float = 30.0,
        sort_key: str | None = None,
    ) -> None:
        super().__init__(
            address, secret, name=name, client_id=client_id, tls=tls,
            server_hostname=server_hostname, timeout=timeout, sort_key=sort_key,
        )  # fmt: skip
        self._branches: dict[Xid, RemoteConsumerBranch] = {}
        self._subscriber_lock = threading.Lock()
        self._subscriber: Connection | None = None
        self._attached: Counter[tuple[str, str]] = Counter()

    def close(self) -> None:
        """Close the idle connections and the subscriber connection (the server detaches what
        it held); branches in flight keep theirs until they end."""
        with self._subscriber_lock:
            self._drop_subscriber()
        super().close()

    # -- administration ----------------------------------------------------------------------

    def subscribe(self, topic: str, name: str, *, durable: bool = True) -> Subscription:
        """Make (or find) subscription ``name`` of ``topic``. A durable one is recorded on the
        server's disk and starts disconnected; a non-durable one is attached through this
        client's subscriber connection and vanishes when its last holder detaches or ends."""
        args: dict[str, Value] = {"topic": topic, "name": name, "durable": durable}
        if not durable:
            return self._hold("subscribe", args)
        return self._admin("subscribe", args, _subscription, idempotent=True)

    def unsubscribe(self, topic: str, name: str) -> int:
        """Remove a subscription and its copies (how many were dropped); `IllegalStateError` if
        there is none or copies of it are handed out or prepared."""
        args: dict[str, Value] = {"topic": topic, "name": name}
        dropped = self._admin("unsubscribe", args, _number("dropped"), idempotent=False)
        with self._subscriber_lock:  # the server forgot every holder of it
            self._attached.pop((topic, name), None)
            self._release_subscriber_if_idle()
        return dropped

    def subscriptions(self, topic: str | None = None) -> list[Subscription]:
        return self._admin("subscriptions", {"topic": topic}, _subscriptions, idempotent=True)

    def attach(self, topic: str, name: str) -> Subscription:
        """Connect as a subscriber of ``topic``/``name`` until `detach`, `close` or the end of
        this process (see the class docstring). Counted: attach twice, detach twice."""
        return self._hold("attach", {"topic": topic, "name": name})

    def detach(self, topic: str, name: str) -> None:
        """End one attachment made through this client. If the subscriber connection has ended
        meanwhile, the server has detached already and this only forgets it."""
        key = (topic, name)
        with self._subscriber_lock:
            if not self._attached[key]:
                self._attached.pop(key, None)
                raise IllegalStateError(f"{self._name}: {topic}/{name} is not attached here")
            conn = self._subscriber
            if conn is None or not _alive(conn):
                self._drop_subscriber()
                return
            args: dict[str, Value] = {"op": "detach", "topic": topic, "name": name}
            try:
                self._exchange(conn, FrameType.XA_RECOVER, None, args, lambda r: None)
            except (_Unsent, _Lost):
                self._drop_subscriber()  # ended: so did everything it held
                return
            except IllegalStateError:  # unsubscribed meanwhile: the server holds nothing of it
                del self._attached[key]
                self._release_subscriber_if_idle()
                raise
            self._attached[key] -= 1
            if not self._attached[key]:
                del self._attached[key]
            self._release_subscriber_if_idle()

    def attached(self) -> dict[tuple[str, str], int]:
        """What this client holds attached, by (topic, name); empty once the subscriber
        connection has ended (the server detached it all)."""
        with self._subscriber_lock:
            if self._subscriber is not None and not _alive(self._subscriber):
                self._drop_subscriber()
            return dict(self._attached)

    def dead_letters(self, queue: str | None = None) -> list[Delivery]:
        """The dead letters of ``queue`` (a destination or its DLQ), or of every DLQ: each with
        its ``reason`` (``expired: ...``, ``max-deliveries: ...``, ``rejected: ...``)."""
        return self._admin("dead_letters", {"queue": queue}, _dead_letters, idempotent=True)

    def replay_dead_letters(self, dlq: str, ids: list[str] | None = None) -> int:
        """Put dead letters (``ids``, or all) back at the tail of their queue; how many."""
        args: dict[str, Value] = {"dlq": dlq, "ids": None if ids is None else list(ids)}
        return self._admin("replay_dead_letters", args, _number("count"), idempotent=False)

    def purge_dead_letters(self, dlq: str, ids: list[str] | None = None) -> int:
        """Delete dead letters (``ids``, or all) for good; how many."""
        args: dict[str, Value] = {"dlq": dlq, "ids": None if ids is None else list(ids)}
        return self._admin("purge_dead_letters", args, _number("count"), idempotent=False)

    def set_transactional(self, queue: str, transactional: bool) -> None:
        """Mark ``queue`` (non-)transactional: a non-transactional queue rejects transactional
        messages to its DLQ, with a negative acknowledgment to their admin queue (seed 004)."""
        args: dict[str, Value] = {"queue": queue, "transactional": transactional}
        self._admin("set_transactional", args, lambda r: None, idempotent=True)

    def is_transactional(self, queue: str) -> bool:
        return self._admin("is_transactional", {"queue": queue}, _flag, idempotent=True)

    def _admin(
        self, op: str, args: dict[str, Value], decode: Callable[[Result], T], *, idempotent: bool
    ) -> T:
        try:
            return self._call(
                FrameType.XA_RECOVER, None, {"op": op, **args}, decode, idempotent=idempotent
            )
        except _Lost as exc:
            raise OutcomeUnknownError(
                f"{self._name}: no answer to {op} ({exc}); it may have been done: look before "
                "doing it again"
            ) from exc

    def _hold(self, op: str, args: dict[str, Value]) -> Subscription:
        """``op`` on the subscriber connection (opened if need be); the server then holds the
        attachment for that connection. A broken connection ends every attachment it held."""
        with self._subscriber_lock:
            conn = self._subscriber
            if conn is not None and not _alive(conn):
                self._drop_subscriber()
                conn = None
            if conn is None:
                conn = self._subscriber = self._pool.acquire()
            try:
                found = self._exchange(
                    conn, FrameType.XA_RECOVER, None, {"op": op, **args}, _subscription
                )
            except (_Unsent, _Lost) as exc:
                self._drop_subscriber()
                raise RemoteUnavailable(
                    f"{self._name}: the subscriber connection broke at {op} ({exc}); every "
                    "attachment made through it has ended"
                ) from exc
            except BaseException:
                self._release_subscriber_if_idle()
                raise
            self._attached[(found.topic, found.name)] += 1
            return found

    def _drop_subscriber(self) -> None:
        """Close the subscriber connection (the server detaches what it held); caller locks."""
        conn, self._subscriber = self._subscriber, None
        self._attached.clear()
        if conn is not None:
            conn.close()

    def _release_subscriber_if_idle(self) -> None:
        """Nothing is attached through it any more: back to the pool; caller locks."""
        if self._subscriber is not None and not self._attached:
            conn, self._subscriber = self._subscriber, None
            self._pool.release(conn)

    # -- branches ------------------------------------------------------------------------------

    def start(self, xid: Xid) -> RemoteConsumerBranch:
        branch = RemoteConsumerBranch(self, self._check(xid))
        with self._lock:
            if xid in self._branches:
                raise IllegalStateError(f"{self._name}: branch {xid} is already active")
            self._branches[xid] = branch
        return branch

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

    def _take(self, xid: Xid) -> RemoteConsumerBranch:
        with self._lock:
            branch = self._branches.pop(self._check(xid), None)
        if branch is None:
            raise IllegalStateError(f"{self._name}: no active branch {xid}")
        branch.closed = True
        return branch

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
            with self._lock:
                if xid in self._branches:
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
        with self._lock:
            branch = self._branches.pop(self._check(xid), None)
        if branch is None:
            return self._rollback_remote(xid)
        branch.closed = True
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
