"""The message log's journal records as readable rows (`resource_managers.journal_rows`)."""

from __future__ import annotations

from typing import Any

from resource_managers.journal_rows import readable

from ._records import decode

KINDS = {
    "O": "OPEN", "P": "PREPARE", "C": "COMMIT", "1": "ONE_PHASE_COMMIT", "R": "ROLLBACK",
    "F": "FORGET", "A": "ACKNOWLEDGED", "D": "DROPPED", "S": "STREAM", "Q": "MESSAGE",
    "K": "REMEMBERED", "W": "FORGET_CARRIED",
}  # fmt: skip
FIELDS = {
    "n": "number", "m": "messages", "s": "numbered", "t": "at_ms", "q": "stream", "e": "epoch",
    "u": "acknowledged_to", "l": "numbers", "x": "next", "a": "acknowledged", "o": "message",
    "w": "gids", "r": "carried", "f": "forgets",
    "O.n": "incarnation", "O.i": "identity", "Q.n": "seq",
}  # fmt: skip


def inspect_record(payload: bytes) -> dict[str, Any]:
    """One journal record of a message log, checked by the log's own codec, as a row."""
    return readable(decode(payload), KINDS, FIELDS)
