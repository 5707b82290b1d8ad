"""Group commit for `SqlDecisionLog`: concurrent callers' records become one statement and one
commit (leader/follower; the first caller of a batch writes it for all)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

from coordinator.decision_log import Decision
from coordinator.decision_log._memory import End
from coordinator.errors import FencedError, LogWriteError, TransactionError


class _Ticket:
    __slots__ = ("done", "error", "forced", "record")

    def __init__(self, record: Decision | End | None, forced: bool) -> None:
        self.record = record
        self.forced = forced
        self.done = False
        self.error: TransactionError | None = None


class GroupCommit:
    """Leader/follower batching of records into one ``flush(records)`` call.

    `coordinator.journal`'s group commit carries bytes and turns every failure into
    `LogWriteError`; a fenced batch must raise `FencedError`, hence this small twin. A forced
    record queues; if no batch is being written, its thread leads: it takes the queue, flushes it,
    and settles every record in it. Records arriving meanwhile form the next batch. Lazy records
    queue and return at once. ``grouped=False`` gives each forced record a batch of its own.
    """

    def __init__(self, flush: Callable[[list[Decision | End]], None], *, grouped: bool) -> None:
        self._flush = flush
        self._grouped = grouped
        self._turn = threading.Condition()
        self._queue: list[_Ticket] = []
        self._leading = False
        self._closed = False
        self.forced = 0
        self.lazy = 0

    def submit(self, record: Decision | End, *, force: bool) -> None:
        """Queue a record; if forced, return once its batch committed (or raise its error)."""
        ticket = _Ticket(record, force)
        with self._turn:
            if self._closed:
                raise LogWriteError("decision log is closed; nothing was written", durable=False)
            self._queue.append(ticket)
            self.forced += force
            self.lazy += not force
        if force:
            self._drive(ticket)

    def sync(self) -> None:
        """Write everything queued so far, lazy records included."""
        ticket = _Ticket(None, True)
        with self._turn:
            self._queue.append(ticket)
        self._drive(ticket)

    def close(self) -> None:
        """Refuse new records, then write the queue."""
        with self._turn:
            self._closed = True
        self.sync()

    def _drive(self, ticket: _Ticket) -> None:
        while True:
            with self._turn:
                while self._leading and not ticket.done:
                    self._turn.wait()
                if ticket.done:
                    break
                self._leading = True
                batch = self._take()
            self._run(batch)
        if ticket.error is not None:
            raise ticket.error

    def _take(self) -> list[_Ticket]:
        cut = len(self._queue)
        if not self._grouped:
            cut = next((i + 1 for i, t in enumerate(self._queue) if t.forced), cut)
        batch, self._queue = self._queue[:cut], self._queue[cut:]
        return batch

    def _run(self, batch: list[_Ticket]) -> None:
        """Flush one batch and settle each of its records, whatever happens."""
        error: TransactionError | None = None
        try:
            records = [t.record for t in batch if t.record is not None]
            if records:
                self._flush(records)
        except (FencedError, LogWriteError) as exc:
            error = exc
        except BaseException as exc:
            error = LogWriteError(f"unexpected failure writing decisions: {exc!r}", durable=None)
            raise
        finally:
            with self._turn:
                for t in batch:
                    t.done = True
                    if error is not None:  # a copy each: one exception raised in many threads
                        t.error = copy.copy(error)  # would share one traceback
                        t.error.__cause__ = error
                self._leading = False
                self._turn.notify_all()
