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

One class over one lock and one journal, written by concern (each a mixin of `._base.LogBase`):
`._branches` (prepare, commit, numbering), `._reader` (what a transfer reads, acknowledges and
drops). This module opens the journal (the ``O`` record, the partition check) and closes it.
"""

from __future__ import annotations

import os
import secrets
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from coordinator.crashpoints import crash_point
from coordinator.errors import ConfigurationError, LogWriteError, ProgrammingError
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

from ._base import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TOMBSTONE_SECONDS,
    MessageLogStats,
    Staged,
    log,
    now_ms,
)
from ._branches import BranchOps
from ._carried import CarriedOps
from ._partition import parse_stream
from ._reader import ReaderOps
from ._records import Message, decode
from ._state import LogState

#: the random low bits of an incarnation (`MessageLog._open`)
INCARNATION_BITS = 20


def _random_bits() -> int:
    return secrets.randbits(INCARNATION_BITS)


class MessageLog(BranchOps, CarriedOps, ReaderOps):
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
        self._preparing: set[str] = set()  # gids whose forced P is being written
        self._staged: dict[str, Staged] = {}  # carried branches (`._carried`)
        self._forgetting: set[str] = set()  # forgets waiting for a record (`._carried`)
        self.version = 0  # bumped whenever messages become visible
        self._listeners: tuple[Callable[[], None], ...] = ()  # `on_publish`
        self._journal = Journal(
            self.directory,
            replay=self._replay,
            segment_bytes=segment_bytes,
            file_ops=file_ops,
            kind="message-log",
            applied_when_queued=True,  # `_submit_settling`, `rollback`, the lazy records
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
        trace of the identity, and the next open chooses again. Parts of a prepare whose last
        part never reached the journal (a crash in between) prepared nothing: they go."""
        self._state.parts.clear()
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

    # -- housekeeping --------------------------------------------------------------------------

    def stats(self) -> MessageLogStats:
        j = self._journal.stats()
        with self._lock:
            pending = sum(len(s.messages) for s in self._state.streams.values())
            return MessageLogStats(
                j.forced_records, j.lazy_records, j.fsyncs, j.rollovers,
                len(self._state.prepared) + len(self._volatile_prepared),
                len(self._state.tombstones), pending, len(self._state.streams),
                self._journal.poisoned,
            )  # fmt: skip

    def journal_stats(self) -> JournalStats:
        """The journal's counters (records, fsyncs, bytes written, rollovers), for metrics."""
        return self._journal.stats()

    def pending_counts(self) -> dict[str, int]:
        """Committed unacknowledged messages per stream (the streams that have any)."""
        with self._lock:
            return {n: len(s.messages) for n, s in self._state.streams.items() if s.messages}

    def close(self) -> None:
        """Write lazy records (acknowledgments, tombstones, commits, forgets), fsync, release the
        lock."""
        try:
            self.flush_forgets()
        except Exception:  # a forget lost is repeated by recovery; the close must go on
            log.warning("message log %s: pending forgets not written", self.directory)
        self._lazy.close()
        try:
            self._journal.close()
        except LogWriteError as exc:  # lazy records only: as a crash would leave them
            log.error(
                "message log %s: closed without its last lazy records: %s", self.directory, exc
            )
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
