"""The message log's branch verbs (the producer side of `MessageLogResource`): room checks,
prepare, commit (forced, one-phase or lazy), rollback and forget, and the numbering at commit:
numbers are taken under the lock and published only once their record is applied (or burned if
its write failed), so a reader never sees 7 before 6 (the `._log` docstring says why)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coordinator.crashpoints import crash_point
from coordinator.errors import LogWriteError

from ._base import BranchRolledBack, DestinationFullError, LogBase, log
from ._partition import PARTITION_MARK, parse_stream, stream_for
from ._records import VOLATILE_SUFFIX, Message, encode, message_obj, prepare_records
from ._validation import check_message


class BranchOps(LogBase):
    """`MessageLog`'s branch verbs and numbering."""

    # -- the resource's verbs ------------------------------------------------------------------

    def check_room(self, destination: str, adding: int) -> None:
        limit = self.max_destination_messages
        if limit is None:
            return
        with self._lock:
            held = self._held.get(destination, 0)
            for name in self._streams_of(destination):
                stream = self._state.streams.get(name)
                held += len(stream.messages) if stream is not None else 0
        if held + adding > limit:
            raise DestinationFullError(
                f"destination {destination!r} holds {held} messages, its limit is {limit}; "
                "nothing was staged, retry when the cursor has acknowledged some"
            )

    def _streams_of(self, destination: str) -> list[str]:
        """Under the lock: the names of every stream of ``destination`` (its partitions, its
        non-persistent twin), whichever partition count numbered them."""
        plain = (destination, destination + VOLATILE_SUFFIX)
        streams = self._state.streams
        if self._partitions(destination) == 1 and not any(PARTITION_MARK in n for n in streams):
            return list(plain)
        return [
            name
            for name in self._state.streams
            if (p := parse_stream(name)) is not None and p.destination == destination
        ]

    def clock(self) -> int:
        """Wall-clock milliseconds, as expiries and tombstones use them."""
        return self._clock()

    def is_tombstoned(self, gid: str) -> bool:
        return gid in self._state.tombstones

    def is_committed(self, gid: str) -> bool:
        return gid in self._state.committed

    def is_prepared(self, gid: str) -> bool:
        """Prepared, or committed by a lazy record not yet durable (recovery must still see it:
        `coordinator.lazy_commit`)."""
        return (
            gid in self._state.prepared or gid in self._volatile_prepared or gid in self._settling
        )

    def prepare(self, gid: str, messages: list[Message]) -> None:
        """Make the persistent ones durable (one forced record); keep the others in memory.

        Raises `BranchRolledBack` if a rollback (recovery's, say) left its tombstone first, even
        while the record was being written: replay ignores a prepare after a tombstone, so
        voting yes then would let a commit report success for messages that do not exist."""
        self._judge(messages)
        durable = [m for m in messages if m.persistent]
        volatile = [m for m in messages if not m.persistent]
        if durable:
            with self._lock:  # from here a rollback forces its R: the P may reach disk first
                self._preparing.add(gid)
            try:
                self._append(prepare_records(gid, [message_obj(m) for m in durable]), True)
            finally:
                with self._lock:
                    self._preparing.discard(gid)
        with self._lock:
            if gid in self._state.tombstones:
                raise BranchRolledBack(f"{gid} was rolled back (tombstone); it cannot prepare")
            if volatile:
                self._volatile_prepared[gid] = volatile
                self._hold_locked(volatile, +1)  # the durable ones since their P applied

    def _judge(self, messages: list[Message]) -> None:
        """Every message of a record passes `check_message` before the record is written, so a
        record in the journal always replays (`InvalidMessageError` writes nothing)."""
        for message in messages:
            check_message(message, max_bytes=self.max_message_bytes)

    def commit(
        self,
        gid: str,
        messages: list[Message] | None = None,
        *,
        after_append: str = "",
        remember: bool = False,
    ) -> None:
        """Number and publish a prepared branch, or, with ``messages``, commit them in one phase.
        A gid that is neither prepared nor given messages is a repeat: nothing to do.
        ``after_append`` names the crash point between the durable record and publication;
        ``remember``: a one-phase commit of a carried branch (`._carried`) keeps its gid."""
        one_phase = messages is not None
        if messages is not None:
            self._judge(messages)
        settling = False
        with self._lock:
            if not one_phase:
                self._await_commit_locked(gid)
                settling = gid in self._settling
                if not settling:
                    self._committing.add(gid)
            if one_phase:
                assert messages is not None
                durable = [m for m in messages if m.persistent]
                volatile = [m for m in messages if not m.persistent]
            elif settling:  # recovery's commit of a lazy one: return once durable, below
                durable, volatile = [], []
            else:
                durable = list(self._state.prepared.get(gid, []))
                volatile = self._volatile_prepared.pop(gid, [])
            numbers = [self._take_number(self._stream_of(m)) for m in durable]
            vnumbers = [self._take_number(self._stream_of(m)) for m in volatile]
        if not one_phase and settling:
            self._settled()
            return
        try:
            if durable or (not one_phase and gid in self._state.prepared):
                record = _commit_record(gid, numbers, durable if one_phase else None, remember)
                self._append([record], force=True)
                if after_append:
                    crash_point(after_append)
            elif one_phase or volatile:
                with self._lock:
                    self._state.committed.add(gid)
        finally:
            self._publish(volatile, vnumbers, numbers, one_phase, committed=gid)

    def _await_commit_locked(self, gid: str) -> None:
        """Wait (holding ``_lock`` through ``changed``) while another thread commits ``gid``:
        two commits of one branch at once would both number its messages. The phase-two commit
        and a later branch's prepare naming it (``after``) do meet so, on purpose."""
        while gid in self._committing:
            self.changed.wait()

    def commit_lazily(self, gid: str, on_durable: Callable[[], None]) -> None:
        """`commit` of a prepared branch whose ``C`` record is written lazily: numbered and
        applied now, carried to disk by the next forced record (or the `LazyWatch`'s own fsync).
        Its messages become visible, and ``on_durable`` runs, only once the record is durable: a
        transfer must never send a number a crash could give to another message. Until then the
        gid counts as prepared (`is_prepared`, `prepared_gids`), so recovery still re-drives it
        from the decision the coordinator keeps (`coordinator.lazy_commit`)."""
        with self._lock:
            self._await_commit_locked(gid)
            settling = gid in self._settling
            if not settling:
                self._committing.add(gid)
                durable = list(self._state.prepared.get(gid, []))
                volatile = self._volatile_prepared.pop(gid, [])
                numbers = [self._take_number(self._stream_of(m)) for m in durable]
                vnumbers = [self._take_number(self._stream_of(m)) for m in volatile]
        if settling:  # committed lazily by another caller: report once that record is durable
            self._settled()
            on_durable()
            return
        if gid not in self._state.prepared:
            self._publish(volatile, vnumbers, [], one_phase=False, committed=gid)
            on_durable()  # volatile only, or a repeat: nothing to write
            return
        self._publish(volatile, vnumbers, [], one_phase=False)
        record = {"k": "C", "g": gid, "s": [list(n) for n in numbers]}
        self._submit_settling(record, encode(record), numbers, durable, on_durable, force=False)

    def _submit_settling(
        self,
        record: dict[str, Any],
        payload: bytes,
        numbers: list[tuple[str, int]],
        held: list[Message],
        on_durable: Callable[[], None],
        *,
        force: bool,
    ) -> None:
        """Write a commit record (``payload``), forced only if ``force``, and apply it; its gid
        stays settling until the record is durable, when its ``numbers`` are published and
        ``on_durable`` runs. ``held``: the messages it stops counting against their
        destinations. A failed write burns the numbers (`commit_lazily`, `commit_carried`)."""
        gid = record["g"]
        self._gate.enter_shared()
        try:
            try:
                with self._lock:
                    ticket = self._journal.submit(payload, force)
                    self._hold_locked(held, -1)
                    self._state.apply(record)
                    self._settling.add(gid)
                    self._committing.discard(gid)
                    self.changed.notify_all()
            except LogWriteError as exc:
                self._publish([], [], numbers, one_phase=False, committed=gid)  # burned
                raise self._located(exc) from exc
        finally:
            self._gate.exit_shared()

        def durable_now() -> None:
            with self._lock:
                self._settling.discard(gid)
            self._publish([], [], numbers, one_phase=False)
            on_durable()

        self._lazy.watch(ticket, durable_now)
        self._journal.wait(ticket)  # forced: its fsync; lazy: only a backlog past its bound
        self._compaction.maybe()
        self._lazy.settle()

    def settling_commits(self) -> int:
        """Branches committed by a lazy record not durable yet: their messages are not visible
        to a reader until it is (within ``lazy_delay``, usually with the next forced record)."""
        return len(self._settling)

    def flush_commits(self) -> None:
        """Make every lazy commit record durable now and run its callback; raises if one is not
        (`_settled`)."""
        self._settled()

    def _stream_of(self, message: Message) -> str:
        """The stream ``message`` is numbered in: its key's partition of its destination."""
        return stream_for(message, self._partitions(message.destination))

    def _take_number(self, stream: str) -> tuple[str, int]:
        s = self._state.stream(stream)
        seq = s.next_seq
        self._inflight.setdefault(stream, set()).add(seq)
        s.next_seq = seq + 1
        return stream, seq

    def _publish(
        self,
        volatile: list[Message],
        vnumbers: list[tuple[str, int]],
        numbers: list[tuple[str, int]],
        one_phase: bool,
        committed: str | None = None,
    ) -> None:
        """Volatile messages join their streams; every number taken leaves the in-flight set
        (burned, if the durable record failed: `_append` already applied a written one); the
        ``committed`` gid's commit is over (`_await_commit_locked`)."""
        with self._lock:
            if committed is not None:
                self._committing.discard(committed)
            self._state.add_numbered(vnumbers, volatile)
            for name, seq in [*numbers, *vnumbers]:
                self._inflight[name].discard(seq)
            if not one_phase:
                self._hold_locked(volatile, -1)
            self.version += 1
            self.changed.notify_all()
        for listener in self._listeners:
            try:
                listener()
            except Exception:  # what it announces is published and durable all the same
                log.exception("message log %s: a publish listener failed", self.directory)

    def rollback(self, gid: str) -> None:
        """Discard a branch and leave its tombstone. Forced for a branch whose prepare is on
        disk, or being written: the coordinator forgets a rolled-back transaction once this
        returns (presumed abort keeps no record of it), so a crash that lost the tombstone would
        bring the branch back prepared with no one left to ask about it. Lazy otherwise: a crash
        loses nothing that matters, since it also loses every unprepared branch the tombstone
        could refuse, and a prepare that queues its ``P`` after it carries it to disk. Decided
        and queued under one hold of the lock, so a ``P`` is queued wholly before or after."""
        record = {"k": "R", "g": gid, "t": self._clock()}
        payload = encode(record)
        self._gate.enter_shared()
        try:
            with self._lock:
                volatile = self._volatile_prepared.pop(gid, [])
                self._hold_locked(volatile, -1)
                # a tombstone already here may be one whose forced write failed (applied when
                # queued; the journal refuses writes since, but should one ever go on): force
                durable = (
                    gid in self._state.prepared
                    or gid in self._preparing
                    or gid in self._state.tombstones
                )
                try:
                    ticket = self._journal.submit(payload, durable)
                except LogWriteError as exc:
                    raise self._located(exc) from exc
                self._hold_locked(self._state.prepared.get(gid, []), -1)
                self._state.apply(record)
            try:
                self._journal.wait(ticket)
            except LogWriteError as exc:
                raise self._located(exc) from exc
        finally:
            self._gate.exit_shared()
        self._compaction.maybe()
        if durable:
            self._lazy.settle()  # the lazy commit records this force carried

    def forget(self, gid: str) -> None:
        if gid in self._state.tombstones:
            self._append([{"k": "F", "g": gid}], force=False)

    def prepared_gids(self) -> list[str]:
        """Prepared branches, and those whose lazy commit record is not durable yet."""
        with self._lock:
            return sorted({*self._state.prepared, *self._volatile_prepared, *self._settling})


def _commit_record(
    gid: str, numbers: list[tuple[str, int]], one_phase: list[Message] | None, remember: bool
) -> dict[str, Any]:
    """A ``C`` record, or with the messages of a one-phase commit a ``1`` (``r``: carried)."""
    numbered = [list(n) for n in numbers]
    if one_phase is None:
        return {"k": "C", "g": gid, "s": numbered}
    record: dict[str, Any] = {"k": "1", "g": gid, "m": [message_obj(m) for m in one_phase]}
    record["s"] = numbered
    if remember:
        record["r"] = 1
    return record
