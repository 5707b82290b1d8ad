"""`Journal`: a segmented, group-committed, append-only log of opaque records.

Written once for the decision log, the message log and the cursor store. It knows nothing of what
the records mean; its owner replays them on open and says, at rollover, which ones are still live.

Failure rules, in one place because a caller's safety depends on them:
- a failed write is cut back to where its batch began and fsync'd; every record of the batch gets
  ``LogWriteError(durable=False)`` (certainly not in the log) and the journal stays usable, unless
  its owner applies records when it queues them (``applied_when_queued``): that owner's memory now
  holds what the disk does not, so the journal is poisoned as below, and a reopen reads the state
  back from the file;
- a failed fsync gives ``durable=None`` (may or may not be on disk) and poisons the journal: after
  an fsync error the kernel may have dropped dirty pages and cleared the error, so nothing written
  later can be trusted until the journal is reopened and the file read back;
- so does a failed cut-back, and an active segment found unlinked under us.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from coordinator import crashpoints
from coordinator.errors import LogError, LogWriteError

from ._fileops import FileOps, OsFileOps, create_file, ensure_dir, fsync_dir, replace_file
from ._framing import JOURNAL_KINDS, MAX_RECORD_BYTES, SegmentHeader, encode_frame
from ._group_commit import GroupCommit, Ticket
from ._lock import acquire_lock
from ._recovery import Active, open_directory
from ._segment import CURRENT, current_contents, list_segments, segment_name

log = logging.getLogger("twopc.journal")

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024


@dataclass
class JournalStats:
    forced_records: int = 0
    lazy_records: int = 0
    batches: int = 0
    fsyncs: int = 0
    dir_fsyncs: int = 0
    bytes_written: int = 0
    truncated_bytes: int = 0
    rollovers: int = 0
    active_segment: int = 0


class Journal:
    """An append-only journal in ``directory``, locked against a second live writer.

    Opening replays every record, oldest first, to ``replay``; a replayed record may be a duplicate
    (carried by a rollover that crashed before deleting the old segment), so the owner must apply
    records idempotently. Thread-safe. Usable as a context manager.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        replay: Callable[[bytes], None] | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        group_commit: bool = True,
        file_ops: FileOps | None = None,
        max_record_bytes: int = MAX_RECORD_BYTES,
        kind: str = "",
        applied_when_queued: bool = False,
    ) -> None:
        if not 0 < max_record_bytes <= MAX_RECORD_BYTES:
            raise ValueError(f"max_record_bytes must be in 1..{MAX_RECORD_BYTES}")
        if kind and kind not in JOURNAL_KINDS:
            raise ValueError(f"kind must be one of {JOURNAL_KINDS}, not {kind!r}")
        #: what this journal is (`JOURNAL_KINDS`), written into every segment's header and
        #: checked against every header read: a store opened on another store's directory
        #: stops with `WrongJournalError` instead of reporting damage
        self.kind = kind
        self.directory = Path(directory)
        self._ops: FileOps = file_ops if file_ops is not None else OsFileOps()
        self._segment_bytes = segment_bytes
        self._max_record = max_record_bytes
        self._stats = JournalStats()
        self._poison: str | None = None
        #: the owner applies a record to its state when it queues it (`submit`), before the write:
        #: a failed write, even one cut back cleanly, leaves that state ahead of the disk, so it
        #: poisons the journal (nothing later may be written on top of what memory assumes)
        self._applied_when_queued = applied_when_queued
        self._shut = False
        self._close_lock = threading.Lock()
        self._closed = False
        self._lock_fd = self._open_locked(replay or (lambda payload: None))
        self._committer = GroupCommit(self._write_batch, grouped=group_commit)

    def _open_locked(self, replay: Callable[[bytes], None]) -> int:
        try:
            ensure_dir(self._ops, self.directory)
            lock_fd = acquire_lock(self.directory, self._ops)
        except OSError as exc:
            raise LogError(f"cannot open journal {self.directory}: {exc}") from exc
        try:
            # Read with the format's limit, not our append limit: records an earlier process was
            # allowed to write must stay readable whatever this one is configured to append.
            opened = open_directory(self.directory, self._ops, MAX_RECORD_BYTES, replay, self.kind)
        except BaseException as exc:
            os.close(lock_fd)
            if isinstance(exc, OSError):
                raise LogError(f"cannot open journal {self.directory}: {exc}") from exc
            raise
        self._active: Active = opened.active
        self._stats.truncated_bytes = opened.truncated_bytes
        self._stats.dir_fsyncs = opened.dir_fsyncs
        self._stats.active_segment = opened.active.seq
        return lock_fd

    # -- appending ---------------------------------------------------------------------------

    def append(self, payload: bytes, force: bool = True) -> None:
        """Append one record. Forced: returns once it is durable. Lazy: returns at once; it is
        written with the next forced group, `flush` or `close`, and lost if we crash first."""
        self._committer.submit(self._frame(payload), force)

    def append_many(self, payloads: Sequence[bytes], force: bool = True) -> None:
        """`append` of several records at once, in order, in one group (counted as lazy records
        and, if ``force``, a forced last one): a batch costs one queue entry, not one each.
        Every record passes the size check before any is queued."""
        frames = [self._frame(payload) for payload in payloads]
        if frames:
            self._committer.submit(b"".join(frames), force, len(frames))

    def submit(self, payload: bytes, force: bool = True) -> Ticket:
        """`append` in two halves, for a caller whose state must follow the journal's order:
        queue the record now (under the caller's lock, where it applies the record too), then
        `wait` for it outside that lock. The journal writes records in the order they were
        queued, so the caller's state and a replay see them in the same order."""
        return self._committer.enqueue(self._frame(payload), force)

    def submit_many(self, payloads: Sequence[bytes], force: bool = True) -> Ticket:
        """`submit` of several records as one queue entry (see `append_many`); ``payloads`` must
        not be empty."""
        frames = [self._frame(payload) for payload in payloads]
        return self._committer.enqueue(b"".join(frames), force, len(frames))

    def _frame(self, payload: bytes) -> bytes:
        """The checks every appended record passes, then its frame."""
        if len(payload) > self._max_record:
            raise LogWriteError(
                f"record of {len(payload)} bytes exceeds the journal's limit of "
                f"{self._max_record}; nothing was written",
                durable=False,
            )
        if self._poison is not None:
            raise self._poisoned_error()
        return encode_frame(payload)

    def wait(self, ticket: Ticket) -> None:
        """Return once a forced record of `submit` is durable (at once for a lazy one)."""
        self._committer.wait(ticket)

    def flush(self) -> None:
        """Make every record appended so far durable, lazy ones included. Raises if one may not
        be: a poisoned journal raises even with nothing queued, since the records of the batch
        that poisoned it were queued before this call and are not on disk."""
        self._committer.sync()
        if self._poison is not None:
            raise self._poisoned_error()

    @property
    def needs_rollover(self) -> bool:
        """The active segment is past ``segment_bytes`` and at least twice what it started with, so
        a large set of live records cannot make every append trigger another rollover."""
        active = self._active
        return active.size >= self._segment_bytes and active.size >= 2 * active.base

    @property
    def truncated_bytes(self) -> int:
        return self._stats.truncated_bytes

    @property
    def poisoned(self) -> bool:
        return self._poison is not None

    def stats(self) -> JournalStats:
        stats = dataclasses.replace(self._stats)
        stats.forced_records = self._committer.forced_records
        stats.lazy_records = self._committer.lazy_records
        return stats

    def _write_batch(self, frames: list[bytes]) -> None:
        """One group: one write, one fsync. Runs in the leader, which alone touches the file."""
        data = b"".join(frames)
        if not data:
            return
        active = self._writable_segment()
        start = active.size
        crashpoints.crash_point("log.before_write")
        try:
            self._write(active.fd, data, start)
        except OSError as exc:
            self._cut_back(active, start, exc)
        active.size = start + len(data)
        crashpoints.crash_point("log.after_write")
        self._fsync_batch(active)
        crashpoints.crash_point("log.after_fsync")
        self._stats.batches += 1
        self._stats.bytes_written += len(data)

    def _writable_segment(self) -> Active:
        if self._shut:
            raise LogWriteError(f"journal {self.directory} is closed", durable=False)
        if self._poison is not None:
            raise self._poisoned_error()
        active = self._active
        try:
            unlinked = os.fstat(active.fd).st_nlink == 0
        except OSError as exc:
            self._poison_with(f"cannot stat {active.path}: {exc}")
            raise LogWriteError(self._poison or "", durable=False) from exc
        if unlinked:
            self._poison_with(f"active segment {active.path} was deleted while open")
            raise LogWriteError(
                f"{self._poison}; nothing written to it could be durable", durable=False
            )
        return active

    def _write(self, fd: int, data: bytes, offset: int) -> None:
        if crashpoints.is_armed("log.torn_write"):
            half = len(data) // 2
            self._ops.write(fd, data[:half], offset)
            crashpoints.crash_point("log.torn_write")
            data, offset = data[half:], offset + half
        self._ops.write(fd, data, offset)

    def _cut_back(self, active: Active, start: int, exc: OSError) -> None:
        """Undo a failed write before telling anyone it failed: a partial batch left on disk
        could hold whole records that would come back on replay after we said durable=False."""
        try:
            self._ops.truncate(active.fd, start)
            self._ops.fsync(active.fd)
        except OSError as undo:
            self._poison_with(f"write to {active.path} failed ({exc}); cutting it back failed too")
            raise LogWriteError(
                f"{self._poison} ({undo}); the batch may or may not be on disk", durable=None
            ) from exc
        self._stats.fsyncs += 1
        log.error("journal: write to %s failed and was cut back: %s", active.path, exc)
        if self._applied_when_queued:
            self._poison_with(
                f"write to {active.path} failed ({exc}) after its records were applied in memory"
            )
        raise LogWriteError(
            f"write to {active.path} failed ({exc}); no record of this batch is in the log",
            durable=False,
        ) from exc

    def _fsync_batch(self, active: Active) -> None:
        try:
            self._ops.fsync(active.fd)
        except OSError as exc:
            self._poison_with(f"fsync of {active.path} failed ({exc})")
            raise LogWriteError(
                f"{self._poison}; the batch may or may not be on disk", durable=None
            ) from exc
        self._stats.fsyncs += 1

    def _poison_with(self, reason: str) -> None:
        if self._poison is None:
            self._poison = reason
            log.error("journal %s refuses writes until reopened: %s", self.directory, reason)

    def _poisoned_error(self) -> LogWriteError:
        return LogWriteError(
            f"journal {self.directory} refuses writes until reopened: {self._poison}",
            durable=False,
        )

    # -- rollover ----------------------------------------------------------------------------

    def rollover(self, carry: Iterable[bytes]) -> None:
        """Start a new segment holding ``carry`` (every record still live), then delete the old.

        The caller must make ``carry`` complete: every live record appended so far, with no
        append in flight whose record it would miss. Raises `LogWriteError`: ``durable=False`` if
        the rollover did not happen (the journal is as it was and usable), ``durable=None`` if
        CURRENT may or may not have moved (the journal is poisoned; both segments are whole, so
        a reopen finds everything either way).
        """
        frames = [self._carry_frame(payload) for payload in carry]
        with self._committer.exclusive() as error:
            if error is not None:
                raise error
            old = self._writable_segment()
            new = self._create_segment(old.seq + 1, frames)
            self._point_current_at(new)
            crashpoints.crash_point("log.during_compaction")
            self._active = new
            self._stats.rollovers += 1
            self._stats.active_segment = new.seq
            with contextlib.suppress(OSError):
                os.close(old.fd)
            self._delete_before(new.seq)

    def _carry_frame(self, payload: bytes) -> bytes:
        if len(payload) > self._max_record:
            raise LogWriteError(f"carried record of {len(payload)} bytes is too big", durable=False)
        return encode_frame(payload)

    def _create_segment(self, seq: int, frames: list[bytes]) -> Active:
        path = self.directory / segment_name(seq)
        data = encode_frame(SegmentHeader(seq, seq, self.kind).encode()) + b"".join(frames)
        try:
            fd = create_file(self._ops, path, data)
        except OSError as exc:
            raise LogWriteError(f"cannot create {path}: {exc}", durable=False) from exc
        self._stats.fsyncs += 1
        self._stats.bytes_written += len(data)
        try:
            self._fsync_dir()
        except OSError as exc:
            os.close(fd)
            self._unlink_quietly(path)
            raise LogWriteError(f"cannot fsync {self.directory}: {exc}", durable=False) from exc
        return Active(seq, path, fd, len(data), len(data))

    def _point_current_at(self, new: Active) -> None:
        try:
            replace_file(self._ops, self.directory / CURRENT, current_contents(new.seq))
        except OSError as exc:
            os.close(new.fd)
            self._unlink_quietly(new.path)
            raise LogWriteError(f"cannot update CURRENT: {exc}", durable=False) from exc
        try:
            self._fsync_dir()
        except OSError as exc:
            # CURRENT names old or new on disk, we cannot tell which, so we may append to neither.
            os.close(new.fd)
            self._poison_with(f"fsync of {self.directory} after renaming CURRENT failed ({exc})")
            raise LogWriteError(self._poison or "", durable=None) from exc

    def _delete_before(self, seq: int) -> None:
        """Delete superseded segments, oldest first. A failure here loses nothing (the files are
        replayed as duplicates next time), so it is logged, not raised."""
        try:
            for old_seq, path in list_segments(self.directory).items():
                if old_seq < seq:
                    path.unlink(missing_ok=True)
            self._fsync_dir()
        except OSError as exc:
            log.warning("journal: could not delete old segments of %s: %s", self.directory, exc)

    def _fsync_dir(self) -> None:
        fsync_dir(self._ops, self.directory)
        self._stats.dir_fsyncs += 1

    def _unlink_quietly(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
            self._fsync_dir()

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Write and fsync lazy records, then release the files and the lock. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        error: LogWriteError | None = None
        try:
            with self._committer.exclusive() as error:
                self._shut_down()  # inside the leader role: no write can be running now
        finally:
            self._shut_down()
            with contextlib.suppress(OSError):
                os.close(self._active.fd)
            os.close(self._lock_fd)
        if error is not None:
            raise error

    def _shut_down(self) -> None:
        self._committer.refuse(f"journal {self.directory} is closed")
        self._shut = True

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
