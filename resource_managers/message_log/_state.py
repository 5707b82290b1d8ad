"""`LogState`: what the message log's records mean, as pure code the journal replays into.

Every ``apply`` is idempotent: a rollover that crashed before deleting its old segment makes the
journal replay carried records a second time.

The epoch rule. A stream's epoch must never let a cursor confuse two histories of its numbers.
Within one directory the numbers are continuous: every number handed to a reader is in a forced
``C``/``1`` record, and ``S`` records carry the next number and the epoch across compaction, so
a persistent stream keeps its epoch across restarts and crashes. What the log cannot prove is
that a directory is the one that numbered a stream before (it may be new, restored or wiped), and
non-persistent streams lose their numbers in every crash. Hence each open writes a forced ``O``
record with an *incarnation* ``n = max(last incarnation + 1, wall-clock ms)``: a persistent stream
first numbered in this directory takes the incarnation of that moment as its epoch, and every
non-persistent stream takes the current incarnation (a new epoch at every open). A lost or new
directory therefore starts above any epoch an earlier one used, unless the wall clock went back
past it: operations must not restore an old log directory over a live one with a clock behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._records import VOLATILE_SUFFIX, Message, message_obj, prepare_records, to_message


@dataclass
class Stream:
    """One stream: its epoch, the next number it will give, the highest acknowledged, and the
    committed messages not acknowledged yet (number -> message, ascending)."""

    name: str
    epoch: int
    next_seq: int = 1
    acked: int = 0
    messages: dict[int, Message] = field(default_factory=dict)

    def add(self, seq: int, message: Message) -> None:
        self.add_many([(seq, message)])

    def add_many(self, numbered: Iterable[tuple[int, Message]]) -> None:
        """Messages with their numbers, kept in ascending order: appended, and merged once at
        the end for those that came below the highest held. Concurrent commits apply their
        records in an order other than their numbers' (each takes a block of numbers, then
        writes); sorting per message made a quarter-million-message commit behind another
        quadratic (hours), and sorting the whole stream once per such commit made a write of
        many branches to one destination with no consumer quadratic in the messages held
        (256 branches into a million held: a third of the log's time)."""
        messages = self.messages
        highest = next(reversed(messages)) if messages else 0
        late: dict[int, Message] = {}
        for seq, message in numbered:
            if seq > self.acked and seq not in messages:
                if seq < highest:
                    late.setdefault(seq, message)
                else:
                    highest = seq
                    messages[seq] = message
            if seq >= self.next_seq:
                self.next_seq = seq + 1
        if late:
            self._merge(late)

    def _merge(self, late: dict[int, Message]) -> None:
        """Put ``late`` (numbers not held, each below the highest held) in their places: only
        the messages held above the lowest of them move, the tail a concurrent commit applied
        first, not the whole stream."""
        messages = self.messages
        low = min(late)
        above: list[int] = []
        for seq in reversed(messages):
            if seq < low:
                break
            above.append(seq)
        for seq in above:
            late[seq] = messages[seq]
        ordered = sorted(late.items())  # all of it made before the stream changes
        for seq in above:
            del messages[seq]
        messages.update(ordered)

    def ack(self, upto: int) -> int:
        """Drop messages up to ``upto``; how many left."""
        gone = [seq for seq in self.messages if seq <= upto]
        for seq in gone:
            del self.messages[seq]
        self.acked = max(self.acked, upto)
        return len(gone)


class LogState:
    """Prepared branches, streams, tombstones: everything the journal's records say."""

    def __init__(self) -> None:
        self.incarnation = 0
        #: the log's durable identity (``O``'s ``i``); None in a journal written before identities
        self.identity: str | None = None
        self.prepared: dict[str, list[Message]] = {}
        #: a large prepare's parts read so far (``P`` with ``more``), until its last part
        self.parts: dict[str, list[Message]] = {}
        self.streams: dict[str, Stream] = {}
        self.tombstones: dict[str, int] = {}  # gid -> wall-clock ms of the rollback
        self.committed: set[str] = set()  # gids whose commit record is in the journal
        #: gids of carried commits (``1`` with ``r``) whose decision row may still exist
        self.remembered: set[str] = set()

    def stream(self, name: str) -> Stream:
        found = self.streams.get(name)
        if found is None:
            found = self.streams[name] = Stream(name, max(1, self.incarnation))
        return found

    def apply(self, r: dict[str, Any]) -> None:
        kind = r["k"]
        if kind == "O":
            self.incarnation = max(self.incarnation, r["n"])
            if self.identity is None:  # chosen once: every later ``O`` repeats it
                self.identity = r.get("i")
        elif kind == "P":
            gid = r["g"]
            if gid not in self.committed and gid not in self.tombstones:
                messages = [to_message(m) for m in r["m"]]
                if "more" in r:
                    self.parts.setdefault(gid, []).extend(messages)
                else:
                    self.prepared[gid] = self.parts.pop(gid, []) + messages
        elif kind in ("C", "1"):
            self._commit(r)
        elif kind == "R":
            self.prepared.pop(r["g"], None)
            self.parts.pop(r["g"], None)
            self.tombstones[r["g"]] = r["t"]
        elif kind == "F":
            self.tombstones.pop(r["g"], None)
        elif kind == "K":
            self.remembered.update(r["w"])
        elif kind == "W":
            self.remembered.difference_update(r["w"])
        else:
            self._apply_stream(r)

    def _apply_stream(self, r: dict[str, Any]) -> None:
        """``A``, ``D``, ``S``, ``Q``: records about one stream. ``A`` and ``D`` of another epoch
        are about a history this log no longer has, and are ignored."""
        kind = r["k"]
        if kind in ("A", "D"):
            stream = self.streams.get(r["q"])
            if stream is None or stream.epoch != r["e"]:
                return
            if kind == "A":
                stream.ack(r["u"])
            for seq in r.get("l", ()):
                stream.messages.pop(seq, None)
        elif kind == "S":
            stream = self.stream(r["q"])
            stream.epoch, stream.next_seq = r["e"], max(stream.next_seq, r["x"])
            stream.acked = max(stream.acked, r["a"])
        else:
            self.stream(r["q"]).add(r["n"], to_message(r["o"]))

    def _commit(self, r: dict[str, Any]) -> None:
        gid = r["g"]
        one_phase = r["k"] == "1"
        self.remembered.difference_update(r.get("f", ()))  # forgets riding a carried commit
        if one_phase and gid in self.remembered:  # a carried commit replayed twice
            return
        messages = [to_message(m) for m in r["m"]] if one_phase else self.prepared.pop(gid, [])
        self.committed.add(gid)
        if "r" in r:
            self.remembered.add(gid)
        numbers = r["s"]
        if messages and len(messages) != len(numbers):
            raise ValueError(
                f"commit of {gid}: {len(numbers)} numbers for {len(messages)} messages"
            )
        if not messages:  # applied before (a duplicate) or compacted: the numbers still count
            for name, seq in numbers:
                stream = self.stream(name)
                stream.next_seq = max(stream.next_seq, seq + 1)
            return
        self.add_numbered(numbers, messages)

    def add_numbered(self, numbers: Iterable[Sequence[Any]], messages: Iterable[Message]) -> None:
        """Each message joins its stream under its ``(stream, seq)``, one `Stream.add_many` per
        stream (so a stream merges late numbers at most once per commit)."""
        by_stream: dict[str, list[tuple[int, Message]]] = {}
        for (name, seq), message in zip(numbers, messages, strict=True):
            by_stream.setdefault(name, []).append((seq, message))
        for name, numbered in by_stream.items():
            self.stream(name).add_many(numbered)

    def live_records(self, now_ms: int, tombstone_ms: int) -> list[dict[str, Any]]:
        """What a rollover carries: the incarnation, streams and their messages, prepared
        branches, and tombstones younger than ``tombstone_ms``."""
        opened: dict[str, Any] = {"k": "O", "n": self.incarnation}
        if self.identity is not None:
            opened["i"] = self.identity
        out: list[dict[str, Any]] = [opened]
        for s in self.streams.values():
            if s.name.endswith(VOLATILE_SUFFIX):
                continue
            out.append({"k": "S", "q": s.name, "e": s.epoch, "x": s.next_seq, "a": s.acked})
            out += [
                {"k": "Q", "q": s.name, "n": n, "o": message_obj(m)} for n, m in s.messages.items()
            ]
        for gid, messages in self.prepared.items():
            out += prepare_records(gid, [message_obj(m) for m in messages])
        for gid, at in self.tombstones.items():
            if now_ms - at < tombstone_ms:
                out.append({"k": "R", "g": gid, "t": at})
        if self.remembered:
            out.append({"k": "K", "w": sorted(self.remembered)})
        return out
