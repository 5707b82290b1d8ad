"""Group commit: one write and one fsync for every record that arrived while the last fsync ran.

Leader/follower, with no background thread. A forced record joins the queue; if nobody is
flushing, its thread becomes the leader, takes the whole queue, writes and fsyncs it once through
the ``flush`` callback, and wakes everyone whose record that made durable. Records arriving during
that fsync queue up and form the next group: the leader hands its role to the first of them, whose
thread then leads. So throughput grows with concurrency instead of being capped at one record per
fsync latency, and an idle log costs no thread. Each waiter sleeps on its own lock and is woken
once, not with every group, which halves the context switches of a busy log.

Lazy records (``force=False``) join the queue and return at once; they ride along with the next
group. A failed flush fails exactly the records of its group: each waiter gets its own copy of the
error, because one exception object raised in many threads would share a traceback.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from coordinator.errors import LogWriteError

# Lazy records waiting for a group are memory that a crash throws away; past this much, the
# lazy appender flushes them itself rather than let the backlog grow without bound.
LAZY_BACKLOG_BYTES = 1024 * 1024


class Ticket:
    __slots__ = ("backlog", "done", "error", "forced", "frame", "records", "wake")

    def __init__(self, frame: bytes, forced: bool, records: int = 1) -> None:
        self.frame = frame
        self.forced = forced
        self.records = records  # frames joined in ``frame`` (the last one counts as forced)
        self.backlog = False  # a lazy record that found the queue over LAZY_BACKLOG_BYTES
        self.done = False
        self.error: LogWriteError | None = None
        # A forced ticket's thread sleeps on its own lock (held from birth) until its record is
        # settled or it is handed the leader role: one wake per waiter, not a thundering herd.
        self.wake: threading.Lock | None = None
        if forced:
            self.wake = threading.Lock()
            self.wake.acquire()

    def settled(self) -> bool:
        return self.done


class GroupCommit:
    """Batches records into ``flush(frames)`` calls; ``flush`` raises `LogWriteError` on failure.

    ``grouped=False`` serialises forced records so that each gets its own write and fsync: the
    baseline the benchmark compares against, not a mode for production.
    """

    def __init__(self, flush: Callable[[list[bytes]], None], *, grouped: bool = True) -> None:
        self._flush = flush
        self._grouped = grouped
        self._mutex = threading.Lock()
        self._exclusive_turn = threading.Condition(self._mutex)
        self._serial = threading.Lock()
        self._queue: list[Ticket] = []
        self._queued_bytes = 0
        self._leading = False
        self._exclusive_waiting = 0
        self._refusal: str | None = None
        self.forced_records = 0
        self.lazy_records = 0

    def submit(self, frame: bytes, force: bool, records: int = 1) -> None:
        """Queue a record (or ``records`` frames joined, written together and in order); if
        forced, return only once it is durable (or raise why it is not)."""
        ticket = Ticket(frame, force, records)
        if force:
            self._force(ticket)
            return
        with self._mutex:
            self._enqueue(ticket)
            backlog = self._queued_bytes >= LAZY_BACKLOG_BYTES
        if backlog:
            self.sync()

    def enqueue(self, frame: bytes, force: bool, records: int = 1) -> Ticket:
        """The first half of `submit`: queue the record and return at once. Records are written
        in the order they are queued, so a caller that queues under its own lock and applies the
        record to its state under the same lock keeps its state in the journal's order; it then
        calls `wait` outside the lock for the durability a forced record needs."""
        ticket = Ticket(frame, force, records)
        with self._mutex:
            self._enqueue(ticket)
            ticket.backlog = not force and self._queued_bytes >= LAZY_BACKLOG_BYTES
        return ticket

    def wait(self, ticket: Ticket) -> None:
        """The second half: a forced record returns once durable (or raises why it is not)."""
        if not ticket.forced:
            if ticket.backlog:
                self.sync()
            return
        if self._grouped:
            self._await(ticket)
        else:
            with self._serial:
                self._await(ticket)
        if ticket.error is not None:
            raise ticket.error

    def sync(self) -> None:
        """Make everything queued so far durable."""
        self._force(Ticket(b"", True))

    def refuse(self, reason: str) -> None:
        """From now on every submission raises ``LogWriteError(durable=False)`` with ``reason``."""
        with self._mutex:
            self._refusal = reason

    @contextmanager
    def exclusive(self) -> Iterator[LogWriteError | None]:
        """Hold the leader role, after flushing the queue, so no write runs meanwhile.

        Yields the flush's error (None if it succeeded) rather than raising it, so that a caller
        such as ``close`` can still do its part. Waiting for it stops the role being handed from
        writer to writer, so a busy log cannot starve a rollover.
        """
        with self._mutex:
            self._exclusive_waiting += 1
            while self._leading:
                self._exclusive_turn.wait()
            self._exclusive_waiting -= 1
            self._leading = True
            batch = self._take()
        try:
            yield self._run(batch)
        finally:
            self._hand_off()

    def _force(self, ticket: Ticket) -> None:
        if self._grouped:
            self._lead_or_follow(ticket)
        else:
            with self._serial:
                self._lead_or_follow(ticket)
        if ticket.error is not None:
            raise ticket.error

    def _lead_or_follow(self, ticket: Ticket) -> None:
        with self._mutex:
            self._enqueue(ticket)
        self._await(ticket)

    def _await(self, ticket: Ticket) -> None:
        """Lead a group or follow one until ``ticket`` is settled. A ticket queued by `enqueue`
        may have been settled by another leader, or handed the leader role (its wake lock
        released), before its thread got here: both are found below."""
        assert ticket.wake is not None
        with self._mutex:
            if ticket.settled():
                return
            follow, self._leading = self._leading, True
        if follow:
            ticket.wake.acquire()  # until settled, or handed the leader role
            if ticket.done:
                return
        with self._mutex:
            batch = self._take()
        try:
            self._run(batch)
        finally:
            self._hand_off()

    def _enqueue(self, ticket: Ticket) -> None:
        if self._refusal is not None:
            raise LogWriteError(self._refusal, durable=False)
        self._queue.append(ticket)
        self._queued_bytes += len(ticket.frame)
        if ticket.frame:
            if ticket.forced:
                self.forced_records += 1
                self.lazy_records += ticket.records - 1
            else:
                self.lazy_records += ticket.records

    def _take(self) -> list[Ticket]:
        batch, self._queue, self._queued_bytes = self._queue, [], 0
        return batch

    def _run(self, batch: list[Ticket]) -> LogWriteError | None:
        """Flush one group and settle every ticket in it, whatever happens."""
        error: LogWriteError | None = None
        try:
            self._flush([ticket.frame for ticket in batch])
        except LogWriteError as exc:
            error = exc
        except BaseException as exc:
            error = LogWriteError(f"unexpected failure writing the journal: {exc!r}", durable=None)
            raise
        finally:
            self._settle(batch, error)
        return error

    @staticmethod
    def _settle(batch: list[Ticket], error: LogWriteError | None) -> None:
        for ticket in batch:
            if error is not None:
                ticket.error = LogWriteError(error.message, durable=error.durable)
                ticket.error.__cause__ = error
            ticket.done = True
            if ticket.wake is not None:
                ticket.wake.release()

    def _hand_off(self) -> None:
        """Pass the leader role on: to a waiting rollover or close first, else to the first
        forced record that queued meanwhile (its thread leads the next group), else to nobody."""
        with self._mutex:
            if self._exclusive_waiting:
                self._leading = False
                self._exclusive_turn.notify()
                return
            successor = next((t for t in self._queue if t.wake is not None), None)
            if successor is None:
                self._leading = False
                return
        assert successor.wake is not None
        successor.wake.release()
