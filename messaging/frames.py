"""The wire codec of the transfer protocol: log <-> cursor transfer, handshake and remote XA verbs.

A frame is a 16-byte header, big-endian, then the payload::

    magic "TPCM" (4) | version u8 | type u8 | flags u16 | length u32 | crc32 u32 | payload

The CRC covers the twelve header bytes before it and the payload, so a flipped bit in the type or
the length is caught, not obeyed. ``length`` counts payload bytes; header plus payload must fit in
the connection's ``max_frame`` (16 MiB unless configured; 4 KiB before authentication). Every
header check runs before a payload byte is read or a buffer allocated, so a length claiming
gigabytes costs nothing. Any failed check raises `FrameError` with ``what`` (``magic``,
``version``, ``flags``, ``type``, ``length``, ``truncated``, ``crc``, ``payload``, ``trailing``),
``expected`` and ``got``; the caller drops that one connection, since after a bad frame the stream
is out of step and nothing read from it can be trusted. ``flags`` are reserved: zero in version 1.

The payload is one map in a small self-describing encoding (one tag byte per value; integers as
LEB128 varints; lengths as varints; bytes raw, never base64)::

    00 None | 01 False | 02 True | 03 uint: varint n < 2**64 | 04 negative: varint of -1-n >= -2**64
    05 float64 | 06 bytes: len, raw | 07 str: len, UTF-8 | 08 list: count, values
    09 map: count, then (key len, key UTF-8, value) in strictly ascending key order

Decoding is canonical and strict: varints minimal, map keys sorted and unique, nesting at most 16
deep, every byte used. Field names are the dataclass attribute names below; an optional field at its
default is left out. A field this version does not know is refused, never skipped: ignoring a field
such as ``one_phase`` could change a transaction's outcome, so protocol changes bump the version,
which HELLO negotiates. The encoding belongs to the protocol version; there is no second number.
"""

from __future__ import annotations

import asyncio
import enum
import struct
import types
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import (
    Any,
    ClassVar,
    Protocol,
    TypeAlias,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    runtime_checkable,
)

from coordinator.errors import FrameError, InvalidXidError, ProgrammingError
from coordinator.xid import Xid

MAGIC = b"TPCM"
#: the handshake's version: HELLO, AUTH, WELCOME and a handshake's ERROR carry it whatever
#: version the connection then speaks, so any client can read a HELLO (and the default HELLO
#: ``versions``)
PROTOCOL_VERSION = 1
#: version 2 adds ORIGIN: a transfer says which log (its durable identity) it carries
ORIGIN_VERSION = 2
HANDSHAKE_VERSIONS = frozenset({PROTOCOL_VERSION})
SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION, ORIGIN_VERSION})
HEADER = struct.Struct(">4sBBHII")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
KNOWN_FLAGS = 0x0000
MAX_DEPTH = 16

Value: TypeAlias = (
    bool | int | float | str | bytes | Sequence["Value"] | Mapping[str, "Value"] | None
)

_NONE, _FALSE, _TRUE, _UINT, _NINT, _FLOAT, _BYTES, _STR, _LIST, _MAP = range(10)
_F64 = struct.Struct(">d")
_U64 = 2**64


class FrameType(enum.IntEnum):
    """Frame type numbers. Do not renumber: they are the wire protocol."""

    HELLO = 1
    AUTH = 2
    WELCOME = 3
    ERROR = 4
    PING = 5
    PONG = 6
    MSG = 16
    ACK = 17
    NACK = 18
    ORIGIN = 19
    XA_START = 32
    XA_PREPARE = 33
    XA_COMMIT = 34
    XA_ROLLBACK = 35
    XA_RECOVER = 36
    XA_FORGET = 37
    XA_REPLY = 47


def bad_frame(what: str, message: str, expected: object = None, got: object = None) -> FrameError:
    """The one way this module reports a bad frame: which check, what it wanted, what came."""
    return FrameError(f"bad frame ({what}): {message}", what=what, expected=expected, got=got)


def _misuse(message: str) -> ProgrammingError:
    return ProgrammingError(f"cannot encode frame: {message}")


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


# -- frame schemas -------------------------------------------------------------------------------

_Conv = Callable[[Any], Any]


def _exact(kind: type) -> tuple[_Conv, _Conv]:
    def check(v: Any) -> Any:
        if type(v) is not kind:  # bool is an int, and a seq number is not a bool
            raise TypeError(f"expected {kind.__name__}, got {type(v).__name__}")
        return v

    return check, check


def _xid_to_wire(v: Any) -> Value:
    if not isinstance(v, Xid):
        raise TypeError(f"expected Xid, got {type(v).__name__}")
    return [v.format_id, v.gtrid, v.bqual]


def _xid_from_wire(v: Any) -> Xid:
    if not (isinstance(v, list) and len(v) == 3):
        raise TypeError("an xid is [format_id, gtrid, bqual]")
    return Xid(*v)  # validates: a malformed xid never gets past the boundary


def _convs(hint: Any) -> tuple[_Conv, _Conv]:
    """(to_wire, from_wire) for a field's annotation; both check types, raising TypeError."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Xid:
        return _xid_to_wire, _xid_from_wire
    if hint in (bool, int, float, str, bytes):
        return _exact(hint)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        to_inner, from_inner = _convs(next(a for a in args if a is not type(None)))
        return (lambda v: None if v is None else to_inner(v)), (
            lambda v: None if v is None else from_inner(v)
        )
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        to_item, from_item = _convs(args[0])

        def to_seq(v: Any) -> list[Any]:
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"expected a sequence, got {type(v).__name__}")
            return [to_item(i) for i in v]

        def from_seq(v: Any) -> tuple[Any, ...]:
            if not isinstance(v, list):
                raise TypeError(f"expected a list, got {type(v).__name__}")
            return tuple(from_item(i) for i in v)

        return to_seq, from_seq
    if origin is Mapping:

        def check_map(v: Any) -> Any:
            if not isinstance(v, Mapping):
                raise TypeError(f"expected a map, got {type(v).__name__}")
            return v

        return check_map, check_map  # a decoded map is a fresh dict already
    raise TypeError(f"no wire form for annotation {hint!r}")


@dataclass(frozen=True)
class _Field:
    name: str
    required: bool
    default: Callable[[], Any]
    to_wire: _Conv
    from_wire: _Conv


_T = TypeVar("_T")
_SCHEMAS: dict[FrameType, tuple[type[Any], tuple[_Field, ...]]] = {}


def _frame(*types_: FrameType) -> Callable[[type[_T]], type[_T]]:
    """Register a frame dataclass for its frame types: its annotations are its wire schema.

    A field named ``verb`` is the frame type itself, carried by the header, not the payload.
    """

    def register(cls: type[_T]) -> type[_T]:
        hints = get_type_hints(cls)
        specs = []
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name == "verb":
                continue
            factory: Any = f.default_factory
            default = factory if factory is not MISSING else (lambda d=f.default: d)
            required = f.default is MISSING and factory is MISSING
            specs.append(_Field(f.name, required, default, *_convs(hints[f.name])))
        for ftype in types_:
            _SCHEMAS[ftype] = (cls, tuple(specs))
        return cls

    return register


@_frame(FrameType.HELLO)
@dataclass(frozen=True, slots=True)
class Hello:
    """Server -> client, first on every connection: a fresh challenge nonce and our versions."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO
    nonce: bytes
    server_id: str
    versions: tuple[int, ...] = (PROTOCOL_VERSION,)


@_frame(FrameType.AUTH)
@dataclass(frozen=True, slots=True)
class Auth:
    """Client -> server: the proof that we hold the secret, bound to this connection's nonces."""

    TYPE: ClassVar[FrameType] = FrameType.AUTH
    client_id: str
    nonce: bytes
    role: str
    version: int
    proof: bytes


@_frame(FrameType.WELCOME)
@dataclass(frozen=True, slots=True)
class Welcome:
    """Server -> client: accepted, and the server's own proof (mutual authentication)."""

    TYPE: ClassVar[FrameType] = FrameType.WELCOME
    proof: bytes


@_frame(FrameType.ERROR)
@dataclass(frozen=True, slots=True)
class ErrorFrame:
    """Sent just before closing: a stable ``code`` (``bad-frame``, ``auth-failed``...) and text."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR
    code: str
    message: str = ""


@_frame(FrameType.PING)
@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness probe; the peer answers `Pong` with the same token."""

    TYPE: ClassVar[FrameType] = FrameType.PING
    token: int = 0


@_frame(FrameType.PONG)
@dataclass(frozen=True, slots=True)
class Pong:
    TYPE: ClassVar[FrameType] = FrameType.PONG
    token: int = 0


@_frame(FrameType.MSG)
@dataclass(frozen=True, slots=True)
class Msg:
    """One committed message of a stream. The cursor accepts it only if ``seq`` is above the last
    number it accepted in (``stream``, ``epoch``) and ``prev`` is not (the messages between were
    acknowledged or expired; see `resource_managers.sequencing.classify`); ``seq`` becomes the
    new last. ``expires_at_ms``
    is wall-clock milliseconds since the Unix epoch, None for never."""

    TYPE: ClassVar[FrameType] = FrameType.MSG
    stream: str
    epoch: int
    seq: int
    prev: int
    message_id: str
    destination: str
    body: bytes
    headers: Mapping[str, Value] = field(default_factory=dict)
    expires_at_ms: int | None = None
    persistent: bool = True
    redelivered: bool = False
    delivery_count: int = 0


@_frame(FrameType.ACK)
@dataclass(frozen=True, slots=True)
class Ack:
    """Order acknowledgment: every message of (``stream``, ``epoch``) up to ``seq`` is durable."""

    TYPE: ClassVar[FrameType] = FrameType.ACK
    stream: str
    epoch: int
    seq: int


@_frame(FrameType.NACK)
@dataclass(frozen=True, slots=True)
class Nack:
    """The receiver refuses message ``seq`` for good; ``reason`` is a stable code."""

    TYPE: ClassVar[FrameType] = FrameType.NACK
    stream: str
    epoch: int
    seq: int
    reason: str
    detail: str = ""


@_frame(FrameType.ORIGIN)
@dataclass(frozen=True, slots=True)
class Origin:
    """Log -> cursor, the first frame of a transfer in version 2: the log's durable identity
    (its streams at the cursor are its own) and the incarnation of the process sending, so a
    cursor can refuse an older process that claims the same identity."""

    TYPE: ClassVar[FrameType] = FrameType.ORIGIN
    log: str
    incarnation: int


XA_VERBS = frozenset(FrameType(t) for t in range(FrameType.XA_START, FrameType.XA_FORGET + 1))


@_frame(*sorted(XA_VERBS))
@dataclass(frozen=True, slots=True)
class XaRequest:
    """An XA verb (``XA_START`` .. ``XA_FORGET``) for a remote resource; ``verb`` is the frame type.

    ``args`` is open on purpose: each verb defines its keys (``one_phase`` for commit...).
    ``request_id`` pairs the `XaReply`; ``xid`` is validated as an `Xid` when decoded.
    """

    verb: FrameType
    request_id: int
    xid: Xid | None = None
    args: Mapping[str, Value] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verb not in XA_VERBS:
            raise ProgrammingError(f"{self.verb!r} is not an XA verb")

    @property
    def TYPE(self) -> FrameType:
        return self.verb


@_frame(FrameType.XA_REPLY)
@dataclass(frozen=True, slots=True)
class XaReply:
    """The answer to request ``request_id``: ``status`` "ok" or an error code, and a result map
    (``vote``, ``outcome``, ``xids``...) whose keys the verb defines."""

    TYPE: ClassVar[FrameType] = FrameType.XA_REPLY
    request_id: int
    status: str = "ok"
    result: Mapping[str, Value] = field(default_factory=dict)
    message: str = ""


Frame: TypeAlias = (
    Hello
    | Auth
    | Welcome
    | ErrorFrame
    | Ping
    | Pong
    | Msg
    | Ack
    | Nack
    | Origin
    | XaRequest
    | XaReply
)


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
    out = _encode_msg(frame) if type(frame) is Msg else None
    if out is None:
        out = _encode_generic(frame)
    if len(out) > max_frame:
        raise _misuse(f"{len(out)} bytes exceed the frame limit of {max_frame}")
    length = len(out) - HEADER_SIZE
    HEADER.pack_into(out, 0, MAGIC, version, frame.TYPE, 0, length, 0)
    crc = zlib.crc32(memoryview(out)[HEADER_SIZE:], zlib.crc32(memoryview(out)[:12]))
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
    if ftype not in _SCHEMAS:
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
    crc = zlib.crc32(payload, zlib.crc32(memoryview(header_bytes)[:12]))
    if crc != header.crc:
        raise bad_frame("crc", "checksum mismatch", header.crc, crc)
    if header.type is FrameType.MSG:
        msg = _decode_msg(payload)
        if msg is not None:
            return msg
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


# -- I/O -------------------------------------------------------------------------------------------


@runtime_checkable
class _Socket(Protocol):
    def recv_into(self, buffer: Any, nbytes: int = ..., flags: int = ...) -> int: ...


class _Stream(Protocol):
    def readinto(self, buffer: Any) -> int | None: ...


class FrameReader:
    """Frames from a blocking socket (``recv_into``) or binary stream (``readinto``).

    No read-ahead by default: it asks for exactly the rest of the current header or payload,
    never a byte of the next frame, so the handshake's small pre-auth reader can hand the socket
    on to a full-size reader with nothing lost, and a bad header costs one 16-byte read. Pass the
    socket itself: ``sock.makefile()`` reads ahead, and what it took would be lost to the next
    reader. ``read_ahead`` (bytes) is for the last reader of a socket, which nothing follows (a
    `Connection`'s): it reads up to that much at a time, so a burst of small frames costs one
    system call, not two per frame; `pending` tells how much it holds that ``select`` cannot see.
    A socket timeout keeps the part already read: call `read` again. After a `FrameError` every
    call raises it again, because the stream is out of step and must be closed.
    """

    def __init__(
        self,
        source: _Socket | _Stream,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        versions: frozenset[int] = SUPPORTED_VERSIONS,
        read_ahead: int = 0,
    ) -> None:
        if not HEADER_SIZE < max_frame <= HEADER_SIZE + 0xFFFFFFFF:
            raise ProgrammingError(
                f"max_frame {max_frame} must exceed the {HEADER_SIZE}-byte header"
            )
        self._recv = source.recv_into if isinstance(source, _Socket) else source.readinto
        self.max_frame = max_frame
        self.versions = versions
        self._head = bytearray(HEADER_SIZE)
        self._header: Header | None = None
        self._payload = bytearray()
        self._got = 0
        self._failed: FrameError | None = None
        self._ahead = memoryview(bytearray(read_ahead))  # bytes read past the current frame
        self._ahead_at = self._ahead_end = 0

    def pending(self) -> int:
        """Bytes already read from the source and not yet returned in a frame."""
        return self._ahead_end - self._ahead_at

    def _fill(self, buf: bytearray, *, boundary: bool) -> bool:
        view = memoryview(buf)
        n: int | None
        while self._got < len(buf):
            want = len(buf) - self._got
            if self._ahead_end > self._ahead_at:  # read ahead before: take from there first
                n = min(want, self._ahead_end - self._ahead_at)
                view[self._got : self._got + n] = self._ahead[self._ahead_at : self._ahead_at + n]
                self._ahead_at += n
                self._got += n
                continue
            if want < len(self._ahead):  # small: read what has come, up to the buffer's size
                n = self._recv(self._ahead)
                if n:
                    self._ahead_at, self._ahead_end = 0, n
                    continue
            else:  # large (or no read-ahead): straight into place
                n = self._recv(view[self._got :])
            if n is None:
                raise ProgrammingError("FrameReader needs a blocking stream")
            if n == 0:
                if boundary and self._got == 0:
                    return False
                where = "header" if boundary else "payload"
                raise bad_frame(
                    "truncated", f"connection closed inside a frame {where}", len(buf), self._got
                )
            self._got += n
        self._got = 0
        return True

    def read(self) -> Frame | None:
        """The next frame, or None when the peer closed cleanly between frames."""
        if self._failed is not None:
            raise self._failed
        try:
            if self._header is None:
                if not self._fill(self._head, boundary=True):
                    return None
                self._header = parse_header(
                    self._head, max_frame=self.max_frame, versions=self.versions
                )
                self._payload = bytearray(self._header.length)  # only now: the length passed
            self._fill(self._payload, boundary=False)
            header, self._header = self._header, None
            payload, self._payload = self._payload, bytearray()
            return decode_payload(self._head, header, payload)
        except FrameError as exc:
            self._failed = exc
            raise

    def __iter__(self) -> Iterator[Frame]:
        while (frame := self.read()) is not None:
            yield frame


class _Sender(Protocol):
    def sendall(self, data: bytes, /) -> None: ...


def send_frame(
    sock: _Sender,
    frame: Frame,
    *,
    version: int = PROTOCOL_VERSION,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> None:
    """Encode and send one frame; callers sharing a socket between threads hold a lock. After
    the handshake, ``version`` is the one it chose (`auth.Peer.version`)."""
    sock.sendall(encode(frame, version=version, max_frame=max_frame))


async def read_frame(
    reader: asyncio.StreamReader,
    *,
    max_frame: int = DEFAULT_MAX_FRAME,
    versions: frozenset[int] = SUPPORTED_VERSIONS,
) -> Frame | None:
    """The asyncio twin of `FrameReader.read`. Cancelled mid-frame, the stream is out of step."""
    try:
        head = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise bad_frame(
            "truncated", "connection closed inside a frame header", HEADER_SIZE, len(exc.partial)
        ) from None
    header = parse_header(head, max_frame=max_frame, versions=versions)
    try:
        payload = await reader.readexactly(header.length)
    except asyncio.IncompleteReadError as exc:
        raise bad_frame(
            "truncated", "connection closed inside a frame payload", header.length, len(exc.partial)
        ) from None
    return decode_payload(head, header, payload)


async def write_frame(
    writer: asyncio.StreamWriter,
    frame: Frame,
    *,
    version: int = PROTOCOL_VERSION,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> None:
    """The asyncio twin of `send_frame`."""
    writer.write(encode(frame, version=version, max_frame=max_frame))
    await writer.drain()
