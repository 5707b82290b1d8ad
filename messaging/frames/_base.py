"""Constants, frame type numbers and the error every check raises."""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping, Sequence
from typing import (
    TypeAlias,
)

from coordinator.errors import FrameError, ProgrammingError

MAGIC = b"TPCM"
#: the handshake's version: HELLO, AUTH, WELCOME and a handshake's ERROR carry it whatever
#: version the connection then speaks, so any client can read a HELLO (and the default HELLO
#: ``versions``)
PROTOCOL_VERSION = 1
#: version 2 adds ORIGIN: a transfer says which log (its durable identity) it carries
ORIGIN_VERSION = 2
#: version 3 adds MSGS: a run of messages in one frame, in a fixed binary layout
BATCH_VERSION = 3
#: version 4: a remote producer's messages travel packed (one bytes value in a fixed layout)
PACKED_VERSION = 4
HANDSHAKE_VERSIONS = frozenset({PROTOCOL_VERSION})
SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION, ORIGIN_VERSION, BATCH_VERSION, PACKED_VERSION})
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
    MSGS = 20
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
