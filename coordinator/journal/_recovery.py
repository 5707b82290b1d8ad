"""Opening a journal directory: check it, replay it, and only then repair it.

Everything is read and judged before anything is changed. A torn tail of the active segment is the
one damage we repair, because only there can a crash have cut a write short whose caller was never
told it was durable. Every other kind of damage means records we acknowledged may be unreadable,
so we refuse with `LogCorruptionError` and leave every byte as it was for an operator to examine.

Leftovers we do clean, because their contents are known to be redundant:
- segments older than the active segment's ``first_live`` (a compaction that crashed before
  deleting them): everything live in them was carried forward; they are replayed first anyway,
  which only repeats records, then deleted;
- the segment right after the active one (a rollover that crashed before CURRENT named it): it holds
  only carried copies, because nothing is appended to a segment before CURRENT names it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coordinator.errors import TransactionError, UnreplayableRecordError, WrongJournalError

from ._fileops import FileOps, create_file, fsync_dir, replace_file
from ._framing import FRAME_HEADER_SIZE, SegmentHeader, corruption, encode_frame
from ._segment import (
    CURRENT,
    Damage,
    SegmentReader,
    current_contents,
    list_segments,
    read_current,
    segment_name,
)

log = logging.getLogger("twopc.journal")

Replay = Callable[[bytes], None]


@dataclass
class Active:
    """The segment appends go to. ``base`` is its size right after creation (header and carry)."""

    seq: int
    path: Path
    fd: int
    size: int
    base: int


@dataclass
class Opened:
    active: Active
    truncated_bytes: int
    dir_fsyncs: int


def open_directory(
    directory: Path, ops: FileOps, max_record: int, replay: Replay, kind: str = ""
) -> Opened:
    """Replay every record to ``replay`` in order and return the segment to append to."""
    segments = list_segments(directory)
    current = read_current(directory)
    if current is None:
        return _start_fresh(directory, ops, segments, max_record, kind)
    header = _check_layout(directory, segments, current, max_record, kind)
    first_live = header.first_live
    damage: Damage | None = None
    end = 0
    for seq, path in segments.items():
        if seq <= current:
            damage, end = replay_segment(
                path, seq, max_record, replay, last=seq == current, kind=kind
            )
    truncated = _cut_torn_tail(ops, segments[current], damage)
    stale = [path for seq, path in segments.items() if seq > current or seq < first_live]
    dir_fsyncs = _remove_stale(directory, ops, stale)
    fd = os.open(segments[current], os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    header_size = FRAME_HEADER_SIZE + len(header.encode())  # a version 1 header is shorter
    return Opened(Active(current, segments[current], fd, end, header_size), truncated, dir_fsyncs)


def _check_layout(
    directory: Path, segments: dict[int, Path], current: int, max_record: int, kind: str
) -> SegmentHeader:
    """Refuse a directory whose set of segments cannot be the result of our own writes (or that
    holds another kind of journal); return the current segment's header."""
    if current not in segments:
        reason = f"CURRENT names {segment_name(current)}, which is missing"
        raise corruption(str(directory / CURRENT), None, reason)
    newer = [seq for seq in segments if seq > current + 1]
    if newer:
        reason = f"segment is newer than the one CURRENT names ({current})"
        raise corruption(str(segments[newer[0]]), None, reason)
    header = _read_header(segments[current], current, max_record, kind)
    first_live = header.first_live
    missing = [seq for seq in range(first_live, current) if seq not in segments]
    if missing:
        raise corruption(
            str(directory / segment_name(missing[0])),
            None,
            f"segment is missing, yet {segment_name(current)} still needs every segment "
            f"from {first_live}",
        )
    return header


def _read_header(path: Path, seq: int, max_record: int, kind: str) -> SegmentHeader:
    reader = SegmentReader(path, max_record)
    frames = reader.frames()
    try:
        return _check_header(reader, next(frames, None), seq, kind)
    finally:
        frames.close()  # closes the file now, not whenever the generator is collected


def _check_header(
    reader: SegmentReader, first: tuple[int, bytes] | None, seq: int, kind: str
) -> SegmentHeader:
    """A segment must open with its own header: anything else is not a file we wrote whole. A
    header naming another kind of journal than ``kind`` means the wrong directory."""
    path = str(reader.path)
    if first is None:
        reason = reader.damage.describe() if reader.damage else "empty file"
        raise corruption(path, 0, f"segment header unreadable: {reason}")
    header = SegmentHeader.decode(first[1], path)
    if header.seq != seq:
        raise corruption(path, 0, f"header says segment {header.seq}, file name says {seq}")
    if kind and header.kind and header.kind != kind:
        raise WrongJournalError(
            f"{reader.path.parent} holds a {header.kind} journal, not a {kind} one: the "
            "directory is wrong (no file was changed)",
            path=path,
            found=header.kind,
            expected=kind,
        )
    return header


def replay_segment(
    path: Path, seq: int, max_record: int, replay: Replay, *, last: bool, kind: str = ""
) -> tuple[Damage | None, int]:
    """Deliver one segment's records; return its torn tail (only allowed if last) and sound end."""
    reader = SegmentReader(path, max_record)
    frames = reader.frames()
    _check_header(reader, next(frames, None), seq, kind)
    for offset, payload in frames:
        try:
            replay(payload)
        except Exception as exc:  # whatever the owner raises: this record stops the open
            raise unreplayable(path, seq, offset, payload, exc) from exc
    damage = reader.damage
    if damage is not None and not (last and damage.torn):
        where = "" if last else " (not the last segment, where no write can have been cut short)"
        raise corruption(str(path), damage.offset, damage.describe() + where)
    return damage, reader.end


def unreplayable(
    path: Path, seq: int, offset: int, payload: bytes, exc: Exception
) -> UnreplayableRecordError:
    """The error naming a record the owner's replay refused: where it is, what it holds, why,
    and the command that moves it aside."""
    reason = exc.message if isinstance(exc, TransactionError) else f"{type(exc).__name__}: {exc}"
    record = payload[:200].decode("ascii", "backslashreplace")
    return UnreplayableRecordError(
        f"journal record cannot be replayed: {path} (segment {seq}) at offset {offset}: "
        f"{reason}; record {record!r}; no file was changed. Move it aside with `twopc journal "
        f"quarantine --dir {path.parent} --segment {seq} --offset {offset} --kind KIND`",
        path=str(path), segment=seq, offset=offset, record=record, reason=reason,
    )  # fmt: skip


def _cut_torn_tail(ops: FileOps, path: Path, damage: Damage | None) -> int:
    if damage is None:
        return 0
    fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        ops.truncate(fd, damage.offset)
        ops.fsync(fd)
    finally:
        os.close(fd)
    log.warning(
        "journal: dropped a torn tail of %d bytes from %s at offset %d (%s)",
        damage.dropped_bytes,
        path,
        damage.offset,
        damage.reason,
    )
    return damage.dropped_bytes


def _remove_stale(directory: Path, ops: FileOps, stale: list[Path]) -> int:
    for path in stale:
        log.warning("journal: removing %s, left over by an interrupted rollover", path)
        path.unlink()
    if not stale:
        return 0
    fsync_dir(ops, directory)
    return 1


def _start_fresh(
    directory: Path, ops: FileOps, segments: dict[int, Path], max_record: int, kind: str
) -> Opened:
    """A new log: segment 1, then CURRENT naming it (in that order, so CURRENT never dangles)."""
    if segments and not _abandoned_start(segments, max_record):
        reason = f"CURRENT is missing but {len(segments)} segment(s) exist"
        raise corruption(str(directory / CURRENT), None, reason)
    for path in segments.values():
        log.warning("journal: removing %s, left over by an interrupted first start", path)
        path.unlink()
    path = directory / segment_name(1)
    data = encode_frame(SegmentHeader(1, 1, kind).encode())
    fd = create_file(ops, path, data)
    try:
        fsync_dir(ops, directory)
        replace_file(ops, directory / CURRENT, current_contents(1))
        fsync_dir(ops, directory)
    except BaseException:
        os.close(fd)
        raise
    return Opened(Active(1, path, fd, len(data), len(data)), 0, 2)


def _abandoned_start(segments: dict[int, Path], max_record: int) -> bool:
    """True for the remains of a first start that died before writing CURRENT: segment 1 alone,
    holding at most its header, so no record can be in it."""
    if list(segments) != [1]:
        return False
    reader = SegmentReader(segments[1], max_record)
    only_header = all(offset == 0 for offset, _ in reader.frames())  # reads to the end or damage
    return only_header and (reader.damage is None or reader.damage.torn)
