"""The cursor's values and errors: what a receive hands out (`Delivery`), its counters
(`CursorStats`), its refusals (`LogFencedError`, `BranchRolledBack`) and its defaults."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import FencedError, TransactionRolledBack
from resource_managers.message_log import Message

from ._records import decode
from ._state import CursorState, Entry

DEFAULT_TOMBSTONE_SECONDS = 24 * 3600
DEFAULT_MAX_DELIVERIES = 5
#: How long the cursor's lazy records (transfer ``M``s, carried and phase-two ``C``s, ``H``s)
#: wait for a forced record to carry them before the cursor fsyncs them itself. The message log
#: waits 2 ms, because a reader sees a committed message only once its record is on disk. Here
#: nothing anyone waits for next hangs on it: an accepted message is available at once, and a
#: consumed one gone at once (the database's commit decided it); what waits is the log's copy
#: (acknowledged once the ``M`` is on disk; its resend timer starts at 0.5 s) and the decision
#: row or record (deleted once the ``C`` is). With both branches riding the database's commits
#: the cursor has no forced record in its steady state, so this fsync is its group commit: 20 ms
#: makes it at most 50 a second. At one message per transaction that took four fifths of the
#: cursor's fsyncs away and a tenth to a sixth of the consumer process's CPU
#: (`bench/messaging_threads.py`); the price, a few more forced ``H`` records (an arrival not yet
#: on disk cannot be pre-counted), is far smaller.
DEFAULT_LAZY_DELAY = 0.02


def shown(entry: Entry) -> int:
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
        m = self.message
        if m.headers:
            if type(m) is Message:  # what replace() builds, without its generic walk
                copy = Message(m.message_id, m.destination, m.body, dict(m.headers),
                               m.persistent, m.expires_at)  # fmt: skip
            else:
                copy = dataclasses.replace(m, headers=dict(m.headers))
            object.__setattr__(self, "message", copy)

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
    #: a write failed after its records were applied in memory: the store refuses writes until
    #: it is reopened (its state read back from disk); see `Journal`'s failure rules
    refusing_writes: bool = False
