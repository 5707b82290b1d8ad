"""Messages and the message log's journal records, as values, with a strict codec.

Records are JSON objects with one-letter keys (ASCII, so the journal's frame magic never appears
in a payload; bodies travel as base64). Decoding is strict: a record that passes its CRC but not
its schema was not written by this code, and guessing at it could lose or duplicate a message, so
it is reported as `LogCorruptionError`.

Kinds (``k``):

- ``O`` open: ``n`` the incarnation number chosen at this open (forced; see ``_state``).
- ``P`` prepare: ``g`` gid, ``m`` the persistent messages (forced).
- ``C`` commit: ``g`` gid, ``s`` one ``[stream, seq]`` per message of its ``P``, in order (forced).
- ``1`` one-phase commit: ``g``, ``m`` and ``s`` together, in one forced write.
- ``R`` rollback: ``g``, ``t`` wall-clock ms: the tombstone (lazy).
- ``F`` forget: ``g`` (lazy).
- ``A`` acknowledged: ``q`` stream, ``e`` epoch, ``u`` up to and including this number (lazy).
- ``D`` dropped (expired): ``q`` stream, ``e`` epoch, ``l`` the numbers (lazy).
- ``S`` stream state, carried by rollover: ``q``, ``e``, ``x`` next number, ``a`` acknowledged.
- ``Q`` a committed unacknowledged message, carried by rollover: ``q``, ``n`` number, ``o``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import LogCorruptionError, ProgrammingError

#: a destination: 1-200 characters, starting with a letter or digit; ``#`` is kept for the log
_DESTINATION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}\Z")
#: the suffix of a destination's non-persistent stream (never a valid destination character)
VOLATILE_SUFFIX = "#np"
#: a destination starting with this is a topic (publish/subscribe, seed 003); a topic's name has
#: no ``/``, which joins it to a subscription's name in the subscription's queue
TOPIC_PREFIX = "topic:"
#: ``<queue>.DLQ`` is the queue's dead-letter queue at the cursor: only the cursor puts messages
#: there, so a producer cannot mix its messages with dead letters
DLQ_SUFFIX = ".DLQ"
MAX_HEADERS = 64
MAX_HEADER_CHARS = 4096

# Reserved headers: the JMS message properties that are not the body (priority, the MSMQ
# administration queue, whether it was sent in a transaction, the publisher whose order the
# dispatcher keeps, the distribution list a copy belongs to). They travel as headers so the log's
# records, the transfer frames and the remote protocol carry them unchanged; `new_message` checks
# their values wherever a message enters.
PRIORITY_HEADER = "twopc-priority"
ADMIN_QUEUE_HEADER = "twopc-admin-queue"
TRANSACTIONAL_HEADER = "twopc-transactional"
PUBLISHER_HEADER = "twopc-publisher"
LIST_HEADER = "twopc-list"
DEFAULT_PRIORITY = 4  # JMS's default; 0 (lowest) to 9 (highest)


class InvalidMessageError(ProgrammingError, ValueError):
    """A message the log refuses at ``send``: bad destination, headers, body or size."""

    code = "mlog-invalid-message"


def validate_destination(destination: object) -> str:
    if not isinstance(destination, str) or not _DESTINATION.match(destination):
        raise InvalidMessageError(
            f"invalid destination {str(destination)[:80]!r}: 1-200 characters from letters, "
            "digits, '.', '_', ':', '/', '-', starting with a letter or digit"
        )
    return destination


def _validate_headers(headers: object) -> dict[str, str]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping) or len(headers) > MAX_HEADERS:
        raise InvalidMessageError(f"headers must be a mapping of at most {MAX_HEADERS} entries")
    for key, value in headers.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise InvalidMessageError(
                f"header {key!r}: names and values must be str (name non-empty)"
            )
        if len(key) + len(value) > MAX_HEADER_CHARS:
            raise InvalidMessageError(
                f"header {key!r} is longer than {MAX_HEADER_CHARS} characters"
            )
    _check_reserved(headers)
    return dict(headers)


def _check_reserved(headers: Mapping[str, str]) -> None:
    priority = headers.get(PRIORITY_HEADER)
    if priority is not None and (len(priority) != 1 or priority not in "0123456789"):
        raise InvalidMessageError(f"priority must be 0-9, not {priority[:20]!r}")
    admin = headers.get(ADMIN_QUEUE_HEADER)
    if admin is not None and (
        validate_destination(admin).startswith(TOPIC_PREFIX) or admin.endswith(DLQ_SUFFIX)
    ):
        raise InvalidMessageError(f"admin queue {admin[:80]!r} must be a plain queue")
    if headers.get(TRANSACTIONAL_HEADER, "1") not in ("0", "1"):
        raise InvalidMessageError(f"header {TRANSACTIONAL_HEADER!r} must be '0' or '1'")
    for key in (PUBLISHER_HEADER, LIST_HEADER):
        if key in headers and not 0 < len(headers[key]) <= 200:
            raise InvalidMessageError(f"header {key!r} must be 1-200 characters")


@dataclass(frozen=True)
class Message:
    """One message. ``expires_at``: wall-clock milliseconds since the epoch, or None (never)."""

    message_id: str
    destination: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    persistent: bool = True
    expires_at: int | None = None

    @property
    def size(self) -> int:
        """What counts against ``max_message_bytes``: body plus headers, UTF-8."""
        return len(self.body) + sum(
            len(k.encode()) + len(v.encode()) for k, v in self.headers.items()
        )

    @property
    def stream(self) -> str:
        return self.destination if self.persistent else self.destination + VOLATILE_SUFFIX

    @property
    def priority(self) -> int:
        return int(self.headers.get(PRIORITY_HEADER, DEFAULT_PRIORITY))

    @property
    def admin_queue(self) -> str | None:
        """Where a negative acknowledgment goes if a destination rejects the message (seed 004)."""
        return self.headers.get(ADMIN_QUEUE_HEADER)

    @property
    def transactional(self) -> bool:
        """Sent inside a transaction (the default): a non-transactional queue rejects it."""
        return self.headers.get(TRANSACTIONAL_HEADER, "1") == "1"

    @property
    def publisher(self) -> str:
        """Whose order topic dispatch keeps: the publisher header, else the destination."""
        return self.headers.get(PUBLISHER_HEADER) or self.destination


def new_message(
    destination: object,
    *,
    body: object,
    headers: object,
    persistent: bool,
    ttl: float | None,
    now_ms: int,
) -> Message:
    """A validated message with a fresh uuid4 id; every refusal is an `InvalidMessageError`."""
    if not isinstance(body, bytes | bytearray | memoryview):
        raise InvalidMessageError(f"body must be bytes, not {type(body).__name__}")
    expires_at = None
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < 10**9:
            raise InvalidMessageError(f"ttl must be a positive number of seconds, not {ttl!r}")
        expires_at = now_ms + max(1, round(ttl * 1000))
    destination = validate_destination(destination)
    if destination.endswith(DLQ_SUFFIX):
        raise InvalidMessageError(
            f"{destination[:80]!r} is a dead-letter queue: only the cursor puts messages there "
            "(replay them with `twopc dlq replay`)"
        )
    if destination.startswith(TOPIC_PREFIX) and ("/" in destination or destination == TOPIC_PREFIX):
        raise InvalidMessageError(
            f"invalid topic {destination[:80]!r}: a topic name follows {TOPIC_PREFIX!r} and has "
            "no '/' (a subscription's queue is <topic>/<name>: receive from it, never send to it)"
        )
    return Message(
        uuid.uuid4().hex,
        destination,
        bytes(body),
        _validate_headers(headers),
        bool(persistent),
        expires_at,
    )


def outgoing(
    destinations: Sequence[object],
    *,
    body: object,
    headers: Mapping[str, str] | None,
    persistent: bool,
    ttl: float | None,
    priority: int | None,
    admin_queue: str | None,
    transactional: bool,
    publisher: str | None,
    now_ms: int,
    max_bytes: int,
) -> list[Message]:
    """The messages one send stages: one per destination, each checked (`InvalidMessageError`
    for the first refusal, so a producer stages all or nothing). More than one destination is a
    distribution list (seed 004): every copy carries the list's id in `LIST_HEADER`, and its own
    message id, since each destination consumes and acknowledges its copy on its own."""
    if isinstance(destinations, str) or not destinations:
        raise InvalidMessageError("a send needs one destination or a non-empty list of them")
    if len(set(destinations)) != len(destinations):
        raise InvalidMessageError("a distribution list names a destination twice")
    merged = dict(headers or {})
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
            raise InvalidMessageError(f"priority must be an int from 0 to 9, not {priority!r}")
        merged[PRIORITY_HEADER] = str(priority)
    if admin_queue is not None:
        merged[ADMIN_QUEUE_HEADER] = admin_queue
    if not transactional:
        merged[TRANSACTIONAL_HEADER] = "0"
    if publisher is not None:
        merged[PUBLISHER_HEADER] = publisher
    if len(destinations) > 1:
        merged[LIST_HEADER] = uuid.uuid4().hex
    out = []
    for destination in destinations:
        message = new_message(
            destination, body=body, headers=merged, persistent=persistent, ttl=ttl, now_ms=now_ms
        )
        if message.size > max_bytes:
            raise InvalidMessageError(
                f"message of {message.size} bytes (body and headers) exceeds the limit of "
                f"{max_bytes}; nothing was staged"
            )
        out.append(message)
    return out


# -- records -----------------------------------------------------------------------------------


def message_obj(m: Message) -> dict[str, Any]:
    """``p`` is written only for a non-persistent message (the cursor keeps those too), so
    records of persistent ones are unchanged and old journals still read."""
    obj = {
        "i": m.message_id,
        "d": m.destination,
        "h": m.headers,
        "b": base64.b64encode(m.body).decode("ascii"),
        "x": m.expires_at,
    }
    if not m.persistent:
        obj["p"] = False
    return obj


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def decode(payload: bytes) -> dict[str, Any]:
    """Parse and check one record's shape; the state applies it."""
    try:
        obj = json.loads(payload)
        if not isinstance(obj, dict):
            raise TypeError("record is not an object")
        kind = obj["k"]
        for key in _SCHEMA[kind]:
            _CHECKS[key](obj[key])
        return obj
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise LogCorruptionError(
            f"undecodable message log record {payload[:120]!r}: {exc}"
        ) from exc


def to_message(obj: object) -> Message:
    if not isinstance(obj, dict):
        raise TypeError("message is not an object")
    headers = obj["h"]
    expires = obj["x"]
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int)):
        raise TypeError("expiry is not an integer")
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise TypeError("headers are not str -> str")
    persistent = obj.get("p", True)
    if not isinstance(persistent, bool):
        raise TypeError("persistent is not a boolean")
    return Message(
        _str(obj["i"]),
        _str(obj["d"]),
        base64.b64decode(_str(obj["b"]), validate=True),
        headers,
        persistent,
        expires,
    )


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _int(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{value!r} is not a non-negative integer")


def _messages(value: object) -> None:
    if not isinstance(value, list):
        raise TypeError("messages are not a list")
    for m in value:
        to_message(m)


def _ints(value: object) -> None:
    if not isinstance(value, list):
        raise TypeError("numbers are not a list")
    for n in value:
        _int(n)


def _numbers(value: object) -> None:
    if not isinstance(value, list):
        raise TypeError("numbers are not a list")
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            raise TypeError("a number is not [stream, seq]")
        _str(pair[0])
        _int(pair[1])


_CHECKS: dict[str, Any] = {
    "g": _str, "q": _str, "m": _messages, "s": _numbers, "n": _int, "t": _int,
    "e": _int, "u": _int, "x": _int, "a": _int, "o": to_message, "l": _ints,
}  # fmt: skip
_SCHEMA: dict[str, tuple[str, ...]] = {
    "O": ("n",),
    "P": ("g", "m"),
    "C": ("g", "s"),
    "1": ("g", "m", "s"),
    "R": ("g", "t"),
    "F": ("g",),
    "A": ("q", "e", "u"),
    "D": ("q", "e", "l"),
    "S": ("q", "e", "x", "a"),
    "Q": ("q", "n", "o"),
}
