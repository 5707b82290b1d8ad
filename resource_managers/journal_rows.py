"""Readable rows of the stores' journal records, for ``twopc log inspect``.

The message log's and the cursor's records are JSON objects with one-letter keys (compact on
disk); an operator reading a journal wants names. Each store maps its kinds and keys here, and
registers its ``inspect_record`` as a ``twopc.journals`` entry point, so the command line (which
sits in the coordinator and imports nothing of the stores) decodes every kind of journal.
A record is decoded by the store's own strict codec first: what it refuses is reported, never
guessed at.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from coordinator.errors import InvalidXidError
from coordinator.xid import Xid


def readable(
    record: Mapping[str, Any], kinds: Mapping[str, str], fields: Mapping[str, str]
) -> dict[str, Any]:
    """``record`` with its kind and keys named; a gid also as its transaction and branch, a
    message as its id, destination and size (never its body)."""
    kind = str(record.get("k"))
    row: dict[str, Any] = {"kind": kinds.get(kind, f"k={kind}")}
    for key, value in record.items():
        if key == "k":
            continue
        if key == "g" and isinstance(value, str):
            row.update(_gid(value))
            continue
        row[fields.get(f"{kind}.{key}") or fields.get(key, key)] = _shown(key, value)
    return row


def _shown(key: str, value: Any) -> Any:
    if key in ("o", "m") and _is_message(value):
        return _message(value)
    if _is_numbering(value):
        return [f"{stream}#{seq}" for stream, seq in value]
    return value


def _is_numbering(value: Any) -> bool:
    """``[[stream, seq], ...]``: a commit's numbers, shown as ``stream#seq``."""
    return (
        isinstance(value, list)
        and all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int)
            for v in value
        )
        and bool(value)
    )


def _gid(gid: str) -> dict[str, Any]:
    try:
        xid = Xid.from_gid(gid)
    except InvalidXidError:
        return {"gid": gid}
    return {"gtrid": xid.gtrid, "branch": xid.bqual}


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and all(isinstance(v, dict) for v in value)
    )


def _message(value: Any) -> Any:
    if isinstance(value, list):
        return [_message(v) for v in value]
    try:
        size = len(base64.b64decode(value.get("b", ""), validate=True))
    except (binascii.Error, ValueError, TypeError):
        size = None
    return f"{value.get('i')} to {value.get('d')} ({size} bytes)"
