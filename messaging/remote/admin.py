"""The consumer service's administrative requests: subscriptions (JMS), dead letters and
non-transactional queues (MSMQ), for `RemoteCursor` and ``twopc subscription|dlq|queue``.

Why they travel as ``XA_RECOVER`` requests with an ``op`` argument: recover is the one verb
about a resource manager as a whole rather than a branch (it takes no xid), which is what an
administrative request is, and its ``args`` are open by design. A frame type of its own would be
a protocol change (an older peer refuses an unknown type as a bad frame), which this is not. A
recover without ``op`` stays a recover; the producer service refuses any ``op``.

Why an attachment belongs to a connection: a remote subscriber is "connected" (JMS: copies
for a durable subscriber that is away are kept on disk even when non-persistent) only while it
can actually receive, and all the server can see of that is its connection. So the connection
that attached holds the attachment, only it can detach it, and when it ends (closed, reset, the
client killed) the server detaches whatever it still held. A non-durable subscription made
remotely is held the same way, so it disappears with its last holder. Keepalive is turned on for
a holding connection, so a client whose machine vanished is noticed too, not only one whose
process died (its kernel closes the socket).

======================= ======================================= ==============================
op                      args                                    result
======================= ======================================= ==============================
``subscribe``           ``topic, name, durable``                ``subscription``
``unsubscribe``         ``topic, name``                         ``dropped: n``
``subscriptions``       ``topic: str | None``                   ``subscriptions: [subscription]``
``attach`` / ``detach`` ``topic, name`` (held by the connection) ``subscription`` / ``{}``
``dead_letters``        ``queue: str | None``                   ``deliveries: [delivery]``
``replay_dead_letters`` ``dlq, ids: [id] | None``               ``count: n``
``purge_dead_letters``  ``dlq, ids: [id] | None``               ``count: n``
``set_transactional``   ``queue, transactional``                ``{}``
``is_transactional``    ``queue``                               ``transactional: bool``
``queues``              (none)                                  ``queues: [{queue, available,
                                                                in_flight, dead_letters,
                                                                transactional}]``
``remove_message``      ``queue, id, action: "drop" |           ``queue``
                        "dead-letter", why``
``stats``               (none; the log's service answers it     ``families``
                        too)                                    (`messaging.metrics`)
======================= ======================================= ==============================

"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable, Mapping

from coordinator.errors import IllegalStateError, TransactionError
from messaging.connection import Connection
from messaging.frames import Value
from resource_managers.cursor import DEAD_LETTER, DROP, Cursor

from .protocol import (
    BadRequestError,
    arg_bool,
    arg_ids,
    arg_opt_str,
    arg_str,
    delivery_to_value,
    subscription_to_value,
)

log = logging.getLogger("twopc.remote")

Result = dict[str, Value]
Key = tuple[str, str]  # (topic, subscription name)
#: seconds idle before keepalive probes, seconds between them, probes lost before the reset
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}


class CursorAdmin:
    """The administrative ops of one cursor's consumer service. Connections are named by a
    token (any int unique among live connections) that the service passes with each request and
    to `release` when the connection ends."""

    def __init__(self, cursor: Cursor) -> None:
        self.cursor = cursor
        # one at a time: what a connection holds must match the cursor's counts exactly
        self._lock = threading.Lock()
        self._held: dict[int, Counter[Key]] = {}
        self._ops: Mapping[str, Callable[[Mapping[str, Value], int, Connection], Result]] = {
            "subscribe": self._subscribe,
            "unsubscribe": self._unsubscribe,
            "subscriptions": self._subscriptions,
            "attach": self._attach,
            "detach": self._detach,
            "dead_letters": self._dead_letters,
            "replay_dead_letters": self._replay,
            "purge_dead_letters": self._purge,
            "set_transactional": self._set_transactional,
            "is_transactional": self._is_transactional,
            "queues": self._queues,
            "remove_message": self._remove_message,
        }

    def answer(self, op: str, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        handler = self._ops.get(op)
        if handler is None:
            raise BadRequestError(f"unknown op {op!r} (expected one of {', '.join(self._ops)})")
        return handler(args, token, conn)

    def release(self, token: int) -> None:
        """Connection ``token`` ended: detach everything it still held."""
        with self._lock:
            held = self._held.pop(token, Counter())
            for (topic, name), n in held.items():
                for _ in range(n):
                    try:
                        self.cursor.detach(topic, name)
                    except TransactionError as exc:  # removed meanwhile: nothing left to hold
                        log.info("detach of %s/%s at disconnect: %s", topic, name, exc)

    # -- subscriptions -----------------------------------------------------------------------

    def _subscribe(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        topic, name = arg_str(args, "topic"), arg_str(args, "name")
        if arg_bool(args, "durable", True):
            return {"subscription": subscription_to_value(self.cursor.subscribe(topic, name))}
        with self._lock:  # non-durable: this connection holds it (see the module docstring)
            found = self.cursor.subscribe(topic, name, durable=False)  # new or one more holder
            self._hold(token, conn, (topic, name))
        return {"subscription": subscription_to_value(found)}

    def _unsubscribe(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        topic, name = arg_str(args, "topic"), arg_str(args, "name")
        with self._lock:
            dropped = self.cursor.unsubscribe(topic, name)
            for held in self._held.values():  # nothing to detach later: a new one of that name
                held.pop((topic, name), None)  # must not lose an attachment to a stale holder
        return {"dropped": dropped}

    def _subscriptions(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        found = self.cursor.subscriptions(arg_opt_str(args, "topic"))
        return {"subscriptions": [subscription_to_value(s) for s in found]}

    def _attach(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        topic, name = arg_str(args, "topic"), arg_str(args, "name")
        with self._lock:
            found = self.cursor.attach(topic, name)
            self._hold(token, conn, (topic, name))
        return {"subscription": subscription_to_value(found)}

    def _detach(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        topic, name = arg_str(args, "topic"), arg_str(args, "name")
        with self._lock:
            held = self._held.get(token, Counter())
            if not held[(topic, name)]:
                raise IllegalStateError(
                    f"this connection holds no attachment to {topic}/{name}: only the connection "
                    "that attached can detach"
                )
            self.cursor.detach(topic, name)
            held[(topic, name)] -= 1
            if not held[(topic, name)]:
                del held[(topic, name)]
        return {}

    def _hold(self, token: int, conn: Connection, key: Key) -> None:
        held = self._held.setdefault(token, Counter())
        if not held:
            _keepalive(conn)
        held[key] += 1

    # -- dead letters and queues --------------------------------------------------------------

    def _dead_letters(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        found = self.cursor.dead_letters(arg_opt_str(args, "queue"))
        return {"deliveries": [delivery_to_value(d) for d in found]}

    def _replay(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        dlq, ids = arg_str(args, "dlq"), arg_ids(args, "ids")
        return {"count": self.cursor.replay_dead_letters(dlq, ids)}

    def _purge(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        dlq, ids = arg_str(args, "dlq"), arg_ids(args, "ids")
        return {"count": self.cursor.purge_dead_letters(dlq, ids)}

    def _set_transactional(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        queue, transactional = arg_str(args, "queue"), arg_bool(args, "transactional")
        self.cursor.set_transactional(queue, transactional)
        return {}

    def _is_transactional(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        return {"transactional": self.cursor.is_transactional(arg_str(args, "queue"))}

    def _queues(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        return {"queues": [dataclasses.asdict(q) for q in self.cursor.queues()]}

    def _remove_message(self, args: Mapping[str, Value], token: int, conn: Connection) -> Result:
        queue, mid = arg_str(args, "queue"), arg_str(args, "id")
        action, why = arg_str(args, "action"), arg_opt_str(args, "why") or ""
        if action not in (DROP, DEAD_LETTER):
            raise BadRequestError(f"action must be {DROP!r} or {DEAD_LETTER!r}, not {action!r}")
        return {"queue": self.cursor.remove_message(queue, mid, action, why)}


def _keepalive(conn: Connection) -> None:
    """Probe an idle holding connection, so a peer whose machine is gone ends it (best effort:
    the options are Linux's; elsewhere only the system's defaults apply)."""
    sock = getattr(conn, "sock", None)
    if not isinstance(sock, socket.socket):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in KEEPALIVE.items():
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except OSError as exc:
        log.info("cannot turn keepalive on: %s", exc)
