"""A segmented, group-committed, append-only journal of opaque records.

Written once, used by the decision log, the message log and the cursor store. See `Journal`.
"""

from __future__ import annotations

from ._compaction import Compaction
from ._fileops import FileOps, OsFileOps
from ._framing import MAX_RECORD_BYTES, SegmentHeader
from ._gate import Gate
from ._group_commit import Ticket
from ._journal import DEFAULT_SEGMENT_BYTES, Journal, JournalStats
from ._lazy import DEFAULT_LAZY_DELAY, LazyWatch
from ._quarantine import QUARANTINE_DIR, Quarantined, find_unreplayable, quarantine
from ._segment import Damage, SegmentReader, list_segments, read_current

__all__ = [
    "DEFAULT_LAZY_DELAY",
    "DEFAULT_SEGMENT_BYTES",
    "MAX_RECORD_BYTES",
    "QUARANTINE_DIR",
    "Compaction",
    "Damage",
    "FileOps",
    "Gate",
    "Journal",
    "JournalStats",
    "LazyWatch",
    "OsFileOps",
    "Quarantined",
    "SegmentHeader",
    "SegmentReader",
    "Ticket",
    "find_unreplayable",
    "list_segments",
    "quarantine",
    "read_current",
]
