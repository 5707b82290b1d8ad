"""`CursorState`: what the cursor's records mean, as pure code the journal replays into.

Every ``apply`` is idempotent (a rollover that crashed before deleting its old segment replays
carried records a second time): an ``M`` at or below its stream's filter state, a ``Q`` of a
message already present, an ``H`` of a message not available, a ``P`` of ids already prepared,
all change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resource_managers.message_log import Message
from resource_managers.sequencing import StreamState

from ._records import DLQ_SUFFIX, message_obj, to_message


@dataclass
class Entry:
    """One accepted message not yet consumed: where it waits, how often it was handed out."""

    message: Message
    order: int  # arrival order (the ``M`` records' order): FIFO within a queue
    count: int = 0  # deliveries so far (``H`` records with ``c`` = 1)
    queue: str = ""  # its destination, or ``<destination>.DLQ``
    reason: str | None = None  # why it is in the dead-letter queue


class CursorState:
    """Filter state, messages, available queues, branches, tombstones."""

    def __init__(self) -> None:
        self.filter: dict[str, StreamState] = {}
        self.entries: dict[str, Entry] = {}
        #: queue -> ids available, in arrival order (dicts as ordered sets)
        self.available: dict[str, dict[str, None]] = {}
        self.handed: dict[str, list[str]] = {}  # gid -> ids handed out, not prepared
        self.prepared: dict[str, list[str]] = {}  # gid -> ids prepared for deletion
        self.tombstones: dict[str, int] = {}  # gid -> wall-clock ms of the rollback
        self.committed: set[str] = set()  # gids whose commit record is in the journal
        self.next_order = 0

    # -- queries -------------------------------------------------------------------------------

    def first_available(self, queue: str) -> str | None:
        ids = self.available.get(queue)
        return next(iter(ids)) if ids else None

    def expired_head(self, queue: str, now_ms: int) -> list[str]:
        """The run of expired messages at the head of ``queue``."""
        out = []
        for mid in self.available.get(queue, {}):
            expires = self.entries[mid].message.expires_at
            if expires is None or expires > now_ms:
                break
            out.append(mid)
        return out

    def branch_ids(self, gid: str) -> list[str]:
        return [*self.handed.get(gid, ()), *self.prepared.get(gid, ())]

    # -- records -------------------------------------------------------------------------------

    def apply(self, r: dict[str, Any]) -> None:
        kind = r["k"]
        if kind == "M":
            self._accept(r)
        elif kind == "Q":
            self._carried(r)
        elif kind == "S":
            old = self.filter.get(r["q"], StreamState())
            new = StreamState(r["e"], r["l"])
            if (new.epoch, new.last) > (old.epoch, old.last):
                self.filter[r["q"]] = new
        elif kind == "H":
            self._hand_out(r["g"], r["i"], counted=r["c"] == 1)
        elif kind == "P":
            self._prepare(r["g"], r["i"])
        elif kind == "C":
            self._commit(r["g"], r["i"])
        elif kind == "R":
            self._rollback(r["g"], r["t"], r["i"], r["x"])
        elif kind == "F":
            self.tombstones.pop(r["g"], None)
        elif kind == "X":
            for mid in r["i"]:
                entry = self.entries.get(mid)
                if entry is not None and mid in self.available.get(entry.queue, {}):
                    del self.available[entry.queue][mid]
                    del self.entries[mid]

    def _accept(self, r: dict[str, Any]) -> None:
        old = self.filter.get(r["q"], StreamState())
        if (r["e"], r["n"]) <= (old.epoch, old.last):
            return  # applied before
        self.filter[r["q"]] = StreamState(r["e"], r["n"])
        message = to_message(r["o"])
        if message.message_id not in self.entries:
            self._add(Entry(message, self.next_order, 0, message.destination))

    def _carried(self, r: dict[str, Any]) -> None:
        message = to_message(r["o"])
        if message.message_id not in self.entries:
            self._add(Entry(message, r["a"], r["c"], r["u"], r["r"]))

    def _add(self, entry: Entry) -> None:
        self.entries[entry.message.message_id] = entry
        self.next_order = max(self.next_order, entry.order + 1)
        self._make_available(entry)

    def _make_available(self, entry: Entry) -> None:
        ids = self.available.setdefault(entry.queue, {})
        last = next(reversed(ids), None)
        ids[entry.message.message_id] = None
        if last is not None and self.entries[last].order > entry.order:  # back in its place
            ordered = sorted(ids, key=lambda i: self.entries[i].order)
            self.available[entry.queue] = dict.fromkeys(ordered)

    def _hand_out(self, gid: str, ids: list[str], counted: bool) -> None:
        for mid in ids:
            entry = self.entries.get(mid)
            if entry is None or mid not in self.available.get(entry.queue, {}):
                continue  # applied before, or consumed since
            del self.available[entry.queue][mid]
            if counted:
                entry.count += 1
            self.handed.setdefault(gid, []).append(mid)

    def _prepare(self, gid: str, ids: list[str]) -> None:
        if gid in self.committed or gid in self.tombstones or gid in self.prepared:
            return
        handed = self.handed.pop(gid, [])
        for mid in ids:
            entry = self.entries.get(mid)
            if entry is not None and mid not in handed:  # carried: take it from its queue
                self.available.get(entry.queue, {}).pop(mid, None)
        self.prepared[gid] = [mid for mid in ids if mid in self.entries]

    def _commit(self, gid: str, ids: list[str]) -> None:
        self.committed.add(gid)
        self.handed.pop(gid, None)
        self.prepared.pop(gid, None)
        for mid in ids:
            entry = self.entries.pop(mid, None)
            if entry is not None:
                self.available.get(entry.queue, {}).pop(mid, None)

    def _rollback(self, gid: str, at: int, ids: list[str], moves: list[list[str]]) -> None:
        self.tombstones[gid] = at
        self.handed.pop(gid, None)
        self.prepared.pop(gid, None)
        for mid in ids:
            entry = self.entries.get(mid)
            if entry is not None and mid not in self.available.get(entry.queue, {}):
                self._make_available(entry)
        for mid, reason in moves:
            entry = self.entries.get(mid)
            if entry is None or entry.reason is not None:
                continue
            self.available.get(entry.queue, {}).pop(mid, None)
            entry.queue, entry.reason = entry.message.destination + DLQ_SUFFIX, reason
            self._make_available(entry)

    def live_records(self, now_ms: int, tombstone_ms: int) -> list[dict[str, Any]]:
        """What a rollover carries: filter states, messages, branches, young tombstones."""
        out: list[dict[str, Any]] = [
            {"k": "S", "q": q, "e": s.epoch, "l": s.last} for q, s in self.filter.items()
        ]
        for e in sorted(self.entries.values(), key=lambda e: e.order):
            out.append({"k": "Q", "o": message_obj(e.message), "a": e.order, "c": e.count,
                        "u": e.queue, "r": e.reason})  # fmt: skip
        out += [{"k": "H", "g": g, "i": ids, "c": 0} for g, ids in self.handed.items()]
        out += [{"k": "P", "g": g, "i": ids} for g, ids in self.prepared.items()]
        for gid, at in self.tombstones.items():
            if now_ms - at < tombstone_ms:
                out.append({"k": "R", "g": gid, "t": at, "i": [], "x": []})
        return out
