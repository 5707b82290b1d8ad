"""`Cursor`: the durable store of the delivery side, on the coordinator's `Journal`.

Per destination a FIFO of accepted messages available to consumers (arrival order, so a single
consumer sees each stream in order); the messages handed to branches (gid -> ids); the filter
state (last accepted epoch and number per stream), rebuilt on open; delivery counts.

Accepting: ``offer(frame)`` judges a frame with `..sequencing.StreamFilter` (no change);
``accept(message, decision)`` writes the message and ``decision.after`` in **one forced** ``M``
record, then adopts the decision and returns the acknowledgment to send: persist before acking.
``deliver(frame, message)`` does both, or returns the re-acknowledgment of a dropped frame.

The delivery-count scheme: a count is durably raised **before** its message is handed out, the
only scheme that keeps counts from being low when the consumer's process dies while handling a
message: counting at rollback instead would lose exactly the deliveries a poison message ends by
crashing its consumer, which would then never reach the dead-letter queue. The raise is either a
forced ``H`` record written before ``receive`` returns, or a *pre-count* (`._precount`): a forced
record the consumer side writes anyway (a branch's ``P``, a one-phase ``C``, an ``H``) raises in
its ``p`` field the counts of the next never-delivered messages of the queues that branch used,
or an arriving message's ``M`` raises its own (into a short queue); handing one of those out
consumes its in-memory credit and writes only a lazy ``H`` (``c`` 0). So a steady consumer at
one message per transaction forces one record per side, not two. A clean close gives unused
pre-counts back (a lazy ``G``); a crash leaves them reading one high. In exchange for the forced
raise the rollback record is lazy: if it is lost, the replay still has the ``H`` (or the ``P``),
and on open every branch handed out and not prepared (its process is gone) is rolled back again,
and a prepared one waits for recovery's decision.

Commit (``C``) is forced when it is the only record of the outcome: a one-phase commit, or a
recovery's commit, after which the coordinator may forget the decision, and a lost ``C`` would
then be presumed aborted and the message delivered twice. Phase two on the coordinator's own path
writes it lazily instead (`commit_lazily`): the coordinator keeps the decision until the record is
durable, and until then the gid is listed as prepared (`coordinator.lazy_commit`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from coordinator.crashpoints import crash_point
from coordinator.errors import (
    FencedError,
    IllegalStateError,
    LogWriteError,
    ProgrammingError,
    TransactionRolledBack,
)
from coordinator.journal import (
    DEFAULT_LAZY_DELAY,
    DEFAULT_SEGMENT_BYTES,
    Compaction,
    FileOps,
    Gate,
    Journal,
    LazyWatch,
    Ticket,
)
from resource_managers.message_log import (
    VOLATILE_SUFFIX,
    Message,
    check_message,
    validate_destination,
)
from resource_managers.sequencing import Ack, Decision, Frame, StreamFilter, stream_key

from . import _precount
from ._precount import DEFAULT_PRECOUNT
from ._queues import QueueOps, expiry_reason
from ._records import DLQ_SUFFIX, decode, encode, message_obj
from ._state import Credit, CursorState, Entry, SubscriptionState
from ._topics import (
    TOPIC_PREFIX,
    Subscription,
    TopicPublication,
    is_topic,
    subscription_queue,
)

log = logging.getLogger("twopc.cursor")

DEFAULT_TOMBSTONE_SECONDS = 24 * 3600
DEFAULT_MAX_DELIVERIES = 5


def _shown(entry: Entry) -> int:
    """Deliveries so far as this process knows them: the count without an unused pre-count."""
    return entry.count - (entry.credit is not None)


def journal_replay() -> Callable[[bytes], None]:
    """What opening a cursor does with each journal record, into a fresh state (read-only: for
    `coordinator.journal.quarantine`, which must judge records exactly as an open would)."""
    state = CursorState()
    return lambda payload: state.apply(decode(payload))


class LogFencedError(FencedError):
    """A transfer from a log whose identity a newer process of the same identity announced
    since (a copied or restored log directory running beside the original): its messages and
    the newer one's cannot both be delivered exactly once, so the older is refused."""

    code = "log-fenced"


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

    def __post_init__(self) -> None:
        # The cursor keeps the message it hands out: the consumer gets its own headers, so a
        # handler that changes them cannot change what a rollback brings back or what a
        # rollover writes (records are checked when written, not when carried).
        if self.message.headers:
            message = dataclasses.replace(self.message, headers=dict(self.message.headers))
            object.__setattr__(self, "message", message)

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


@dataclass
class _Reserved:
    """A receive's messages, reserved under the lock: the forced ``H`` to wait for (None if
    every message held a credit), the keys it counts, the credits consumed (each must be durable
    before the messages go out) and the credits the ``H`` itself grants."""

    taken: list[Entry]
    ticket: Ticket | None
    counted: set[str]
    consumed: list[Credit]
    granted: Credit | None


class Cursor(QueueOps):
    """Accepted messages in ``directory``, locked to this process. Thread-safe; a context manager.

    ``max_deliveries`` applies to the branches found handed out (not prepared) at open, which are
    rolled back then; `CursorResource` passes its own to each rollback. ``precount``: how many
    waiting messages per queue a consumer's forced record pre-counts (`._precount`; 0: none, every
    receive forces its own ``H``)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        tombstone_seconds: float = DEFAULT_TOMBSTONE_SECONDS,
        file_ops: FileOps | None = None,
        clock_ms: Callable[[], int] = now_ms,
        lazy_delay: float = DEFAULT_LAZY_DELAY,
        precount: int = DEFAULT_PRECOUNT,
    ) -> None:
        if max_deliveries < 1:
            raise ProgrammingError("max_deliveries must be >= 1")
        if precount < 0:
            raise ProgrammingError("precount must be >= 0")
        self.directory = Path(directory)
        self.max_deliveries = max_deliveries
        self.precount = precount
        self._tombstone_ms = int(tombstone_seconds * 1000)
        self._clock = clock_ms
        self._state = CursorState()
        self._gate = Gate()
        #: one accept at a time per stream, so its filter decisions hold; streams share fsyncs
        self._stream_locks: dict[str, threading.RLock] = {}
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # notified when messages become available
        self._attached: Counter[str] = Counter()  # subscription queue -> subscribers attached
        self._take_lock = threading.Lock()  # one publication taken at a time
        self._journal = Journal(
            self.directory,
            replay=self._replay,
            segment_bytes=segment_bytes,
            file_ops=file_ops,
            kind="cursor",
        )
        self._compaction = Compaction(
            self._journal, self._gate, self._carry, f"cursor {self.directory}", log
        )
        self._lazy = LazyWatch(self._journal, delay=lazy_delay, name=f"cursor {directory}")
        self._settling: set[str] = set()  # gids whose lazy commit record is not durable yet
        self._last_accept: Ticket | None = None  # the newest lazy M record (`deliver_lazily`)
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
        check_message(message)
        with self._stream_lock(frame.stream):
            with self._lock:
                if self._filter.state(frame.stream, frame.epoch) != decision.before:
                    raise IllegalStateError(
                        f"stream {frame.stream!r} moved since the offer", stream=frame.stream
                    )
            self._persist_batch([(self._accept_record(message, decision), decision)])
            with self._lock:
                ack = self._filter.ack_for(frame.stream)
        self._compaction.maybe()
        return ack

    def deliver(self, frame: Frame, message: Message) -> Ack:
        """Offer and, if the filter accepts, accept; otherwise the re-acknowledgment."""
        with self._stream_lock(frame.stream):
            decision = self.offer(frame)
            if decision.ack is not None:
                self._filter_durable()
                return decision.ack
            return self.accept(message, decision)

    def deliver_lazily(
        self,
        items: Sequence[tuple[Frame, Message]],
        send: Callable[[list[Ack]], None],
        *,
        source: tuple[str, int] | None = None,
    ) -> None:
        """`deliver_many` whose ``M`` records are not forced: they are applied at once (the
        messages available, the filter advanced) and ``send`` gets the acknowledgments only once
        the records are durable — carried by the cursor's next forced record (a consumer's
        prepare or commit, which the journal writes after them) or by an fsync of its own
        ``lazy_delay`` later. The log discards a message only on its acknowledgment, so a crash
        before then loses nothing: the log resends. A re-acknowledgment (a batch of duplicates)
        waits likewise for every accepted record before it, since the filter it reports may be
        ahead of the disk. ``send`` may run on another thread; if a record's write fails it
        never runs (the journal refuses writes from then on). ``source``: the announced log
        identity and incarnation the batch came from (`announce_log`); a batch of an
        incarnation fenced since raises `LogFencedError` and writes nothing."""
        with self._judged(items, source) as (streams, records, trial):
            self._gate.enter_shared()
            try:
                with self._lock:
                    if records:
                        self._queue_arrivals_locked([r for r, _ in records])
                    for _, decision in records:
                        self._filter.adopt(decision)
                    for verdict, n in trial.counts.items():
                        self._filter.counts[verdict] += n
                    if records:
                        self.changed.notify_all()
                    ticket = self._last_accept
                    acks = [self._filter.ack_for(s, e) for s, e in streams.items()]
            finally:
                self._gate.exit_shared()
        if ticket is None or (ticket.done and ticket.error is None):
            send(acks)
        else:
            self._lazy.watch(ticket, lambda: send(acks))
            self._lazy.settle()
        self._compaction.maybe()

    def _queue_arrivals_locked(self, records: list[dict[str, Any]]) -> None:
        """Under the lock: queue a batch's ``M`` records unforced, as one journal entry in
        order, apply them, and grant the pre-counts they carry (pending until it is on disk)."""
        fresh = [self._fresh_arrival(r) for r in records]
        self._last_accept = self._submit_many_locked(records)
        keys = [
            key for record, new in zip(records, fresh, strict=True)
            for key in self._arrived(record, new)
        ]  # fmt: skip
        credit = _precount.grant(self._state, keys)
        if credit is not None:
            credit.ticket = self._last_accept

    @contextmanager
    def _judged(
        self, items: Sequence[tuple[Frame, Message]], source: tuple[str, int] | None = None
    ) -> Iterator[tuple[dict[str, int], list[tuple[dict[str, Any], Decision]], StreamFilter]]:
        """Check every message, hold the locks of the batch's streams, judge the batch (`_trial`):
        the streams (each with the epoch of its last frame, which its acknowledgment is judged
        in), the accepted ones' ``M`` records and the trial filter, for as long as the caller
        writes and adopts them."""
        self._check_batch(items)
        streams = {frame.stream: frame.epoch for frame, _ in items}
        with ExitStack() as stack:
            for stream in sorted(streams):
                stack.enter_context(self._stream_lock(stream))
            records, trial = self._trial(items, streams, source)
            yield streams, records, trial

    def _check_batch(self, items: Sequence[tuple[Frame, Message]]) -> None:
        for frame, message in items:  # the whole batch is judged before a record is written
            if frame.message_id != message.message_id:
                raise ProgrammingError(
                    f"frame {frame.message_id} carries message {message.message_id}"
                )
            check_message(message)

    def _trial(
        self,
        items: Sequence[tuple[Frame, Message]],
        streams: dict[str, int],
        source: tuple[str, int] | None,
    ) -> tuple[list[tuple[dict[str, Any], Decision]], StreamFilter]:
        """Under the streams' locks: judge the batch in arrival order on a copy of the filter;
        the ``M`` records of the accepted ones, and the copy (its verdict counts). The fence is
        checked under the same lock an announcement takes, so a batch is judged wholly before
        or wholly after a newer incarnation of its log announced itself."""
        with self._lock:
            if source is not None:
                self._check_fence_locked(*source)
            trial = self._filter.subset(streams)
        records: list[tuple[dict[str, Any], Decision]] = []
        ahead: Counter[str] = Counter()
        for frame, message in items:
            decision = trial.offer(frame)
            if decision.verdict.accepts:
                trial.adopt(decision)
                records.append((self._accept_record(message, decision, ahead), decision))
        return records, trial

    def deliver_many(
        self, items: Sequence[tuple[Frame, Message]], *, source: tuple[str, int] | None = None
    ) -> list[Ack]:
        """Judge a batch of frames in arrival order, persist every accepted message with its
        stream's filter state in one forced group of records (one fsync, and one journal queue
        entry, for the batch), then adopt; return one acknowledgment per stream touched. What a
        transfer reads off the wire in one go costs one fsync, not one per message.

        Every message is checked (`check_message`) before a record is written, so an
        `InvalidMessageError` writes nothing. A record that fails to write leaves the batch
        unadopted and unacknowledged; the journal is then poisoned (nothing more is written),
        so no later record can contradict it. ``source`` as for `deliver_lazily`."""
        with self._judged(items, source) as (streams, records, trial):
            if records:
                self._persist_batch(records)
            with self._lock:
                for verdict, n in trial.counts.items():
                    self._filter.counts[verdict] += n
                acks = [self._filter.ack_for(s, e) for s, e in streams.items()]
        self._filter_durable()
        self._compaction.maybe()
        return acks

    def _filter_durable(self) -> None:
        """Before the filter's state is reported as an acknowledgment: make every lazily
        written ``M`` record durable (`deliver_lazily`), or the log could discard a message
        that a crash then takes from the cursor."""
        ticket = self._last_accept
        if ticket is not None and not ticket.done:
            self._lazy.flush()

    def _accept_record(
        self, message: Message, decision: Decision, ahead: Counter[str] | None = None
    ) -> dict[str, Any]:
        """The ``M`` record, with the non-transactional-queue verdict in it (``j``: rejected, a
        transactional message at a non-transactional queue) so that applying it never depends on the
        queue's kind at that moment: an ``M`` is written before it is applied, and a ``T`` may land
        between the two. ``p``: the message is pre-counted at arrival (`_precount.on_arrival`;
        ``ahead``: the batch's earlier messages per destination, not applied yet)."""
        record = {"k": "M", "q": decision.frame.stream, "e": decision.after.epoch,
                  "n": decision.after.last, "o": message_obj(message)}  # fmt: skip
        destination = message.destination
        with self._lock:
            if message.transactional and destination in self._state.non_transactional:
                record["j"] = True
            elif not is_topic(destination) and not decision.frame.stream.endswith(VOLATILE_SUFFIX):
                waiting = 0 if ahead is None else ahead[destination]
                if _precount.on_arrival(
                    self._state, destination, waiting, self.precount, self.max_deliveries
                ):
                    record["p"] = [message.message_id]
                if ahead is not None:
                    ahead[destination] += 1
        return record

    def _persist_batch(self, records: list[tuple[dict[str, Any], Decision]]) -> None:
        """Write accepted messages, then adopt them: unlike `_append`, an ``M`` is applied only
        once durable, because adopting it advances the stream's filter, and a filter ahead of
        the disk would re-acknowledge, as duplicates, resends of messages the cursor never
        wrote."""
        force = any(not r["q"].endswith(VOLATILE_SUFFIX) for r, _ in records)
        self._gate.enter_shared()
        try:
            self._write_many([record for record, _ in records], force)  # one group, in order
            with self._lock:
                keys: list[str] = []
                for record, decision in records:
                    keys += self._apply_arrival(record)
                    self._filter.adopt(decision)
                credit = _precount.grant(self._state, keys)  # durable: written above
                if credit is not None:
                    credit.durable = True
                self.changed.notify_all()
        finally:
            self._gate.exit_shared()

    def _fresh_arrival(self, record: dict[str, Any]) -> bool:
        """Under the lock, before applying an ``M``: would its pre-count make a new entry?"""
        return "p" in record and record["p"][0] not in self._state.entries

    def _arrived(self, record: dict[str, Any], fresh: bool) -> list[str]:
        """After applying it: the key its ``p`` raised (none if the message was there before)."""
        return record["p"] if fresh and record["p"][0] in self._state.entries else []

    def _apply_arrival(self, record: dict[str, Any]) -> list[str]:
        fresh = self._fresh_arrival(record)
        self._state.apply(record)
        return self._arrived(record, fresh)

    def _stream_lock(self, stream: str) -> threading.RLock:
        with self._lock:
            return self._stream_locks.setdefault(stream, threading.RLock())

    def ack_for(self, stream: str, log: str = "") -> Ack:
        """Where ``stream`` stands, on disk: as sent by the log whose identity is ``log`` (""
        for a log that announced none)."""
        self._filter_durable()
        with self._lock:
            return self._filter.ack_for(stream_key(log, stream))

    # -- log identities (protocol version 2) ---------------------------------------------------

    def announce_log(self, identity: str, incarnation: int) -> None:
        """A transfer connection says which log, and which open of it, it carries. An older
        incarnation than one announced before is refused (`LogFencedError`): another process
        holds the same identity (a copied or restored directory). A newer one is kept (a lazy
        ``L``: every ``M`` of this connection is written after it, so whatever of it is
        durable, the ``L`` is too) and fences the older one's connections at their next batch."""
        self._gate.enter_shared()  # a rollover never sees the record queued and not applied
        try:
            with self._lock:
                self._check_fence_locked(identity, incarnation)
                fresh = incarnation > self._state.logs.get(identity, 0)
                if fresh:
                    self._submit_locked({"k": "L", "s": identity, "n": incarnation}, False)
        finally:
            self._gate.exit_shared()
        if fresh:
            crash_point("xfer.cursor.after_announce")

    def _check_fence_locked(self, identity: str, incarnation: int) -> None:
        newest = self._state.logs.get(identity, 0)
        if incarnation < newest:
            raise LogFencedError(
                f"log {identity} incarnation {incarnation} is fenced: incarnation {newest} of "
                f"the same log identity announced itself since (two processes hold one log's "
                f"directory, a copy or a restored backup); this one's messages are refused"
            )

    def log_incarnations(self) -> dict[str, int]:
        """The newest incarnation announced per log identity."""
        with self._lock:
            return dict(self._state.logs)

    # -- the resource's verbs ------------------------------------------------------------------

    def take(self, gid: str, queue: str, timeout: float | None = 0.0) -> Delivery | None:
        """Hand the first available message of ``queue`` to branch ``gid`` (see `take_many`)."""
        got = self.take_many(gid, queue, 1, timeout)
        return got[0] if got else None

    def take_many(
        self, gid: str, queue: str, max_messages: int, timeout: float | None = 0.0
    ) -> list[Delivery]:
        """Hand up to ``max_messages`` available messages of ``queue``, in order, to branch
        ``gid``: one forced ``H`` record raises the counts of those without a credit (and
        pre-counts the next ones); those with a credit go out once the record that pre-counted
        them is durable, named in a lazy ``H``. Waits up to ``timeout`` seconds (None: forever)
        for the first; takes what is there then, without waiting for more.
        Higher priority first, arrival order within a priority. Expired messages at the head of
        the queue move to its dead-letter queue on the way (a lazy ``W`` record: one that comes
        back after a crash has expired all the same)."""
        if max_messages < 1:
            raise ProgrammingError("max_messages must be >= 1")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            self._gate.enter_shared()
            try:
                with self._lock:
                    held = self._reserve(gid, queue, max_messages)
                if held is not None:
                    self._await_hand_out(gid, held)
            finally:
                self._gate.exit_shared()
            if held is not None:
                if not held.counted:
                    crash_point("cursor.after_credited_take")
                self._compaction.maybe()
                return [Delivery(e.message, e.count, queue, e.reason) for e in held.taken]
            with self.changed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                if self._state.first_available(queue) is None:
                    self.changed.wait(remaining)

    def _reserve(self, gid: str, queue: str, max_messages: int) -> _Reserved | None:
        """Under the lock: move the expired head to the dead-letter queue, reserve the next
        messages for ``gid`` (no other consumer gets them): the records queued and applied in
        journal order; what to wait for outside the lock. None: nothing available."""
        if gid in self._state.tombstones:
            raise BranchRolledBack(f"{gid} was rolled back (tombstone)")
        if gid in self._state.prepared:
            raise IllegalStateError(f"{gid} is prepared: it can no longer receive")
        if is_topic(queue):
            raise ProgrammingError(
                f"{queue!r} is a topic: receive from a subscription's queue "
                "(subscription_queue(topic, name))"
            )
        now = self._clock()
        expired = self._state.expired_head(queue, now)
        if expired:  # one record each: each reason names its message's deadline
            deadlines = [self._state.entries[key].message.expires_at or 0 for key in expired]
            self._submit_many_locked([
                {"k": "W", "i": [key], "r": expiry_reason(deadline, now)}
                for key, deadline in zip(expired, deadlines, strict=True)
            ])  # fmt: skip
        ids = list(itertools.islice(self._state.available.get(queue, ()), max_messages))
        if not ids:
            return None
        taken = [self._state.entries[key] for key in ids]
        consumed = [e.credit for e in taken if e.credit is not None]
        credited = [e.key for e in taken if e.credit is not None]
        counted = [e.key for e in taken if e.credit is None]
        ticket, granted = None, None
        if counted:  # first: if it cannot be queued, nothing changed
            record = {"k": "H", "g": gid, "i": counted, "c": 1}
            ticket, granted = self._submit_precounting(record, {queue: len(ids)}, ids)
        for entry in taken:
            entry.credit = None
        if credited:  # counts raised already: lazy, for the replay's and the rollover's sake
            self._submit_locked({"k": "H", "g": gid, "i": credited, "c": 0}, force=False)
        return _Reserved(taken, ticket, set(counted), consumed, granted)

    def _await_hand_out(self, gid: str, held: _Reserved) -> None:
        """Outside the lock: the forced ``H`` durable, the credits it grants settled, and every
        consumed credit's record durable; otherwise the reservation is undone."""
        try:
            if held.ticket is not None:
                self._wait(held.ticket)
            self._settle(held.granted, True)
            self._await_credits(held.consumed)
        except BaseException:
            self._settle(held.granted, False)
            with self._lock:
                for entry in reversed(held.taken):
                    self._unhand(gid, entry, counted=entry.key in held.counted)
            raise

    def _await_credits(self, credits: list[Credit]) -> None:
        """Wait until the records behind ``credits`` are durable (normally they are: only a
        receive racing another branch's prepare finds one pending)."""
        if not credits:
            return
        if any(c.ticket is not None and _precount.durable(c) is None for c in credits):
            try:  # a lazily written arrival (`deliver_lazily`) not on disk yet: make it so
                self._journal.flush()
            except LogWriteError as exc:
                raise self._located(exc) from exc
        with self.changed:
            while any(_precount.durable(c) is None for c in credits):
                self.changed.wait()
        if not all(_precount.durable(c) for c in credits):
            raise LogWriteError(
                f"cursor {self.directory}: the record that pre-counted these messages failed",
                durable=False,
            )

    def _unhand(self, gid: str, entry: Entry, counted: bool = True) -> None:
        """Undo a reservation whose record failed (if it was written after all, the replay
        counts one delivery more than happened: a count may be high, never low). A credited
        entry keeps its (raised) count and goes back without its credit."""
        mid = entry.key
        handed = self._state.handed.get(gid, [])
        if mid in handed:
            handed.remove(mid)
            if not handed:
                del self._state.handed[gid]
        if counted:
            entry.count -= 1
        self._state._make_available(entry)
        self.changed.notify_all()

    def _submit_precounting(
        self, record: dict[str, Any], taken: dict[str, int], skip: Collection[str] = ()
    ) -> tuple[Ticket, Credit | None]:
        """Under the lock: queue a forced consumer ``record`` with the pre-counts of the
        queues in ``taken`` (queue -> messages the branch took there) in its ``p``, apply it,
        grant the credits (pending until `_settle`)."""
        keys = _precount.window(self._state, taken, self.precount, self.max_deliveries, skip)
        if keys:
            record["p"] = keys
        ticket = self._submit_locked(record, force=True)
        return ticket, _precount.grant(self._state, keys)

    def _append_precounting(self, record: dict[str, Any]) -> None:
        """`_append` of a forced ``P`` or one-phase ``C`` that pre-counts for the queues its
        branch's messages (``i``) came from."""
        self._gate.enter_shared()
        try:
            with self._lock:
                taken = Counter(self._state.entries[k].queue for k in record["i"]
                                if k in self._state.entries)  # fmt: skip
                ticket, granted = self._submit_precounting(record, dict(taken))
            durable = False
            try:
                self._wait(ticket)
                durable = True
                if granted is not None:
                    crash_point("cursor.after_precount")
            finally:  # a receive may be waiting on these credits: never leave them pending
                self._settle(granted, durable)
        finally:
            self._gate.exit_shared()

    def _give_back_credits(self) -> None:
        """At a clean close, lower again the counts pre-counted for messages never handed out
        (a lazy ``G``, written before the close's fsync), so only a crash leaves them one high.
        Only durable credits: the record that raised each is before the ``G`` in the journal."""
        with self._lock:
            keys = [k for k, e in self._state.entries.items()
                    if e.credit is not None and _precount.durable(e.credit)]  # fmt: skip
        if not keys:
            return
        try:
            self._append({"k": "G", "i": keys}, force=False)
        except LogWriteError as exc:  # a refusing journal: the counts just stay one high
            log.warning("cursor %s: unused pre-counts not given back: %s", self.directory, exc)

    def _settle(self, credit: Credit | None, durable: bool) -> None:
        if credit is None or credit.durable is not None:
            return
        with self._lock:
            _precount.settle(self._state, credit, durable)
            self.changed.notify_all()

    def is_tombstoned(self, gid: str) -> bool:
        return gid in self._state.tombstones

    def is_committed(self, gid: str) -> bool:
        return gid in self._state.committed

    def is_prepared(self, gid: str) -> bool:
        """Prepared, or committed by a lazy record not yet durable (recovery must still see it:
        `coordinator.lazy_commit`)."""
        return gid in self._state.prepared or gid in self._settling

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
        self._append_precounting({"k": "P", "g": gid, "i": ids})
        with self._lock:
            self._refuse_tombstoned(gid)
        return True

    def commit_one_phase(self, gid: str) -> None:
        """Delete the messages of a branch that was never prepared (forced ``C``, pre-counting
        the next messages of its queues as a ``P`` would); nothing if it holds none."""
        with self._lock:
            ids = self._state.branch_ids(gid)
        if ids:
            self._append_precounting({"k": "C", "g": gid, "i": ids})
            self._compaction.maybe()

    def _refuse_tombstoned(self, gid: str) -> None:
        if gid in self._state.tombstones:
            raise BranchRolledBack(f"{gid} was rolled back (tombstone); it cannot prepare")

    def commit(self, gid: str) -> None:
        """Delete the branch's messages (forced ``C``); nothing if it holds none. A commit whose
        lazy record is not durable yet (recovery's) returns once it is."""
        if gid in self._settling:
            self._lazy.flush()
            return
        with self._lock:
            ids = self._state.branch_ids(gid)
        if ids:
            self._append({"k": "C", "g": gid, "i": ids}, force=True)
            self._compaction.maybe()

    def commit_lazily(self, gid: str, on_durable: Callable[[], None]) -> None:
        """`commit` of a prepared branch with a lazy ``C`` record: the messages are deleted now,
        the record is carried to disk by the next forced record (or the `LazyWatch`'s own
        fsync), and ``on_durable`` runs once it is. Until then the gid counts as prepared, so
        recovery still re-drives it from the decision the coordinator keeps
        (`coordinator.lazy_commit`); a crash before it only leaves the branch prepared."""
        if gid in self._settling:
            self._lazy.flush()
        with self._lock:
            ids = self._state.branch_ids(gid)
        if not ids:
            on_durable()
            return
        self._gate.enter_shared()
        try:
            with self._lock:
                ticket = self._submit_locked({"k": "C", "g": gid, "i": ids}, False)
                self._settling.add(gid)
            self._wait(ticket)  # only a lazy backlog past its bound waits (an fsync)
        finally:
            self._gate.exit_shared()

        def durable_now() -> None:
            with self._lock:
                self._settling.discard(gid)
            on_durable()

        self._lazy.watch(ticket, durable_now)
        self._compaction.maybe()
        self._lazy.settle()

    def flush_commits(self) -> None:
        """Make every lazy commit record durable now and run its callback."""
        self._lazy.flush()

    def rollback(self, gid: str, max_deliveries: int | None = None) -> list[str]:
        """Make the branch's messages available again, or move those delivered ``max_deliveries``
        times to their dead-letter queue; leave a tombstone (lazy ``R``). Returns the ids moved."""
        limit = self.max_deliveries if max_deliveries is None else max_deliveries
        with self._lock:
            back: list[str] = []
            moves: list[list[str]] = []
            for mid in self._state.branch_ids(gid):
                entry = self._state.entries.get(mid)
                if entry is None:
                    continue
                if entry.count >= limit and entry.reason is None:
                    reason = (f"max-deliveries: delivered {entry.count} times "
                              f"(max_deliveries {limit}), rolled back")  # fmt: skip
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
        """Prepared branches, and those whose lazy commit record is not durable yet."""
        with self._lock:
            return sorted({*self._state.prepared, *self._settling})

    # -- inspection ----------------------------------------------------------------------------

    def available(self, queue: str) -> list[Delivery]:
        """The messages ``queue`` would hand out now, in order (their counts so far; a
        pre-count this process holds a credit for is not counted until its delivery)."""
        with self._lock:
            entries = [self._state.entries[m] for m in self._state.available.get(queue, ())]
            return [Delivery(e.message, _shown(e), e.queue, e.reason) for e in entries]

    def delivery_count(self, message_id: str) -> int | None:
        with self._lock:
            entry = self._state.entries.get(message_id)
            return None if entry is None else _shown(entry)

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

    # -- topics and subscriptions (JMS) -------------------------------------------------------

    def subscribe(self, topic: str, name: str, *, durable: bool = True) -> Subscription:
        """Create a subscription (idempotent for one of the same kind). A durable one is a
        forced ``U`` record and keeps copies while no subscriber is attached; a non-durable one
        lives in memory, is attached at once, and goes with its last subscriber."""
        queue = subscription_queue(topic, name)
        with self._lock:
            existing = self._state.subscriptions.get(queue)
            if existing is not None:
                if existing.durable != durable:
                    kind = "durable" if existing.durable else "non-durable"
                    raise IllegalStateError(f"subscription {queue!r} exists and is {kind}")
                if not durable:  # one more subscriber shares it: it lives until the last detach
                    self._attached[queue] += 1
                return self._subscription(existing, queue)
            if not durable:
                self._state.subscriptions[queue] = SubscriptionState(topic, name, False)
                self._attached[queue] += 1
                return self._subscription(self._state.subscriptions[queue], queue)
        self._append({"k": "U", "u": topic, "s": name}, force=True)
        with self._lock:
            return self._subscription(self._state.subscriptions[queue], queue)

    def unsubscribe(self, topic: str, name: str) -> int:
        """Remove a subscription and the copies waiting in its queue (its dead letters stay);
        how many copies went. Refused while copies are handed out or prepared: their branches
        would commit or roll back messages of a subscription that no longer exists."""
        queue = subscription_queue(topic, name)
        with self._lock:
            sub = self._state.subscriptions.get(queue)
            if sub is None:
                raise IllegalStateError(f"no subscription {queue!r}")
            busy = self._in_flight(queue)
            if busy:
                raise IllegalStateError(
                    f"subscription {queue!r} has {busy} message(s) handed out or prepared; "
                    "end those transactions first"
                )
            if not sub.durable:
                self._attached.pop(queue, None)
                return self._state.remove_subscription(queue)
            waiting = len(self._state.available.get(queue, ()))
        self._append({"k": "V", "u": topic, "s": name}, force=True)
        with self._lock:
            self._attached.pop(queue, None)
        return waiting

    def subscriptions(self, topic: str | None = None) -> list[Subscription]:
        with self._lock:
            return [
                self._subscription(sub, queue)
                for queue, sub in self._state.subscriptions.items()
                if topic is None or sub.topic == topic
            ]

    def attach(self, topic: str, name: str) -> Subscription:
        """A subscriber connects to an existing subscription (counted, in memory)."""
        queue = subscription_queue(topic, name)
        with self._lock:
            sub = self._state.subscriptions.get(queue)
            if sub is None:
                raise IllegalStateError(f"no subscription {queue!r}: subscribe first")
            self._attached[queue] += 1
            return self._subscription(sub, queue)

    def detach(self, topic: str, name: str) -> None:
        """A subscriber disconnects. A durable subscription keeps its copies (and stores the
        non-persistent ones durably from now on); a non-durable one goes with its last
        subscriber, with the copies waiting in it."""
        queue = subscription_queue(topic, name)
        with self._lock:
            if self._attached[queue] > 1:
                self._attached[queue] -= 1
                return
            self._attached.pop(queue, None)
            sub = self._state.subscriptions.get(queue)
            if sub is not None and not sub.durable:
                self._state.remove_subscription(queue)

    def holders(self, message_id: str) -> list[str]:
        """Where the message still is: the topic input, subscription queues (handed out or
        not), dead-letter queues. Empty once every subscriber's copy is consumed: only then is
        the message gone from the store."""
        with self._lock:
            return sorted(e.queue for e in self._state.entries.values()
                          if e.message.message_id == message_id)  # fmt: skip

    def _subscription(self, sub: SubscriptionState, queue: str) -> Subscription:
        return Subscription(sub.topic, sub.name, sub.durable, queue, self._attached[queue] > 0,
                            len(self._state.available.get(queue, ())),
                            self._in_flight(queue))  # fmt: skip

    def _in_flight(self, queue: str) -> int:
        s = self._state
        return sum(1 for keys in (*s.handed.values(), *s.prepared.values()) for k in keys
                   if (e := s.entries.get(k)) is not None and e.queue == queue)  # fmt: skip

    # -- topic dispatch: the input, the in-doubt list, the monitor queue (seeds 002, 001) -------

    def next_publication(self, worker: str, timeout: float | None = 0.0) -> TopicPublication | None:
        """Take the oldest publication off the topic input for dispatcher thread ``worker``:
        a lazy ``I`` record puts it in the in-doubt list with the subscription queues it goes
        to. Waits up to ``timeout`` seconds (None: for ever) for one."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._take_lock:
            while True:
                with self.changed:
                    mid = next(iter(self._state.inbox), None)
                    if mid is None:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            return None
                        self.changed.wait(remaining)
                        continue
                    entry = self._state.entries[mid]
                    queues = self._state.topic_queues(entry.message.destination)
                record = {"k": "I", "m": mid, "w": worker, "z": list(queues)}
                self._append(record, force=False)
                return TopicPublication(entry.message, queues, worker)

    def deliver_copy(self, message_id: str, queue: str, by: str) -> bool:
        """Put a publication's copy into a subscription queue with its monitor entry, in one
        ``K`` record; False (nothing written) if the monitor queue already has this copy or the
        subscription is gone. Forced only for a non-persistent message while a durable
        subscriber is disconnected: JMS stores that one as if it were persistent."""
        with self._lock:
            taken = self._state.taken.get(message_id)
            if taken is None:
                raise IllegalStateError(f"publication {message_id} is not in the in-doubt list")
            sub = self._state.subscriptions.get(queue)
            if queue in taken.monitor or sub is None:
                return False
            message = self._state.entries[message_id].message
            force = not message.persistent and sub.durable and self._attached[queue] == 0
        self._append({"k": "K", "m": message_id, "u": queue, "w": by}, force=force)
        with self._lock:
            self.changed.notify_all()
        return True

    def finish_publication(self, message_id: str) -> None:
        """The publication reached every subscription: it leaves the in-doubt list (lazy ``E``;
        if lost, recovery finds every copy in the monitor queue and sends none again)."""
        with self._lock:
            if message_id not in self._state.taken:
                return
        self._append({"k": "E", "m": message_id}, force=False)
        self._compaction.maybe()

    def in_doubt(self) -> list[TopicPublication]:
        """The in-doubt list, in take order."""
        with self._lock:
            return [TopicPublication(self._state.entries[mid].message, t.queues, t.worker)
                    for mid, t in self._state.taken.items()]  # fmt: skip

    def monitored(self, message_id: str, queue: str) -> bool:
        """Whether the monitor queue records this publication's copy in ``queue``."""
        with self._lock:
            taken = self._state.taken.get(message_id)
            return taken is not None and queue in taken.monitor

    def topic_backlog(self) -> int:
        """Publications not yet taken by a dispatcher thread."""
        with self._lock:
            return len(self._state.inbox)

    # -- queue kinds and dead letters (seeds 004, 003) -----------------------------------------

    def set_transactional(self, queue: str, transactional: bool) -> None:
        """Mark a queue (non-)transactional (forced ``T``). A transactional message that reaches
        a non-transactional queue is rejected into its dead-letter queue, and a negative
        acknowledgment goes to the administration queue the message named (as MSMQ does)."""
        validate_destination(queue)
        if queue.startswith(TOPIC_PREFIX):
            raise ProgrammingError(
                f"{queue!r} is a topic or a subscription's queue: those are always transactional"
            )
        if self.is_transactional(queue) != transactional:
            self._append({"k": "T", "u": queue, "v": transactional}, force=True)

    def is_transactional(self, queue: str) -> bool:
        with self._lock:
            return queue not in self._state.non_transactional

    def dead_letters(self, queue: str | None = None) -> list[Delivery]:
        """Dead letters with their reasons (``expired:``, ``max-deliveries:``, ``rejected:``),
        of one queue (its name or its dead-letter queue's) or of all, oldest first."""
        dlq = None if queue is None else self._dlq_name(queue)
        with self._lock:
            entries = sorted((e for e in self._state.entries.values()
                              if e.reason is not None and (dlq is None or e.queue == dlq)),
                             key=lambda e: e.order)  # fmt: skip
            return [Delivery(e.message, _shown(e), e.queue, e.reason) for e in entries]

    def replay_dead_letters(self, dlq: str, ids: Sequence[str] | None = None) -> int:
        """Put dead letters back at the tail of their queue with their count reset (forced
        ``Y``); ``ids``: message ids, None for all. Handed-out ones are skipped; how many went."""
        return self._settle_dead_letters("Y", dlq, ids)

    def purge_dead_letters(self, dlq: str, ids: Sequence[str] | None = None) -> int:
        """Delete dead letters (forced ``Z``); ``ids`` as for `replay_dead_letters`."""
        return self._settle_dead_letters("Z", dlq, ids)

    def _settle_dead_letters(self, kind: str, dlq: str, ids: Sequence[str] | None) -> int:
        name = self._dlq_name(dlq)
        wanted = None if ids is None else set(ids)
        with self._lock:
            keys = [
                k
                for k in self._state.available.get(name, ())
                if wanted is None or self._state.entries[k].message.message_id in wanted
            ]
            if kind == "Y":  # nowhere to go back to, or a queue that would reject it again
                keys = [k for k in keys if self._state.replayable(self._state.entries[k])]
        if keys:
            self._append({"k": kind, "i": keys}, force=True)
            with self._lock:
                self.changed.notify_all()
        return len(keys)

    @staticmethod
    def _dlq_name(queue: str) -> str:
        validate_destination(queue.removesuffix(DLQ_SUFFIX))
        return queue if queue.endswith(DLQ_SUFFIX) else queue + DLQ_SUFFIX

    # -- the journal ---------------------------------------------------------------------------

    def _append(self, record: dict[str, Any], force: bool) -> None:
        """Queue and apply under the lock, then wait for durability outside it, all inside the
        gate (a rollover never sees one without the other). Queue order is the journal's write
        order, so the state applies records in the order a replay will: a decision taken in an
        ``apply`` (a dead letter replayed or not, a copy made or skipped) comes out the same.
        A forced record that then fails poisons the journal: nothing later is written, and the
        next open rebuilds the state from what the disk holds."""
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

    def _located(self, exc: LogWriteError) -> LogWriteError:
        return LogWriteError(f"cursor {self.directory}: {exc.message}", durable=exc.durable)

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
        """Give back unused pre-counts (a lazy ``G``), write lazy records (rollbacks, forgets,
        commits), fsync, release the lock."""
        self._give_back_credits()
        self._lazy.close()
        self._journal.close()
        self._lazy.settle()

    def __enter__(self) -> Cursor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
