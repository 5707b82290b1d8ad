"""The one validation of a message, wherever it enters: a local producer (`outgoing`), a remote
producer and a transfer frame (`check_message` on the message they decoded), and the stores
themselves before they write it (`MessageLog.prepare`/`commit`, `Cursor.deliver_many`).

Every rule `docs/messaging.md` states about a message is here and nowhere else, so a message one
path accepts cannot be refused, or worse fail to replay, on another: a value that passed
`check_message` has a well-formed id, destination, headers (reserved ones included: its
``priority``, ``transactional`` and ``admin_queue`` properties cannot raise), body and expiry.
Every refusal is an `InvalidMessageError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import cast

from coordinator.errors import ProgrammingError

from ._ids import new_id
from ._options import DEFAULT, SendOptions
from ._records import (
    ADMIN_QUEUE_HEADER,
    DLQ_SUFFIX,
    KEY_HEADER,
    LIST_HEADER,
    PRIORITY_HEADER,
    PUBLISHER_HEADER,
    TOPIC_PREFIX,
    TRANSACTIONAL_HEADER,
    Message,
)

#: a destination: 1-200 characters, starting with a letter or digit; ``#`` is kept for the log
_DESTINATION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}\Z")
MAX_HEADERS = 64
MAX_HEADER_CHARS = 4096
#: a message id: 1-128 printable ASCII characters (a producer's are uuid4 hex)
MAX_MESSAGE_ID_CHARS = 128


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


def _validate_headers(headers: object) -> None:
    if type(headers) is dict and not headers:  # most messages: nothing to walk or to reserve
        return
    if not isinstance(headers, Mapping) or len(headers) > MAX_HEADERS:
        raise InvalidMessageError(f"headers must be a mapping of at most {MAX_HEADERS} entries")
    for key, value in headers.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise InvalidMessageError(
                f"header {str(key)[:80]!r}: names and values must be str (name non-empty)"
            )
        if len(key) + len(value) > MAX_HEADER_CHARS:
            raise InvalidMessageError(
                f"header {key[:80]!r} is longer than {MAX_HEADER_CHARS} characters"
            )
    _check_reserved(headers)


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
    for key in (PUBLISHER_HEADER, LIST_HEADER, KEY_HEADER):
        if key in headers and not 0 < len(headers[key]) <= 200:
            raise InvalidMessageError(f"header {key!r} must be 1-200 characters")


#: set on a `Message` that passed `check_message`: its size, so a later check (a store's, after
#: the entry path's) only compares that with its limit. A `Message` is frozen and the entry paths
#: build its headers as their own copy, so what passed once still holds.
_CHECKED_SIZE = "_twopc_checked_size"


def check_message(message: Message, *, max_bytes: int | None = None) -> Message:
    """``message`` if it is one a producer could have sent (and, with ``max_bytes``, within that
    size); else `InvalidMessageError`. The check every entry path and both stores share; a
    message checked before is judged by its recorded size only (see `_CHECKED_SIZE`)."""
    size = message.__dict__.get(_CHECKED_SIZE) if type(message) is Message else None
    if size is None:
        size = _check_fields(message)
    if max_bytes is not None and size > max_bytes:
        raise _too_large(size, max_bytes)
    return message


def _too_large(size: int, max_bytes: int) -> InvalidMessageError:
    return InvalidMessageError(
        f"message of {size} bytes (body and headers) exceeds the limit of {max_bytes}; nothing "
        "was staged"
    )


def _check_fields(message: Message) -> int:
    """Every rule but the size limit; the message's size, recorded on it (`_CHECKED_SIZE`)."""
    mid = message.message_id
    if not (
        isinstance(mid, str)
        and 0 < len(mid) <= MAX_MESSAGE_ID_CHARS
        and mid.isascii()
        and mid.isprintable()
    ):
        raise InvalidMessageError(
            f"message id {str(mid)[:80]!r}: 1-{MAX_MESSAGE_ID_CHARS} printable ASCII characters"
        )
    _check_destination(message.destination)
    if not isinstance(message.body, bytes):
        raise InvalidMessageError(f"body must be bytes, not {type(message.body).__name__}")
    _validate_headers(message.headers)
    if not isinstance(message.persistent, bool):
        raise InvalidMessageError("persistent must be a bool")
    expires = message.expires_at
    if expires is not None and (type(expires) is not int or expires < 0):
        raise InvalidMessageError(f"expiry must be a non-negative integer (ms), not {expires!r}")
    size = message.size
    if type(message) is Message:
        object.__setattr__(message, _CHECKED_SIZE, size)  # frozen: the one write, after checks
    return size


#: destinations `_check_destination` accepted: a producer names a few of them, many times over,
#: and a dict lookup costs less than the pattern and the suffix tests (emptied when full)
_ACCEPTED: dict[str, None] = {}
_ACCEPTED_MAX = 4096


def _check_destination(destination: object) -> str:
    """A destination a producer may name: valid, not a dead-letter queue, not a subscription's
    queue (nor a topic without a name)."""
    if type(destination) is str and destination in _ACCEPTED:
        return destination
    destination = _refuse_bad_destination(destination)
    if type(destination) is str:
        if len(_ACCEPTED) >= _ACCEPTED_MAX:
            _ACCEPTED.clear()
        _ACCEPTED[destination] = None
    return destination


def _refuse_bad_destination(destination: object) -> str:
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
    return destination


def new_message(
    destination: object,
    *,
    body: object,
    headers: object,
    persistent: bool,
    ttl: float | None,
    now_ms: int,
    max_bytes: int | None = None,
) -> Message:
    """A validated message with a fresh uuid4 id; every refusal is an `InvalidMessageError`."""
    if not isinstance(body, bytes | bytearray | memoryview):
        raise InvalidMessageError(f"body must be bytes, not {type(body).__name__}")
    expires_at = None
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < 10**9:
            raise InvalidMessageError(f"ttl must be a positive number of seconds, not {ttl!r}")
        expires_at = now_ms + max(1, round(ttl * 1000))
    if headers is not None and not isinstance(headers, Mapping):
        raise InvalidMessageError(f"headers must be a mapping, not {type(headers).__name__}")
    message = Message(
        new_id(),
        cast(str, destination),  # checked below, with everything else
        bytes(body),
        dict(headers or {}),
        bool(persistent),
        expires_at,
    )
    return check_message(message, max_bytes=max_bytes)


def outgoing(
    destinations: Sequence[object],
    *,
    body: object,
    headers: Mapping[str, str] | None,
    options: SendOptions = DEFAULT,
    now_ms: int,
    max_bytes: int,
) -> list[Message]:
    """The messages one send stages: one per destination, each checked (`InvalidMessageError`
    for the first refusal, so a producer stages all or nothing). More than one destination is a
    distribution list (MSMQ): every copy carries the list's id in `LIST_HEADER`, and its own
    message id, since each destination consumes and acknowledges its copy on its own. ``key``
    (`KEY_HEADER`) picks the partition of a partitioned destination (`_partition`)."""
    if isinstance(destinations, str) or not destinations:
        raise InvalidMessageError("a send needs one destination or a non-empty list of them")
    if len(set(destinations)) != len(destinations):
        raise InvalidMessageError("a distribution list names a destination twice")
    persistent, ttl, priority, admin_queue, transactional, publisher, key = options
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
    if key is not None:
        if not isinstance(key, str):
            raise InvalidMessageError(f"key must be a str, not {type(key).__name__}")
        merged[KEY_HEADER] = key
    if len(destinations) > 1:
        merged[LIST_HEADER] = new_id()
    return [
        new_message(
            destination,
            body=body,
            headers=merged,
            persistent=persistent,
            ttl=ttl,
            now_ms=now_ms,
            max_bytes=max_bytes,
        )
        for destination in destinations
    ]


def copies_with_bodies(
    first: Message, bodies: Sequence[object], *, max_bytes: int
) -> list[Message]:
    """``first`` (a message `check_message` passed), then one message per body of ``bodies``
    with everything else of ``first`` but a fresh id: a batch send to one destination. Only
    what differs is checked again (the body's type and the size limit); the headers are each
    message's own copy, as `new_message` makes them. `InvalidMessageError` for the first
    refusal, so a batch stages all or nothing."""
    checked = first.__dict__.get(_CHECKED_SIZE)
    if checked is None:
        raise ProgrammingError("copies_with_bodies needs a checked first message")
    extra = checked - len(first.body)  # the headers' share of the size
    out = [first]
    dest, headers, persistent, expires = (
        first.destination,
        first.headers,
        first.persistent,
        first.expires_at,
    )
    for given in bodies:
        body = given if type(given) is bytes else None
        if body is None:  # as `new_message` takes a body: any bytes-like, kept as bytes
            if not isinstance(given, bytes | bytearray | memoryview):
                raise InvalidMessageError(f"body must be bytes, not {type(given).__name__}")
            body = bytes(given)
        size = len(body) + extra
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        message = Message(new_id(), dest, body, dict(headers), persistent, expires)
        object.__setattr__(message, _CHECKED_SIZE, size)  # as `_check_fields` records it
        out.append(message)
    return out
