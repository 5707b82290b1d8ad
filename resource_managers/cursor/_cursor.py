"""`Cursor`: the durable store of the delivery side, on the coordinator's `Journal`.

Per destination a FIFO of accepted messages available to consumers (arrival order, so a single
consumer sees each stream in order); the messages handed to branches (gid -> ids); the filter
state (last accepted epoch and number per stream), rebuilt on open; delivery counts.

One class over one lock and one state, written by concern (each a mixin of `._base.CursorBase`):
`._intake` (messages from the transfers), `._xa` (the consumer branches' verbs and the delivery
counts), `._subscriptions` and `._dispatch` (topics), `._dead_letters` (queue kinds, dead
letters), `._queues` (operator tools). This module opens the journal, replays it, and closes.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from coordinator.errors import LogWriteError, ProgrammingError
from coordinator.journal import (
    DEFAULT_SEGMENT_BYTES,
    Compaction,
    FileOps,
    Gate,
    Journal,
    LazyWatch,
)
from resource_managers.sequencing import StreamFilter

from ._base import log
from ._carried import CarriedOps
from ._dead_letters import DeadLetterOps
from ._dispatch import DispatchOps
from ._intake import Intake
from ._precount import DEFAULT_PRECOUNT
from ._queues import QueueOps
from ._records import decode
from ._state import CursorState
from ._subscriptions import SubscriptionOps
from ._values import (
    DEFAULT_LAZY_DELAY,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_TOMBSTONE_SECONDS,
    CursorStats,
    Delivery,
    now_ms,
    shown,
)
from ._xa import BranchOps


class Cursor(Intake, CarriedOps, BranchOps, SubscriptionOps, DispatchOps, DeadLetterOps, QueueOps):
    """Accepted messages in ``directory``, locked to this process. Thread-safe; a context manager.

    ``max_deliveries`` applies to the branches found handed out (not prepared) at open, which are
    rolled back then; `CursorResource` passes its own to each rollback. ``precount``: how many
    waiting messages per queue a consumer's forced record pre-counts (`._precount`; 0: none, every
    receive forces its own ``H``). ``lazy_delay``: how long a lazy record waits for a forced one
    to carry it before the cursor fsyncs it itself (`DEFAULT_LAZY_DELAY`: longer than the
    message log's, since no one's next step waits on it)."""

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
        self._stream_locks = {}
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # notified when messages become available
        self._attached = Counter()  # subscription queue -> subscribers attached
        self._take_lock = threading.Lock()  # one publication taken at a time
        self._journal = Journal(
            self.directory,
            replay=self._replay,
            segment_bytes=segment_bytes,
            file_ops=file_ops,
            kind="cursor",
            applied_when_queued=True,  # `_submit_locked`, `deliver_lazily`
        )
        self._compaction = Compaction(
            self._journal, self._gate, self._carry, f"cursor {self.directory}", log
        )
        self._lazy = LazyWatch(self._journal, delay=lazy_delay, name=f"cursor {directory}")
        self._settling = set()  # gids whose lazy commit record is not durable yet
        self._last_accept = None  # the newest lazy M record (`deliver_lazily`)
        self._staged, self._forgetting, self._arrivals = {}, set(), deque()
        self._carrier_lock, self._closing = threading.Lock(), False
        #: a crash may have lost carried commits of these nodes: nothing goes out until their
        #: recovery restored them (`._carried`)
        self._awaiting = set(self._state.carriers)
        if self._awaiting:
            log.warning(
                "cursor %s: hands nothing out until the recovery of coordinator node(s) %s has "
                "restored the carried commits a crash may have lost here (a TransactionManager "
                "with that node id and this resource, recovering on start)",
                self.directory,
                ", ".join(sorted(self._awaiting)),
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

    # -- inspection ----------------------------------------------------------------------------

    def available(self, queue: str) -> list[Delivery]:
        """The messages ``queue`` would hand out now, in order (their counts so far; a
        pre-count this process holds a credit for is not counted until its delivery)."""
        with self._lock:
            entries = [self._state.entries[m] for m in self._state.available.get(queue, ())]
            return [Delivery(e.message, shown(e), e.queue, e.reason) for e in entries]

    def delivery_count(self, message_id: str) -> int | None:
        with self._lock:
            entry = self._state.entries.get(message_id)
            return None if entry is None else shown(entry)

    # -- housekeeping --------------------------------------------------------------------------

    def stats(self) -> CursorStats:
        j = self._journal.stats()
        with self._lock:
            s = self._state
            return CursorStats(
                j.forced_records, j.lazy_records, j.fsyncs, j.rollovers,
                sum(len(ids) for ids in s.available.values()),
                sum(len(ids) for ids in s.handed.values()),
                len(s.prepared), len(s.tombstones), self._journal.poisoned,
            )  # fmt: skip

    def close(self) -> None:
        """Give back unused pre-counts (a lazy ``G``), clear the carriers (a lazy ``O``) if
        nothing is staged, write lazy records (rollbacks, forgets, commits), fsync, release the
        lock."""
        self._clear_carriers()
        self._give_back_credits()
        self._lazy.close()
        try:
            self._journal.close()
        except LogWriteError as exc:  # lazy records only: as a crash would leave them
            log.error("cursor %s: closed without its last lazy records: %s", self.directory, exc)
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
