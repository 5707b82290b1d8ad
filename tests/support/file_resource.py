"""`FileResource`: a small crash-safe resource manager on local files, for tests only.

It keeps every promise of `coordinator.resource.Resource` the way a real one must, so a crash test
can kill a process anywhere and then read what survived::

    <directory>/
      data.json            committed key/values, the gids committed into them (the markers),
                           and, for a last resource, its decision rows (gtrid -> commit/abort)
      prepared/<gid>.json  one staged write set per prepared branch
      aborted/<gid>        one tombstone per rolled-back branch: fences a late prepare
      audit.log            one JSON line per branch that ended: gid, gtrid, bqual, outcome

Durability: every file is written under a temporary name, fsync'd, renamed over its target, and
the directory is fsync'd, so a SIGKILL (or a power cut) leaves the old version or the new one.

Why the committed markers live inside data.json: applying a write set and remembering that it was
applied must be one atomic step. With a marker beside the data, a crash between the two writes
would let a re-driven commit apply an ``add`` twice.

The audit log is appended after the step it reports, so a crash can leave it one line short;
opening the resource repairs it from data.json and the tombstones (and drops a torn last line),
the way a database replays its own log at start-up before it answers a coordinator.

``FileResource(..., last_resource=True)`` is a logging last resource
(`coordinator.last_resource`): ``commit_with_decision`` writes the branch's data, its marker and
the decision row in the one atomic replace of data.json, as PostgreSQL commits them in one
transaction. Its rows can carry other branches (`coordinator.carried`): ``FileResource(...,
carried=True)`` stages its write set in memory instead of preparing it, the last resource's row
holds it, and the commit that applies it also remembers the gid in data.json (``carried``) until
``forget_carried``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.crashpoints import crash_point
from coordinator.decision_log import Decision
from coordinator.errors import FencedError, IllegalStateError, InvalidXidError
from coordinator.resource import Outcome, Vote
from coordinator.xid import Xid, validate_resource_name

log = logging.getLogger("twopc.tests.file_resource")

Value = int | str
Op = tuple[str, str, Value]

COMMITTED = "committed"
ROLLED_BACK = "rolled-back"
PREPARED = "prepared"
ABSENT = "absent"

_DATA = "data.json"
_AUDIT = "audit.log"
_PREPARED = "prepared"
_ABORTED = "aborted"
# A gid holds digits, '_' and base64 ([A-Za-z0-9+/=]); only '/' cannot appear in a file name.
# '-' and '.' never occur in a gid, so the mapping is reversible.
_TO_FILE = str.maketrans("/+", "-.")
_FROM_FILE = str.maketrans("-.", "/+")


#: how long a lazy commit waits for its timer: long enough that phase two always finishes first
#: (so each transaction's end is deferred and crash points count transactions), short enough
#: that a test does not wait on it
LAZY_DELAY = 0.05


def gid_to_filename(gid: str) -> str:
    return gid.translate(_TO_FILE)


def filename_to_gid(name: str) -> str:
    return name.translate(_FROM_FILE)


# -- durable file primitives -------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file, fsync, rename, directory fsync."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_durably(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def append_line(path: Path, line: str) -> None:
    """One ``write`` of one line, then fsync: a crash loses the line or tears only its tail."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (line + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading durable state (no repair: what a crash left is what you see) -----------------------


@dataclass(frozen=True)
class AuditEntry:
    gid: str
    gtrid: str
    bqual: str
    outcome: str  # COMMITTED or ROLLED_BACK


@dataclass
class DurableState:
    """Everything a `FileResource` directory holds, read without touching it."""

    data: dict[str, Value] = field(default_factory=dict)
    committed: set[Xid] = field(default_factory=set)
    aborted: set[Xid] = field(default_factory=set)
    prepared: set[Xid] = field(default_factory=set)
    audit: list[AuditEntry] = field(default_factory=list)
    #: a last resource's decision rows: gtrid -> {"o": "c" (commit) or "a" (abort), "b": [...]}
    decisions: dict[str, dict[str, object]] = field(default_factory=dict)
    #: gids of carried commits remembered until their rows are gone (`coordinator.carried`)
    remembered: set[str] = field(default_factory=set)

    def outcome(self, gtrid: str) -> str:
        """COMMITTED, ROLLED_BACK, PREPARED or ABSENT: what this resource holds for ``gtrid``."""
        for label, xids in (
            (COMMITTED, self.committed),
            (ROLLED_BACK, self.aborted),
            (PREPARED, self.prepared),
        ):
            if any(x.gtrid == gtrid for x in xids):
                return label
        return ABSENT

    def audited(self, outcome: str) -> set[str]:
        """The gtrids the audit log says ended with ``outcome``."""
        return {e.gtrid for e in self.audit if e.outcome == outcome}

    def audit_problems(self) -> list[str]:
        """Where the audit log and the data disagree (empty once the resource has been opened)."""
        problems: list[str] = []
        seen = Counter(e.gid for e in self.audit)
        problems += [f"{gid} audited {n} times" for gid, n in seen.items() if n > 1]
        by_gid = {e.gid: e.outcome for e in self.audit}
        for label, xids in ((COMMITTED, self.committed), (ROLLED_BACK, self.aborted)):
            for xid in xids:
                if by_gid.get(xid.to_gid()) != label:
                    problems.append(
                        f"{xid.gtrid} is {label} but audited {by_gid.get(xid.to_gid())}"
                    )
        return problems


def read_state(directory: str | os.PathLike[str]) -> DurableState:
    root = Path(directory)
    data, committed, decisions = _read_data(root / _DATA)
    try:
        remembered = set(json.loads((root / _DATA).read_bytes()).get("carried", []))
    except FileNotFoundError:
        remembered = set()
    return DurableState(
        data=data,
        committed=committed,
        aborted=set(_xids_in(root / _ABORTED)),
        prepared=set(_xids_in(root / _PREPARED)),
        audit=list(_read_audit(root / _AUDIT)),
        decisions=decisions,
        remembered=remembered,
    )


def _ops_of(payload: bytes) -> list[Op]:
    """A carried branch's write set, from the payload its ``stage`` gave the decision row."""
    return [(kind, key, value) for kind, key, value in json.loads(payload)["ops"]]


def _read_data(
    path: Path,
) -> tuple[dict[str, Value], set[Xid], dict[str, dict[str, object]]]:
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}, set(), {}
    committed = {Xid.from_gid(gid) for gid in obj["committed"]}
    return dict(obj["data"]), committed, dict(obj.get("decisions", {}))


def _xids_in(folder: Path) -> Iterator[Xid]:
    """Xids named by the files of ``folder``; temp files and foreign names are skipped."""
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        try:
            yield Xid.from_gid(filename_to_gid(path.name.removesuffix(".json")))
        except InvalidXidError:
            log.warning("ignoring %s: not a branch file", path)


def _read_audit(path: Path) -> Iterator[AuditEntry]:
    try:
        text = path.read_bytes().decode("ascii")
    except FileNotFoundError:
        return
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            return  # a torn last line: the step it reports is repaired on open
        yield AuditEntry(**json.loads(line))


def apply_ops(data: dict[str, Value], ops: Iterable[Op]) -> dict[str, Value]:
    """``data`` with ``ops`` applied (a new dict); a bad op raises before anything changes."""
    out = dict(data)
    for kind, key, value in ops:
        if kind == "set":
            out[key] = value
        elif kind == "add":
            current = out.get(key, 0)
            if not isinstance(current, int) or not isinstance(value, int):
                raise TypeError(f"cannot add {value!r} to {key}={current!r}")
            out[key] = current + value
        else:
            raise ValueError(f"unknown op {kind!r}")
    return out


# -- the resource ------------------------------------------------------------------------------


class LedgerBranch:
    """The handle ``tx.join`` returns: writes are buffered until commit, reads see them."""

    def __init__(self, resource: FileResource, xid: Xid) -> None:
        self.xid = xid
        self.ops: list[Op] = []
        self.vetoed = False
        self._resource = resource

    def set(self, key: str, value: Value) -> None:
        if not isinstance(value, int | str) or isinstance(value, bool):
            raise TypeError(f"values are int or str, not {type(value).__name__}")
        self.ops.append(("set", _key(key), value))

    def add(self, key: str, amount: int) -> None:
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise TypeError(f"amounts are int, not {type(amount).__name__}")
        self.ops.append(("add", _key(key), amount))

    def get(self, key: str) -> Value | None:
        return apply_ops(self._resource.snapshot(), self.ops).get(key)

    def veto(self) -> None:
        """Make this branch vote no at prepare."""
        self.vetoed = True


def _key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError("keys are non-empty str")
    return key


class FileResource:
    """A durable key/value ledger that enlists as an XA branch (see the module docstring).

    One live instance per directory: a restarted process opens a new one, which repairs what a
    crash cut short before answering anyone.
    """

    def __init__(
        self,
        name: str,
        directory: str | os.PathLike[str],
        *,
        last_resource: bool = False,
        lazy_commit: bool = False,
        carried: bool = False,
    ) -> None:
        self._name = validate_resource_name(name)
        self._last = last_resource
        #: rides a last resource's commit (`coordinator.carried`): staged write sets, by xid
        self.rides_last_resource = carried
        self._staged: dict[Xid, list[Op]] = {}
        self._lazy_remember: set[Xid] = set()  # lazy commits that are carried ones
        self._after_drop: dict[str, Callable[[], None]] = {}  # end_decision's ``then``
        # lazy_commit: phase two queues the commit and applies it on disk a moment later
        # (`coordinator.lazy_commit`); the queue, in order, with each one's durability callback
        self._lazy_enabled = lazy_commit
        self._lazy: list[tuple[Xid, list[Op], Callable[[], None]]] = []
        self._lazy_timer: threading.Timer | None = None
        self._lazy_flush = threading.Lock()
        self._ended: set[str] = set()  # decision rows queued for deletion (end_decision)
        self.directory = Path(directory)
        self._lock = threading.RLock()
        self._branches: dict[Xid, LedgerBranch] = {}
        for folder in (self.directory, self.directory / _PREPARED, self.directory / _ABORTED):
            folder.mkdir(parents=True, exist_ok=True)
        self._open()

    @property
    def name(self) -> str:
        return self._name

    @property
    def sort_key(self) -> str:
        return self._name

    @property
    def last_resource(self) -> bool:
        return self._last

    def __repr__(self) -> str:
        return f"<FileResource {self._name} {self.directory}>"

    # -- opening: repair what a crash cut short ------------------------------------------------

    def _open(self) -> None:
        for folder in (self.directory, self.directory / _PREPARED, self.directory / _ABORTED):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink()
        self._drop_torn_audit_line()
        state = read_state(self.directory)
        self._data, self._committed, self._aborted = state.data, state.committed, state.aborted
        self._decisions = state.decisions
        self._remembered = state.remembered
        self._audited = {entry.gid for entry in state.audit}
        for xid in sorted(state.committed, key=Xid.to_gid):
            self._settle(xid, COMMITTED)
        for xid in sorted(state.aborted, key=Xid.to_gid):
            self._settle(xid, ROLLED_BACK)

    def _drop_torn_audit_line(self) -> None:
        path = self.directory / _AUDIT
        if not path.exists():
            return
        raw = path.read_bytes()
        if raw and not raw.endswith(b"\n"):
            with path.open("r+b") as f:
                f.truncate(raw.rfind(b"\n") + 1)
                os.fsync(f.fileno())

    def _settle(self, xid: Xid, outcome: str) -> None:
        """Finish the bookkeeping after a branch ended: its audit line, then its prepared file."""
        gid = xid.to_gid()
        if gid not in self._audited:
            entry = {"gid": gid, "gtrid": xid.gtrid, "bqual": xid.bqual, "outcome": outcome}
            append_line(self.directory / _AUDIT, json.dumps(entry, sort_keys=True))
            self._audited.add(gid)
        remove_durably(self._prepared_path(xid))

    def _prepared_path(self, xid: Xid) -> Path:
        return self.directory / _PREPARED / f"{gid_to_filename(xid.to_gid())}.json"

    def _tombstone_path(self, xid: Xid) -> Path:
        return self.directory / _ABORTED / gid_to_filename(xid.to_gid())

    # -- reads -----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Value]:
        """The committed data."""
        with self._lock:
            return dict(self._data)

    def state(self) -> DurableState:
        with self._lock:
            return read_state(self.directory)

    # -- the Resource protocol -------------------------------------------------------------------

    def start(self, xid: Xid) -> LedgerBranch:
        with self._lock:
            self._refuse_if_ended(xid, "start")
            if xid in self._branches or self._prepared_path(xid).exists():
                raise IllegalStateError(f"{xid.gtrid} already has a branch on {self._name}")
            branch = self._branches[xid] = LedgerBranch(self, xid)
            return branch

    def prepare(self, xid: Xid) -> Vote:
        with self._lock:
            self._refuse_if_ended(xid, "prepare")
            if self._prepared_path(xid).exists():
                return Vote.COMMIT
            branch = self._branches.pop(xid, None)
            if branch is None:
                raise IllegalStateError(f"{xid.gtrid} has no active branch on {self._name}")
            if branch.vetoed:
                return Vote.ROLLBACK
            if not branch.ops:
                return Vote.READ_ONLY
            apply_ops(self._data, branch.ops)  # a write set that cannot apply votes no now
            payload = {"gid": xid.to_gid(), "ops": branch.ops}
            write_atomic(self._prepared_path(xid), json.dumps(payload).encode("ascii"))
            crash_point(f"fileres.{self._name}.after_stage")
            return Vote.COMMIT

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if any(queued == xid for queued, _, _ in self._lazy):
            self.flush_commits()  # recovery's commit of a lazy one returns once it is on disk
        with self._lock:
            if xid in self._committed:
                self._settle(xid, COMMITTED)  # idempotent; also finishes a commit cut short
                return None
            if xid in self._aborted:
                if one_phase:
                    raise FencedError(f"{xid.gtrid} was rolled back on {self._name}")
                return Outcome.HEURISTIC_ROLLBACK
            ops = self._one_phase_ops(xid) if one_phase else self._prepared_ops(xid)
            if ops is None:
                return None  # never prepared here (or forgotten): a commit of it counts as done
            self._apply(xid, ops)
            return None

    def commit_lazily(self, xid: Xid, on_durable: Callable[[], None]) -> Outcome | None:
        """With ``lazy_commit``: queue the prepared branch's commit; a timer (or recovery's
        commit, or `flush_commits`) applies it on disk, then calls ``on_durable``."""
        with self._lock:
            ops = self._prepared_ops(xid) if self._lazy_enabled else None
            if ops is None or xid in self._committed or xid in self._aborted:
                outcome = None
            else:
                self._queue_lazy(xid, ops, on_durable)
                return None
        outcome = self.commit(xid)
        on_durable()
        return outcome

    def _queue_lazy(self, xid: Xid, ops: list[Op], on_durable: Callable[[], None]) -> None:
        """Under the lock: queue a commit for the timer (or `flush_commits`) to apply."""
        self._lazy.append((xid, ops, on_durable))
        if self._lazy_timer is None:
            self._lazy_timer = threading.Timer(LAZY_DELAY, self.flush_commits)
            self._lazy_timer.daemon = True
            self._lazy_timer.start()
        crash_point(f"fileres.{self._name}.after_lazy_commit")

    def flush_commits(self) -> None:
        """Apply the queued lazy commits on disk, then run their callbacks (a flush running on
        another thread is waited for, so this returns once every earlier callback has run)."""
        with self._lazy_flush:
            with self._lock:
                queued, self._lazy, self._lazy_timer = self._lazy, [], None
                for xid, ops, _ in queued:
                    if xid not in self._committed:
                        self._apply(xid, ops, remember=xid in self._lazy_remember)
                    self._lazy_remember.discard(xid)
            for _, _, on_durable in queued:
                crash_point(f"fileres.{self._name}.lazy_durable")
                on_durable()

    def rollback(self, xid: Xid) -> Outcome | None:
        with self._lock:
            if xid in self._committed:
                return Outcome.HEURISTIC_COMMIT
            self._branches.pop(xid, None)
            self._staged.pop(xid, None)
            if xid not in self._aborted:
                # The tombstone goes first: from here on a late prepare of this xid is refused.
                write_atomic(self._tombstone_path(xid), xid.to_gid().encode("ascii"))
                self._aborted.add(xid)
            self._settle(xid, ROLLED_BACK)
            return None

    def recover(self) -> list[Xid]:
        with self._lock:
            ended = self._committed | self._aborted
            return [x for x in _xids_in(self.directory / _PREPARED) if x not in ended]

    def forget(self, xid: Xid) -> None:
        with self._lock:
            if xid in self._committed:
                self._write_data(self._data, self._committed - {xid}, self._decisions)
            if xid in self._aborted:
                remove_durably(self._tombstone_path(xid))
                self._aborted.discard(xid)

    # -- the LastResource protocol ----------------------------------------------------------------

    def commit_with_decision(self, xid: Xid, decision: Decision) -> None:
        with self._lock:
            if self._decisions.get(decision.gtrid, {}).get("o") == "a":
                self._branches.pop(xid, None)
                raise FencedError(f"{decision.gtrid} was fenced by recovery on {self._name}")
            self._refuse_if_ended(xid, "commit")
            ops = self._one_phase_ops(xid)
            decisions = {g: d for g, d in self._decisions.items() if g not in self._ended}
            decisions[decision.gtrid] = {"o": "c", "b": list(decision.branches)}
            if decision.carried:
                decisions[decision.gtrid]["p"] = {n: p.decode() for n, p in decision.carried}
            self._write_data(apply_ops(self._data, ops), self._committed | {xid}, decisions)
            gone, self._ended = self._ended, set()
            crash_point(f"fileres.{self._name}.after_apply")
            self._settle(xid, COMMITTED)
        self._run_after_drop(gone)

    def decisions_of(self, gtrids: Iterable[str]) -> set[str]:
        with self._lock:
            wanted = set(gtrids)
            fenced = {g: {"o": "a", "b": []} for g in wanted if g not in self._decisions}
            if fenced:
                self._write_data(self._data, self._committed, {**self._decisions, **fenced})
            return {g for g in wanted if self._decisions[g]["o"] == "c"}

    def committed_decisions(self, node_id: str) -> dict[str, tuple[str, ...]]:
        with self._lock:
            return {
                g: tuple(str(b) for b in d["b"])  # type: ignore[attr-defined]
                for g, d in self._decisions.items()
                if d["o"] == "c" and g.startswith(f"{node_id}:")
            }

    def end_decision(self, gtrid: str, then: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._ended.add(gtrid)
            if then is not None:
                self._after_drop[gtrid] = then

    def drop_decisions(self, gtrids: Iterable[str]) -> None:
        with self._lock:
            gone = self._ended | set(gtrids)
            kept = {g: d for g, d in self._decisions.items() if not (g in gone and d["o"] == "c")}
            if kept != self._decisions:
                self._write_data(self._data, self._committed, kept)
            self._ended.clear()
        self._run_after_drop(gone)

    def _run_after_drop(self, gone: set[str]) -> None:
        with self._lock:
            then = [f for g in sorted(gone) if (f := self._after_drop.pop(g, None)) is not None]
        for callback in then:
            callback()

    # -- carried branches (coordinator.carried) -------------------------------------------------

    def carries_branches(self) -> bool:
        return self._last

    def carried_of(self, node_id: str) -> dict[str, dict[str, bytes]]:
        with self._lock:
            return {
                g: {str(n): str(p).encode() for n, p in d["p"].items()}  # type: ignore[attr-defined]
                for g, d in self._decisions.items()
                if d["o"] == "c" and "p" in d and g.startswith(f"{node_id}:")
            }

    def stage(self, xid: Xid) -> bytes | None:
        with self._lock:
            self._refuse_if_ended(xid, "stage")
            branch = self._branches.pop(xid, None)
            if branch is None:
                raise IllegalStateError(f"{xid.gtrid} has no active branch on {self._name}")
            if branch.vetoed:
                raise IllegalStateError(f"{xid.gtrid} was vetoed on {self._name}")
            if not branch.ops:
                return None
            apply_ops(self._data, branch.ops)  # a write set that cannot apply votes no now
            self._staged[xid] = branch.ops
            crash_point(f"fileres.{self._name}.after_stage")
            return json.dumps({"gid": xid.to_gid(), "ops": branch.ops}).encode("ascii")

    def commit_carried(self, xid: Xid, payload: bytes, on_durable: Callable[[], None]) -> None:
        with self._lock:
            ops = self._staged.pop(xid, None)
            if ops is None or not self._lazy_enabled:
                ops = ops if ops is not None else _ops_of(payload)
                if xid not in self._committed:
                    self._apply(xid, ops, remember=True)
                lazy = False
            else:
                self._lazy_remember.add(xid)
                self._queue_lazy(xid, ops, on_durable)
                lazy = True
        if not lazy:
            on_durable()

    def restore_carried(self, xid: Xid, payload: bytes) -> None:
        if xid in self._lazy_remember:
            self.flush_commits()
        with self._lock:
            if xid.to_gid() in self._remembered:
                return
            self._apply(xid, _ops_of(payload), remember=True)

    def carried_gids(self) -> set[str]:
        with self._lock:
            return set(self._remembered) - {x.to_gid() for x in self._lazy_remember}

    def forget_carried(self, gids: Iterable[str]) -> None:
        with self._lock:
            gone = self._remembered & set(gids)
            if gone:
                self._remembered = self._remembered - gone
                self._write_data(self._data, self._committed, self._decisions)

    # -- what an operator (or a buggy peer) might do behind the coordinator's back --------------

    def operator_rollback(self, xid: Xid) -> None:
        """Roll a prepared branch back on our own: a heuristic decision."""
        with self._lock:
            if xid in self._committed:
                raise IllegalStateError(f"{xid.gtrid} is already committed on {self._name}")
            self.rollback(xid)

    # -- internals -------------------------------------------------------------------------------

    def _refuse_if_ended(self, xid: Xid, action: str) -> None:
        if xid in self._aborted:
            raise FencedError(f"cannot {action} {xid.gtrid} on {self._name}: it was rolled back")
        if xid in self._committed:
            raise FencedError(f"cannot {action} {xid.gtrid} on {self._name}: it was committed")

    def _one_phase_ops(self, xid: Xid) -> list[Op]:
        branch = self._branches.pop(xid, None)
        if branch is None:
            raise IllegalStateError(f"{xid.gtrid} has no active branch on {self._name}")
        if branch.vetoed:
            raise IllegalStateError(f"{xid.gtrid} was vetoed on {self._name}")
        return branch.ops

    def _prepared_ops(self, xid: Xid) -> list[Op] | None:
        if xid in self._branches:
            raise IllegalStateError(f"two-phase commit of unprepared {xid.gtrid} on {self._name}")
        try:
            payload = json.loads(self._prepared_path(xid).read_bytes())
        except FileNotFoundError:
            return None
        return [(kind, key, value) for kind, key, value in payload["ops"]]

    def _apply(self, xid: Xid, ops: list[Op], *, remember: bool = False) -> None:
        if remember:  # written with the data: a carried commit and its memory are one step
            self._remembered = self._remembered | {xid.to_gid()}
        self._write_data(apply_ops(self._data, ops), self._committed | {xid}, self._decisions)
        crash_point(f"fileres.{self._name}.after_apply")
        self._settle(xid, COMMITTED)

    def _write_data(
        self,
        data: dict[str, Value],
        committed: set[Xid],
        decisions: dict[str, dict[str, object]],
    ) -> None:
        payload = {
            "data": data,
            "committed": sorted(x.to_gid() for x in committed),
            "decisions": decisions,
            "carried": sorted(self._remembered),
        }
        write_atomic(self.directory / _DATA, json.dumps(payload, sort_keys=True).encode("ascii"))
        self._data, self._committed, self._decisions = data, committed, decisions
