"""Read a decision log directory for an operator, changing nothing and taking no lock.

``twopc log inspect`` and ``twopc status`` run this against the log of a live manager, so it must
never block that manager and never repair what it finds: a torn tail or a damaged record becomes a
NOTE row that says what opening the log would do (cut a torn tail) or refuse to do (anything else),
and reading goes on wherever it still can.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from coordinator.errors import LogCorruptionError
from coordinator.journal import Damage, SegmentHeader, SegmentReader, list_segments, read_current

from ._base import Decision, HeuristicRecord
from ._file import decode
from ._memory import End, Record

Row = dict[str, Any]
#: one record's payload as a row (``kind`` and the record's fields); raises on a record it does
#: not recognise, which is how an older journal without a kind in its headers is told apart
Decoder = Callable[[bytes], Row]
DECISION_LOG = "decision-log"


def inspect_log(
    directory: str | os.PathLike[str], decoders: Mapping[str, Decoder] | None = None
) -> list[Row]:
    """One row per record, in log order: ``segment``, ``offset``, ``kind`` and the record's own
    fields (a decision log's: ``gtrid``, ``branches``, ``deadline``, ``written_at``; ``branch``,
    ``outcome``, ``detail``, ``recorded_at``). Each segment's header is a ``SEGMENT`` row naming
    its ``journal`` kind; anything wrong is a ``NOTE`` row whose ``note`` says what and where, and
    reading goes on after a damaged frame from the next valid one. An empty directory yields no
    rows.

    ``decoders`` adds the records of other journals by kind (``message-log``, ``cursor``: the
    command line finds them as ``twopc.journals`` entry points); a decision log's are built in.
    The journal's kind is the one its segment headers name; a journal written before headers
    named it is read by the first decoder that reads every one of its records."""
    root = Path(directory)
    if not root.is_dir():
        return [_note(None, None, f"{root} is not a directory")]
    try:
        segments = list_segments(root)
    except OSError as exc:
        return [_note(None, None, f"cannot list {root}: {exc}")]
    rows, current = _current_notes(root, segments)
    last = current if current in segments else max(segments, default=None)
    read: list[tuple[str, int, bytes]] = []  # every record's (segment, offset, payload)
    for seq, path in segments.items():
        rows.extend(_segment_rows(path, read, last=seq == last))
    named = [row["journal"] for row in rows if row["kind"] == "SEGMENT" and row.get("journal")]
    known = {DECISION_LOG: _decision_row, **(decoders or {})}
    kind = named[0] if named else _guess(known, [payload for _, _, payload in read])
    decode_row = known.get(kind)
    for segment, offset, payload in read:
        rows.append(_record_row(decode_row, kind, segment, offset, payload))
    rows.sort(key=_position)
    return rows


def _guess(known: Mapping[str, Decoder], payloads: list[bytes]) -> str:
    """The first kind whose decoder reads every record (a decision log's first)."""
    for kind, decode_row in known.items():
        try:
            for payload in payloads:
                decode_row(payload)
        except Exception:  # any refusal: not this kind
            continue
        return kind
    return DECISION_LOG


def _position(row: Row) -> tuple[str, int]:
    return (row["segment"] or "", -1 if row["offset"] is None else row["offset"])


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


def _segment_rows(path: Path, read: list[tuple[str, int, bytes]], *, last: bool) -> list[Row]:
    """The segment's header row and damage notes; its records go to ``read``. After a damaged
    frame, reading goes on from the next valid one (what an operator needs to see: the records
    the damage would strand)."""
    rows: list[Row] = []
    start = 0
    while True:
        reader = SegmentReader(path)
        try:
            for offset, payload in reader.frames(start):
                if offset == 0:
                    rows.append(_header_row(path, payload))
                else:
                    read.append((path.name, offset, payload))
        except OSError as exc:  # a live manager may delete a segment while we read it
            rows.append(_note(path.name, None, f"cannot read: {exc}"))
            return rows
        damage = reader.damage
        if damage is None:
            return rows
        rows.append(_damage_note(path.name, damage, last=last))
        if damage.next_valid is None:
            return rows
        start = damage.next_valid


def _header_row(path: Path, payload: bytes) -> Row:
    try:
        header = SegmentHeader.decode(payload, str(path))
    except LogCorruptionError as exc:
        return _note(path.name, 0, exc.message)
    row: Row = {"segment": path.name, "offset": 0, "kind": "SEGMENT", "gtrid": None}
    row.update(first_live=header.first_live, version=header.version, journal=header.kind)
    return row


def _record_row(
    decode_row: Decoder | None, kind: str, segment: str, offset: int, payload: bytes
) -> Row:
    if decode_row is None:
        return _note(segment, offset, f"no decoder for {kind} records (is its package installed?)")
    try:
        row = decode_row(payload)
    except LogCorruptionError as exc:
        return _note(segment, offset, exc.message)
    except Exception as exc:  # a decoder refusing a record it cannot read
        return _note(segment, offset, f"not a {kind} record: {exc}")
    return {"segment": segment, "offset": offset, "gtrid": None, **row}


def _decision_row(payload: bytes) -> Row:
    record = decode(payload)
    return {"kind": _kind(record), **_fields(record)}


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
