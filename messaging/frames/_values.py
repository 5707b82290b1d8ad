"""The payload's value encoding: tags, LEB128 varints, canonical maps (the package
docstring has the table)."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.errors import FrameError

from ._base import (
    _BYTES,
    _F64,
    _FALSE,
    _FLOAT,
    _LIST,
    _MAP,
    _NINT,
    _NONE,
    _STR,
    _TRUE,
    _U64,
    _UINT,
    MAX_DEPTH,
    Value,
    _misuse,
    bad_frame,
)

# -- values ----------------------------------------------------------------------------------------


def _varint(n: int, out: bytearray) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _encode_value(v: object, out: bytearray, depth: int) -> None:  # noqa: PLR0912
    if depth > MAX_DEPTH:
        raise _misuse(f"value nested deeper than {MAX_DEPTH} levels")
    if v is None or v is True or v is False:
        out.append(_NONE if v is None else _TRUE if v else _FALSE)
    elif isinstance(v, str):
        raw = v.encode("utf-8", "strict")
        out.append(_STR)
        _varint(len(raw), out)
        out += raw
    elif isinstance(v, int):
        if not -_U64 <= v < _U64:
            raise _misuse(f"integer {v} outside -2**64..2**64-1")
        out.append(_UINT if v >= 0 else _NINT)
        _varint(v if v >= 0 else -1 - v, out)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        out.append(_BYTES)
        _varint(len(v) if not isinstance(v, memoryview) else v.nbytes, out)
        out += v
    elif isinstance(v, float):
        out.append(_FLOAT)
        out += _F64.pack(v)
    elif isinstance(v, Mapping):
        if not all(isinstance(k, str) for k in v):
            raise _misuse("map keys must be str")
        out.append(_MAP)
        _varint(len(v), out)
        for key in sorted(v):  # code point order is UTF-8 byte order: canonical on the wire
            raw = key.encode("utf-8", "strict")
            _varint(len(raw), out)
            out += raw
            _encode_value(v[key], out, depth + 1)
    elif isinstance(v, (list, tuple)):
        out.append(_LIST)
        _varint(len(v), out)
        for item in v:
            _encode_value(item, out, depth + 1)
    else:
        raise _misuse(f"no wire encoding for {type(v).__name__}")


def encode_value(value: Value) -> bytes:
    """One value in the payload encoding; also the auth transcript's unambiguous byte form."""
    out = bytearray()
    try:
        _encode_value(value, out, 0)
    except UnicodeEncodeError as exc:
        raise _misuse(f"text is not encodable as UTF-8 ({exc.reason})") from None
    return bytes(out)


def _bad_payload(message: str, got: object = None) -> FrameError:
    return bad_frame("payload", message, expected="a valid payload", got=got)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    if pos < len(data) and data[pos] < 0x80:  # the common case: one byte
        return data[pos], pos + 1
    result = shift = 0
    for i in range(10):
        if pos >= len(data):
            raise _bad_payload("payload ends inside a varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            if byte == 0 and i > 0:
                raise _bad_payload("non-minimal varint")
            if result >= _U64:
                raise _bad_payload("varint above 2**64-1")
            return result, pos
        shift += 7
    raise _bad_payload("varint longer than 10 bytes")


def _read_sized(data: memoryview, pos: int) -> tuple[memoryview, int]:
    n, pos = _read_varint(data, pos)
    end = pos + n
    if end > len(data):
        raise _bad_payload(f"length {n} runs past the payload's end", got=n)
    return data[pos:end], end


def _text(raw: memoryview) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise _bad_payload("text is not valid UTF-8") from None


def _decode_value(data: memoryview, pos: int, depth: int) -> tuple[Value, int]:  # noqa: PLR0912
    if depth > MAX_DEPTH:
        raise _bad_payload(f"nested deeper than {MAX_DEPTH} levels")
    if pos >= len(data):
        raise _bad_payload("payload ends inside a value")
    tag = data[pos]
    pos += 1
    if tag == _STR:
        raw, pos = _read_sized(data, pos)
        return _text(raw), pos
    if tag in (_UINT, _NINT):
        n, pos = _read_varint(data, pos)
        return (n if tag == _UINT else -1 - n), pos
    if tag == _BYTES:
        raw, pos = _read_sized(data, pos)
        return bytes(raw), pos
    if tag <= _TRUE:
        return (None, False, True)[tag], pos
    if tag == _FLOAT:
        if len(data) - pos < 8:
            raise _bad_payload("payload ends inside a float")
        return _F64.unpack_from(data, pos)[0], pos + 8
    if tag in (_LIST, _MAP):
        count, pos = _read_varint(data, pos)
        if count > len(data) - pos:  # every item takes a byte: refuse before looping
            raise _bad_payload(f"count {count} exceeds the bytes left", got=count)
        if tag == _LIST:
            items: list[Value] = []
            for _ in range(count):
                item, pos = _decode_value(data, pos, depth + 1)
                items.append(item)
            return items, pos
        result: dict[str, Value] = {}
        previous: str | None = None
        for _ in range(count):
            raw, pos = _read_sized(data, pos)
            key = _text(raw)
            if previous is not None and key <= previous:
                raise _bad_payload(f"map key {key!r} duplicated or out of order", got=key)
            result[key], pos = _decode_value(data, pos, depth + 1)
            previous = key
        return result, pos
    raise _bad_payload(f"unknown value tag {tag}", got=tag)


def decode_value(data: bytes | bytearray | memoryview) -> Value:
    """The inverse of `encode_value`; anything malformed or left over is a `FrameError`."""
    view = memoryview(data).cast("B")
    value, pos = _decode_value(view, 0, 0)
    if pos != len(view):
        raise _bad_payload(f"{len(view) - pos} bytes after the value", got=len(view) - pos)
    return value
