"""`CursorBase`: the one lock, state and journal that every concern of the cursor shares, and
the record-writing discipline they all follow (queue and apply under the lock, wait for
durability outside it, all inside the rollover gate)."""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.errors import LogWriteError
from coordinator.journal import Compaction, Gate, Journal, LazyWatch, Ticket
from resource_managers.bookkeeping import carried_records
from resource_managers.sequencing import StreamFilter

from ._records import encode
from ._state import CursorState, StagedBranch

log = logging.getLogger("twopc.cursor")


class CursorBase:
    """The state every concern of `Cursor` shares, and the journal they all write through.

    One lock (``_lock``, with its condition ``changed``) guards ``_state`` and every in-memory
    table below; the ``_gate`` keeps a rollover from seeing a record queued and not applied;
    ``Cursor.__init__`` sets every attribute. The concerns (`._intake`, `._xa`,
    `._subscriptions`, `._dispatch`, `._dead_letters`, `._queues`) are mixins of this class, so
    they take the same lock and write the same journal in the same order as one class would."""

    directory: Path
    max_deliveries: int
    precount: int
    _tombstone_ms: int
    _clock: Callable[[], int]
    _state: CursorState
    _gate: Gate
    _lock: threading.Lock
    changed: threading.Condition  # notified when messages become available
    _journal: Journal
    _compaction: Compaction
    _lazy: LazyWatch
    #: the stream filter (`._intake`), rebuilt from the state on open
    _filter: StreamFilter
    #: one accept at a time per stream, so its filter decisions hold; streams share fsyncs
    _stream_locks: dict[str, threading.RLock]
    _last_accept: Ticket | None  # the newest lazy M record (`deliver_lazily`)
    _settling: set[str]  # gids whose lazy commit record is not durable yet (`._xa`)
    _attached: Counter[str]  # subscription queue -> subscribers attached (in memory)
    _take_lock: threading.Lock  # one publication taken at a time (`._dispatch`)
    # carried branches (`._carried`)
    _staged: dict[str, StagedBranch]  # gid -> a branch staged for the last resource's commit
    _forgetting: set[str]  # remembered gids to forget with the next record
    _awaiting: set[str]  # nodes whose recovery must run before anything is handed out
    _arrivals: deque[tuple[Ticket, list[str]]]  # lazy ``M`` batches not known durable
    _carrier_lock: threading.Lock  # one ``O`` record at a time
    _closing: bool  # a clean close began: no more staging

    def _append(self, record: dict[str, Any], force: bool) -> None:
        """Queue and apply under the lock, then wait for durability outside it, all inside the
        gate (a rollover never sees one without the other). Queue order is the journal's write
        order, so the state applies records in the order a replay will: a decision taken in an
        ``apply`` (a dead letter replayed or not, a copy made or skipped) comes out the same.
        A record that then fails to write, forced or lazy, poisons the journal (it was opened
        ``applied_when_queued``): nothing later is written, and the next open rebuilds the state
        from what the disk holds."""
        self._gate.enter_shared()
        try:
            with self._lock:
                ticket = self._submit_locked(record, force)
            self._wait(ticket)
        finally:
            self._gate.exit_shared()

    def _submit_locked(self, record: dict[str, Any], force: bool) -> Ticket:
        """Under the lock (and the gate): queue ``record`` and apply it."""
        try:
            ticket = self._journal.submit(encode(record), force)
        except LogWriteError as exc:
            raise self._located(exc) from exc
        self._state.apply(record)
        return ticket

    def _submit_many_locked(self, records: list[dict[str, Any]]) -> Ticket:
        """`_submit_locked` of a lazy batch: queued as one entry, then applied in order."""
        try:
            ticket = self._journal.submit_many([encode(r) for r in records], False)
        except LogWriteError as exc:
            raise self._located(exc) from exc
        for record in records:
            self._state.apply(record)
        return ticket

    def _wait(self, ticket: Ticket) -> None:
        try:
            self._journal.wait(ticket)
        except LogWriteError as exc:
            raise self._located(exc) from exc
        if ticket.forced:
            self._lazy.settle()  # the lazy commit records this force carried

    def _write_many(self, records: list[dict[str, Any]], force: bool) -> None:
        try:
            self._journal.append_many([encode(r) for r in records], force)
        except LogWriteError as exc:
            raise self._located(exc) from exc
        if force:
            self._lazy.settle()

    def _flush_journal(self) -> None:
        try:
            self._journal.flush()
        except LogWriteError as exc:
            raise self._located(exc) from exc

    def _settled(self) -> None:
        """Return once every record queued so far is durable, for a caller that found a gid
        settling (its lazy commit record queued by another caller, perhaps not yet handed to
        the `LazyWatch`, whose flush is the journal's). Raises if one is not: a failed write
        poisons the journal (``applied_when_queued``), and the branch is then prepared on disk;
        saying "committed" would let the coordinator forget a commit the disk does not hold."""
        try:
            self._lazy.flush()
        except LogWriteError as exc:
            raise self._located(exc) from exc

    def _located(self, exc: LogWriteError) -> LogWriteError:
        return LogWriteError(f"cursor {self.directory}: {exc.message}", durable=exc.durable)

    def _carry(self) -> list[bytes]:
        """Every live record, for `Compaction`; tombstones past their time are left behind."""
        with self._lock:
            carry = carried_records(self._state, self._clock(), self._tombstone_ms)
        return [encode(r) for r in carry]
