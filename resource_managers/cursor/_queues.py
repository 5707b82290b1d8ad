"""What an operator does to a cursor's queues: see their depth, sweep expired messages out of
them wherever they wait, and take one message out of a stream that cannot move past it.

A mixin of `Cursor` (its lock, gate, state and journal), kept apart because none of it is on
the delivery path: `Cursor` calls nothing here.

**Expiry anywhere.** A receive moves the expired run at the *head* of its queue to the
dead-letter queue; a message behind an unexpired one, or in a queue nobody reads, stayed until it
reached the head. `QueueOps.sweep_expired` moves every available expired message of every queue
(lazy ``W`` records, one per message, so each reason names that message's deadline). A crash
before they are on disk loses nothing: the messages are back in their queues, still expired, and
the next sweep (or receive) moves them again (crash point ``cursor.after_sweep``). Publications
waiting in the topic input are not swept: the dispatcher copies them on, and their copies are.

**Taking one message out.** `QueueOps.remove_message` drops a waiting message (a forced ``Z``
record, the one a dead-letter purge writes) or moves it to the dead-letter queue (a forced ``W``
with the operator's reason), so a consumer that keeps rolling back the message at the head of
its queue receives the next one (crash point ``cursor.after_remove``: the record durable, the
caller not yet answered). Only a message that is *waiting*: one handed out or prepared
belongs to a branch, which will commit (consumed) or roll back (waiting again: do it then).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from coordinator.crashpoints import crash_point
from coordinator.errors import IllegalStateError, ProgrammingError
from coordinator.journal import JournalStats
from resource_managers.message_log import validate_destination

from ._base import CursorBase
from ._records import DLQ_SUFFIX
from ._state import CursorState, Entry, is_topic

#: what `QueueOps.remove_message` does with the message
DROP = "drop"
DEAD_LETTER = "dead-letter"


@dataclass(frozen=True)
class QueueDepth:
    """One queue as an operator sees it: ``available`` waiting, ``in_flight`` handed out or
    prepared, ``dead_letters`` waiting in its dead-letter queue, and whether it takes
    transactional messages."""

    queue: str
    available: int
    in_flight: int
    dead_letters: int
    transactional: bool


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")


def expiry_reason(deadline_ms: int, now_ms: int) -> str:
    """The dead-letter reason of an expired message: its deadline, and when it was seen past it."""
    return (
        f"expired: its time to live ran out at {_iso(deadline_ms)} ({deadline_ms} ms), before "
        f"delivery (seen at {now_ms} ms)"
    )


def sweepable(state: CursorState) -> list[str]:
    """The queues that hold waiting messages, dead-letter queues excepted (dead letters never
    expire)."""
    return [name for name, fifo in state.available.items()
            if fifo and not name.endswith(DLQ_SUFFIX)]  # fmt: skip


def expired_in(state: CursorState, queue: str, now_ms: int) -> list[tuple[str, int]]:
    """The available messages of ``queue`` past their deadline, as (key, deadline), in order."""
    out: list[tuple[str, int]] = []
    for key in state.available.get(queue, ()):
        expires = state.entries[key].message.expires_at
        if expires is not None and expires <= now_ms:
            out.append((key, expires))
    return out


def queue_depths(state: CursorState) -> list[QueueDepth]:
    """Every queue that holds something or is marked non-transactional, sorted by name; a
    dead-letter queue is counted in its queue's row, not as a row of its own."""
    available: Counter[str] = Counter()
    dead: Counter[str] = Counter()
    for name, fifo in state.available.items():
        if name.endswith(DLQ_SUFFIX):
            dead[name.removesuffix(DLQ_SUFFIX)] += len(fifo)
        else:
            available[name] += len(fifo)
    in_flight: Counter[str] = Counter()
    for keys in (*state.handed.values(), *state.prepared.values()):
        for key in keys:
            entry = state.entries.get(key)
            if entry is not None:
                in_flight[entry.queue.removesuffix(DLQ_SUFFIX)] += 1
    names = {*available, *dead, *in_flight, *state.non_transactional} - {""}
    return [
        QueueDepth(q, available[q], in_flight[q], dead[q], q not in state.non_transactional)
        for q in sorted(names)
        if not is_topic(q)
    ]


class QueueOps(CursorBase):
    """`Cursor`'s operator side (see the module docstring)."""

    def queues(self) -> list[QueueDepth]:
        """The depth of every queue (plain queues and subscription queues)."""
        with self._lock:
            return queue_depths(self._state)

    def journal_stats(self) -> JournalStats:
        """The journal's counters (records, fsyncs, bytes written, rollovers)."""
        return self._journal.stats()

    def sweep_expired(self) -> int:
        """Move every available expired message to its dead-letter queue (lazy ``W`` records,
        each reason naming the message's deadline); how many. Runs beside deliveries, one queue
        at a time: the lock is held for a scan of one queue's waiting messages, not all."""
        with self._lock:
            queues = sweepable(self._state)
        moved = sum(self._sweep_queue(queue) for queue in queues)
        if moved:
            crash_point("cursor.after_sweep")
            self._compaction.maybe()
        return moved

    def _sweep_queue(self, queue: str) -> int:
        self._gate.enter_shared()
        try:
            with self._lock:
                now = self._clock()
                found = expired_in(self._state, queue, now)
                if found:
                    self._submit_many_locked([
                        {"k": "W", "i": [key], "r": expiry_reason(deadline, now)}
                        for key, deadline in found
                    ])  # fmt: skip
                    self.changed.notify_all()
        finally:
            self._gate.exit_shared()
        return len(found)

    def remove_message(self, queue: str, message_id: str, action: str, why: str = "") -> str:
        """Drop (``DROP``) or dead-letter (``DEAD_LETTER``) message ``message_id`` waiting in
        ``queue`` (a destination, a subscription's queue, or for a drop a dead-letter queue),
        durably (a forced record) before this returns; the queue it was in. `IllegalStateError`
        if it is not waiting there (unknown, consumed, handed out or prepared)."""
        if action not in (DROP, DEAD_LETTER):
            raise ProgrammingError(f"unknown action {action!r} (expected {DROP} or {DEAD_LETTER})")
        validate_destination(queue.removesuffix(DLQ_SUFFIX))
        if action == DEAD_LETTER and queue.endswith(DLQ_SUFFIX):
            raise IllegalStateError(f"{message_id} is in {queue} already: drop it, or replay it")
        self._gate.enter_shared()
        try:
            with self._lock:
                entry = self._waiting(queue, message_id)
                if action == DROP:
                    record: dict[str, Any] = {"k": "Z", "i": [entry.key]}
                else:
                    reason = "dead-lettered by an operator" + (f": {why}" if why else "")
                    record = {"k": "W", "i": [entry.key], "r": reason}
                ticket = self._submit_locked(record, force=True)
                self.changed.notify_all()
            self._wait(ticket)
        finally:
            self._gate.exit_shared()
        crash_point("cursor.after_remove")
        return queue

    def _waiting(self, queue: str, message_id: str) -> Entry:
        """Under the lock: the entry of ``message_id`` available in ``queue``."""
        s = self._state
        for key in (message_id, f"{message_id}@{queue.removesuffix(DLQ_SUFFIX)}"):
            entry = s.entries.get(key)
            if entry is None or entry.queue != queue:
                continue
            if key in s.queue(queue):
                return entry
            raise IllegalStateError(
                f"{message_id} in {queue} is handed out to (or prepared in) a consumer's "
                "transaction: it is consumed if that commits; if it rolls back, it waits again "
                "and can be removed then (stop its consumer first to be sure)"
            )
        raise IllegalStateError(f"no message {message_id} waits in {queue}")
