"""`FileDecisionLog`: the embedded decision log, on a `Journal` in a local directory.

Records are compact JSON objects with one-letter keys: cheap to write (a few microseconds), and
still readable by ``twopc log inspect`` and by a human with a hex dump on a bad day. Decoding is
strict: a record that passes its CRC but not its schema was not written by this code, and guessing
at it could drop a decision, so it is reported as corruption.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from coordinator.errors import LogCorruptionError, LogWriteError
from coordinator.journal import DEFAULT_SEGMENT_BYTES, Compaction, FileOps, Gate, Journal

from ._base import Decision, HeuristicRecord, LogStats
from ._memory import Clock, End, Forget, LogState, Record, admit

log = logging.getLogger("twopc.decision_log")

# The C string escaper json.dumps itself uses; building the few fixed shapes by hand costs a
# fraction of a generic dumps call and produces exactly the bytes dumps would.
_quote: Callable[[str], str] = json.encoder.encode_basestring_ascii


def encode(record: Record) -> bytes:
    """One record as ASCII JSON (ASCII keeps the journal's frame magic out of every payload)."""
    g = _quote(record.gtrid)
    if isinstance(record, Decision):
        b = ",".join(map(_quote, record.branches))
        text = f'{{"k":"C","g":{g},"b":[{b}],"d":{_float(record.deadline)},'
        text += f'"w":{_float(record.written_at)}}}'
    elif isinstance(record, End):
        text = f'{{"k":"E","g":{g}}}'
    elif isinstance(record, HeuristicRecord):
        text = f'{{"k":"H","g":{g},"b":{_quote(record.branch)},"o":{_quote(record.outcome)},'
        text += f'"t":{_quote(record.detail)},"r":{_float(record.recorded_at)}}}'
    else:
        b = "null" if record.branch is None else _quote(record.branch)
        text = f'{{"k":"F","g":{g},"b":{b}}}'
    return text.encode("ascii")


def _float(value: float | None) -> str:
    if value is None:
        return "null"
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"a decision log time must be finite, not {value!r}")
    return repr(number)


def decode(payload: bytes) -> Record:
    """The inverse of `encode`; anything else raises `LogCorruptionError`."""
    try:
        obj = json.loads(payload)
        kind = obj["k"]
        if kind == "C":
            return Decision(_str(obj, "g"), _branches(obj), _opt_num(obj, "d"), _num(obj, "w"))
        if kind == "E":
            return End(_str(obj, "g"))
        if kind == "H":
            gtrid, branch, outcome = _str(obj, "g"), _str(obj, "b"), _str(obj, "o")
            return HeuristicRecord(gtrid, branch, outcome, _str(obj, "t"), _num(obj, "r"))
        if kind == "F":
            branch = obj["b"]
            return Forget(_str(obj, "g"), None if branch is None else _str(obj, "b"))
        raise ValueError(f"unknown record kind {kind!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise LogCorruptionError(f"undecodable decision record {payload[:120]!r}: {exc}") from exc


def _str(obj: dict[str, Any], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise TypeError(f"field {key!r} is {type(value).__name__}, not str")
    return value


def _num(obj: dict[str, Any], key: str) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"field {key!r} is {type(value).__name__}, not a number")
    return float(value)


def _opt_num(obj: dict[str, Any], key: str) -> float | None:
    return None if obj[key] is None else _num(obj, key)


def _branches(obj: dict[str, Any]) -> tuple[str, ...]:
    value = obj["b"]
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise TypeError("field 'b' is not a list of branch names")
    return tuple(value)


def journal_replay() -> Callable[[bytes], None]:
    """What opening a file decision log does with each journal record, into a fresh state
    (read-only: for `coordinator.journal.quarantine`, which must judge records as an open would)."""
    state = LogState()
    return lambda payload: state.apply(decode(payload))


class FileDecisionLog:
    """Decisions in a journal directory (created owner-only if missing), locked to this process.

    Opening replays the journal into memory, so ``pending`` and ``heuristics`` cost no I/O. Forced
    records are group-committed: concurrent commits share one fsync. ``file_ops`` swaps the raw
    I/O (tests inject a full disk); ``clock`` is what deadlines are checked against.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        group_commit: bool = True,
        file_ops: FileOps | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.directory = Path(directory)
        self._state = LogState()
        self._clock = clock
        self._gate = Gate()
        self._journal = Journal(
            self.directory,
            replay=self._replay,
            segment_bytes=segment_bytes,
            group_commit=group_commit,
            file_ops=file_ops,
            kind="decision-log",
        )
        self._compaction = Compaction(
            self._journal,
            self._gate,
            lambda: [encode(r) for r in self._state.live_records()],
            f"decision log {self.directory}",
            log,
        )
        self._compaction.maybe()

    def _replay(self, payload: bytes) -> None:
        self._state.apply(decode(payload))

    def log_commit(self, decision: Decision) -> None:
        self._append(admit(decision, self._clock), force=True)

    def log_end(self, gtrid: str) -> None:
        self._append(End(gtrid), force=False)

    def log_heuristic(self, record: HeuristicRecord) -> None:
        self._append(record, force=True)

    def forget_heuristic(self, gtrid: str, branch: str | None = None) -> None:
        self._append(Forget(gtrid, branch), force=True)

    def pending(self) -> list[Decision]:
        return self._state.pending()

    def heuristics(self) -> list[HeuristicRecord]:
        return self._state.heuristics()

    def _append(self, record: Record, *, force: bool) -> None:
        """Write, then update memory, both inside the gate so a rollover never sees one alone.

        The gate is shared, never a lock: holding a lock across the fsync would serialise the
        very group commit that makes the log fast.
        """
        payload = encode(record)
        self._gate.enter_shared()
        try:
            self._journal.append(payload, force)
            self._state.apply(record)
        except LogWriteError as exc:
            # Maybe on disk: keep what it asserts, so this process never presumes abort for a
            # decision a restart may find. A removal (END, FORGET) stays undone, losing nothing.
            if exc.durable is None and isinstance(record, Decision | HeuristicRecord):
                self._state.apply(record)
            raise
        finally:
            self._gate.exit_shared()
        self._compaction.maybe()

    def stats(self) -> LogStats:
        j = self._journal.stats()
        extra = {
            "batches": j.batches,
            "dir_fsyncs": j.dir_fsyncs,
            "truncated_bytes": j.truncated_bytes,
            "rollovers": j.rollovers,
            "active_segment": j.active_segment,
            "poisoned": self._journal.poisoned,
            "pending": len(self._state.pending()),
            "heuristics": len(self._state.heuristics()),
        }
        return LogStats(j.forced_records, j.lazy_records, j.fsyncs, j.bytes_written, extra)

    def check_owner(self) -> None:
        """Never fenced: the directory lock is held for as long as the log is open."""

    def close(self) -> None:
        """Write any lazy END records, fsync, and release the directory lock. Idempotent."""
        self._journal.close()

    def __enter__(self) -> FileDecisionLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
