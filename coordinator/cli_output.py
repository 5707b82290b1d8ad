"""How every ``twopc`` command prints what it found: an aligned table or one JSON document, with
times an operator can read and ``-`` where there is nothing.

One module for every command (the coordinator's and the plugins'), so a cell reads the same
wherever it appears: never ``None``, never a float of seconds since the epoch, never a Python
repr. JSON carries the same values, with times as ISO 8601 UTC text and ``null`` for none.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

#: keys whose numbers are wall-clock times (seconds since the epoch)
TIME_KEYS = frozenset({"written_at", "recorded_at", "deadline", "expires_at", "created_at"})


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; empty tables say so rather than print a bare header."""
    if not rows:
        return "(none)"
    cells = [[str(c) for c in headers], *[[cell(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cell(value: object) -> str:
    """One table cell: ``-`` for none, ``yes``/``no``, lists joined with commas."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value) if value else "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def when(epoch: float | None) -> str | None:
    """An epoch time as ISO 8601 UTC to the second (``2026-11-26T22:53:03Z``); None stays None."""
    if epoch is None or isinstance(epoch, bool) or not isinstance(epoch, int | float):
        return None
    if epoch <= 0:  # records written before times were kept say 0: unknown, not 1970
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def age(seconds: float | None) -> str | None:
    """A duration as a person says it: ``42s``, ``3m05s``, ``2h03m``, ``4d02h``."""
    if seconds is None:
        return None
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def readable(row: Mapping[str, Any]) -> dict[str, Any]:
    """A record's fields with its wall-clock times as ISO text (for a table and for JSON)."""
    return {k: when(v) if k in TIME_KEYS else _plain(v) for k, v in row.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("ascii", "backslashreplace")
    return value


def emit_json(value: object) -> None:
    """One indented JSON document on stdout, keys sorted so output diffs cleanly."""
    json.dump(value, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
