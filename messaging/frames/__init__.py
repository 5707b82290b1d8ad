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


The package: `_base` (constants, frame types, `bad_frame`), `_values` (the value encoding),
`_schema` (the frames and their schemas), `_codec` (the header and whole frames), `_io` (reading
and writing them on sockets and asyncio streams).
"""

from ._base import (
    BATCH_VERSION,
    DEFAULT_MAX_FRAME,
    HANDSHAKE_VERSIONS,
    HEADER,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    MAX_DEPTH,
    ORIGIN_VERSION,
    PACKED_VERSION,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    FrameType,
    Value,
    bad_frame,
)
from ._batch import MSGS_OVERHEAD, PackedMsg, pack_fields
from ._codec import Header, decode, decode_payload, encode, encode_many, parse_header
from ._io import FrameReader, read_frame, send_frame, write_frame
from ._schema import (
    XA_VERBS,
    Ack,
    Auth,
    ErrorFrame,
    Frame,
    Hello,
    Msg,
    MsgBatch,
    Nack,
    Origin,
    Ping,
    Pong,
    Welcome,
    XaReply,
    XaRequest,
)
from ._values import decode_value, encode_value

__all__ = [
    "BATCH_VERSION",
    "DEFAULT_MAX_FRAME",
    "HANDSHAKE_VERSIONS",
    "HEADER",
    "HEADER_SIZE",
    "KNOWN_FLAGS",
    "MAGIC",
    "MAX_DEPTH",
    "MSGS_OVERHEAD",
    "ORIGIN_VERSION",
    "PACKED_VERSION",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "XA_VERBS",
    "Ack",
    "Auth",
    "ErrorFrame",
    "Frame",
    "FrameReader",
    "FrameType",
    "Header",
    "Hello",
    "Msg",
    "MsgBatch",
    "Nack",
    "Origin",
    "PackedMsg",
    "Ping",
    "Pong",
    "Value",
    "Welcome",
    "XaReply",
    "XaRequest",
    "bad_frame",
    "decode",
    "decode_payload",
    "decode_value",
    "encode",
    "encode_many",
    "encode_value",
    "pack_fields",
    "parse_header",
    "read_frame",
    "send_frame",
    "write_frame",
]
