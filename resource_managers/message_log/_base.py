"""The state, values and journal discipline shared by the parts of `MessageLog` (`._log`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.errors import LogWriteError, TransactionRolledBack, TransientError
from coordinator.journal import Compaction, Gate, Journal, LazyWatch
from resource_managers.bookkeeping import carried_records

from ._records import Message, decode, encode
from ._state import LogState

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
    #: a write failed after its records were applied in memory: the store refuses writes until
    #: it is reopened (its state read back from disk); see `Journal`'s failure rules
    refusing_writes: bool = False


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Staged:
    """A staged branch: its messages, their record objects and the payload made of them (the
    commit record reuses both: one base64 and one JSON encoding per message, not two)."""

    messages: list[Message]
    objs: list[dict[str, Any]]  # the persistent messages' record objects
    payload: bytes


class LogBase:
    """What every part of `MessageLog` shares: one lock (``_lock``, with its condition
    ``changed``) over the numbering, the numbers in flight and the per-destination counts; the
    state the journal replays into; and the journal they all write through (`_append`: write,
    then apply, inside the rollover gate). ``MessageLog.__init__`` sets every attribute; the
    branch verbs (`._branches`) and the reader's side (`._reader`) are mixins of this class."""

    directory: Path
    max_message_bytes: int
    max_destination_messages: int | None
    _tombstone_ms: int
    _clock: Callable[[], int]
    _partitions: Callable[[str], int]
    _state: LogState
    _gate: Gate
    _lock: threading.Lock
    changed: threading.Condition  # notified when messages become visible
    _inflight: dict[str, set[int]]  # stream -> numbers taken whose commit is not published
    _held: dict[str, int]  # destination -> prepared-but-uncommitted messages
    _volatile_prepared: dict[str, list[Message]]
    _preparing: set[str]  # gids whose forced P is being written (a rollback then forces its R)
    _staged: dict[str, Staged]  # gid -> a carried branch (`._carried`)
    _forgetting: set[str]  # remembered gids to forget with the next record (`._carried`)
    version: int  # bumped whenever messages become visible
    _listeners: tuple[Callable[[], None], ...]  # called after each publish (`on_publish`)
    _journal: Journal
    _compaction: Compaction
    _lazy: LazyWatch
    _settling: set[str]  # gids whose lazy commit record is not durable yet
    _committing: set[str]  # gids numbered by a commit whose record is not applied

    # -- the journal ---------------------------------------------------------------------------

    def _settled(self) -> None:
        """Return once every record queued so far is durable, for a caller that found a gid
        settling (its lazy commit record queued by another caller, perhaps not yet handed to
        the `LazyWatch`, whose flush is the journal's). Raises if one is not:
        a failed write poisons the journal (``applied_when_queued``), and the branch is then
        prepared on disk; saying "committed" would let the coordinator forget a commit the disk
        does not hold."""
        try:
            self._lazy.flush()
        except LogWriteError as exc:
            raise self._located(exc) from exc

    def _located(self, exc: LogWriteError) -> LogWriteError:
        """``exc`` naming this log's directory (a journal's errors name only its file)."""
        return LogWriteError(f"message log {self.directory}: {exc.message}", durable=exc.durable)

    def _append(self, records: Iterable[dict[str, Any]], force: bool) -> None:
        """Write, then apply, inside the gate (so a rollover never sees one without the other).
        Several records (a large prepare's parts) go as one group: every one passes the size
        check before any is written, and ``force`` makes the last durable, and so all of them."""
        records = list(records)
        payloads = [encode(record) for record in records]
        self._gate.enter_shared()
        try:
            try:
                if len(payloads) == 1:
                    self._journal.append(payloads[0], force)
                else:
                    self._journal.append_many(payloads, force)
            except LogWriteError as exc:
                raise self._located(exc) from exc
            with self._lock:
                for record in records:
                    kind = record["k"]
                    if kind in ("C", "R"):
                        self._hold_locked(self._state.prepared.get(record["g"], []), -1)
                    held = len(self._state.prepared.get(record["g"], ())) if kind == "P" else 0
                    self._state.apply(record)
                    if kind == "P":  # held from the moment they are prepared, under this hold
                        # of the lock: a rollback between here and the prepare's return
                        # releases exactly what was held (a tombstone ignores the P: nothing)
                        self._hold_locked(self._state.prepared.get(record["g"], [])[held:], +1)
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
            carry = carried_records(self._state, self._clock(), self._tombstone_ms)
        return [encode(r) for r in carry]
