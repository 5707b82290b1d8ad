"""The cursor's intake: messages transferred from the logs, judged by the stream filter.

Accepting: ``offer(frame)`` judges a frame with `..sequencing.StreamFilter` (no change);
``accept(message, decision)`` writes the message and ``decision.after`` in **one forced** ``M``
record, then adopts the decision and returns the acknowledgment to send: persist before acking.
``deliver(frame, message)`` does both, or returns the re-acknowledgment of a dropped frame.

``deliver_many`` and ``deliver_lazily`` do the same for a batch (one journal entry, one fsync
or none); ``announce_log`` fences an older incarnation of a log identity (`LogFencedError`).
A mixin of `Cursor` (`._base`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from coordinator.crashpoints import crash_point
from coordinator.errors import IllegalStateError, ProgrammingError
from resource_managers.message_log import VOLATILE_SUFFIX, Message, check_message
from resource_managers.sequencing import Ack, Decision, Frame, StreamFilter, stream_key

from . import _precount
from ._base import CursorBase
from ._carried import drop_durable
from ._records import message_obj
from ._topics import is_topic
from ._values import LogFencedError


class Intake(CursorBase):
    """`Cursor`'s transfer side: offer, accept, deliver, the filter and the log identities."""

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
        # for a carried branch's pre-counts (`._carried`)
        drop_durable(self._arrivals).append((self._last_accept, [r["o"]["i"] for r in records]))
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
        that a crash then takes from the cursor. One that failed to write poisoned the journal,
        whose flush then raises (`_settled`)."""
        ticket = self._last_accept
        if ticket is not None and (not ticket.done or ticket.error is not None):
            self._settled()

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
        # lazy only for non-persistent messages on their own streams: a persistent message
        # (which a carried branch may consume without a forced record of its own) is forced
        force = any(
            not r["q"].endswith(VOLATILE_SUFFIX) or r["o"].get("p", True) for r, _ in records
        )
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
