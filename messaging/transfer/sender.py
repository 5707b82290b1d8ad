"""`LogTransfer`: the message log's side of the transfer protocol (US patent 8,200,836), one per
cursor.

At-least-once over TCP: every committed message is sent, its timer started, resent on expiry with
back-off, and compacted from the log once the cursor acknowledges it. Exactly-once and in order on
top, through the stream numbers (`resource_managers.sequencing`): the log numbers messages at
commit, this loop adopts them into a `StreamSender` per stream, which puts the previous number on
each frame and judges every acknowledgment.

One thread, the *pump*, owns the socket: it takes the acknowledgments that have arrived, reads new
commits, expires, sends what is due (at most ``max_in_flight`` unacknowledged first sends per
stream, so a backlog cannot flood the socket and then time out in its buffer), reconnects, and
sleeps in ``select`` on the socket and a wake-up pipe, which the thread that publishes pokes
(`MessageLog.on_publish`: no thread of ours parked to relay the news). A single owner matters: a
TLS socket must not be read and written by two threads at once, and a timeout set for a read must
not cut a concurrent write short. A lost connection makes every unacknowledged message due again on
the next one, since what was on the old one may never have arrived. Nothing here is durable: the
log holds the messages and their numbers, the cursor the filter, so a crash of either side at any
point costs at most a resend that the filter drops.

Crash points: ``xfer.log.after_send`` (frames on the wire, no ack yet),
``xfer.log.before_compact`` (an ack received, the log not yet compacted) and
``xfer.log.after_keep_refused`` (a refused message kept in ``refused/``, not yet dropped).

Why one module: the pump is one thread that owns the socket, and its steps (acknowledgments, new
commits, expiry, sends, reconnects) share its state; the single-owner rule is easiest to check
with the whole loop in one class.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from coordinator import tracing
from coordinator.backoff import Backoff, ExponentialBackoff
from coordinator.crashpoints import crash_point
from coordinator.errors import FrameError, LogError
from resource_managers.message_log import Message, MessageLog
from resource_managers.sequencing import AckVerdict, DoublingBackoff, Frame, StreamSender

from ..connection import Connection
from ..frames import (
    BATCH_VERSION,
    MSGS_OVERHEAD,
    ORIGIN_VERSION,
    Ack,
    ErrorFrame,
    Msg,
    Nack,
    Origin,
    PackedMsg,
    Ping,
    Pong,
)
from ..frames import Frame as WireFrame
from .wire import pack_wire, to_wire

log = logging.getLogger("twopc.transfer")

#: first repeat of the ``cannot reach cursor`` warning, doubling up to `UNREACHABLE_WARN_CAP`
UNREACHABLE_WARN_FIRST = 10.0
UNREACHABLE_WARN_CAP = 300.0

#: the role a log authenticates with at a cursor's listener
TRANSFER_ROLE = "transfer"
#: the NACK reason of a message the cursor will never accept (see `TransferReceiver`)
INVALID_MESSAGE = "invalid-message"
#: the ERROR code of a cursor refusing this process's log identity (`LogFencedError`)
LOG_FENCED = "log-fenced"


class LogTransfer:
    """Moves committed messages of ``mlog`` to one cursor, reached through ``connect`` (called
    again after every failure). ``streams`` selects which streams go there (default: all).
    ``resend``: the back-off of each message's timer. ``ping_interval``: a silent connection is
    probed that often and given up after three intervals without a frame. ``peer`` names the
    cursor (``HOST:PORT``) in the warnings an operator reads when it cannot be reached."""

    def __init__(
        self,
        mlog: MessageLog,
        connect: Callable[[], Connection],
        *,
        streams: Callable[[str], bool] | None = None,
        resend: DoublingBackoff | None = None,
        reconnect: Backoff | None = None,
        max_in_flight: int = 1024,
        batch: int = 256,
        ping_interval: float = 5.0,
        name: str = "transfer",
        peer: str | None = None,
    ) -> None:
        self.mlog = mlog
        self._connect = connect
        self._wanted = streams or (lambda _stream: True)
        self.resend = resend or DoublingBackoff(base=0.5, cap=30.0)
        self.reconnect = reconnect or ExponentialBackoff(base=0.1, cap=5.0)
        self.max_in_flight = max_in_flight
        self.batch = batch
        self.ping_interval = ping_interval
        self.name = name
        self.peer = peer or "(its address)"
        self.stats: Counter[str] = Counter()
        self._unreachable = _Unreachable(time.monotonic)
        self._senders: dict[str, StreamSender] = {}
        self._lock = threading.Lock()  # the senders
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closing = threading.Event()
        self._conn: Connection | None = None
        self._threads: list[threading.Thread] = []
        self._unwatch: Callable[[], None] = lambda: None
        self._seen_version = -1
        self._fenced_logged: set[str] = set()
        self._last_sent = self._last_heard = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LogTransfer:
        self._unwatch = self.mlog.on_publish(self._poke)  # before the pump's first look
        thread = threading.Thread(target=self._pump, name=f"twopc-{self.name}-pump", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._closing.set()
        self._unwatch()
        self._poke()
        for thread in self._threads:
            thread.join(timeout)
        self._drop()
        self._wake_r.close()
        self._wake_w.close()

    def _poke(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"x")

    def __enter__(self) -> LogTransfer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- inspection ------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        conn = self._conn
        return conn is not None and not conn.closed

    def backlog(self) -> dict[str, int]:
        """Unacknowledged messages per stream, as this transfer sees them."""
        with self._lock:
            return {s: len(sender.window) for s, sender in self._senders.items() if sender.window}

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the log holds no unacknowledged message for this cursor, nor a commit
        whose messages are not visible yet (a lazy commit record on its way to disk)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.mlog.settling_commits() and not any(
                self.mlog.pending(s) for s in self.mlog.streams() if self._wanted(s)
            ):
                return True
            time.sleep(0.01)
        return False

    # -- the pump --------------------------------------------------------------------------------

    def _pump(self) -> None:
        failures = 0
        # the cursor closed on us with an error, or this log refused a write: both stay so
        # until someone acts (a full disk, a fenced log), so the pump backs off, not only until
        # the next connect succeeds (which it does at once), but until an acknowledgment is
        # recorded again
        refused = 0
        while not self._closing.is_set():
            if self._conn is None:
                if not self._open():
                    failures += 1
                    self._closing.wait(self.reconnect.compute(failures))
                    continue
                failures = 0
            conn = self._conn
            assert conn is not None
            try:
                acknowledged = self.stats["acknowledged"]
                self._take_replies(conn)
                if self.stats["acknowledged"] > acknowledged:
                    refused = 0
                more = self._step()
                if not more:
                    self._idle(conn, self._sleep())
            except TimeoutError:
                self.stats["silent_peer"] += 1
                log.warning("%s: the cursor is silent; reconnecting", self.name)
                self._drop()
            except _ClosedByCursor as exc:  # said once a run, then quietly until progress
                self.stats["closed_by_cursor"] += 1
                log.log(logging.INFO if refused else logging.WARNING, "%s: %s", self.name, exc)
                self._drop()
                refused += 1
                self._closing.wait(self.reconnect.compute(refused))
            except LogError as exc:  # an acknowledgment or a drop not written: the log refuses
                self.stats["log_errors"] += 1
                log.log(
                    logging.INFO if refused else logging.ERROR,
                    "%s: the message log refused a write: %s", self.name, exc.message,
                )  # fmt: skip
                self._drop()
                refused += 1
                self._closing.wait(self.reconnect.compute(refused))
            except (OSError, FrameError) as exc:
                self.stats["connection_errors"] += 1
                log.info("%s: connection lost: %s", self.name, exc)
                self._drop()

    def _open(self) -> bool:
        try:
            conn = self._connect()
        except (OSError, FrameError) as exc:
            self.stats["connect_failures"] += 1
            self._unreachable.failed(self.name, self.peer, exc)
            return False
        if conn.version >= ORIGIN_VERSION:  # our streams are ours at the cursor, not shared
            try:
                conn.send(Origin(self.mlog.identity, self.mlog.incarnation))
            except OSError as exc:
                conn.close()
                self.stats["connect_failures"] += 1
                self._unreachable.failed(self.name, self.peer, exc)
                return False
        self._unreachable.reached(self.name, self.peer)
        self.stats["connections"] += 1
        with self._lock:
            for sender in self._senders.values():
                sender.resend_all()
        self._conn = conn
        self._last_sent = self._last_heard = time.monotonic()
        return True

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _idle(self, conn: Connection, timeout: float) -> None:
        """Sleep until a frame arrives, the log publishes, or ``timeout`` passes."""
        if conn.readable():
            return
        ready, _, _ = select.select([conn.sock, self._wake_r], [], [], timeout)
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while self._wake_r.recv(4096):
                    pass

    def _take_replies(self, conn: Connection) -> None:
        """Handle every frame that has arrived, without waiting for more; a peer silent for
        three ping intervals is given up (TimeoutError)."""
        while conn.readable():
            frame = conn.recv(timeout=self.ping_interval)  # a frame has begun: the rest follows
            if frame is None:
                raise ConnectionResetError("the cursor closed the connection")
            self._last_heard = time.monotonic()
            self._handle(conn, frame)
        if time.monotonic() - self._last_heard > 3 * self.ping_interval:
            raise TimeoutError("no frame from the cursor in three ping intervals")

    def _step(self) -> bool:
        """Adopt new commits, expire, send what is due; True if more is due at once."""
        self._sync()
        now = time.monotonic()
        out: list[tuple[Frame, str]] = []
        drops: list[tuple[str, int, list[int]]] = []
        more = False
        with self._lock:
            for name, sender in self._senders.items():
                sent_before = sender.highest_sent  # a frame numbered at or below: a resend
                tick = sender.tick(now, self.batch, self.max_in_flight)
                if tick.frames and tick.frames[0].seq <= sent_before:
                    self.stats["resends"] += sum(f.seq <= sent_before for f in tick.frames)
                if tick.expired:
                    drops.append((name, sender.epoch, [e.seq for e in tick.expired]))
                    self.stats["expired"] += len(tick.expired)
                out += [(f, name) for f in tick.frames]
                more = more or len(tick.frames) >= self.batch
        for name, epoch, numbers in drops:
            self.mlog.drop(name, epoch, numbers)
        conn = self._conn
        if conn is None:
            return False
        frames = self._wire(out, conn)
        if frames:
            conn.send_many(frames)
            self.stats["frames_sent"] += len(frames)
            self._last_sent = now
            crash_point("xfer.log.after_send")
        elif now - self._last_sent >= self.ping_interval:
            conn.send(Ping(int(now * 1000)))
            self._last_sent = now
        return more

    def _wire(self, out: list[tuple[Frame, str]], conn: Connection) -> list[Msg | PackedMsg]:
        """The frames to send, packed already where the connection reads MSGS (`pack_wire`)."""
        by_stream: dict[str, list[Frame]] = {}
        for frame, name in out:
            by_stream.setdefault(name, []).append(frame)
        frames: list[Msg | PackedMsg] = []
        wire: Callable[[Frame, Message], Msg | PackedMsg] = to_wire
        if conn.version >= BATCH_VERSION:
            wire = functools.partial(pack_wire, limit=conn.max_frame - MSGS_OVERHEAD)
        for name, group in by_stream.items():
            messages = self.mlog.get(name, [f.seq for f in group])
            for f in group:
                message = messages.get(f.seq)
                if message is not None:  # acknowledged or dropped meanwhile: nothing to send
                    frames.append(wire(f, message))
                    if tracing.installed() is not None:
                        tracing.message_event(
                            "transfer.send", message.headers, destination=message.destination,
                            seq=str(f.seq),
                        )  # fmt: skip
        return frames

    def _sync(self) -> None:
        """Adopt what the log committed since the last look; a stream whose epoch changed (its
        volatile twin after a restart) starts over from the log's state."""
        version = self.mlog.version
        if version == self._seen_version:
            return
        self._seen_version = version
        for name, epoch in self.mlog.streams().items():
            if not self._wanted(name):
                continue
            with self._lock:
                sender = self._senders.get(name)
            if sender is None or sender.epoch != epoch:
                state = self.mlog.sender_state(name)
                fresh = StreamSender.from_dict(_to_monotonic(state), backoff=self.resend)
                with self._lock:
                    self._senders[name] = fresh
                continue
            adopted = self.mlog.pending(name, after=sender.next_seq - 1)
            with self._lock:
                for seq, message in adopted:
                    if seq >= sender.next_seq:
                        sender.adopt(seq, message.message_id, _deadline(message.expires_at))

    def _sleep(self) -> float:
        with self._lock:
            wakeups = [
                w
                for s in self._senders.values()
                if (w := s.next_wakeup(self.max_in_flight)) is not None
            ]
        now = time.monotonic()
        until = min(wakeups, default=now + self.ping_interval)
        return max(0.0, min(until - now, self.ping_interval))

    # -- the reader ------------------------------------------------------------------------------

    def _handle(self, conn: Connection, frame: WireFrame) -> None:
        if isinstance(frame, Ack):
            self._on_ack(frame)
        elif isinstance(frame, Ping):
            conn.send(Pong(frame.token))
        elif isinstance(frame, Pong):
            pass
        elif isinstance(frame, Nack):
            self._on_nack(frame)
        elif isinstance(frame, ErrorFrame):
            if frame.code == LOG_FENCED:
                self._fenced(frame.message)
            raise _ClosedByCursor(f"the cursor closes: {frame.code} {frame.message}")
        else:
            raise FrameError(f"unexpected {type(frame).__name__} frame on a transfer")

    def _fenced(self, message: str) -> None:
        """The cursor refuses this log's identity: a newer process announced the same one. Said
        once, loudly: nothing this process sends will be accepted until it is the newest again
        (reopened), and two processes of one log must not both run."""
        self.stats["fenced"] += 1
        if self.stats["fenced"] == 1:
            log.error(
                "%s: the cursor fenced this log (identity %s, incarnation %d): %s",
                self.name, self.mlog.identity, self.mlog.incarnation, message,
            )  # fmt: skip

    def _on_nack(self, nack: Nack) -> None:
        """``invalid-message``: the cursor will refuse every resend, and the stream cannot move
        past it, so the log keeps the message in ``refused/`` (durably) and takes it out of the
        stream; the next message is relinked past it. Any other reason, or a message this
        transfer no longer holds (a refusal of a resend already dealt with), changes nothing."""
        self.stats["nacks"] += 1
        with self._lock:
            sender = self._senders.get(nack.stream)
            mine = sender is not None and sender.epoch == nack.epoch and nack.seq in sender.window
        kept = self._keep_and_drop(nack) if mine and nack.reason == INVALID_MESSAGE else None
        if kept is None or sender is None:
            log.error(
                "%s: the cursor refused message %d of %s (epoch %d): %s %s; nothing changed",
                self.name, nack.seq, nack.stream, nack.epoch, nack.reason, nack.detail,
            )  # fmt: skip
            return
        with self._lock:
            sender.withdraw(nack.seq)
        self.stats["refused"] += 1
        log.error(
            "%s: the cursor refused message %d of %s (epoch %d): %s; kept in %s and taken out "
            "of the stream", self.name, nack.seq, nack.stream, nack.epoch, nack.detail, kept,
        )  # fmt: skip

    def _keep_and_drop(self, nack: Nack) -> Path | None:
        """Keep the refused message, then drop it from the log; the kept file, or None if either
        failed (then it stays in the stream and is resent with back-off, to be refused again)."""
        try:
            kept = self.mlog.keep_refused(nack.stream, nack.epoch, nack.seq, nack.detail)
            if kept is not None:
                crash_point("xfer.log.after_keep_refused")
                self.mlog.drop(nack.stream, nack.epoch, [nack.seq])
        except (OSError, LogError) as exc:
            log.error("%s: cannot set refused message %d of %s aside: %s; it is resent",
                      self.name, nack.seq, nack.stream, exc)  # fmt: skip
            return None
        return kept

    def _on_ack(self, ack: Ack) -> None:
        with self._lock:
            sender = self._senders.get(ack.stream)
            if sender is None:
                self.stats["stray_acks"] += 1
                return
            result = sender.on_ack(ack.epoch, ack.seq)
            fenced = sender.fenced
        self.stats[f"ack_{result.verdict.value}"] += 1
        if fenced and ack.stream not in self._fenced_logged:
            self._fenced_logged.add(ack.stream)
            log.error(
                "%s: the cursor acknowledged stream %s in epoch %d, newer than ours (%d): "
                "another process of this log (or, over protocol version 1, another log) feeds "
                "the same stream; its messages and ours cannot both be delivered in order",
                self.name, ack.stream, ack.epoch, sender.epoch,
            )  # fmt: skip
        if result.verdict is AckVerdict.ADVANCED:
            crash_point("xfer.log.before_compact")
            self.mlog.acknowledge(ack.stream, ack.epoch, ack.seq)
            self.stats["acknowledged"] += len(result.acknowledged)


class _ClosedByCursor(ConnectionAbortedError):
    """The cursor sent an ``ERROR`` frame and closes: reconnecting at once would meet the same
    refusal (a cursor that refuses writes, a fenced log)."""


def _deadline(expires_at_ms: int | None) -> float | None:
    """A wall-clock expiry on the monotonic clock the timers use."""
    if expires_at_ms is None:
        return None
    return expires_at_ms / 1000 - time.time() + time.monotonic()


def _to_monotonic(state: dict[str, object]) -> dict[str, object]:
    pending = state["pending"]
    assert isinstance(pending, list)
    return {**state, "pending": [[n, mid, _deadline(exp)] for n, mid, exp in pending]}


class _Unreachable:
    """``cannot reach cursor HOST:PORT`` at WARNING: at the first failed attempt, then again
    after 10 s, 20 s, 40 s ... at most every 5 minutes while it lasts (the attempts themselves
    go on at their own back-off, logged at INFO), and once more when it is reached again. An
    operator sees it without ``-v``, and a cursor down for a day costs a few hundred lines,
    not one per attempt."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._failures = 0
        self._next_warning = 0.0
        self._interval = UNREACHABLE_WARN_FIRST

    def failed(self, name: str, peer: str, exc: BaseException) -> None:
        self._failures += 1
        now = self._clock()
        if self._failures == 1 or now >= self._next_warning:
            log.warning(
                "%s: cannot reach cursor %s: %s (attempt %d; retrying)",
                name, peer, exc, self._failures,
            )  # fmt: skip
            if self._failures > 1:
                self._interval = min(self._interval * 2, UNREACHABLE_WARN_CAP)
            self._next_warning = now + self._interval
        else:
            log.info("%s: cannot reach cursor %s: %s", name, peer, exc)

    def reached(self, name: str, peer: str) -> None:
        if self._failures:
            log.warning(
                "%s: reached cursor %s after %d failed attempts", name, peer, self._failures
            )
        self._failures = 0
        self._interval = UNREACHABLE_WARN_FIRST
