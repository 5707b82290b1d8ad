"""The cursor's side of the transfer protocol: a connection handler for the ``transfer`` role.

It reads MSG frames, takes whatever has already arrived as one batch (so a burst costs one fsync:
`Cursor.deliver_many`), lets the stream filter judge each frame, persists the accepted messages
with the filter state, and only then acknowledges, once per stream, with the last accepted number
("order acknowledgment"). Duplicates and out-of-order frames are dropped and answered with that
same acknowledgment, which tells the sender where the stream stands. A frame that breaks the
protocol closes this connection; a well-formed message no log could have written (a bad
destination, a header that is not text) is refused with a NACK and the connection goes on.

Crash points: ``xfer.cursor.after_persist`` (a batch is durable, its acknowledgments not sent) and
``xfer.cursor.after_ack``.
"""

from __future__ import annotations

import logging
from collections import Counter

from coordinator.crashpoints import crash_point
from coordinator.errors import FrameError
from resource_managers.cursor import Cursor
from resource_managers.message_log import InvalidMessageError, Message
from resource_managers.sequencing import Frame

from ..connection import Connection
from ..frames import Ack, ErrorFrame, Msg, Nack, Ping, Pong
from ..frames import Frame as WireFrame
from .sender import INVALID_MESSAGE
from .wire import from_wire

log = logging.getLogger("twopc.transfer")


class TransferReceiver:
    """Serves transfer connections into ``cursor``; one instance for every connection of a
    listener (``stats`` adds them up). ``idle_timeout``: a connection silent that long is given
    up (the sender pings far more often)."""

    def __init__(self, cursor: Cursor, *, batch: int = 1024, idle_timeout: float = 30.0) -> None:
        self.cursor = cursor
        self.batch = batch
        self.idle_timeout = idle_timeout
        self.stats: Counter[str] = Counter()

    def __call__(self, conn: Connection) -> None:
        while True:
            first = conn.recv(timeout=self.idle_timeout)
            if first is None:
                return
            frames = [first, *self._arrived(conn)]
            items: list[tuple[Frame, Message]] = []
            replies: list[WireFrame] = []
            for frame in frames:
                if isinstance(frame, Msg):
                    self._take(frame, items, replies)
                elif isinstance(frame, Ping):
                    replies.append(Pong(frame.token))
                elif isinstance(frame, Pong):
                    pass
                elif isinstance(frame, ErrorFrame):
                    log.warning("transfer peer %s closes: %s", conn.peer.id, frame.code)
                    return
                else:
                    raise FrameError(f"unexpected {type(frame).__name__} frame on a transfer")
            if items:
                acks = self.cursor.deliver_many(items)
                crash_point("xfer.cursor.after_persist")
                replies += [Ack(a.stream, a.epoch, a.seq) for a in acks]
                self.stats["messages"] += len(items)
                self.stats["batches"] += 1
            conn.send_many(replies)
            if items:
                crash_point("xfer.cursor.after_ack")

    def _arrived(self, conn: Connection) -> list[WireFrame]:
        """Frames already in the socket (or TLS) buffer, without waiting for more."""
        out: list[WireFrame] = []
        while len(out) < self.batch and conn.readable():
            try:
                frame = conn.recv(timeout=0.05)
            except TimeoutError:  # a frame half here: it is kept for the next recv
                break
            if frame is None:
                break
            out.append(frame)
        return out

    def _take(self, msg: Msg, items: list[tuple[Frame, Message]], replies: list[WireFrame]) -> None:
        try:
            items.append(from_wire(msg))
        except InvalidMessageError as exc:
            self.stats["refused"] += 1
            log.error("refusing message %s of %s: %s", msg.message_id, msg.stream, exc)
            replies.append(Nack(msg.stream, msg.epoch, msg.seq, INVALID_MESSAGE, str(exc)[:500]))
