"""Framing: the 16-byte header with its CRC, and whole frames encoded and decoded (with a
direct path for MSG, byte-identical to the generic one)."""

from __future__ import annotations

import binascii
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import (
    Any,
)

from coordinator.checksum import crc32
from coordinator.errors import InvalidXidError

from ._base import (
    BATCH_VERSION,
    DEFAULT_MAX_FRAME,
    HEADER,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    FrameType,
    Value,
    _misuse,
    bad_frame,
)
from ._batch import PackedMsg, batch_frame, decode_batch, pack_batch, runs
from ._msg_codec import _decode_msg, _encode_msg
from ._schema import _SCHEMAS, Frame, Msg, MsgBatch, XaRequest
from ._values import _bad_payload, _encode_value, decode_value

# -- frames ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Header:
    """A header that passed every check that needs no payload."""

    version: int
    type: FrameType
    flags: int
    length: int
    crc: int


def encode(
    frame: Frame, *, version: int = PROTOCOL_VERSION, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """One whole frame. A wrong field type or a frame over ``max_frame`` is the caller's bug
    (`ProgrammingError`): better refused here than dropped by the peer with the connection."""
    out: bytearray | None = None
    if type(frame) is MsgBatch:
        if version < BATCH_VERSION:
            raise _misuse(f"MSGS needs protocol version {BATCH_VERSION}, not {version}")
        out = batch_frame(pack_batch(frame))
    elif type(frame) is Msg:
        out = _encode_msg(frame)
    if out is None:
        out = _encode_generic(frame)
    return finish(out, frame.TYPE, version=version, max_frame=max_frame)


def encode_many(
    frames: Iterable[Frame | PackedMsg],
    *,
    version: int = PROTOCOL_VERSION,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> bytes:
    """Frames as they go on the wire, in order. From version 3 each run of consecutive Msgs
    (or `PackedMsg`, a Msg packed already) goes as MSGS frames of at most ``max_frame``
    (`_batch`), which a reader unpacks. A `PackedMsg` before version 3 is the caller's bug."""
    if version < BATCH_VERSION:
        # a PackedMsg here is refused by `encode` as not a frame type
        return b"".join(encode(f, version=version, max_frame=max_frame) for f in frames)  # type: ignore[arg-type]
    out = []
    for item in runs(frames, max_frame):
        if type(item) is list:
            whole = batch_frame(item)
            out.append(finish(whole, FrameType.MSGS, version=version, max_frame=max_frame))
        else:
            out.append(encode(item, version=version, max_frame=max_frame))  # type: ignore[arg-type]
    return b"".join(out)


def finish(
    out: bytearray, ftype: FrameType, *, version: int, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """``out`` (header room, then a payload) as a whole frame: the header and its CRC."""
    if len(out) > max_frame:
        raise _misuse(f"{len(out)} bytes exceed the frame limit of {max_frame}")
    length = len(out) - HEADER_SIZE
    HEADER.pack_into(out, 0, MAGIC, version, ftype, 0, length, 0)
    # in pieces that keep the GIL (`coordinator.checksum`): a 100-message frame is ~40 KiB
    crc = crc32(memoryview(out)[HEADER_SIZE:], binascii.crc32(memoryview(out)[:12]))
    struct.pack_into(">I", out, 12, crc)
    return bytes(out)


def _encode_generic(frame: Frame) -> bytearray:
    """The header's room, then the payload: the frame's schema fields, walked generically."""
    schema = _SCHEMAS.get(getattr(frame, "TYPE", None))  # type: ignore[arg-type]
    if schema is None or type(frame) is not schema[0]:  # the reader would refuse it
        raise _misuse(f"{type(frame).__name__} is not a frame type")
    wire: dict[str, Value] = {}
    for spec in schema[1]:
        value = getattr(frame, spec.name)
        if not spec.required and value == spec.default() and type(value) is type(spec.default()):
            continue  # the decoder fills it in: a default costs no bytes
        try:
            wire[spec.name] = spec.to_wire(value)
        except TypeError as exc:
            raise _misuse(f"{type(frame).__name__}.{spec.name}: {exc}") from None
    out = bytearray(HEADER_SIZE)
    try:
        _encode_value(wire, out, 0)
    except UnicodeEncodeError as exc:
        raise _misuse(f"text is not encodable as UTF-8 ({exc.reason})") from None
    return out


def parse_header(
    data: bytes | bytearray | memoryview,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
    versions: frozenset[int] = SUPPORTED_VERSIONS,
) -> Header:
    """Check everything a header alone can tell, before any payload is read or allocated."""
    if len(data) < HEADER_SIZE:
        raise bad_frame("truncated", "header cut short", HEADER_SIZE, len(data))
    magic, version, ftype, flags, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise bad_frame("magic", "not a twopc frame", MAGIC, bytes(magic))
    if version not in versions:
        raise bad_frame("version", "unsupported protocol version", sorted(versions), version)
    if flags & ~KNOWN_FLAGS:
        raise bad_frame("flags", "reserved flags set", KNOWN_FLAGS, flags)
    if ftype not in _SCHEMAS and (ftype != FrameType.MSGS or version < BATCH_VERSION):
        raise bad_frame("type", "unknown frame type", sorted(_SCHEMAS), ftype)
    if length > max_frame - HEADER_SIZE:
        raise bad_frame("length", "frame over the size limit", max_frame - HEADER_SIZE, length)
    return Header(version, FrameType(ftype), flags, length, crc)


def decode_payload(
    header_bytes: bytes | bytearray | memoryview,
    header: Header,
    payload: bytes | bytearray | memoryview,
) -> Frame:
    """Check the CRC, then build the frame; the header was checked by `parse_header`."""
    if len(payload) != header.length:
        raise bad_frame("truncated", "payload cut short", header.length, len(payload))
    crc = crc32(payload, binascii.crc32(memoryview(header_bytes)[:12]))
    if crc != header.crc:
        raise bad_frame("crc", "checksum mismatch", header.crc, crc)
    if header.type is FrameType.MSG:
        msg = _decode_msg(payload)
        if msg is not None:
            return msg
    elif header.type is FrameType.MSGS:
        return decode_batch(payload)
    return _decode_generic(header.type, payload)


def _decode_generic(ftype: FrameType, payload: bytes | bytearray | memoryview) -> Frame:
    """The payload as a map, then each schema field converted and checked."""
    wire = decode_value(payload)
    if not isinstance(wire, dict):
        raise _bad_payload("payload is not a map", got=type(wire).__name__)
    cls, specs = _SCHEMAS[ftype]
    kwargs: dict[str, Any] = {}
    for spec in specs:
        if spec.name in wire:
            try:
                kwargs[spec.name] = spec.from_wire(wire[spec.name])
            except (TypeError, ValueError, InvalidXidError) as exc:
                raise _bad_payload(f"{cls.__name__}.{spec.name}: {exc}", got=spec.name) from None
        elif spec.required:
            raise _bad_payload(f"{cls.__name__}.{spec.name} missing", got=None)
    if len(kwargs) != len(wire):
        unknown = sorted(wire.keys() - kwargs.keys())
        raise _bad_payload(f"unknown fields {unknown} in {cls.__name__}", got=unknown)
    if cls is XaRequest:
        kwargs["verb"] = ftype
    frame: Frame = cls(**kwargs)
    return frame


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
    versions: frozenset[int] = SUPPORTED_VERSIONS,
) -> Frame:
    """Exactly one whole frame from a buffer (tests, the fault proxy); no byte may be left over."""
    view = memoryview(data).cast("B")
    header = parse_header(view, max_frame=max_frame, versions=versions)
    end = HEADER_SIZE + header.length
    if len(view) < end:
        raise bad_frame("truncated", "payload cut short", header.length, len(view) - HEADER_SIZE)
    if len(view) > end:
        raise bad_frame("trailing", "bytes after the frame", 0, len(view) - end)
    return decode_payload(view[:HEADER_SIZE], header, view[HEADER_SIZE:])
