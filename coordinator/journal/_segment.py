"""Segment files on disk: names, the CURRENT pointer, and reading frames back.

A journal directory holds ``LOCK``, ``CURRENT`` (the name of the active segment, replaced
atomically) and segments named by a zero-padded sequence number, so that sorting names sorts
sequences. Reading never changes a file: the decision to cut a torn tail is the caller's, made only
after every segment has been read and found sound.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ._framing import (
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    MAX_RECORD_BYTES,
    corruption,
    frame_problem,
    next_valid_frame,
    payload_problem,
)

CURRENT = "CURRENT"
LOCK = "LOCK"
_SEGMENT_RE = re.compile(r"^(\d{20})\.seg$")


def segment_name(seq: int) -> str:
    return f"{seq:020d}.seg"


def list_segments(directory: Path) -> dict[int, Path]:
    """Every segment file in the directory by sequence number; other names are not ours."""
    found: dict[int, Path] = {}
    for path in directory.iterdir():
        match = _SEGMENT_RE.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def read_current(directory: Path) -> int | None:
    """The active segment's sequence, None if there is no CURRENT; a garbled one is corruption."""
    path = directory / CURRENT
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise corruption(str(path), None, f"CURRENT is unreadable: {exc}") from exc
    match = _SEGMENT_RE.match(text.rstrip("\n"))
    if not match or text.count("\n") != 1:
        raise corruption(str(path), None, f"CURRENT does not name a segment: {text[:80]!r}")
    return int(match.group(1))


def current_contents(seq: int) -> bytes:
    return f"{segment_name(seq)}\n".encode("ascii")


@dataclass(frozen=True)
class Damage:
    """The first bad frame of a segment, and whether a valid frame follows it.

    With nothing valid after it, the damage is a torn tail: a write that a crash cut short, whose
    caller was never told it was durable. With a valid frame after it, records were acknowledged
    past the damage, so cutting there would drop them.
    """

    offset: int
    reason: str
    file_size: int
    next_valid: int | None

    @property
    def torn(self) -> bool:
        return self.next_valid is None

    @property
    def dropped_bytes(self) -> int:
        return self.file_size - self.offset

    def describe(self) -> str:
        if self.torn:
            return f"{self.reason}; nothing valid follows"
        return f"{self.reason}; yet a valid record follows at offset {self.next_valid}"


class SegmentReader:
    """Reads one segment's frames in order, stopping at the first bad one and saying why.

    Frames are read one at a time, checking each length against the limit before reading the
    payload, so memory stays bounded by the record size; only after damage is the rest of the file
    read, to search it for a valid frame.
    """

    def __init__(self, path: Path, max_record: int = MAX_RECORD_BYTES) -> None:
        self.path = path
        self.max_record = max_record
        self.damage: Damage | None = None
        self.end = 0

    def frames(self, start: int = 0) -> Generator[tuple[int, bytes], None, None]:
        """Yield ``(offset, payload)`` from ``start`` (a frame's offset: 0, or where a valid frame
        follows damage); afterwards ``damage`` and ``end`` describe how it ended."""
        self.damage = None
        with self.path.open("rb") as file:
            file.seek(start)
            offset = start
            while True:
                header = file.read(FRAME_HEADER_SIZE)
                if not header:
                    self.end = offset
                    return
                payload, problem = self._read_payload(file, header)
                if problem is not None:
                    self.end = offset
                    self.damage = self._assess(file, offset, problem)
                    return
                yield offset, payload
                offset += FRAME_HEADER_SIZE + len(payload)

    def _read_payload(self, file: BinaryIO, header: bytes) -> tuple[bytes, str | None]:
        problem = frame_problem(header, self.max_record)
        if problem is not None:
            return b"", problem
        _, length, _ = FRAME_HEADER.unpack(header)
        payload = file.read(length)
        return payload, payload_problem(header, payload)

    def _assess(self, file: BinaryIO, offset: int, problem: str) -> Damage:
        file.seek(offset)
        rest = file.read()
        found = next_valid_frame(rest, 1, self.max_record)
        if rest.count(0) == len(rest):
            problem = f"{problem} (the rest of the file is zeros)"
        return Damage(
            offset=offset,
            reason=problem,
            file_size=offset + len(rest),
            next_valid=None if found is None else offset + found,
        )
