"""The cursor's journal records, with a strict codec (the message log's conventions: JSON objects
with one-letter keys, ASCII, bodies in base64; a record that passes its CRC but not its schema is a
`LogCorruptionError`). Messages reuse `resource_managers.message_log`'s `Message` and its codec.

Kinds (``k``):

- ``M`` accepted: ``q`` stream, ``e`` epoch, ``n`` sequence number, ``o`` the message; ``j``
  true if the message was rejected (a transactional message at a non-transactional queue). The
  message and the stream's new filter state (``e``, ``n``) in one forced write: persist before
  acking (lazy for a non-persistent stream, ``<destination>#np``).
- ``H`` handed out: ``g`` gid, ``i`` message ids, ``c`` 1 (a delivery: each count + 1, forced) or
  0 (no count: carried by rollover, or messages whose count a pre-count already raised; lazy).
- ``P`` prepare: ``g``, ``i`` the ids the branch deletes (forced).
- ``C`` commit: ``g``, ``i`` the ids deleted (forced; also the one-phase commit). With ``v``
  true, a *carried* commit (`._carried`): the branch never prepared here, its record rode the last
  resource's commit as a payload, and this record (lazy) also *remembers* ``g`` until a ``D``;
  ``f`` (optional) gids forgotten with it.
- ``O`` the coordinator nodes whose carried commits this cursor may have lost in a crash: ``d``
  (forced before the first carried branch of a node is staged; an empty list at a clean close).
  An open that finds any hands nothing out until each node's recovery has restored them.
- ``A`` remembered carried gids, carried by rollover: ``b``. ``D`` forgotten ones: ``b`` (lazy).
- ``p`` (optional, in ``H`` with ``c`` 1, ``P`` and a one-phase ``C``): keys of available,
  never-delivered messages whose count goes + 1 ahead of their delivery (a *pre-count*: the
  forced record that has to be written anyway makes the next deliveries' counts durable, so
  handing those out writes no forced ``H``; see ``Cursor``). In an ``M``: ``[its message
  id]``, the message arrives with its count at 1 (pre-counted at arrival, into a queue with
  fewer than ``precount`` messages waiting). Never carried by a rollover.
- ``R`` rollback: ``g``, ``t`` wall-clock ms (the tombstone), ``i`` ids made available again,
  ``x`` ``[id, reason]`` moved to their dead-letter queue instead (lazy).
- ``F`` forget: ``g`` (lazy).
- ``X`` expired: ``i`` the available messages dropped because their ``expires_at`` passed (lazy).
- ``S`` a stream's filter state, carried by rollover: ``q``, ``e``, ``l`` last accepted.
- ``q`` (in ``M`` and ``S``) is the stream's key: ``<log identity>|<stream>`` for a log that
  announced its identity (protocol version 2), the bare stream for one that did not and in
  journals written before identities. An ``M`` or ``S`` of a log's key in the epoch of the bare
  key's state replaces it (the log claimed its history, `sequencing.claim`).
- ``L`` a log's process announced itself on a transfer connection: ``s`` the log's identity,
  ``n`` its incarnation; the newest incarnation per identity is kept, and connections of older
  ones are refused (lazy: every ``M`` the announcing connection writes comes after it; carried
  by rollover).
- ``Q`` a message, carried by rollover: ``o`` the message, ``a`` its arrival order, ``c`` its
  delivery count, ``u`` its queue (its destination or ``<destination>.DLQ``), ``r`` reason or null;
  for a topic copy also ``y`` its key and ``h`` its subscription queue.
- ``W`` moved to their dead-letter queues: ``i`` keys, ``r`` the reason (expiry; lazy).
- ``T`` a queue's kind: ``u`` queue, ``v`` transactional (forced; carried when false).
- ``U`` / ``V`` a durable subscription created / removed: ``u`` topic, ``s`` name (forced).
- ``I`` a publication taken off the topic input by a dispatcher thread (the in-doubt list):
  ``m`` message id, ``w`` the thread, ``z`` the subscription queues at that moment (lazy).
- ``K`` a copy of a publication put into a subscription queue together with its monitor entry:
  ``m``, ``u`` queue, ``w`` the thread (lazy; forced for a non-persistent message whose durable
  subscriber is disconnected). ``N`` is the monitor entry alone, carried by rollover.
- ``E`` a publication fanned out: ``m`` (lazy): it leaves the in-doubt list and the store.
- ``Y`` dead letters replayed to their queue: ``i`` keys (forced). ``Z`` purged: ``i`` (forced).
- ``G`` pre-counts given back: ``i`` keys of messages pre-counted and never handed out, whose
  counts go - 1 (lazy, written by a clean close; a crash leaves them one high instead).

Why the dispatch records may be lazy: the journal is written in order, so whatever a later forced
record (a consumer's ``H``) makes durable, every dispatch record before it is durable too; a crash
that loses a tail of them loses only work the recovery thread redoes from the in-doubt list.
"""

from __future__ import annotations

import json
from typing import Any

from coordinator.errors import LogCorruptionError
from resource_managers.message_log._records import DLQ_SUFFIX, encode, message_obj, to_message

__all__ = ["DLQ_SUFFIX", "decode", "encode", "message_obj", "to_message"]


def decode(payload: bytes) -> dict[str, Any]:
    """Parse and check one record's shape; the state applies it."""
    try:
        obj = json.loads(payload)
        if not isinstance(obj, dict):
            raise TypeError("record is not an object")
        for key in _SCHEMA[obj["k"]]:
            _CHECKS[key](obj[key])
        for key in _OPTIONAL.get(obj["k"], ()):
            if key in obj:
                _CHECKS[key](obj[key])
        return obj
    except (ValueError, KeyError, TypeError) as exc:
        raise LogCorruptionError(f"undecodable cursor record {payload[:120]!r}: {exc}") from exc


def _str(value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")


def _opt_str(value: object) -> None:
    if value is not None:
        _str(value)


def _int(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{value!r} is not a non-negative integer")


def _strs(value: object) -> None:
    if not isinstance(value, list):
        raise TypeError("ids are not a list")
    for v in value:
        _str(v)


def _bool(value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{value!r} is not a boolean")


def _pairs(value: object) -> None:
    if not isinstance(value, list):
        raise TypeError("moves are not a list")
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            raise TypeError("a move is not [id, reason]")
        _str(pair[0])
        _str(pair[1])


_CHECKS: dict[str, Any] = {
    "q": _str, "e": _int, "n": _int, "o": to_message, "g": _str, "i": _strs, "c": _int,
    "t": _int, "x": _pairs, "l": _int, "a": _int, "u": _str, "r": _opt_str, "v": _bool,
    "s": _str, "w": _str, "y": _str, "h": _str, "m": _str, "z": _strs, "j": _bool, "p": _strs,
    "d": _strs, "b": _strs, "f": _strs,
}  # fmt: skip
_SCHEMA: dict[str, tuple[str, ...]] = {
    "M": ("q", "e", "n", "o"),
    "H": ("g", "i", "c"),
    "P": ("g", "i"),
    "C": ("g", "i"),
    "R": ("g", "t", "i", "x"),
    "F": ("g",),
    "X": ("i",),
    "S": ("q", "e", "l"),
    "Q": ("o", "a", "c", "u", "r"),
    "W": ("i", "r"),
    "T": ("u", "v"),
    "U": ("u", "s"),
    "V": ("u", "s"),
    "I": ("m", "w", "z"),
    "K": ("m", "u", "w"),
    "N": ("m", "u", "w"),
    "E": ("m",),
    "Y": ("i",),
    "Z": ("i",),
    "G": ("i",),
    "L": ("s", "n"),
    "O": ("d",),
    "A": ("b",),
    "D": ("b",),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "Q": ("y", "h"), "M": ("j", "p"), "H": ("p",), "P": ("p",), "C": ("p", "v", "f"),
}  # fmt: skip
