"""The cursor's side of the transfer protocol: a connection handler for the ``transfer`` role.

It reads MSG frames, takes whatever has already arrived as one batch, lets the stream filter judge
each frame, persists the accepted messages with the filter state, and only then acknowledges, once
per stream, with the last accepted number ("order acknowledgment"). By default the records are
not forced (`Cursor.deliver_lazily`): the cursor's next forced record — a consumer's prepare or
commit — carries them to disk, or an fsync of its own a moment later, and the acknowledgments
leave (from this connection's acknowledgment thread) only then; so a message costs the transfer
no fsync of its own while consumers are busy. ``lazy_acks=False`` forces each batch
(`Cursor.deliver_many`: one fsync per burst) and acknowledges on this thread.

Duplicates and out-of-order frames are dropped and answered with that
same acknowledgment, which tells the sender where the stream stands. A frame that breaks the
protocol closes this connection; a well-formed message no log could have written (a bad
destination, a header that is not text) is refused with a NACK and the connection goes on.

In protocol version 2 a transfer begins with ORIGIN: the log's durable identity and incarnation.
The cursor keeps that log's streams under its identity (`sequencing.stream_key`), so any number of
logs feed one destination, each judged in its own numbers; an older incarnation of an identity
announced since is refused (``ERROR log-fenced``), before its first batch and at every batch.
A version-1 transfer names no log: its streams are the bare stream names, as before.

Crash points: ``xfer.cursor.after_announce`` (a newer incarnation's ``L`` record queued, no
batch of it judged), ``xfer.cursor.after_persist`` (a batch is applied, durable unless lazy, its
acknowledgments not sent) and ``xfer.cursor.after_ack``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter

from coordinator import tracing
from coordinator.crashpoints import crash_point
from coordinator.errors import FrameError
from resource_managers.cursor import Cursor
from resource_managers.message_log import LOG_IDENTITY, InvalidMessageError, Message
from resource_managers.sequencing import Ack as SeqAck
from resource_managers.sequencing import Frame, split_key

from ..connection import Connection
from ..frames import ORIGIN_VERSION, Ack, ErrorFrame, Msg, Nack, Origin, Ping, Pong
from ..frames import Frame as WireFrame
from .sender import INVALID_MESSAGE
from .wire import from_wire

log = logging.getLogger("twopc.transfer")


class TransferReceiver:
    """Serves transfer connections into ``cursor``; one instance for every connection of a
    listener (``stats`` adds them up). ``idle_timeout``: a connection silent that long is given
    up (the sender pings far more often)."""

    def __init__(
        self,
        cursor: Cursor,
        *,
        batch: int = 1024,
        idle_timeout: float = 30.0,
        lazy_acks: bool = True,
    ) -> None:
        self.cursor = cursor
        self.batch = batch
        self.idle_timeout = idle_timeout
        self.lazy_acks = lazy_acks
        self.stats: Counter[str] = Counter()

    def __call__(self, conn: Connection) -> None:
        acks = _AckSender(conn) if self.lazy_acks else None
        try:
            self._serve(conn, acks)
        finally:
            if acks is not None:
                acks.close()

    def _serve(self, conn: Connection, acks: _AckSender | None) -> None:
        source: tuple[str, int] | None = None
        if conn.version >= ORIGIN_VERSION:
            source = self._origin(conn)
            if source is None:
                return
        log_id = "" if source is None else source[0]
        while True:
            first = conn.recv(timeout=self.idle_timeout)
            if first is None:
                return
            items: list[tuple[Frame, Message]] = []
            replies: list[WireFrame] = []
            if not self._sort(conn, [first, *self._arrived(conn)], log_id, items, replies):
                return
            if acks is not None:  # everything answers in order, behind the records' fsync
                self._deliver_lazily(items, replies, acks, source)
                continue
            if items:
                done = self.cursor.deliver_many(items, source=source)
                replies += [_wire_ack(a) for a in done]
                self._delivered(items)
            if replies:
                conn.send_many(replies)
            if items:
                crash_point("xfer.cursor.after_ack")

    def _sort(
        self,
        conn: Connection,
        frames: list[WireFrame],
        log_id: str,
        items: list[tuple[Frame, Message]],
        replies: list[WireFrame],
    ) -> bool:
        """A batch's frames into messages to judge and replies; False if the peer closes."""
        for frame in frames:
            if isinstance(frame, Msg):
                self._take(frame, log_id, items, replies)
            elif isinstance(frame, Ping):
                replies.append(Pong(frame.token))
            elif isinstance(frame, Pong):
                pass
            elif isinstance(frame, ErrorFrame):
                log.warning("transfer peer %s closes: %s", conn.peer.id, frame.code)
                return False
            else:
                raise FrameError(f"unexpected {type(frame).__name__} frame on a transfer")
        return True

    def _origin(self, conn: Connection) -> tuple[str, int] | None:
        """Version 2: the first frame names the log (None: the peer closed first). A log
        identity that is not one is a bad frame; an incarnation fenced by a newer one of the
        same identity raises `LogFencedError` (the listener answers ``ERROR log-fenced``)."""
        frame = conn.recv(timeout=self.idle_timeout)
        if frame is None:
            return None
        if not isinstance(frame, Origin):
            raise FrameError(f"a version-2 transfer begins with ORIGIN, not {type(frame).__name__}")
        if not LOG_IDENTITY.fullmatch(frame.log) or not 0 < frame.incarnation < 2**64:
            raise FrameError(f"ORIGIN: {frame.log[:64]!r} is not a log identity, or incarnation 0")
        self.cursor.announce_log(frame.log, frame.incarnation)
        self.stats["origins"] += 1
        return frame.log, frame.incarnation

    def _deliver_lazily(
        self,
        items: list[tuple[Frame, Message]],
        replies: list[WireFrame],
        acks: _AckSender,
        source: tuple[str, int] | None,
    ) -> None:
        """The batch's answers (PONGs and NACKs in frame order, then one ACK per stream) leave
        once every record before them is durable, so a PONG still means "all before it is
        answered", and nothing is acknowledged that a crash could take back."""

        def answer(done: list[SeqAck]) -> None:
            acks.put([*replies, *(_wire_ack(a) for a in done)])

        self.cursor.deliver_lazily(items, answer, source=source)
        if items:
            self._delivered(items)

    def _delivered(self, items: list[tuple[Frame, Message]]) -> None:
        crash_point("xfer.cursor.after_persist")
        if tracing.installed() is not None:
            for frame, message in items:
                tracing.message_event(
                    "cursor.accept", message.headers, destination=message.destination,
                    seq=str(frame.seq),
                )  # fmt: skip
        self.stats["messages"] += len(items)
        self.stats["batches"] += 1

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

    def _take(
        self, msg: Msg, log_id: str, items: list[tuple[Frame, Message]], replies: list[WireFrame]
    ) -> None:
        try:
            items.append(from_wire(msg, log_id))
        except InvalidMessageError as exc:
            self.stats["refused"] += 1
            log.error("refusing message %s of %s: %s", msg.message_id, msg.stream, exc)
            replies.append(Nack(msg.stream, msg.epoch, msg.seq, INVALID_MESSAGE, str(exc)[:500]))


def _wire_ack(ack: SeqAck) -> Ack:
    """The cursor's acknowledgment of a stream key, as the log knows the stream: the connection
    carries one log, so its ACKs name the bare stream."""
    return Ack(split_key(ack.stream)[1], ack.epoch, ack.seq)


class _AckSender:
    """Sends a connection's answers from a thread of its own: they become due when the cursor's
    records are durable, often on a consumer's thread (whose forced record carried them), which
    must never block on a peer that stopped reading."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[list[WireFrame] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="twopc-transfer-acks", daemon=True)
        self._thread.start()

    def put(self, frames: list[WireFrame]) -> None:
        if frames:
            self._queue.put(frames)

    def close(self) -> None:
        """Stop after what is queued; acknowledgments due later are dropped (the log resends,
        and the cursor re-acknowledges them as duplicates)."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            frames = self._queue.get()
            if frames is None:
                return
            while True:  # what else is due goes in the same send
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                frames += more
            try:
                self._conn.send_many(frames)
            except OSError:
                return  # the connection is gone: the log resends what it did not hear of
            crash_point("xfer.cursor.after_ack")
