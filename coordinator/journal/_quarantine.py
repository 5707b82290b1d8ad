"""Moving aside a record that its owner cannot replay, so a journal opens again without anyone
editing a segment by hand.

Opening a journal stops at such a record with `UnreplayableRecordError` (segment, offset, record).
`quarantine` is the operator's way on: with the journal's lock held (the owner is not running),
it replays the directory read-only into a fresh owner state, checks that the record named is
exactly the first one that replay refuses (so a valid record is never moved: a wrong or stale
segment/offset is refused and nothing changes), writes that record whole to
``quarantine/<segment>@<offset>.json`` (forced), and only then rewrites its segment without it
(a temporary file, fsync, rename, directory fsync: a crash leaves the old segment or the new one,
and running the command again finishes the job). Frames carry no offsets or chain, so the records
after it are untouched.

What a moved-aside record meant is the owner's to say (the operations guide does, per store): it
is as if that write had never been made.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coordinator.crashpoints import crash_point
from coordinator.errors import LogError, UnreplayableRecordError

from ._fileops import FileOps, OsFileOps, ensure_dir, fsync_dir, replace_file
from ._framing import FRAME_HEADER, FRAME_HEADER_SIZE, MAX_RECORD_BYTES
from ._lock import acquire_lock
from ._recovery import replay_segment
from ._segment import list_segments, read_current

QUARANTINE_DIR = "quarantine"


@dataclass(frozen=True)
class Quarantined:
    """A record moved aside: where it was, why, and the file that keeps it."""

    segment: int
    offset: int
    reason: str
    payload: bytes
    kept_in: Path


def find_unreplayable(
    directory: str | os.PathLike[str], replay: Callable[[bytes], None]
) -> UnreplayableRecordError | None:
    """The first record ``replay`` (a fresh owner state's) refuses, or None: read-only, under
    the journal's lock (`LogLockedError` while the owner runs). Other damage raises as at open."""
    path = Path(directory)
    lock_fd = acquire_lock(path, OsFileOps())
    try:
        return _first_unreplayable(path, replay)
    finally:
        os.close(lock_fd)


def _first_unreplayable(
    directory: Path, replay: Callable[[bytes], None]
) -> UnreplayableRecordError | None:
    current = read_current(directory)
    if current is None:
        return None
    for seq, path in list_segments(directory).items():
        if seq <= current:
            try:
                replay_segment(path, seq, MAX_RECORD_BYTES, replay, last=seq == current)
            except UnreplayableRecordError as exc:
                return exc
    return None


def quarantine(
    directory: str | os.PathLike[str],
    replay: Callable[[bytes], None],
    segment: int,
    offset: int,
    *,
    file_ops: FileOps | None = None,
    after_keep: str = "",
) -> Quarantined:
    """Move the record at ``segment``/``offset`` aside, if it is the first one ``replay``
    refuses (else `LogError`, nothing changed). ``replay`` must belong to a fresh owner state.
    ``after_keep`` names the crash point between keeping the record and rewriting its segment
    (the command line's is ``journal.quarantine.after_keep``)."""
    path = Path(directory)
    ops = file_ops or OsFileOps()
    lock_fd = acquire_lock(path, ops)
    try:
        found = _first_unreplayable(path, replay)
        if found is None:
            raise LogError(f"every record of {path} replays: nothing to quarantine")
        if (found.segment, found.offset) != (segment, offset):
            raise LogError(
                f"segment {segment} offset {offset} is not the record {path} cannot replay: that "
                f"is segment {found.segment} offset {found.offset}; nothing was changed"
            )
        return _move_aside(path, ops, found, after_keep)
    finally:
        os.close(lock_fd)


def _move_aside(
    directory: Path, ops: FileOps, found: UnreplayableRecordError, after_keep: str
) -> Quarantined:
    segment_path = Path(found.path)
    data = segment_path.read_bytes()
    start = found.offset
    _, length, _ = FRAME_HEADER.unpack_from(data, start)
    end = start + FRAME_HEADER_SIZE + length
    payload = data[start + FRAME_HEADER_SIZE : end]
    aside = directory / QUARANTINE_DIR
    ensure_dir(ops, aside)
    kept = aside / f"{segment_path.stem}@{start}.json"
    note = {
        "segment": found.segment,
        "offset": start,
        "reason": found.reason,
        "record_base64": base64.b64encode(payload).decode("ascii"),
    }
    replace_file(ops, kept, json.dumps(note, indent=1).encode("ascii"))
    fsync_dir(ops, aside)
    if after_keep:
        crash_point(after_keep)
    replace_file(ops, segment_path, data[:start] + data[end:])
    fsync_dir(ops, directory)
    return Quarantined(found.segment, start, found.reason, payload, kept)


__all__ = ["QUARANTINE_DIR", "Quarantined", "find_unreplayable", "quarantine"]
