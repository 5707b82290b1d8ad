"""`MessageLog`: the durable store of the capture side, on the coordinator's `Journal`.

Per stream (a destination, or its non-persistent twin ``<destination>#np``), the committed
messages not yet acknowledged, numbered 1, 2, 3, ... in commit order within the stream's epoch
(see ``_state`` for the epoch rule). Numbers are assigned at commit and written in the commit
record, so a replay gives every message the number a reader may already have sent.

Numbers become visible in order: a commit takes its numbers under a lock, then writes its record
outside it (so concurrent commits share one fsync), and a reader sees a number only when every
lower number of its stream is either visible or *burned* (its commit's write failed). Without
that rule a transfer could send 7 before 6 and the cursor, accepting 7, would drop 6 as old.
A burned number leaves a gap; the previous-number links of `resource_managers.sequencing` cover it.

Non-persistent messages are never written: they are kept in memory, committed without a record
and lost in a crash or close, as JMS allows.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from coordinator.crashpoints import crash_point
from coordinator.errors import (
    ConfigurationError,
    LogWriteError,
    ProgrammingError,
    TransactionRolledBack,
    TransientError,
)
from coordinator.journal import (
    DEFAULT_LAZY_DELAY,
    DEFAULT_SEGMENT_BYTES,
    Compaction,
    FileOps,
    Gate,
    Journal,
    JournalStats,
    LazyWatch,
)

from ._partition import PARTITION_MARK, parse_stream, stream_for
from ._records import VOLATILE_SUFFIX, Message, decode, encode, message_obj
from ._refused import keep_refused
from ._state import LogState
from ._validation import check_message

log = logging.getLogger("twopc.message_log")

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
DEFAULT_TOMBSTONE_SECONDS = 24 * 3600


def journal_replay() -> Callable[[bytes], None]:
    """What opening a message log does with each journal record, into a fresh state (read-only:
    for `coordinator.journal.quarantine`, which must judge records exactly as an open would)."""
    state = LogState()
    return lambda payload: state.apply(decode(payload))


class BranchRolledBack(TransactionRolledBack):
    """The log refuses to prepare a branch it has already rolled back (its tombstone)."""

    code = "mlog-rolled-back"
    reason = "vote"


class DestinationFullError(TransientError):
    """The destination holds ``max_destination_messages`` already; retry once it drains."""

    code = "mlog-destination-full"


@dataclass
class MessageLogStats:
    forced_records: int
    lazy_records: int
    fsyncs: int
    rollovers: int
    prepared: int
    tombstones: int
    pending: int
    streams: int


#: the random low bits of an incarnation (`MessageLog._open`)
INCARNATION_BITS = 20


def _random_bits() -> int:
    return secrets.randbits(INCARNATION_BITS)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class MessageLog:
    """Prepared branches and committed messages in ``directory``, locked to this process.

    ``max_message_bytes``: a message's body plus headers. ``max_destination_messages``: committed
    unacknowledged plus prepared messages a destination may hold (None: no limit).
    ``tombstone_seconds``: how long a rollback's tombstone survives compaction (``forget`` drops
    it sooner). ``partitions``: how many partitions each destination has (its route's cursors,
    `messaging.routes.Router.partitions`; default 1 for all): a message is numbered at commit in
    the stream of its key's partition (`_partition`), so the hash is taken where the numbers
    are. Opening refuses (`ConfigurationError`) a count that differs from the one a destination's
    unacknowledged messages were numbered under, unless ``allow_repartition``. Thread-safe; a
    context manager.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_destination_messages: int | None = None,
        tombstone_seconds: float = DEFAULT_TOMBSTONE_SECONDS,
        file_ops: FileOps | None = None,
        clock_ms: Callable[[], int] = now_ms,
        lazy_delay: float = DEFAULT_LAZY_DELAY,
        partitions: Callable[[str], int] | None = None,
        allow_repartition: bool = False,
    ) -> None:
        if max_message_bytes < 1 or (max_destination_messages or 1) < 1:
            raise ProgrammingError("max_message_bytes and max_destination_messages must be >= 1")
        self.directory = Path(directory)
        self.max_message_bytes = max_message_bytes
        self.max_destination_messages = max_destination_messages
        self._tombstone_ms = int(tombstone_seconds * 1000)
        self._clock = clock_ms
        self._partitions = partitions or (lambda _destination: 1)
        self._state = LogState()
        self._gate = Gate()
        self._lock = threading.Lock()  # numbering, in-flight numbers, counts
        self.changed = threading.Condition(self._lock)  # notified when messages become visible
        self._inflight: dict[str, set[int]] = {}
        self._held: dict[str, int] = {}  # destination -> prepared-but-uncommitted messages
        self._volatile_prepared: dict[str, list[Message]] = {}
        self.version = 0  # bumped whenever messages become visible
        self._journal = Journal(
            self.directory,
            replay=self._replay,
            segment_bytes=segment_bytes,
            file_ops=file_ops,
            kind="message-log",
        )
        self._compaction = Compaction(
            self._journal, self._gate, self._carry, f"message log {self.directory}", log
        )
        self._lazy = LazyWatch(self._journal, delay=lazy_delay, name=f"message log {directory}")
        self._settling: set[str] = set()  # gids whose lazy commit record is not durable yet
        self._committing: set[str] = set()  # gids numbered by a commit whose record is not applied
        try:
            self._check_partitions(allow_repartition)
            self._open()
        except BaseException:
            self._journal.close()
            raise

    def _replay(self, payload: bytes) -> None:
        self._state.apply(decode(payload))

    def _open(self) -> None:
        """The forced ``O`` record: this open's incarnation, and the log's identity, chosen
        here once (a uuid4) when the journal has none — a new directory, or one written before
        identities. Nothing is sent before it is durable, so a crash before then leaves no
        trace of the identity, and the next open chooses again."""
        # the clock's milliseconds, with 20 random bits below them: two opens of one journal
        # (a copied directory started beside the original) in the same millisecond must still
        # differ, or neither would be fenced (`identity_fencing`); above every earlier open's
        incarnation = max(
            self._state.incarnation + 1, (self._clock() << INCARNATION_BITS) | _random_bits()
        )
        identity = self._state.identity or uuid.uuid4().hex
        self._append([{"k": "O", "n": incarnation, "i": identity}], force=True)
        crash_point("mlog.after_open")
        for messages in self._state.prepared.values():
            self._hold(messages, +1)
        self._compaction.maybe()

    def _check_partitions(self, allow: bool) -> None:
        """Refuse to open with a partition count other than the one a destination's
        unacknowledged messages were numbered under (before the ``O`` record: a refused open
        writes nothing). Those messages stay in their streams and go to the cursor their
        partition index now routes to, while new messages of the same key may hash to another
        partition and cursor: two consumers could then take one key's messages out of order. A
        count changed once the destination is drained costs nothing (`docs/messaging.md`,
        "Changing the partition count"); ``allow`` opens anyway, for an operator who accepts it
        (a cursor host lost for good), and who accepts too that an old partition whose cursor
        changes is a moved route (what its old cursor accepted unacknowledged comes twice)."""
        moved: dict[str, tuple[int, int, int]] = {}
        for name, stream in self._state.streams.items():
            parsed = parse_stream(name)
            if not stream.messages or parsed is None or not parsed.persistent:
                continue
            now = self._partitions(parsed.destination)
            if now != parsed.count:
                held, _, _ = moved.get(parsed.destination, (0, 0, 0))
                moved[parsed.destination] = (held + len(stream.messages), parsed.count, now)
        if not moved:
            return
        said = "; ".join(
            f"{d!r}: {n} unacknowledged messages numbered in {old} partition(s), its route now "
            f"has {new}"
            for d, (n, old, new) in sorted(moved.items())[:3]
        )
        if allow:
            log.warning("message log %s: partition count changed (%s): per-key order is not "
                        "kept across the change, and a partition whose cursor changes may "
                        "deliver some messages twice", self.directory, said)  # fmt: skip
            return
        raise ConfigurationError(
            f"message log {self.directory}: {said}; changing a destination's partition count "
            "while it holds unacknowledged messages breaks per-key order: run with the old "
            "routes until the log is idle, or allow it explicitly (--allow-repartition)"
        )

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
            self._append([{"k": "P", "g": gid, "m": [message_obj(m) for m in durable]}], True)
        with self._lock:
            if gid in self._state.tombstones:
                raise BranchRolledBack(f"{gid} was rolled back (tombstone); it cannot prepare")
            if volatile:
                self._volatile_prepared[gid] = volatile
            self._hold_locked(messages, +1)

    def _judge(self, messages: list[Message]) -> None:
        """Every message of a record passes `check_message` before the record is written, so a
        record in the journal always replays (`InvalidMessageError` writes nothing)."""
        for message in messages:
            check_message(message, max_bytes=self.max_message_bytes)

    def commit(
        self, gid: str, messages: list[Message] | None = None, *, after_append: str = ""
    ) -> None:
        """Number and publish a prepared branch, or, with ``messages``, commit them in one phase.
        A gid that is neither prepared nor given messages is a repeat: nothing to do.
        ``after_append`` names the crash point between the durable record and publication."""
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
            self._lazy.flush()
            return
        try:
            if durable or (not one_phase and gid in self._state.prepared):
                record: dict[str, Any] = {"k": "C", "g": gid, "s": [list(n) for n in numbers]}
                if one_phase:
                    record = {
                        "k": "1",
                        "g": gid,
                        "m": [message_obj(m) for m in durable],
                        "s": record["s"],
                    }
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
            self._lazy.flush()
            on_durable()
            return
        if gid not in self._state.prepared:
            self._publish(volatile, vnumbers, [], one_phase=False, committed=gid)
            on_durable()  # volatile only, or a repeat: nothing to write
            return
        self._publish(volatile, vnumbers, [], one_phase=False)
        record = {"k": "C", "g": gid, "s": [list(n) for n in numbers]}
        payload = encode(record)
        self._gate.enter_shared()
        try:
            try:
                with self._lock:
                    ticket = self._journal.submit(payload, False)
                    self._hold_locked(self._state.prepared.get(gid, []), -1)
                    self._state.apply(record)
                    self._settling.add(gid)
                    self._committing.discard(gid)
                    self.changed.notify_all()
            except LogWriteError as exc:
                self._publish([], [], numbers, one_phase=False, committed=gid)  # burned
                raise LogWriteError(
                    f"message log {self.directory}: {exc.message}", durable=exc.durable
                ) from exc
        finally:
            self._gate.exit_shared()

        def durable_now() -> None:
            with self._lock:
                self._settling.discard(gid)
            self._publish([], [], numbers, one_phase=False)
            on_durable()

        self._lazy.watch(ticket, durable_now)
        self._journal.wait(ticket)  # only a lazy backlog past its bound waits (an fsync)
        self._compaction.maybe()
        self._lazy.settle()

    def settling_commits(self) -> int:
        """Branches committed by a lazy record not durable yet: their messages are not visible
        to a reader until it is (within ``lazy_delay``, usually with the next forced record)."""
        return len(self._settling)

    def flush_commits(self) -> None:
        """Make every lazy commit record durable now and run its callback."""
        self._lazy.flush()

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
            for (name, seq), message in zip(vnumbers, volatile, strict=True):
                self._state.stream(name).add(seq, message)
            for name, seq in [*numbers, *vnumbers]:
                self._inflight[name].discard(seq)
            if not one_phase:
                self._hold_locked(volatile, -1)
            self.version += 1
            self.changed.notify_all()

    def rollback(self, gid: str) -> None:
        """Discard a branch and leave its tombstone (a lazy record: a crash loses nothing that
        matters, since a crash also loses every unprepared branch it could refuse)."""
        with self._lock:
            volatile = self._volatile_prepared.pop(gid, [])
            self._hold_locked(volatile, -1)
        self._append([{"k": "R", "g": gid, "t": self._clock()}], force=False)

    def forget(self, gid: str) -> None:
        if gid in self._state.tombstones:
            self._append([{"k": "F", "g": gid}], force=False)

    def prepared_gids(self) -> list[str]:
        """Prepared branches, and those whose lazy commit record is not durable yet."""
        with self._lock:
            return sorted({*self._state.prepared, *self._volatile_prepared, *self._settling})

    # -- the reader's side ---------------------------------------------------------------------

    @property
    def identity(self) -> str:
        """This log's durable identity: chosen once (a uuid4's hex) by the first open of its
        directory and kept in its journal; a cursor keeps this log's streams under it."""
        identity = self._state.identity
        assert identity is not None  # written by `_open`
        return identity

    @property
    def incarnation(self) -> int:
        """This open's incarnation (its ``O`` record): above every earlier open's."""
        return self._state.incarnation

    def streams(self) -> dict[str, int]:
        """Every stream with its epoch."""
        with self._lock:
            return {name: s.epoch for name, s in self._state.streams.items()}

    def epoch(self, stream: str) -> int:
        with self._lock:
            return self._state.stream(stream).epoch

    def pending(self, stream: str, after: int = 0) -> list[tuple[int, Message]]:
        """Committed unacknowledged messages of ``stream`` numbered above ``after``, in order, up
        to the first number still being written. Cost: the messages returned, not the backlog."""
        with self._lock:
            s = self._state.streams.get(stream)
            if s is None:
                return []
            barrier = min(self._inflight.get(stream, ()), default=s.next_seq)
            newest_first = []
            for n in reversed(s.messages):
                if n <= after:
                    break
                if n < barrier:
                    newest_first.append((n, s.messages[n]))
            return newest_first[::-1]

    def sender_state(self, stream: str) -> dict[str, Any]:
        """The state `resource_managers.sequencing.StreamSender.from_dict` takes for this stream."""
        pending = self.pending(stream)
        with self._lock:
            s = self._state.stream(stream)
            top = pending[-1][0] + 1 if pending else s.acked + 1
            window = [[n, m.message_id, m.expires_at] for n, m in pending]
            return {"version": 1, "stream": stream, "epoch": s.epoch, "next_seq": top,
                    "acked": s.acked, "pending": window}  # fmt: skip

    def acknowledge(self, stream: str, epoch: int, upto: int) -> int:
        """Compact ``stream`` up to ``upto``; how many messages left. An ack of another epoch or
        of a number not visible yet is ignored (0): it cannot be about this log's messages."""
        with self._lock:
            s = self._state.streams.get(stream)
            if s is None or s.epoch != epoch or upto <= s.acked:
                return 0
            barrier = min(self._inflight.get(stream, ()), default=s.next_seq)
            if upto >= barrier:
                return 0
            if stream.endswith(VOLATILE_SUFFIX):
                return s.ack(upto)
            gone = sum(1 for seq in s.messages if seq <= upto)
        self._append([{"k": "A", "q": stream, "e": epoch, "u": upto}], force=False)
        return gone

    def get(self, stream: str, numbers: Iterable[int]) -> dict[int, Message]:
        """The visible messages of ``stream`` among ``numbers`` (acknowledged or dropped ones are
        left out): what a transfer needs to put a frame on the wire."""
        with self._lock:
            s = self._state.streams.get(stream)
            if s is None:
                return {}
            barrier = min(self._inflight.get(stream, ()), default=s.next_seq)
            return {n: m for n in numbers if n < barrier and (m := s.messages.get(n)) is not None}

    def drop(self, stream: str, epoch: int, numbers: list[int]) -> None:
        """Remove messages the transfer expired (a lazy ``D`` record: one that comes back after
        a crash has expired all the same); numbers it no longer holds are ignored."""
        with self._lock:
            s = self._state.streams.get(stream)
            if not numbers or s is None or s.epoch != epoch:
                return
        record = {"k": "D", "q": stream, "e": epoch, "l": sorted(numbers)}
        if stream.endswith(VOLATILE_SUFFIX):
            with self._lock:
                self._state.apply(record)
        else:
            self._append([record], force=False)

    def keep_refused(self, stream: str, epoch: int, seq: int, reason: str) -> Path | None:
        """The cursor refused message ``seq`` (``NACK invalid-message``): keep it whole in
        ``refused/`` (durable when this returns), so that the caller may then `drop` it from
        its stream. Returns the kept file, or None if the log no longer holds that message."""
        message = self.get(stream, [seq]).get(seq)
        if message is None or self.epoch(stream) != epoch:
            return None
        return keep_refused(self.directory, stream, epoch, seq, message=message, reason=reason)

    def drop_expired(self, stream: str, now_ms: int | None = None) -> list[tuple[int, Message]]:
        """Remove the visible messages of ``stream`` whose ``expires_at`` has passed (a lazy
        ``D`` record: one that comes back after a crash has expired all the same) and return
        them, so the transfer side can relink the stream past them (as MSMQ does)."""
        now = self._clock() if now_ms is None else now_ms
        expired = [
            (n, m)
            for n, m in self.pending(stream)
            if m.expires_at is not None and m.expires_at <= now
        ]
        if expired:
            self.drop(stream, self.epoch(stream), [n for n, _ in expired])
        return expired

    def wait(self, seen: int, timeout: float | None = None) -> int:
        """Block until ``version`` passes ``seen`` (or the timeout); return the version."""
        with self.changed:
            self.changed.wait_for(lambda: self.version != seen, timeout)
            return self.version

    # -- the journal ---------------------------------------------------------------------------

    def _append(self, records: Iterable[dict[str, Any]], force: bool) -> None:
        """Write, then apply, inside the gate (so a rollover never sees one without the other)."""
        for record in records:
            payload = encode(record)
            self._gate.enter_shared()
            try:
                try:
                    self._journal.append(payload, force)
                except LogWriteError as exc:
                    raise LogWriteError(
                        f"message log {self.directory}: {exc.message}", durable=exc.durable
                    ) from exc
                with self._lock:
                    if record["k"] in ("C", "R"):
                        self._hold_locked(self._state.prepared.get(record["g"], []), -1)
                    self._state.apply(record)
            finally:
                self._gate.exit_shared()
        self._compaction.maybe()
        if force:
            self._lazy.settle()  # the lazy commit records this force carried

    def _hold(self, messages: list[Message], delta: int) -> None:
        with self._lock:
            self._hold_locked(messages, delta)

    def _hold_locked(self, messages: list[Message], delta: int) -> None:
        for m in messages:
            self._held[m.destination] = self._held.get(m.destination, 0) + delta

    def _carry(self) -> list[bytes]:
        """Every live record, for `Compaction`; tombstones past their time are left behind."""
        with self._lock:
            carry = self._state.live_records(self._clock(), self._tombstone_ms)
            self._state.committed.clear()
            self._state.tombstones = {r["g"]: r["t"] for r in carry if r["k"] == "R"}
        return [encode(r) for r in carry]

    # -- housekeeping --------------------------------------------------------------------------

    def stats(self) -> MessageLogStats:
        j = self._journal.stats()
        with self._lock:
            pending = sum(len(s.messages) for s in self._state.streams.values())
            return MessageLogStats(
                j.forced_records, j.lazy_records, j.fsyncs, j.rollovers,
                len(self._state.prepared) + len(self._volatile_prepared),
                len(self._state.tombstones), pending, len(self._state.streams),
            )  # fmt: skip

    def journal_stats(self) -> JournalStats:
        """The journal's counters (records, fsyncs, bytes written, rollovers), for metrics."""
        return self._journal.stats()

    def pending_counts(self) -> dict[str, int]:
        """Committed unacknowledged messages per stream (the streams that have any)."""
        with self._lock:
            return {n: len(s.messages) for n, s in self._state.streams.items() if s.messages}

    def close(self) -> None:
        """Write lazy records (acknowledgments, tombstones, commits), fsync, release the lock."""
        self._lazy.close()
        self._journal.close()
        self._lazy.settle()

    def __enter__(self) -> MessageLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
