"""`Cursor`: the durable store of the delivery side, on the coordinator's `Journal`.

Per destination a FIFO of accepted messages available to consumers (arrival order, so a single
consumer sees each stream in order); the messages handed to branches (gid -> ids); the filter
state (last accepted epoch and number per stream), rebuilt on open; delivery counts.

Accepting: ``offer(frame)`` judges a frame with `..sequencing.StreamFilter` (no change);
``accept(message, decision)`` writes the message and ``decision.after`` in **one forced** ``M``
record, then adopts the decision and returns the acknowledgment to send: persist before acking.
``deliver(frame, message)`` does both, or returns the re-acknowledgment of a dropped frame.

The delivery-count scheme: a count is raised when a message is **handed out**, by a forced ``H``
record written before ``receive`` returns. That is one fsync per receive (shared by concurrent
receivers through the journal's group commit), and the only scheme that keeps counts exact when
the consumer's process dies while handling a message: counting at rollback instead would lose
exactly the deliveries a poison message ends by crashing its consumer, which would then never
reach the dead-letter queue. In exchange the rollback record is lazy: if it is lost, the replay
still has the ``H`` (or the ``P``), and on open every branch handed out and not prepared (its
process is gone) is rolled back again, and a prepared one waits for recovery's decision.

Commit (``C``) is forced: once the coordinator has its acknowledgment it may forget the decision,
and a lost ``C`` would then be presumed aborted and the message delivered twice.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from coordinator.errors import (
    IllegalStateError,
    LogWriteError,
    ProgrammingError,
    TransactionRolledBack,
)
from coordinator.journal import DEFAULT_SEGMENT_BYTES, Compaction, FileOps, Gate, Journal
from resource_managers.message_log import VOLATILE_SUFFIX, Message, validate_destination
from resource_managers.sequencing import Ack, Decision, Frame, StreamFilter

from ._records import DLQ_SUFFIX, decode, encode, message_obj
from ._state import CursorState, Entry

log = logging.getLogger("twopc.cursor")

DEFAULT_TOMBSTONE_SECONDS = 24 * 3600
DEFAULT_MAX_DELIVERIES = 5


class BranchRolledBack(TransactionRolledBack):
    """The cursor refuses to prepare (or receive in) a branch it has rolled back: its tombstone."""

    code = "cursor-rolled-back"
    reason = "vote"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Delivery:
    """A message handed to one branch. ``delivery_count`` counts this delivery (1 the first time);
    ``redelivered`` is True from the second. ``queue`` is where it was taken from (its destination
    or ``<destination>.DLQ``); ``reason`` says why it is in the dead-letter queue."""

    message: Message
    delivery_count: int
    queue: str
    reason: str | None = None

    @property
    def redelivered(self) -> bool:
        return self.delivery_count > 1

    @property
    def message_id(self) -> str:
        return self.message.message_id

    @property
    def body(self) -> bytes:
        return self.message.body

    @property
    def headers(self) -> dict[str, str]:
        return self.message.headers


@dataclass
class CursorStats:
    forced_records: int
    lazy_records: int
    fsyncs: int
    rollovers: int
    available: int
    in_flight: int
    prepared: int
    tombstones: int


class Cursor:
    """Accepted messages in ``directory``, locked to this process. Thread-safe; a context manager.

    ``max_deliveries`` applies to the branches found handed out (not prepared) at open, which are
    rolled back then; `CursorResource` passes its own to each rollback."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        tombstone_seconds: float = DEFAULT_TOMBSTONE_SECONDS,
        file_ops: FileOps | None = None,
        clock_ms: Callable[[], int] = now_ms,
    ) -> None:
        if max_deliveries < 1:
            raise ProgrammingError("max_deliveries must be >= 1")
        self.directory = Path(directory)
        self.max_deliveries = max_deliveries
        self._tombstone_ms = int(tombstone_seconds * 1000)
        self._clock = clock_ms
        self._state = CursorState()
        self._gate = Gate()
        #: one accept at a time per stream, so its filter decisions hold; streams share fsyncs
        self._stream_locks: dict[str, threading.RLock] = {}
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # notified when messages become available
        self._journal = Journal(
            self.directory, replay=self._replay, segment_bytes=segment_bytes, file_ops=file_ops
        )
        self._compaction = Compaction(
            self._journal, self._gate, self._carry, f"cursor {self.directory}", log
        )
        try:
            self._filter = StreamFilter(self._state.filter)
            for gid in list(self._state.handed):  # their process is gone: presumed abort
                self.rollback(gid, max_deliveries)
            self._compaction.maybe()
        except BaseException:
            self._journal.close()
            raise

    def _replay(self, payload: bytes) -> None:
        self._state.apply(decode(payload))

    # -- accepting (the transfer side) ---------------------------------------------------------

    def offer(self, frame: Frame) -> Decision:
        """Judge a frame against the filter; changes nothing."""
        with self._lock:
            return self._filter.offer(frame)

    def accept(self, message: Message, decision: Decision) -> Ack:
        """Persist an accepted message with its stream's new filter state (one forced record),
        then adopt the decision; return the acknowledgment to send. A non-persistent stream
        (``<destination>#np``) skips the fsync: its messages may be lost in a crash, as at the
        log, and the filter then takes the stream up again at the log's queue head (previous
        number 0)."""
        frame = decision.frame
        if not decision.verdict.accepts:
            raise ProgrammingError(f"accept of a {decision.verdict.value} decision")
        if frame.message_id != message.message_id:
            raise ProgrammingError(f"frame {frame.message_id} carries message {message.message_id}")
        validate_destination(message.destination)
        with self._stream_lock(frame.stream):
            with self._lock:
                if self._filter.state(frame.stream) != decision.before:
                    raise IllegalStateError(
                        f"stream {frame.stream!r} moved since the offer", stream=frame.stream
                    )
            record = self._accept_record(message, decision)
            self._append(record, force=not frame.stream.endswith(VOLATILE_SUFFIX))
            with self._lock:
                ack = self._filter.accepted(decision)
                self.changed.notify_all()
        self._compaction.maybe()
        return ack

    def deliver(self, frame: Frame, message: Message) -> Ack:
        """Offer and, if the filter accepts, accept; otherwise the re-acknowledgment."""
        with self._stream_lock(frame.stream):
            decision = self.offer(frame)
            if decision.ack is not None:
                return decision.ack
            return self.accept(message, decision)

    def deliver_many(self, items: Sequence[tuple[Frame, Message]]) -> list[Ack]:
        """Judge a batch of frames in arrival order, persist every accepted message with its
        stream's filter state, the last record forced (the journal writes in order, so one fsync
        covers the batch), then adopt; return one acknowledgment per stream touched. What a
        transfer reads off the wire in one go costs one fsync, not one per message.

        A record that fails to write leaves the batch unadopted and unacknowledged; the journal
        is then poisoned (nothing more is written), so no later record can contradict it."""
        for frame, message in items:
            if frame.message_id != message.message_id:
                raise ProgrammingError(
                    f"frame {frame.message_id} carries message {message.message_id}"
                )
            validate_destination(message.destination)
        streams = sorted({frame.stream for frame, _ in items})
        with ExitStack() as stack:
            for stream in streams:
                stack.enter_context(self._stream_lock(stream))
            with self._lock:
                trial = StreamFilter({s: self._filter.state(s) for s in streams})
            records: list[tuple[dict[str, Any], Decision]] = []
            for frame, message in items:
                decision = trial.offer(frame)
                if decision.verdict.accepts:
                    trial.accepted(decision)
                    records.append((self._accept_record(message, decision), decision))
            if records:
                self._persist_batch(records)
            with self._lock:
                for verdict, n in trial.counts.items():
                    self._filter.counts[verdict] += n
                acks = [self._filter.ack_for(stream) for stream in streams]
        self._compaction.maybe()
        return acks

    @staticmethod
    def _accept_record(message: Message, decision: Decision) -> dict[str, Any]:
        return {"k": "M", "q": decision.frame.stream, "e": decision.after.epoch,
                "n": decision.after.last, "o": message_obj(message)}  # fmt: skip

    def _persist_batch(self, records: list[tuple[dict[str, Any], Decision]]) -> None:
        durable = [i for i, (r, _) in enumerate(records) if not r["q"].endswith(VOLATILE_SUFFIX)]
        last_forced = durable[-1] if durable else -1
        self._gate.enter_shared()
        try:
            for i, (record, _) in enumerate(records):
                self._write(record, force=i == last_forced)
            with self._lock:
                for record, decision in records:
                    self._state.apply(record)
                    self._filter.accepted(decision)
                self.changed.notify_all()
        finally:
            self._gate.exit_shared()

    def _stream_lock(self, stream: str) -> threading.RLock:
        with self._lock:
            return self._stream_locks.setdefault(stream, threading.RLock())

    def ack_for(self, stream: str) -> Ack:
        with self._lock:
            return self._filter.ack_for(stream)

    # -- the resource's verbs ------------------------------------------------------------------

    def take(self, gid: str, queue: str, timeout: float | None = 0.0) -> Delivery | None:
        """Hand the first available message of ``queue`` to branch ``gid`` (see `take_many`)."""
        got = self.take_many(gid, queue, 1, timeout)
        return got[0] if got else None

    def take_many(
        self, gid: str, queue: str, max_messages: int, timeout: float | None = 0.0
    ) -> list[Delivery]:
        """Hand up to ``max_messages`` available messages of ``queue``, in order, to branch
        ``gid``: one forced ``H`` record raises all their counts. Waits up to ``timeout`` seconds
        (None: forever) for the first; takes what is there then, without waiting for more.
        Expired messages at the head of the queue are dropped on the way (a lazy ``X`` record:
        one that comes back after a crash has expired all the same)."""
        if max_messages < 1:
            raise ProgrammingError("max_messages must be >= 1")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            self._gate.enter_shared()
            try:
                with self._lock:
                    dropped, record, taken = self._reserve(gid, queue, max_messages)
                if dropped is not None:
                    self._write(dropped, force=False)
                if record is not None:
                    try:
                        self._write(record, force=True)
                    except BaseException:
                        with self._lock:
                            for entry in reversed(taken):
                                self._unhand(gid, entry)
                        raise
            finally:
                self._gate.exit_shared()
            if taken:
                self._compaction.maybe()
                return [Delivery(e.message, e.count, queue, e.reason) for e in taken]
            with self.changed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                if self._state.first_available(queue) is None:
                    self.changed.wait(remaining)

    def _reserve(
        self, gid: str, queue: str, max_messages: int
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[Entry]]:
        """Under the lock: drop the expired head, reserve the next messages for ``gid`` (no
        other consumer gets them); the records to write for both."""
        if gid in self._state.tombstones:
            raise BranchRolledBack(f"{gid} was rolled back (tombstone)")
        if gid in self._state.prepared:
            raise IllegalStateError(f"{gid} is prepared: it can no longer receive")
        dropped = record = None
        expired = self._state.expired_head(queue, self._clock())
        if expired:
            self._state.apply(dropped := {"k": "X", "i": expired})
        ids = list(itertools.islice(self._state.available.get(queue, {}), max_messages))
        if ids:
            self._state.apply(record := {"k": "H", "g": gid, "i": ids, "c": 1})
        return dropped, record, [self._state.entries[mid] for mid in ids]

    def _unhand(self, gid: str, entry: Entry) -> None:
        """Undo a reservation whose record failed (if it was written after all, the replay
        counts one delivery more than happened: a count may be high, never low)."""
        mid = entry.message.message_id
        handed = self._state.handed.get(gid, [])
        if mid in handed:
            handed.remove(mid)
            if not handed:
                del self._state.handed[gid]
        entry.count -= 1
        self._state._make_available(entry)
        self.changed.notify_all()

    def is_tombstoned(self, gid: str) -> bool:
        return gid in self._state.tombstones

    def is_committed(self, gid: str) -> bool:
        return gid in self._state.committed

    def is_prepared(self, gid: str) -> bool:
        return gid in self._state.prepared

    def branch_ids(self, gid: str) -> list[str]:
        with self._lock:
            return self._state.branch_ids(gid)

    def prepare(self, gid: str) -> bool:
        """Make the branch's deletions durable (forced ``P``); False if it holds nothing.
        Raises `BranchRolledBack` if a rollback (recovery's, say) left its tombstone first, even
        while the record was being written: replay ignores a prepare after a tombstone, and the
        rollback made the messages available to others, so voting yes would deliver them twice."""
        with self._lock:
            self._refuse_tombstoned(gid)
            ids = list(self._state.handed.get(gid, []))
        if not ids:
            return False
        self._append({"k": "P", "g": gid, "i": ids}, force=True)
        with self._lock:
            self._refuse_tombstoned(gid)
        return True

    def _refuse_tombstoned(self, gid: str) -> None:
        if gid in self._state.tombstones:
            raise BranchRolledBack(f"{gid} was rolled back (tombstone); it cannot prepare")

    def commit(self, gid: str) -> None:
        """Delete the branch's messages (forced ``C``); nothing if it holds none."""
        with self._lock:
            ids = self._state.branch_ids(gid)
        if ids:
            self._append({"k": "C", "g": gid, "i": ids}, force=True)
            self._compaction.maybe()

    def rollback(self, gid: str, max_deliveries: int | None = None) -> list[str]:
        """Make the branch's messages available again, or move those delivered ``max_deliveries``
        times to their dead-letter queue; leave a tombstone (lazy ``R``). Returns the ids moved."""
        limit = self.max_deliveries if max_deliveries is None else max_deliveries
        with self._lock:
            back: list[str] = []
            moves: list[list[str]] = []
            for mid in self._state.branch_ids(gid):
                entry = self._state.entries[mid]
                if entry.count >= limit and entry.reason is None:
                    reason = f"delivered {entry.count} times (max_deliveries {limit}), rolled back"
                    moves.append([mid, reason])
                else:
                    back.append(mid)
        self._append({"k": "R", "g": gid, "t": self._clock(), "i": back, "x": moves}, False)
        with self._lock:
            self.changed.notify_all()
        self._compaction.maybe()
        return [mid for mid, _ in moves]

    def forget(self, gid: str) -> None:
        if gid in self._state.tombstones:
            self._append({"k": "F", "g": gid}, force=False)

    def prepared_gids(self) -> list[str]:
        with self._lock:
            return sorted(self._state.prepared)

    # -- inspection ----------------------------------------------------------------------------

    def available(self, queue: str) -> list[Delivery]:
        """The messages ``queue`` would hand out now, in order (their counts so far)."""
        with self._lock:
            entries = [self._state.entries[m] for m in self._state.available.get(queue, {})]
            return [Delivery(e.message, e.count, e.queue, e.reason) for e in entries]

    def delivery_count(self, message_id: str) -> int | None:
        with self._lock:
            entry = self._state.entries.get(message_id)
            return None if entry is None else entry.count

    def filter_counts(self) -> dict[str, int]:
        """Frames judged since open, by verdict (``accept``, ``duplicate``, ``out-of-order``...):
        duplicates and gaps are the transfer's resends at work; stale epochs mean a log was
        restored or two logs feed one stream."""
        with self._lock:
            return {verdict.value: n for verdict, n in self._filter.counts.items()}

    def filter_state(self) -> dict[str, Any]:
        """`StreamFilter.to_dict` of the durable filter."""
        with self._lock:
            return self._filter.to_dict()

    @staticmethod
    def dead_letter_queue(destination: str) -> str:
        return destination + DLQ_SUFFIX

    # -- the journal ---------------------------------------------------------------------------

    def _append(self, record: dict[str, Any], force: bool) -> None:
        """Write, then apply, inside the gate (a rollover never sees one without the other)."""
        self._gate.enter_shared()
        try:
            self._write(record, force)
            with self._lock:
                self._state.apply(record)
        finally:
            self._gate.exit_shared()

    def _write(self, record: dict[str, Any], force: bool) -> None:
        try:
            self._journal.append(encode(record), force)
        except LogWriteError as exc:
            raise LogWriteError(
                f"cursor {self.directory}: {exc.message}", durable=exc.durable
            ) from exc

    def _carry(self) -> list[bytes]:
        """Every live record, for `Compaction`; tombstones past their time are left behind."""
        with self._lock:
            carry = self._state.live_records(self._clock(), self._tombstone_ms)
            self._state.committed.clear()
            self._state.tombstones = {r["g"]: r["t"] for r in carry if r["k"] == "R"}
        return [encode(r) for r in carry]

    # -- housekeeping --------------------------------------------------------------------------

    def stats(self) -> CursorStats:
        j = self._journal.stats()
        with self._lock:
            s = self._state
            return CursorStats(
                j.forced_records, j.lazy_records, j.fsyncs, j.rollovers,
                sum(len(ids) for ids in s.available.values()),
                sum(len(ids) for ids in s.handed.values()),
                len(s.prepared), len(s.tombstones),
            )  # fmt: skip

    def close(self) -> None:
        """Write lazy records (rollbacks, forgets), fsync, release the lock."""
        self._journal.close()

    def __enter__(self) -> Cursor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
