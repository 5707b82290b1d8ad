"""Record framing: how a reader tells a whole record from a torn or damaged one.

A frame is ``magic (2) | length (u32) | crc32(length + payload) (u32) | payload``, little-endian.
The CRC covers the length as well as the payload, so a flipped bit in the length is caught instead
of sending the reader off into the middle of another record. The magic lets a reader that met a
bad frame look for a later valid one: that is what separates a torn tail (nothing valid follows,
safe to cut) from damage in the middle of the log (something valid follows, never cut).

The magic bytes are not valid UTF-8 and never occur in ASCII, so they cannot appear inside the
ASCII JSON payloads the decision log writes: a stray match inside a payload stays improbable even
for other payload formats, because a candidate must also pass its CRC.

Every segment opens with a header frame naming the format version, the segment's sequence number
and ``first_live``, the oldest segment still required when it was created; from version 2 also the
kind of journal it belongs to (``decision-log``, ``message-log``, ``cursor``), so that a store
opened on another store's directory says so instead of reporting damage. Version 1 segments (no
kind) are still read; every segment written now is version 2.
"""

from __future__ import annotations

import binascii
import struct
from dataclasses import dataclass

from coordinator.checksum import crc32
from coordinator.errors import LogCorruptionError

MAGIC = b"\xfe\xd1"
FRAME_HEADER = struct.Struct("<2sII")
FRAME_HEADER_SIZE = FRAME_HEADER.size
FILE_MAGIC = b"TWOPCJNL"
FORMAT_VERSION = 2
SEGMENT_HEADER_V1 = struct.Struct("<8sHQQ")
SEGMENT_HEADER = struct.Struct("<8sHQQ16s")  # version 2: + the journal's kind, ASCII, NUL-padded
#: the kinds of journal twopc writes; "" in a header: written by a caller that named none
JOURNAL_KINDS = ("decision-log", "message-log", "cursor")
_KIND_BYTES = 16
# The largest payload a frame may carry. A reader checks a length against it before allocating,
# so a damaged length can never make it try to read gigabytes.
MAX_RECORD_BYTES = 16 * 1024 * 1024

_LENGTH = struct.Struct("<I")


def encode_frame(payload: bytes) -> bytes:
    """Frame one payload; the caller has already checked its size against the limit. The
    checksum keeps the GIL (`coordinator.checksum`): a store's record of a 100-message
    transaction is ~50 KiB, and the thread writing it is the one a commit waits on."""
    length = _LENGTH.pack(len(payload))
    crc = crc32(payload, binascii.crc32(length))
    return FRAME_HEADER.pack(MAGIC, len(payload), crc) + payload


def frame_problem(header: bytes, max_record: int) -> str | None:
    """Why a frame header cannot start a valid frame, or None if its payload is worth reading."""
    if len(header) < FRAME_HEADER_SIZE:
        return f"incomplete frame header ({len(header)} of {FRAME_HEADER_SIZE} bytes)"
    magic, length, _ = FRAME_HEADER.unpack(header)
    if magic != MAGIC:
        return f"bad frame magic {magic.hex()}"
    if length > max_record:
        return f"frame length {length} exceeds the limit of {max_record} bytes"
    return None


def payload_problem(header: bytes, payload: bytes) -> str | None:
    """Why a payload read after a sound header does not belong to it, or None if it does."""
    _, length, crc = FRAME_HEADER.unpack(header)
    if len(payload) < length:
        return f"record of {length} bytes runs past end of file ({len(payload)} bytes present)"
    if crc32(payload, binascii.crc32(_LENGTH.pack(length))) != crc:
        return "checksum mismatch"
    return None


def next_valid_frame(data: bytes, start: int, max_record: int) -> int | None:
    """Offset in ``data`` of the first complete, CRC-valid frame at or after ``start``.

    Every occurrence of the magic is tried, not just frame boundaries we believe in: after a bad
    frame we no longer know where boundaries are.
    """
    index = data.find(MAGIC, start)
    while index != -1:
        header = data[index : index + FRAME_HEADER_SIZE]
        if frame_problem(header, max_record) is None:
            _, length, _ = FRAME_HEADER.unpack(header)
            body = data[index + FRAME_HEADER_SIZE : index + FRAME_HEADER_SIZE + length]
            if payload_problem(header, body) is None:
                return index
        index = data.find(MAGIC, index + 1)
    return None


@dataclass(frozen=True)
class SegmentHeader:
    """The first record of every segment. ``kind`` is None in a version 1 header (written before
    headers named their journal) and "" in one whose writer named no kind."""

    seq: int
    first_live: int
    kind: str | None = ""
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        if self.version == 1:
            return SEGMENT_HEADER_V1.pack(FILE_MAGIC, 1, self.seq, self.first_live)
        kind = (self.kind or "").encode("ascii")
        return SEGMENT_HEADER.pack(FILE_MAGIC, self.version, self.seq, self.first_live, kind)

    @classmethod
    def decode(cls, payload: bytes, path: str) -> SegmentHeader:
        """Refuse anything but a header this code can read: guessing at a format loses records."""
        if len(payload) not in (SEGMENT_HEADER_V1.size, SEGMENT_HEADER.size):
            raise corruption(path, 0, f"segment header has {len(payload)} bytes")
        magic, version = payload[:8], int.from_bytes(payload[8:10], "little")
        if magic != FILE_MAGIC:
            raise corruption(path, 0, f"not a twopc journal segment (magic {magic!r})")
        if version not in (1, FORMAT_VERSION):
            raise corruption(
                path, 0, f"format version {version}; this code reads 1 to {FORMAT_VERSION}"
            )
        kind: str | None = None
        if version == 1 and len(payload) == SEGMENT_HEADER_V1.size:
            _, _, seq, first_live = SEGMENT_HEADER_V1.unpack(payload)
        elif version == FORMAT_VERSION and len(payload) == SEGMENT_HEADER.size:
            _, _, seq, first_live, raw = SEGMENT_HEADER.unpack(payload)
            try:
                kind = raw.rstrip(b"\0").decode("ascii")
            except UnicodeDecodeError:
                raise corruption(path, 0, f"journal kind {raw!r} is not ASCII") from None
        else:
            raise corruption(path, 0, f"a version {version} header has {len(payload)} bytes")
        if first_live > seq:
            raise corruption(path, 0, f"first_live {first_live} is after the segment's own {seq}")
        return cls(seq=seq, first_live=first_live, kind=kind, version=version)


def corruption(path: str, offset: int | None, reason: str) -> LogCorruptionError:
    """The one way the journal reports damage: where, and what, so an operator can look."""
    where = path if offset is None else f"{path} at offset {offset}"
    return LogCorruptionError(
        f"journal damaged: {where}: {reason}; no file was changed",
        path=path,
        offset=offset,
        reason=reason,
    )
