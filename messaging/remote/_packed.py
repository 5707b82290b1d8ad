"""A producer branch's messages as one bytes value (protocol version 4), in a fixed layout.

Why: a remote producer's messages travelled as a list of maps, each field named, tagged and
varint-framed, and walked one value at a time on both ends. For a branch of many messages (a
Spark partition sends a quarter of a million) that walk was most of the work: about 25 µs per
message to encode in the client and 30 µs to decode and re-check in the server, more than the
log's own staging, prepare record and commit together. Packed, the client writes each message
with one `struct` call and the server reads it with one, under the frame's one CRC.

The layout, big-endian, every byte used::

    count u32 (at least 1), then per message:
      flags u8 (1 persistent, 4 expires_at present; no other bit)
      expires_at u64 (0 without flag 4)
      len(id) u16 | len(destination) u16 | len(body) u32 | headers u16
      id, destination (UTF-8), body (raw)
      per header: len(name) u16 | len(value) u32 | name, value (UTF-8; each name once)

A length past the end, a byte left after the last message, an unknown flag, an expiry without
its flag, text that is not UTF-8, a header name twice or a count of 0 is a `BadRequestError`
(the request's shape is wrong, as a list holding a number would be); what the message says is
then judged by `check_message`, exactly as for the map form.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from coordinator.errors import ProgrammingError
from resource_managers.message_log import Message, check_message

from .protocol import BadRequestError

_COUNT = struct.Struct(">I")
_FIXED = struct.Struct(">BQHHIH")
_HEADER = struct.Struct(">HI")
_PERSISTENT, _EXPIRES = 1, 4
#: a packed message's bytes besides its id, destination, body and headers' text
FIXED_BYTES = _FIXED.size
HEADER_BYTES = _HEADER.size


def pack(messages: Sequence[Message]) -> bytes:
    """``messages`` (checked already, as `ProducerBranch.send` checks them) in the layout above.
    A message it cannot hold is a `ProgrammingError`: a checked one always fits."""
    if not messages:
        raise ProgrammingError("a packed run holds at least one message")
    fixed, header = _FIXED.pack, _HEADER.pack
    parts: list[bytes] = [_COUNT.pack(len(messages))]
    add = parts.append
    for m in messages:
        mid, dest, body, headers = m.message_id.encode(), m.destination.encode(), m.body, m.headers
        expires = m.expires_at
        flags = _PERSISTENT if m.persistent else 0
        if expires is not None:
            flags |= _EXPIRES
        try:
            add(fixed(flags, expires or 0, len(mid), len(dest), len(body), len(headers)))
        except struct.error as exc:  # a field too long for its length: never a checked message
            raise ProgrammingError(
                f"message {m.message_id[:80]!r} cannot be packed: {exc}"
            ) from exc
        add(mid)
        add(dest)
        add(body)
        for name, value in headers.items():
            raw_name, raw_value = name.encode(), value.encode()
            add(header(len(raw_name), len(raw_value)))
            add(raw_name)
            add(raw_value)
    return b"".join(parts)


def packed_size(m: Message) -> int:
    """``m``'s bytes in the layout, never low (text counted at 4 bytes a character, UTF-8's
    most; an id is ASCII), for cutting a branch into shares before any is packed."""
    size = FIXED_BYTES + len(m.message_id) + 4 * len(m.destination) + len(m.body)
    for name, value in m.headers.items():
        size += HEADER_BYTES + 4 * (len(name) + len(value))
    return size


def _bad(message: str) -> BadRequestError:
    return BadRequestError(f"packed messages: {message}")


def unpack(data: bytes) -> list[Message]:
    """The messages of a packed run, each checked by `check_message` (`InvalidMessageError` for
    what it says); `BadRequestError` for a run that breaks the layout."""
    end = len(data)
    if end < _COUNT.size:
        raise _bad("shorter than its count")
    (count,) = _COUNT.unpack_from(data, 0)
    if count == 0:
        raise _bad("a count of 0")
    # each message takes at least its fixed part: a count the bytes cannot hold is refused
    # before anything is allocated for it
    if count > (end - _COUNT.size) // FIXED_BYTES:
        raise _bad(f"a count of {count} in {end} bytes")
    view = memoryview(data)
    messages: list[Message] = []
    at = _COUNT.size
    try:
        for _ in range(count):
            message, at = _one(data, view, at, end)
            messages.append(check_message(message))
    except struct.error:
        raise _bad("a length past the end") from None
    except UnicodeDecodeError:
        raise _bad("text that is not UTF-8") from None
    if at != end:
        raise _bad(f"{end - at} bytes after the last message")
    return messages


def _one(data: bytes, view: memoryview, at: int, end: int) -> tuple[Message, int]:
    """The message at ``at`` and where the next begins (unchecked but for the layout)."""
    flags, expires, n_id, n_dest, n_body, n_headers = _FIXED.unpack_from(data, at)
    at += FIXED_BYTES
    if flags & ~(_PERSISTENT | _EXPIRES):
        raise _bad(f"unknown flags {flags:#x}")
    if not flags & _EXPIRES:
        if expires:
            raise _bad("an expiry without its flag")
        expires = None
    stop = at + n_id + n_dest + n_body
    if stop > end:
        raise _bad("a length past the end")
    mid = str(view[at : at + n_id], "utf-8")
    at += n_id
    dest = str(view[at : at + n_dest], "utf-8")
    body = data[at + n_dest : stop]
    headers: dict[str, str] = {}
    at = stop
    for _ in range(n_headers):
        n_name, n_value = _HEADER.unpack_from(data, at)
        at += HEADER_BYTES
        if at + n_name + n_value > end:
            raise _bad("a length past the end")
        name = str(view[at : at + n_name], "utf-8")
        at += n_name
        headers[name] = str(view[at : at + n_value], "utf-8")
        at += n_value
    if len(headers) != n_headers:
        raise _bad("a header name twice")
    return Message(mid, dest, body, headers, bool(flags & _PERSISTENT), expires), at
