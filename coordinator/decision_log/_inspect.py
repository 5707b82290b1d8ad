"""Read a decision log directory for an operator, changing nothing and taking no lock.

``twopc log inspect`` and ``twopc status`` run this against the log of a live manager, so it must
never block that manager and never repair what it finds: a torn tail or a damaged record becomes a
NOTE row that says what opening the log would do (cut a torn tail) or refuse to do (anything else),
and reading goes on wherever it still can.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from coordinator.errors import LogCorruptionError
from coordinator.journal import Damage, SegmentHeader, SegmentReader, list_segments, read_current

from ._base import Decision, HeuristicRecord
from ._file import decode
from ._memory import End, Record

Row = dict[str, Any]


def inspect_log(directory: str | os.PathLike[str]) -> list[Row]:
    """One row per record, in log order: ``segment``, ``offset``, ``kind``, ``gtrid`` and the
    record's own fields (``branches``, ``deadline``, ``written_at``; ``branch``, ``outcome``,
    ``detail``, ``recorded_at``). Each segment's header is a ``SEGMENT`` row; anything wrong is a
    ``NOTE`` row whose ``note`` says what and where. An empty directory yields no rows."""
    root = Path(directory)
    if not root.is_dir():
        return [_note(None, None, f"{root} is not a directory")]
    try:
        segments = list_segments(root)
    except OSError as exc:
        return [_note(None, None, f"cannot list {root}: {exc}")]
    rows, current = _current_notes(root, segments)
    last = current if current in segments else max(segments, default=None)
    for seq, path in segments.items():
        rows.extend(_segment_rows(path, last=seq == last))
    return rows


def _current_notes(root: Path, segments: dict[int, Path]) -> tuple[list[Row], int | None]:
    """What is wrong with CURRENT, if anything, and the active segment it names."""
    try:
        current = read_current(root)
    except LogCorruptionError as exc:
        return [_note(None, None, exc.message)], None
    if current is None and segments:
        return [_note(None, None, "CURRENT is missing but segments exist")], None
    if current is not None and current not in segments:
        return [_note(None, None, f"CURRENT names segment {current}, which is missing")], current
    return [], current


def _segment_rows(path: Path, *, last: bool) -> list[Row]:
    reader = SegmentReader(path)
    rows: list[Row] = []
    try:
        for offset, payload in reader.frames():
            rows.append(_header_row(path, payload) if offset == 0 else _row(path, offset, payload))
    except OSError as exc:  # a live manager may delete a segment while we read it
        rows.append(_note(path.name, None, f"cannot read: {exc}"))
        return rows
    if reader.damage is not None:
        rows.append(_damage_note(path.name, reader.damage, last=last))
    return rows


def _header_row(path: Path, payload: bytes) -> Row:
    try:
        header = SegmentHeader.decode(payload, str(path))
    except LogCorruptionError as exc:
        return _note(path.name, 0, exc.message)
    row: Row = {"segment": path.name, "offset": 0, "kind": "SEGMENT", "gtrid": None}
    row.update(first_live=header.first_live, version=header.version)
    return row


def _row(path: Path, offset: int, payload: bytes) -> Row:
    try:
        record = decode(payload)
    except LogCorruptionError as exc:
        return _note(path.name, offset, exc.message)
    row: Row = {"segment": path.name, "offset": offset, "kind": _kind(record)}
    row.update(_fields(record))
    return row


def _kind(record: Record) -> str:
    if isinstance(record, Decision):
        return "COMMIT"
    if isinstance(record, End):
        return "END"
    if isinstance(record, HeuristicRecord):
        return "HEURISTIC"
    return "FORGET"


def _fields(record: Record) -> dict[str, Any]:
    fields = dataclasses.asdict(record)
    if "branches" in fields:
        fields["branches"] = list(fields["branches"])
    return fields


def _damage_note(segment: str, damage: Damage, *, last: bool) -> Row:
    if last and damage.torn:
        what = f"torn tail: opening the log will cut {damage.dropped_bytes} bytes here"
    else:
        what = "corruption: the log will refuse to open"
    return _note(segment, damage.offset, f"{what} ({damage.describe()})")


def _note(segment: str | None, offset: int | None, note: str) -> Row:
    return {"segment": segment, "offset": offset, "kind": "NOTE", "gtrid": None, "note": note}
