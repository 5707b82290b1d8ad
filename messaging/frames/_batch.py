"""MSGS (version 3): a run of MSG frames as one frame, each message in a fixed binary layout.

Why: a transfer sends one MSG per message, and in Python the self-describing map of a MSG (field
names, tags and varints, read one by one) cost more than everything else the frame layer does:
about 10 µs to encode and 20 µs to read per message, most of a receiving cursor's time at 100
messages per transaction. A MSGS frame carries the same fields in a layout `struct` reads in one
call per message, under one header and one CRC: about 2 and 7 µs. Nothing else changes: a reader
(`messaging.connection.Connection`) hands its messages on one at a time as the MSG frames they
replace, so every rule of a MSG (the accept rule, NACKs, the order of replies) is unchanged.

The payload, big-endian::

    count u32 (at least 1), then per message:
      flags u8 (1 persistent, 2 redelivered, 4 expires_at_ms present; no other bit)
      epoch u64 | seq u64 | prev u64 | expires_at_ms u64 (0 without flag 4) | delivery_count u32
      len(stream) u16 | len(message_id) u16 | len(destination) u16 | len(body) u32 | headers u16
      stream, message_id, destination (UTF-8), body (raw)
      per header: len(name) u16 | len(value) u32 | name, value (UTF-8; each name once)

Every byte is used; a length past the end, invalid UTF-8, a name twice or a count of 0 is a bad
frame, as a malformed MSG is. A message this layout cannot hold (a header value that is not
text, a delivery count of 2**32 or more) travels as a MSG frame of its own, in its place.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from ._base import HEADER_SIZE, _misuse
from ._schema import Frame, Msg, MsgBatch
from ._values import _bad_payload

_COUNT = struct.Struct(">I")
_FIXED = struct.Struct(">BQQQQIHHHIH")
_HEADER = struct.Struct(">HI")
_PERSISTENT, _REDELIVERED, _EXPIRES = 1, 2, 4
_U16, _U32, _U64 = 2**16, 2**32, 2**64
_ROOM = bytes(HEADER_SIZE)


class PackedMsg(bytes):
    """A Msg already in the MSGS layout (`pack_fields`): what a sender that holds a message's
    fields, not a `Msg`, hands `Connection.send_many` at version 3 and later."""

    __slots__ = ()


def pack_msg(m: Msg) -> bytes | None:
    """One message in the MSGS layout; None if the layout cannot hold it (see the module)."""
    return pack_fields(
        m.stream, m.epoch, m.seq, m.prev, m.message_id, m.destination, m.body, m.headers,
        m.expires_at_ms, m.persistent, m.redelivered, m.delivery_count,
    )  # fmt: skip


def pack_fields(  # noqa: PLR0917 - a Msg's fields, without building one
    stream: str,
    epoch: int,
    seq: int,
    prev: int,
    mid: str,
    dest: str,
    body: bytes,
    headers: Mapping[str, object],
    expires: int | None,
    persistent: bool,
    redelivered: bool,
    count: int,
) -> PackedMsg | None:
    """A Msg of these fields in the MSGS layout; None if the layout cannot hold it."""
    if not (
        type(body) is bytes and type(headers) is dict
        and type(epoch) is int and type(seq) is int and type(prev) is int
        and 0 <= epoch < _U64 and 0 <= seq < _U64 and 0 <= prev < _U64
        and (expires is None or (type(expires) is int and 0 <= expires < _U64))
        and type(count) is int and 0 <= count < _U32
        and type(persistent) is bool and type(redelivered) is bool
        and len(body) < _U32 and len(headers) < _U16
    ):  # fmt: skip
        return None
    try:
        raw = [stream.encode(), mid.encode(), dest.encode()]
        pairs = [(k.encode(), v.encode()) for k, v in headers.items()]
    except (AttributeError, UnicodeEncodeError):  # not text, or not encodable
        return None
    if any(len(r) >= _U16 for r in raw) or any(len(k) >= _U16 or len(v) >= _U32 for k, v in pairs):
        return None
    flags = persistent * _PERSISTENT + redelivered * _REDELIVERED
    if expires is not None:
        flags |= _EXPIRES
    parts = [
        _FIXED.pack(flags, epoch, seq, prev, expires or 0, count,
                    len(raw[0]), len(raw[1]), len(raw[2]), len(body), len(pairs)),
        *raw,
        body,
    ]  # fmt: skip
    for k, v in pairs:
        parts += (_HEADER.pack(len(k), len(v)), k, v)
    return PackedMsg(b"".join(parts))


def batch_frame(packed: list[bytes]) -> bytearray:
    """The header's room, then the MSGS payload of these packed messages, built in one copy
    (`_codec.finish` writes the header into the room)."""
    return bytearray().join((_ROOM, _COUNT.pack(len(packed)), *packed))


def batch_payload(packed: list[bytes]) -> bytes:
    """The MSGS payload alone (tests build frames from it, damaged or whole)."""
    return _COUNT.pack(len(packed)) + b"".join(packed)


def pack_batch(batch: MsgBatch) -> list[bytes]:
    """`MsgBatch`'s messages packed; a message the layout cannot hold is the caller's bug."""
    packed = []
    for m in batch.messages:
        one = pack_msg(m) if type(m) is Msg else None
        if one is None:
            raise _misuse("MSGS holds Msgs of text headers and counts below 2**32 only")
        packed.append(one)
    if not packed:
        raise _misuse("MSGS holds at least one message")
    return packed


#: a MSGS frame's bytes besides its messages: the frame header and the count
MSGS_OVERHEAD = HEADER_SIZE + _COUNT.size


def runs(frames: Iterable[Frame | PackedMsg], max_frame: int) -> Iterable[Frame | list[bytes]]:
    """``frames`` with each run of consecutive packable Msgs (or `PackedMsg`) as a list of packed
    messages, cut so that its frame fits in ``max_frame``; everything else, in its place, as it
    was."""
    budget = max_frame - MSGS_OVERHEAD
    run: list[bytes] = []
    size = 0
    for frame in frames:
        if isinstance(frame, PackedMsg):  # no Msg to fall back on: it must fit
            if len(frame) > budget:
                raise _misuse(f"a packed message of {len(frame)} bytes exceeds the frame limit")
            packed: bytes = frame
        else:
            one = pack_msg(frame) if type(frame) is Msg else None
            if one is None or len(one) > budget:  # a MSG of its own (or the encoder's refusal)
                if run:
                    yield run
                    run, size = [], 0
                yield frame
                continue
            packed = one
        if size + len(packed) > budget:
            yield run
            run, size = [], 0
        run.append(packed)
        size += len(packed)
    if run:
        yield run


def decode_batch(payload: bytes | bytearray | memoryview) -> MsgBatch:
    """The messages of a MSGS payload, each checked as the module says; else a bad frame."""
    data = bytes(payload)
    end = len(data)
    try:
        (count,) = _COUNT.unpack_from(data, 0)
        if not 0 < count <= (end - _COUNT.size) // _FIXED.size:
            raise _bad_payload("MSGS count is 0 or more than the payload holds", got=count)
        pos = _COUNT.size
        messages = []
        for _ in range(count):
            flags, epoch, seq, prev, expires, dcount, ls, li, ld, lb, nh = _FIXED.unpack_from(
                data, pos
            )
            pos += _FIXED.size
            if flags & ~(_PERSISTENT | _REDELIVERED | _EXPIRES) or (
                expires and not flags & _EXPIRES
            ):
                raise _bad_payload("MSGS flags unknown, or an expiry without its flag", got=flags)
            stop = pos + ls + li + ld + lb
            if stop > end:
                raise _bad_payload("MSGS message runs past the payload", got=stop - end)
            stream = data[pos : pos + ls].decode()
            pos += ls
            message_id = data[pos : pos + li].decode()
            pos += li
            destination = data[pos : pos + ld].decode()
            pos += ld
            body = data[pos:stop]
            pos = stop
            headers: dict[str, str] = {}
            for _ in range(nh):
                lk, lv = _HEADER.unpack_from(data, pos)
                pos += _HEADER.size
                if pos + lk + lv > end:
                    raise _bad_payload("MSGS header runs past the payload", got=pos + lk + lv - end)
                name = data[pos : pos + lk].decode()
                headers[name] = data[pos + lk : pos + lk + lv].decode()
                pos += lk + lv
            if len(headers) != nh:
                raise _bad_payload("MSGS header name twice", got=nh)
            messages.append(
                Msg(stream, epoch, seq, prev, message_id, destination, body, headers,
                    expires if flags & _EXPIRES else None, bool(flags & _PERSISTENT),
                    bool(flags & _REDELIVERED), dcount)
            )  # fmt: skip
    except struct.error:
        raise _bad_payload("MSGS cut short inside a message") from None
    except UnicodeDecodeError:
        raise _bad_payload("MSGS text is not valid UTF-8") from None
    if pos != end:
        raise _bad_payload("bytes after the last message of MSGS", got=end - pos)
    return MsgBatch(tuple(messages))
