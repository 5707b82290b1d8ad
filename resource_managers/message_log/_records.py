"""Messages and the message log's journal records, as values, with a strict codec.

Records are JSON objects with one-letter keys (ASCII, so the journal's frame magic never appears
in a payload; bodies travel as base64). Decoding is strict: a record that passes its CRC but not
its schema was not written by this code, and guessing at it could lose or duplicate a message, so
it is reported as `LogCorruptionError`.

Kinds (``k``):

- ``O`` open: ``n`` the incarnation number chosen at this open (forced; see ``_state``); ``i``
  the log's durable identity (optional: journals written before identities have none, and the
  first open that finds none chooses one and writes it here, in the same forced record).
- ``P`` prepare: ``g`` gid, ``m`` the persistent messages (forced). A branch too large for one
  record (`prepare_records`: past `PART_BYTES` of messages, estimated) is written as several
  ``P`` records of the same gid, each but the last with ``more`` (1), all forced by the last one's
  write: replay gathers them and the branch is prepared at the last; parts without their last
  (a crash in between) prepare nothing.
- ``C`` commit: ``g`` gid, ``s`` one ``[stream, seq]`` per message of its ``P``, in order (forced).
- ``1`` one-phase commit: ``g``, ``m`` and ``s`` together, in one forced write; with ``r`` (1)
  a carried branch's commit (`._carried`: lazy, and the gid is remembered until ``W``); its
  ``f``, if any, lists remembered gids to forget (as a ``W`` would).
- ``R`` rollback: ``g``, ``t`` wall-clock ms: the tombstone (forced for a branch whose ``P`` is
  on disk or being written, lazy otherwise).
- ``F`` forget: ``g`` (lazy).
- ``A`` acknowledged: ``q`` stream, ``e`` epoch, ``u`` up to and including this number (lazy).
- ``D`` dropped (expired): ``q`` stream, ``e`` epoch, ``l`` the numbers (lazy).
- ``S`` stream state, carried by rollover: ``q``, ``e``, ``x`` next number, ``a`` acknowledged.
- ``Q`` a committed unacknowledged message, carried by rollover: ``q``, ``n`` number, ``o``.
- ``K`` remembered carried commits, carried by rollover: ``w`` their gids.
- ``W`` forget carried commits (their decision rows are gone): ``w`` the gids (lazy).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coordinator.errors import LogCorruptionError

#: a log's durable identity: what a cursor keeps its streams under (`MessageLog.identity`);
#: never ``|``, which joins it to a stream name in the cursor's stream keys
LOG_IDENTITY = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,39}")
#: the suffix of a destination's non-persistent stream (never a valid destination character)
VOLATILE_SUFFIX = "#np"
#: a destination starting with this is a topic (JMS publish/subscribe); a topic's name has
#: no ``/``, which joins it to a subscription's name in the subscription's queue
TOPIC_PREFIX = "topic:"
#: ``<queue>.DLQ`` is the queue's dead-letter queue at the cursor: only the cursor puts messages
#: there, so a producer cannot mix its messages with dead letters
DLQ_SUFFIX = ".DLQ"

# Reserved headers: the JMS message properties that are not the body (priority, the MSMQ
# administration queue, whether it was sent in a transaction, the publisher whose order the
# dispatcher keeps, the distribution list a copy belongs to, the partition key). They travel as
# headers so the log's records, the transfer frames and the remote protocol carry them unchanged;
# `new_message` checks their values wherever a message enters (`_validation.check_message`).
PRIORITY_HEADER = "twopc-priority"
ADMIN_QUEUE_HEADER = "twopc-admin-queue"
TRANSACTIONAL_HEADER = "twopc-transactional"
PUBLISHER_HEADER = "twopc-publisher"
LIST_HEADER = "twopc-list"
#: the partition key of a message (``send(..., key=...)``): `_partition` hashes it
KEY_HEADER = "twopc-key"
DEFAULT_PRIORITY = 4  # JMS's default; 0 (lowest) to 9 (highest)


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
        """What counts against ``max_message_bytes``: body plus headers, UTF-8 (the names and
        the values joined, each side encoded once: the sum of their lengths)."""
        headers = self.headers
        if not headers:
            return len(self.body)
        names, values = "".join(headers).encode(), "".join(headers.values()).encode()
        return len(self.body) + len(names) + len(values)

    @property
    def stream(self) -> str:
        return self.destination if self.persistent else self.destination + VOLATILE_SUFFIX

    @property
    def key(self) -> str | None:
        """The partition key (``send(..., key=...)``), or None."""
        return self.headers.get(KEY_HEADER)

    @property
    def priority(self) -> int:
        return int(self.headers.get(PRIORITY_HEADER, DEFAULT_PRIORITY))

    @property
    def admin_queue(self) -> str | None:
        """Where a negative acknowledgment goes if a destination rejects the message (MSMQ's
        administration queue)."""
        return self.headers.get(ADMIN_QUEUE_HEADER)

    @property
    def transactional(self) -> bool:
        """Sent inside a transaction (the default): a non-transactional queue rejects it."""
        return self.headers.get(TRANSACTIONAL_HEADER, "1") == "1"

    @property
    def publisher(self) -> str:
        """Whose order topic dispatch keeps: the publisher header, else the destination."""
        return self.headers.get(PUBLISHER_HEADER) or self.destination


# -- records -----------------------------------------------------------------------------------


class _MessageObj(dict[str, Any]):
    """A record's message object that still knows the `Message` it was made from, so a store
    applying its own record (`to_message`) takes that value back instead of decoding base64
    and checking again what `check_message` checked before the record was written. A record
    read from disk holds plain dicts and takes the full path."""

    __slots__ = ("message",)
    message: Message


def message_obj(m: Message) -> dict[str, Any]:
    """``p`` is written only for a non-persistent message (the cursor keeps those too), so
    records of persistent ones are unchanged and old journals still read."""
    obj = _MessageObj({
        "i": m.message_id,
        "d": m.destination,
        "h": m.headers,
        "b": base64.b64encode(m.body).decode("ascii"),
        "x": m.expires_at,
    })  # fmt: skip
    if not m.persistent:
        obj["p"] = False
    obj.message = m
    return obj


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)
# json.dumps with these options builds an encoder per call, and a store writes a record per
# message: build the C encoder once (what JSONEncoder.encode uses), the Python one if absent.
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE = None
if _c_make_encoder is not None:  # arguments as JSONEncoder.iterencode passes them
    _ascii = json.encoder.encode_basestring_ascii
    _C_ENCODE = _c_make_encoder(None, _JSON.default, _ascii, None, ":", ",", False, False, True)


T = TypeVar("T")

#: a prepare record's messages, estimated in encoded bytes, above which it is split into parts:
#: a quarter of the journal's record limit (16 MiB), so a part never reaches it
PART_BYTES = 4 * 1024 * 1024


def _estimated(obj: dict[str, Any]) -> int:
    """A message object's bytes in a record, estimated high (base64 body, headers, keys)."""
    headers = obj["h"]
    return (
        128
        + len(obj["b"])
        + len(obj["i"])
        + len(obj["d"])
        + sum(len(k) + len(str(v)) + 8 for k, v in headers.items())
    )


def split_by_size(items: Iterable[T], size_of: Callable[[T], int], budget: int) -> list[list[T]]:
    """``items`` cut, in order, into runs of at most ``budget`` by ``size_of`` (an item larger
    than that alone); at least one run, empty if ``items`` is. The cut of a large prepare into
    records here, and of a remote producer's messages into frames (`messaging.remote`)."""
    runs: list[list[T]] = [[]]
    size = 0
    for item in items:
        n = size_of(item)
        if runs[-1] and size + n > budget:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += n
    return runs


def prepare_records(gid: str, objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``P`` record(s) of a branch's persistent messages, in order: one, or parts of at most
    `PART_BYTES` (estimated), each but the last marked ``more``."""
    parts = split_by_size(objs, _estimated, PART_BYTES)
    records: list[dict[str, Any]] = [{"k": "P", "g": gid, "m": part, "more": 1} for part in parts]
    del records[-1]["more"]
    return records


def encode(obj: dict[str, Any]) -> bytes:
    """A record as compact ASCII JSON: ``json.dumps(obj, separators=(",", ":"))``'s bytes."""
    if _C_ENCODE is None:
        return _JSON.encode(obj).encode("ascii")
    return "".join(_C_ENCODE(obj, 0)).encode("ascii")


def decode(payload: bytes) -> dict[str, Any]:
    """Parse and check one record's shape; the state applies it."""
    try:
        obj = json.loads(payload)
        if not isinstance(obj, dict):
            raise TypeError("record is not an object")
        kind = obj["k"]
        for key in _SCHEMA[kind]:
            _CHECKS[key](obj[key])
        if kind == "O" and "i" in obj:
            _identity(obj["i"])
        if "more" in obj and (kind != "P" or obj["more"] != 1):
            raise TypeError("only a part of a prepare has more (1)")
        if ("r" in obj or "f" in obj) and (kind != "1" or obj.get("r") != 1):
            raise TypeError("only a carried one-phase commit has r (1) and f")
        if "f" in obj:
            _strs(obj["f"])
        return obj
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise LogCorruptionError(
            f"undecodable message log record {payload[:120]!r}: {exc}"
        ) from exc


def to_message(obj: object) -> Message:
    if type(obj) is _MessageObj:
        return obj.message
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


def _identity(value: object) -> None:
    if not isinstance(value, str) or not LOG_IDENTITY.fullmatch(value):
        raise TypeError(f"{value!r} is not a log identity")


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


def _strs(value: object) -> None:
    if not isinstance(value, list):
        raise TypeError("gids are not a list")
    for gid in value:
        _str(gid)


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
    "e": _int, "u": _int, "x": _int, "a": _int, "o": to_message, "l": _ints, "w": _strs,
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
    "K": ("w",),
    "W": ("w",),
}
