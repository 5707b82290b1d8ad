"""MSG's direct path: a MSG frame's payload written and read straight from its fields, in the
everyday layout, byte-identical to the generic map walk (`_codec` falls back to that walk for
anything else). A transfer of protocol versions 1 and 2 sends one MSG per message, and the generic
walk was most of its cost; version 3 sends runs of them as MSGS (`_batch`) instead."""

from __future__ import annotations

from coordinator.errors import FrameError

from ._base import _BYTES, _FALSE, _MAP, _STR, _TRUE, _U64, _UINT, HEADER_SIZE, Value
from ._schema import Msg
from ._values import _bad_payload, _read_sized, _read_varint, _varint


def _key(name: str) -> bytes:
    return bytes([len(name)]) + name.encode("ascii")


# Msg's field names in the payload's (sorted) key order, each as it is written: length, name.
_K_BODY, _K_COUNT, _K_DEST, _K_EPOCH, _K_EXPIRES, _K_HEADERS = map(
    _key, ("body", "delivery_count", "destination", "epoch", "expires_at_ms", "headers")
)
_K_ID, _K_PERSISTENT, _K_PREV, _K_REDELIVERED, _K_SEQ, _K_STREAM = map(
    _key, ("message_id", "persistent", "prev", "redelivered", "seq", "stream")
)


def _put_str(text: str, out: bytearray) -> None:
    raw = text.encode("utf-8", "strict")
    out.append(_STR)
    _varint(len(raw), out)
    out += raw


def _put_uint(n: int, out: bytearray) -> None:
    out.append(_UINT)
    _varint(n, out)


def _encode_msg(m: Msg) -> bytearray | None:
    """`_encode_generic`'s bytes for a MSG frame, written straight from its fields (a transfer
    sends one per message, and the generic walk was most of its cost). None when a field is not
    of the everyday kind (text headers, non-negative numbers, valid UTF-8): the generic path then
    encodes it or refuses it with its message. Tests hold the two byte-identical."""
    stream, mid, dest, body, headers = m.stream, m.message_id, m.destination, m.body, m.headers
    numbers = (m.epoch, m.seq, m.prev, m.delivery_count)
    expires, persistent, redelivered = m.expires_at_ms, m.persistent, m.redelivered
    if not (
        type(stream) is str and type(mid) is str and type(dest) is str and type(body) is bytes
        and type(headers) is dict and all(type(n) is int and 0 <= n < _U64 for n in numbers)
        and (expires is None or (type(expires) is int and 0 <= expires < _U64))
        and type(persistent) is bool and type(redelivered) is bool
        and all(type(k) is str and type(v) is str for k, v in headers.items())
    ):  # fmt: skip
        return None
    epoch, seq, prev, count = numbers
    fields_ = 7 + (count != 0) + (expires is not None) + bool(headers)
    fields_ += (not persistent) + redelivered
    out = bytearray(HEADER_SIZE)
    out.append(_MAP)
    out.append(fields_)  # at most 12: one varint byte
    try:
        out += _K_BODY
        out.append(_BYTES)
        _varint(len(body), out)
        out += body
        if count:
            out += _K_COUNT
            _put_uint(count, out)
        out += _K_DEST
        _put_str(dest, out)
        out += _K_EPOCH
        _put_uint(epoch, out)
        if expires is not None:
            out += _K_EXPIRES
            _put_uint(expires, out)
        if headers:
            out += _K_HEADERS
            out.append(_MAP)
            _varint(len(headers), out)
            for key in sorted(headers):
                raw = key.encode("utf-8", "strict")
                _varint(len(raw), out)
                out += raw
                _put_str(headers[key], out)
        out += _K_ID
        _put_str(mid, out)
        if not persistent:
            out += _K_PERSISTENT
            out.append(_FALSE)
        out += _K_PREV
        _put_uint(prev, out)
        if redelivered:
            out += _K_REDELIVERED
            out.append(_TRUE)
        out += _K_SEQ
        _put_uint(seq, out)
        out += _K_STREAM
        _put_str(stream, out)
    except UnicodeEncodeError:
        return None
    return out


def _uint_at(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned integer value (tag, then varint) at ``pos``."""
    if data[pos] != _UINT:
        raise _bad_payload("not the everyday form")
    if data[pos + 1] < 0x80:
        return data[pos + 1], pos + 2
    return _read_varint(memoryview(data), pos + 1)


def _str_at(data: bytes, pos: int) -> tuple[str, int]:
    """A text value (tag, length, UTF-8) at ``pos``."""
    if data[pos] != _STR:
        raise _bad_payload("not the everyday form")
    n, start = data[pos + 1], pos + 2
    if n >= 0x80:
        n, start = _read_varint(memoryview(data), pos + 1)
    end = start + n
    if end > len(data):
        raise _bad_payload("text runs past the payload's end")
    return data[start:end].decode("utf-8"), end


def _bool_at(data: bytes, pos: int) -> bool:
    if data[pos] not in (_FALSE, _TRUE):
        raise _bad_payload("not the everyday form")
    return data[pos] == _TRUE


def _headers_at(data: bytes, pos: int) -> tuple[dict[str, Value], int]:
    """A map of text to text at ``pos``, keys strictly ascending."""
    if data[pos] != _MAP:
        raise _bad_payload("not the everyday form")
    entries, pos = _read_varint(memoryview(data), pos + 1)
    headers: dict[str, Value] = {}
    previous = ""
    for i in range(entries):
        raw, pos = _read_sized(memoryview(data), pos)
        key = str(raw, "utf-8")
        if i and key <= previous:
            raise _bad_payload("header keys out of order")
        headers[key], pos = _str_at(data, pos)
        previous = key
    return headers, pos


def _decode_msg(payload: bytes | bytearray | memoryview) -> Msg | None:  # noqa: PLR0912
    """The Msg `_decode_generic` would build, read in the everyday layout `_encode_msg` writes
    (fields in canonical order, numbers unsigned, headers text); None for any other payload,
    which the generic path then reads or refuses with its own error. Nothing is accepted here
    that the generic path would refuse: varints minimal (a one-byte one always is), text valid
    UTF-8, header keys strictly ascending, field names compared whole and in order, every byte
    used."""
    data = bytes(payload)  # one small copy: bytes index and compare cheaper than a view
    try:
        if data[0] != _MAP or data[1] > 12 or not data.startswith(_K_BODY, 2):
            return None
        at = 2 + len(_K_BODY)
        if data[at] != _BYTES:
            return None
        n, start = data[at + 1], at + 2
        if n >= 0x80:
            n, start = _read_varint(memoryview(data), at + 1)
        pos = start + n
        if pos > len(data):
            return None
        body = data[start:pos]
        count, fields_ = data[1], 7
        delivery_count = 0
        if data.startswith(_K_COUNT, pos):
            delivery_count, pos = _uint_at(data, pos + len(_K_COUNT))
            fields_ += 1
        if not data.startswith(_K_DEST, pos):
            return None
        destination, pos = _str_at(data, pos + len(_K_DEST))
        if not data.startswith(_K_EPOCH, pos):
            return None
        epoch, pos = _uint_at(data, pos + len(_K_EPOCH))
        expires: int | None = None
        if data.startswith(_K_EXPIRES, pos):
            expires, pos = _uint_at(data, pos + len(_K_EXPIRES))
            fields_ += 1
        headers: dict[str, Value] = {}
        if data.startswith(_K_HEADERS, pos):
            headers, pos = _headers_at(data, pos + len(_K_HEADERS))
            fields_ += 1
        if not data.startswith(_K_ID, pos):
            return None
        message_id, pos = _str_at(data, pos + len(_K_ID))
        persistent = True
        if data.startswith(_K_PERSISTENT, pos):
            persistent = _bool_at(data, pos + len(_K_PERSISTENT))
            pos, fields_ = pos + len(_K_PERSISTENT) + 1, fields_ + 1
        if not data.startswith(_K_PREV, pos):
            return None
        prev, pos = _uint_at(data, pos + len(_K_PREV))
        redelivered = False
        if data.startswith(_K_REDELIVERED, pos):
            redelivered = _bool_at(data, pos + len(_K_REDELIVERED))
            pos, fields_ = pos + len(_K_REDELIVERED) + 1, fields_ + 1
        if not data.startswith(_K_SEQ, pos):
            return None
        seq, pos = _uint_at(data, pos + len(_K_SEQ))
        if not data.startswith(_K_STREAM, pos):
            return None
        stream, pos = _str_at(data, pos + len(_K_STREAM))
    except (FrameError, IndexError, UnicodeDecodeError):
        return None
    if pos != len(data) or count != fields_:
        return None
    return Msg(stream, epoch, seq, prev, message_id, destination, body, headers, expires,
               persistent, redelivered, delivery_count)  # fmt: skip
