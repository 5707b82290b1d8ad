"""`RemoteCursor`'s administration, client side: subscriptions (JMS), dead letters and
non-transactional queues (MSMQ), the same calls as on a local `Cursor`; `admin` is the server
side.

Why a module of its own: these calls ride on the consumer role's connections but belong to no
transaction. What is subtle about them is the *subscriber connection* an attachment lives on,
explained on `CursorAdmin`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from coordinator.errors import IllegalStateError, OutcomeUnknownError
from messaging.frames import FrameType, Value
from resource_managers.bookkeeping import B
from resource_managers.cursor import Delivery, QueueDepth, Subscription

from ._loop_link import Link
from ._pool import _alive
from ._replies import (
    Result,
    _dead_letters,
    _flag,
    _number,
    _queues,
    _subscription,
    _subscriptions,
    _text,
)
from ._resource import _Lost, _RemoteResource, _Unsent
from .protocol import RemoteUnavailable

T = TypeVar("T")


class CursorAdmin(_RemoteResource[B]):
    """The administrative calls of `RemoteCursor`, which calls `_init_admin` when it is made.

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

    _subscriber_lock: threading.Lock
    _subscriber: Link | None
    _attached: Counter[tuple[str, str]]

    def _init_admin(self) -> None:
        """No subscriber connection yet: `_hold` opens it on first use."""
        self._subscriber_lock = threading.Lock()
        self._subscriber = None
        self._attached = Counter()

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
        messages to its DLQ, with a negative acknowledgment to their admin queue (MSMQ)."""
        args: dict[str, Value] = {"queue": queue, "transactional": transactional}
        self._admin("set_transactional", args, lambda r: None, idempotent=True)

    def is_transactional(self, queue: str) -> bool:
        return self._admin("is_transactional", {"queue": queue}, _flag, idempotent=True)

    def queues(self) -> list[QueueDepth]:
        """Every queue's depth: waiting, handed out or prepared, dead letters."""
        return self._admin("queues", {}, _queues, idempotent=True)

    def remove_message(self, queue: str, message_id: str, action: str, why: str = "") -> str:
        """Drop or dead-letter one waiting message (`Cursor.remove_message`); its queue."""
        args: dict[str, Value] = {"queue": queue, "id": message_id, "action": action, "why": why}
        return self._admin("remove_message", args, _text("queue"), idempotent=False)

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
