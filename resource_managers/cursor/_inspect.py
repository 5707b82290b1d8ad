"""The cursor's journal records as readable rows (`resource_managers.journal_rows`)."""

from __future__ import annotations

from typing import Any

from resource_managers.journal_rows import readable

from ._records import decode

KINDS = {
    "M": "ACCEPTED", "H": "HANDED_OUT", "P": "PREPARE", "C": "COMMIT", "R": "ROLLBACK",
    "F": "FORGET", "X": "EXPIRED", "S": "STREAM", "Q": "MESSAGE", "W": "DEAD_LETTERED",
    "T": "QUEUE_KIND", "U": "SUBSCRIBE", "V": "UNSUBSCRIBE", "I": "IN_DOUBT", "K": "COPY",
    "N": "MONITOR", "E": "FANNED_OUT", "Y": "DLQ_REPLAYED", "Z": "DLQ_PURGED",
    "G": "PRECOUNT_RETURNED", "L": "LOG_ANNOUNCED", "O": "CARRIERS", "A": "REMEMBERED",
    "D": "FORGOTTEN",
}  # fmt: skip
FIELDS = {
    "i": "ids", "q": "stream", "e": "epoch", "n": "seq", "o": "message", "j": "rejected",
    "c": "count", "p": "precounted", "t": "at_ms", "x": "dead_lettered", "l": "last",
    "a": "order", "u": "queue", "r": "reason", "y": "key", "h": "subscription_queue",
    "v": "transactional", "s": "name", "m": "message_id", "w": "worker", "z": "queues",
    "U.u": "topic", "V.u": "topic", "L.s": "log", "L.n": "incarnation", "C.v": "carried",
    "d": "nodes", "b": "gids", "f": "forgotten",
}  # fmt: skip


def inspect_record(payload: bytes) -> dict[str, Any]:
    """One journal record of a cursor, checked by the cursor's own codec, as a row."""
    return readable(decode(payload), KINDS, FIELDS)
