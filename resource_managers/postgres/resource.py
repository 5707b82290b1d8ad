"""`PostgresResource`: a PostgreSQL database as a two-phase-commit participant.

A branch is one pooled connection in an ordinary transaction, checked out once and kept from the
first statement through phase two. ``tx.join(pg)`` hands the application a SQLAlchemy `Session`
on it; ``pg.connection(tx)`` the Core `Connection` (no session, no ORM: the lighter handle for
hot paths), ``pg.dbapi_connection(tx)`` the driver's own connection. ``prepare`` turns the
transaction into a prepared one with ``PREPARE TRANSACTION``; the connection stays with the
branch so that phase two's ``COMMIT PREPARED`` needs no second checkout, at most
``hold_prepared`` seconds (after that it goes back to the pool and phase two, or recovery, takes
whichever connection the pool gives). Four things here are not what a first attempt would do:

- **Our own BEGIN, sent with the first statement.** The connection runs in autocommit mode and
  we send ``BEGIN`` ourselves, so the driver never believes it owns a transaction: after
  ``PREPARE TRANSACTION`` psycopg2 would otherwise keep sending statements without a BEGIN
  (autocommitting them) until someone called rollback. The BEGIN costs no round trip of its
  own: it travels with the application's first statement (`_driver` says how, per driver), and
  a branch that never ran a statement has nothing to prepare or commit.
- **We check that PREPARE prepared.** A transaction that failed earlier answers ``PREPARE
  TRANSACTION`` with the command tag ``ROLLBACK`` and no error (psycopg2 #1213): a yes vote that
  would turn into a phase-two failure. We require the tag, and refuse earlier when the server's
  transaction status (read by the driver without a round trip) is not a healthy open
  transaction: in error, or ended by a COMMIT/ROLLBACK the application sent itself.
- **An outcome marker.** ``COMMIT PREPARED`` of a gid that does not exist cannot say whether it
  was committed (our earlier commit whose answer was lost) or rolled back by an operator. Each
  prepared branch therefore inserts its gid into a small table *inside* the branch, sent in the
  same round trip as the PREPARE: the row exists exactly when the branch committed. So a repeated
  commit is recognised as done, and an operator's ``ROLLBACK PREPARED`` is reported as the
  heuristic outcome it is instead of being hidden. Rows older than ``marker_retention`` are
  purged by recovery passes; a decision re-driven after that long is reported as a heuristic
  rollback, loudly, never silently taken for committed.
- **No hooks per statement or per branch.** The connection's cursors report writes and errors
  to the branch (`_branch`), whichever handle ran them; the session class carries one hook
  (a rollback dooms the branch), registered once per class.

One-phase commits (this database is the only participant) skip all of it: no marker, no prepare,
just ``COMMIT`` with its tag checked.

``last_resource=True`` makes the database a logging last resource (`coordinator.last_resource`):
its branch never prepares; ``commit_with_decision`` sends the decision row, the deletion of rows
whose transactions ended, and ``COMMIT`` in one round trip (`_decision_table` has the SQL).

Why one module of ~800 lines: it is one class, the XA verbs of a branch over shared state (the
open branches, the connections held for phase two, the queue of ended decision rows), and each
verb's failure handling reads that state; what stands apart lives apart: the drivers
(`_driver`, `_psycopg2`, `_psycopg3`), the branch and its cursors (`_branch`), the resource's
own statements (`_pooled`), what it learns from the server (`_server`), the session hook
(`_sessions`), the decision table's SQL (`_decision_table`).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Generic, Literal, NoReturn, TypedDict, TypeVar, overload

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from coordinator import (
    ConfigurationError,
    Outcome,
    OutcomeUnknownError,
    ProgrammingError,
    Transaction,
    TransactionRolledBack,
    TransientError,
    Vote,
    Xid,
)
from coordinator.crashpoints import crash_point
from coordinator.decision_log import Decision
from coordinator.errors import FencedError
from coordinator.xid import branches_of

from . import _drivers, _errors
from ._branch import IDLE, INERROR, INTRANS, Branch, BranchConnection
from ._decision_table import DecisionTable
from ._pooled import Pooled
from ._server import ServerFacts, Tables, look_up
from ._sessions import BRANCH, default_session, watch

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("twopc.postgres")
T = TypeVar("T")
H = TypeVar("H")  # what ``tx.join`` returns: `Session`, Core `Connection`, or the driver's
Handle = Literal["session", "connection", "dbapi"]

_ISOLATION_LEVELS = ("READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE")
_HANDLES = ("session", "connection", "dbapi")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class BranchFailed(TransactionRolledBack):
    """The branch's own work failed, so it votes no; the message carries the server's error."""

    code = "postgres-branch-failed"
    reason = "vote"


class NotPreparable(ProgrammingError):
    """The branch did something PostgreSQL cannot prepare (temporary tables, LISTEN, WITH HOLD)."""

    code = "postgres-not-preparable"


class _Options(TypedDict, total=False):
    """`PostgresResource`'s keyword options besides ``handle`` (one list for its overloads)."""

    sort_key: str | None
    session_factory: Callable[[Connection], Session] | None
    isolation_level: str | None
    hold_prepared: float
    outcome_markers: bool
    marker_table: str
    marker_retention: float
    busy_retries: int
    busy_delay: float
    last_resource: bool
    decision_table: str


class PostgresResource(Generic[H]):
    """A PostgreSQL database (SQLAlchemy engine on psycopg2 or psycopg 3) as an XA-style resource
    manager.

    ``name`` is the branch qualifier written into every gid and the decision log: keep it stable
    and unique per database within a manager (default ``pg-<database>``). ``handle`` is what
    ``tx.join`` returns: ``"session"`` (default; a `Session` made by ``session_factory``, default
    ``Session(bind=connection)``), ``"connection"`` (the Core `Connection`) or ``"dbapi"`` (the
    driver's connection); ``connection(tx)`` and ``dbapi_connection(tx)`` ask for the lighter
    ones per call. ``isolation_level`` sets the branch transaction's level (default: the
    server's). ``hold_prepared`` bounds how long a prepared branch keeps its connection waiting
    for phase two (0: give it back at once). ``outcome_markers=False`` drops the marker table and
    with it the ability to tell an operator's rollback from an earlier commit (an unknown gid is
    then taken as committed). ``last_resource=True``: a logging last resource (see the module
    docstring); its decision rows live in ``decision_table``, abort fences are kept for
    ``marker_retention``. Such a database needs no ``max_prepared_transactions``.
    """

    @overload
    def __init__(
        self: PostgresResource[Session],
        engine: Engine,
        name: str | None = None,
        *,
        handle: Literal["session"] = "session",
        **options: Unpack[_Options],
    ) -> None: ...

    @overload
    def __init__(
        self: PostgresResource[Connection],
        engine: Engine,
        name: str | None = None,
        *,
        handle: Literal["connection"],
        **options: Unpack[_Options],
    ) -> None: ...

    @overload
    def __init__(
        self: PostgresResource[Any],
        engine: Engine,
        name: str | None = None,
        *,
        handle: Handle,
        **options: Unpack[_Options],
    ) -> None: ...

    def __init__(
        self,
        engine: Engine,
        name: str | None = None,
        *,
        sort_key: str | None = None,
        handle: Handle = "session",
        session_factory: Callable[[Connection], Session] | None = None,
        isolation_level: str | None = None,
        hold_prepared: float = 5.0,
        outcome_markers: bool = True,
        marker_table: str = "twopc_outcome",
        marker_retention: float = 7 * 24 * 3600.0,
        busy_retries: int = 20,
        busy_delay: float = 0.05,
        last_resource: bool = False,
        decision_table: str = "twopc_decision_row",
    ) -> None:
        self._driver = _drivers.for_engine(engine)
        if isolation_level is not None and isolation_level.upper() not in _ISOLATION_LEVELS:
            raise ConfigurationError(f"isolation_level must be one of {_ISOLATION_LEVELS}")
        if handle not in _HANDLES:
            raise ConfigurationError(f"handle must be one of {_HANDLES}, not {handle!r}")
        if not hold_prepared >= 0:
            raise ConfigurationError(f"hold_prepared must be >= 0 seconds, not {hold_prepared!r}")
        for label, table in (("marker_table", marker_table), ("decision_table", decision_table)):
            if not _IDENTIFIER.match(table):
                raise ConfigurationError(f"{label} {table!r} is not a plain identifier")
        self.engine = engine
        self._name = name or _default_name(engine)
        self._sort_key = sort_key or self._name
        self._handle: Handle = handle
        self._session_factory = session_factory or default_session
        self._begin = "BEGIN"
        self._isolation = (isolation_level or "READ COMMITTED").upper()
        if isolation_level is not None:
            self._begin += f" ISOLATION LEVEL {isolation_level.upper()}"
        self._hold = hold_prepared
        self._markers = outcome_markers
        self._marker_name = marker_table
        self._marker_retention = marker_retention
        self._busy_retries = busy_retries
        self._busy_delay = busy_delay
        self._lock = threading.Lock()
        self._branches: dict[Xid, Branch] = {}
        #: prepared branches keeping their connection for phase two, oldest first
        self._held: dict[Xid, Branch] = {}
        self._wanted = threading.local()  # the handle `connection`/`dbapi_connection` asked for
        self._facts: ServerFacts | None = None
        self._pool = Pooled(engine, self._driver, self._name)
        self._last_purge = 0.0
        self._last = last_resource
        self._decision_name = decision_table
        self._ended: list[str] = []  # decision rows to delete with the next commit or cleanup

    @property
    def name(self) -> str:
        return self._name

    @property
    def sort_key(self) -> str:
        return self._sort_key

    @property
    def last_resource(self) -> bool:
        return self._last

    @property
    def reads_committed(self) -> bool:
        """Its branches run READ COMMITTED, unless the server's default says otherwise."""
        return self._isolation == "READ COMMITTED"

    def __repr__(self) -> str:
        return f"PostgresResource({self._name!r}, {self.engine.url.render_as_string()!r})"

    # -- phase zero: the branch's work -----------------------------------------------------------

    def start(self, xid: Xid) -> H:
        facts = self._server_facts()
        if facts.max_prepared <= 0 and not self._last:
            raise ConfigurationError(
                f"{self._name}: the server has max_prepared_transactions = 0, so it cannot take "
                "part in two-phase commit; set max_prepared_transactions (at least "
                "max_connections) in postgresql.conf and restart PostgreSQL"
            )
        if self._held:
            self._release_expired()
        branch = self._open(xid)
        try:
            handle = self._handle_of(branch, getattr(self._wanted, "kind", None) or self._handle)
        except BaseException:
            self._release(branch, broken=False)
            raise
        with self._lock:
            self._branches[xid] = branch
        return handle  # type: ignore[no-any-return]  # the kind ``handle=`` named, i.e. H

    def connection(self, tx: Transaction) -> Connection:
        """Join ``tx`` (if not joined yet) and return the branch's SQLAlchemy Core `Connection`:
        no `Session` is made when this is the first join. Its statements are the branch's."""
        return self._core(self._joined(tx, "connection"))

    def dbapi_connection(self, tx: Transaction) -> Any:
        """Join ``tx`` and return the driver's connection of the branch (psycopg2 or psycopg 3).
        Use its cursors; never its ``commit``, ``rollback`` or ``autocommit``."""
        return self._joined(tx, "dbapi").dbapi

    def _joined(self, tx: Transaction, kind: Handle) -> Branch:
        xid = Xid.branch_of(tx.gtrid, self._name)
        with self._lock:
            branch = self._branches.get(xid)
        if branch is None:
            self._wanted.kind = kind
            try:
                tx.join(self)
            finally:
                self._wanted.kind = None
            branch = self._branch(xid)
        return branch

    def _open(self, xid: Xid) -> Branch:
        """A pooled connection, in autocommit mode, whose cursors report to the new branch. No
        round trip: the BEGIN waits for the first statement (the module docstring says why)."""
        try:
            pooled = self.engine.raw_connection()
        except Exception as exc:
            raise TransientError(
                f"{self._name}: cannot connect to PostgreSQL: {_errors.describe(exc)}"
            ) from exc
        dbapi = pooled.dbapi_connection
        branch = Branch(xid, xid.to_gid(), pooled, dbapi, self._begin)
        try:
            self._driver.autocommit(dbapi, True)
            self._driver.attach(dbapi, branch)
        except Exception as exc:
            pooled.invalidate()
            pooled.close()
            raise TransientError(
                f"{self._name}: cannot open a branch: {_errors.describe(exc)}"
            ) from exc
        return branch

    def _handle_of(self, branch: Branch, kind: Handle) -> Any:
        if kind == "dbapi":
            return branch.dbapi
        connection = self._core(branch)
        if kind == "connection":
            return connection
        session = branch.session = self._session_factory(connection)
        watch(type(session))
        session.info[BRANCH] = branch
        return session

    def _core(self, branch: Branch) -> Connection:
        """The branch's Core connection, made on first use. It may not reconnect by itself: a
        statement on a fresh connection would run outside the branch's transaction."""
        if branch.connection is None:
            branch.connection = BranchConnection(
                self.engine, connection=branch.pooled, _allow_revalidate=False
            )
        return branch.connection

    def is_transient(self, error: BaseException) -> bool:
        """For `TransactionManager.run`: may a retry of the whole transaction succeed?

        Serialization failures and deadlocks (the server's advice is to retry), a lock timeout,
        and a connection lost while the work ran (nothing was prepared or committed yet).
        """
        return _errors.is_retryable(error)

    # -- phase one ---------------------------------------------------------------------------------

    def prepare(self, xid: Xid) -> Vote:
        branch = self._branch(xid)
        self._flush_for_commit(branch)
        if branch.begin is not None or (not branch.may_write and not self._has_xid(branch)):
            self._end_local(branch)  # no statement ran, or none wrote
            return Vote.READ_ONLY
        self._prepare_on_server(branch)
        crash_point(f"postgres.{self._name}.after_prepare")
        return Vote.COMMIT

    def _prepare_on_server(self, branch: Branch) -> None:
        facts = self._server_facts()
        sql, params = "PREPARE TRANSACTION %s", [branch.gid]
        if facts.marker_table is not None:
            # one round trip: the marker commits (or not) with the branch, never on its own
            sql = f"INSERT INTO {facts.marker_table} (gid) VALUES (%s); {sql}"
            params.insert(0, branch.gid)
        branch.prepare_sent = True
        try:
            tag = self._driver.run(branch.dbapi, sql, params)
        except Exception as exc:
            if _errors.is_unreachable(exc):
                # The PREPARE may have landed before the connection died: roll back by gid later.
                self._discard(branch, broken=True)
                raise TransientError(
                    f"{self._name}: connection lost during PREPARE; the branch is rolled back "
                    f"(now or by recovery): {_errors.describe(exc)}"
                ) from exc
            self._end_local(branch)
            if _errors.is_not_preparable(exc):
                raise NotPreparable(
                    f"{self._name}: PostgreSQL cannot prepare this branch: "
                    f"{_errors.describe(exc)}. A two-phase branch must not use temporary tables, "
                    "LISTEN/UNLISTEN/NOTIFY or cursors WITH HOLD; do that work outside the "
                    "transaction"
                ) from exc
            raise BranchFailed(
                f"{self._name}: PREPARE TRANSACTION failed: {_errors.describe(exc)}"
            ) from exc
        if tag != "PREPARE TRANSACTION":
            # e.g. "ROLLBACK": the server threw the transaction away instead of preparing it
            self._discard(branch, broken=False)
            raise BranchFailed(
                f"{self._name}: the server answered PREPARE TRANSACTION with {tag!r}; "
                "nothing was prepared"
            )
        self._hold_for_phase_two(branch)

    def _hold_for_phase_two(self, branch: Branch) -> None:
        """The prepared transaction belongs to the server now; its connection waits for phase
        two (one checkout per transaction), for ``hold_prepared`` seconds at most."""
        with self._lock:
            self._branches.pop(branch.xid, None)
            if self._hold > 0:
                branch.held_until = time.monotonic() + self._hold
                self._held[branch.xid] = branch
                return
        self._release(branch, broken=False)

    def _release_expired(self) -> None:
        """Give back the connections of branches prepared longer than ``hold_prepared`` ago:
        their phase two (or recovery's) takes a pooled connection when it comes."""
        now = time.monotonic()
        with self._lock:
            expired = []
            for branch in self._held.values():  # oldest first: insertion order
                if branch.held_until > now:
                    break
                expired.append(branch)
            for branch in expired:
                del self._held[branch.xid]
        for branch in expired:
            self._release(branch, broken=False)

    # -- phase two ---------------------------------------------------------------------------------

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if one_phase:
            return self._commit_one_phase(self._branch(xid))
        with self._lock:
            stray = self._branches.get(xid)
            held = self._held.pop(xid, None) if stray is None else None
        if stray is not None:
            raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
        try:
            self._finish_prepared("COMMIT PREPARED", xid, held)
        except _UnknownGid:
            if not self._markers or self._marker_exists(xid):
                return None  # committed before; the answer was lost
            return Outcome.HEURISTIC_ROLLBACK
        return None

    def _flush_for_commit(self, branch: Branch) -> None:
        """Flush the session; a branch whose work failed, or whose transaction the application
        ended itself, is ended here and votes no. The server's transaction status is the
        driver's, read without a round trip."""
        if branch.session is not None:
            try:
                branch.session.flush()
            except Exception as exc:
                self._end_local(branch)
                raise BranchFailed(f"{self._name}: flush failed: {_errors.describe(exc)}") from exc
        if branch.failure is None and branch.begin is None:
            status = self._driver.status(branch.dbapi)
            if status == INERROR:
                branch.failure = branch.last_error or "a statement failed earlier"
            elif status == IDLE:
                branch.failure = (
                    "the transaction was ended by a COMMIT or ROLLBACK sent through the "
                    "branch's connection; its work is not the branch's any more"
                )
            elif status != INTRANS:
                branch.failure = f"the connection is not in a usable transaction (status {status})"
        if branch.failure is not None:
            self._end_local(branch)
            raise BranchFailed(f"{self._name}: the branch's work failed: {branch.failure}")

    def _commit_one_phase(self, branch: Branch) -> Outcome | None:
        self._flush_for_commit(branch)
        if branch.begin is not None:  # no statement ran: nothing to commit
            self._discard(branch, broken=False)
            return None
        try:
            tag = self._driver.run(branch.dbapi, "COMMIT")
        except Exception as exc:
            broken = _errors.is_unreachable(exc)
            self._discard(branch, broken=True)
            if broken:
                raise OutcomeUnknownError(
                    f"{self._name}: connection lost during a one-phase COMMIT; it may or may not "
                    f"have committed: {_errors.describe(exc)}",
                    gtrid=branch.xid.gtrid,
                ) from exc
            raise BranchFailed(f"{self._name}: COMMIT failed: {_errors.describe(exc)}") from exc
        self._discard(branch, broken=False)
        if tag != "COMMIT":
            raise BranchFailed(f"{self._name}: the server answered COMMIT with {tag!r}")
        return None

    def rollback(self, xid: Xid) -> Outcome | None:
        with self._lock:
            branch = self._branches.get(xid)
            held = self._held.pop(xid, None)
        if branch is not None:
            if not branch.prepare_sent:
                self._end_local(branch)
                return None
            self._discard(branch, broken=True)
        try:
            self._finish_prepared("ROLLBACK PREPARED", xid, held)
        except _UnknownGid:
            if self._markers and self._marker_exists(xid):
                return Outcome.HEURISTIC_COMMIT
        return None

    def _finish_prepared(self, verb: str, xid: Xid, held: Branch | None = None) -> None:
        """``COMMIT/ROLLBACK PREPARED``: on the branch's own connection if it still holds one,
        else (or if that fails for any reason but an unknown gid) on a pooled connection,
        retrying while the gid is busy."""
        gid = xid.to_gid() if held is None else held.gid
        if held is not None:
            try:
                self._driver.run(held.dbapi, f"{verb} %s", [gid])
            except Exception as exc:
                self._release(held, broken=_errors.is_unreachable(exc))
                if _errors.is_unknown_gid(exc):
                    raise _UnknownGid(gid) from exc
            else:
                self._release(held, broken=False)
                return

        def finish() -> None:
            with self._pool.connection() as connection:
                self._driver.run(connection, f"{verb} %s", [gid])

        for attempt in range(self._busy_retries + 1):
            try:
                self._pool.once_more(finish)
                return
            except Exception as exc:
                if _errors.is_unknown_gid(exc):
                    raise _UnknownGid(gid) from exc
                if _errors.is_busy(exc) and attempt < self._busy_retries:
                    time.sleep(self._busy_delay)
                    continue
                raise TransientError(
                    f"{self._name}: {verb} of {gid} did not complete, will retry: "
                    f"{_errors.describe(exc)}"
                ) from exc

    # -- the last resource (coordinator.last_resource) ---------------------------------------------

    def commit_with_decision(self, xid: Xid, decision: Decision) -> None:
        """The branch's data and the decision row in one server commit, one round trip."""
        table = self._decision_table()
        with self._lock:
            ended, self._ended = self._ended, []
        node = xid.node_id or ""
        sql, params = table.commit(decision.gtrid, node, decision.branches, ended)
        try:
            self.commit_carrying(xid, sql, params, fence=_errors.is_unique_violation)
        except BaseException:
            self._requeue(ended)
            raise

    def commit_carrying(
        self,
        xid: Xid,
        sql: str,
        params: list[Any],
        *,
        fence: Callable[[BaseException], bool],
        fenced: str = "recovery presumed {gtrid} aborted before its last resource could commit",
    ) -> None:
        """Send ``sql`` (a decision record's statements, ending in ``COMMIT``) inside the branch's
        own transaction: the branch's data and the record in one server commit, one round trip.

        Answers as `LastResource.commit_with_decision`: an error that ``fence`` recognises (the
        record's own guard refused it) is `FencedError`, with ``fenced`` as its reason.
        """
        branch = self._branch(xid)
        self._flush_for_commit(branch)
        if branch.begin is not None:  # no statement ran yet: the record opens the branch
            sql, branch.begin = f"{branch.begin}; {sql}", None
        try:
            tag = self._driver.run(branch.dbapi, sql, params)
        except Exception as exc:
            self._lost_last_commit(branch, exc, fence, fenced)
        self._discard(branch, broken=False)
        if tag != "COMMIT":  # the transaction had failed: the server rolled it back
            raise BranchFailed(f"{self._name}: the server answered COMMIT with {tag!r}")

    def _lost_last_commit(
        self,
        branch: Branch,
        exc: Exception,
        fence: Callable[[BaseException], bool],
        fenced: str,
    ) -> NoReturn:
        """Say what a failed commit with a decision leaves: unknown, fenced, or rolled back."""
        gtrid = branch.xid.gtrid
        if _errors.is_unreachable(exc):
            self._discard(branch, broken=True)
            raise OutcomeUnknownError(
                f"{self._name}: connection lost while committing with the decision of {gtrid}; "
                f"recovery reads the decision: {_errors.describe(exc)}",
                gtrid=gtrid,
            ) from exc
        self._end_local(branch)
        if fence(exc):
            raise FencedError(
                f"{self._name}: {fenced.format(gtrid=gtrid)}; it rolls back", gtrid=gtrid
            ) from exc
        raise BranchFailed(
            f"{self._name}: commit with the decision failed: {_errors.describe(exc)}"
        ) from exc

    def decisions_of(self, gtrids: Collection[str]) -> set[str]:
        crash_point(f"postgres.{self._name}.before_decision_lookup")
        wanted = sorted(gtrids)
        if not wanted:
            return set()
        rows = self._pool.query(*self._decision_table().fence_and_read(wanted))
        return {str(gtrid) for (gtrid,) in rows}

    def committed_decisions(self, node_id: str) -> dict[str, tuple[str, ...]]:
        rows = self._pool.query(*self._decision_table().committed(node_id))
        return {str(gtrid): tuple(branches) for gtrid, branches in rows}

    def end_decision(self, gtrid: str) -> None:
        with self._lock:
            self._ended.append(gtrid)

    def drop_decisions(self, gtrids: Collection[str]) -> None:
        with self._lock:
            ended, self._ended = self._ended, []
        gone = sorted({*ended, *gtrids})
        if not gone:
            return
        try:
            self._pool.run(*self._decision_table().drop(gone))
        except Exception:
            self._requeue(ended)
            raise

    def _requeue(self, ended: list[str]) -> None:
        with self._lock:
            self._ended[:0] = ended

    def _decision_table(self) -> DecisionTable:
        table = self._server_facts().decisions
        if table is None:
            raise ProgrammingError(f"{self._name} is not a last resource (last_resource=False)")
        return table

    # -- recovery ----------------------------------------------------------------------------------

    def recover(self) -> list[Xid]:
        """Our prepared branches (and sub-branches) in this database, owned by our role, of any
        age."""
        if self._held:
            self._release_expired()
        rows = self._pool.query(
            "SELECT gid FROM pg_prepared_xacts "
            "WHERE database = current_database() AND owner = current_user"
        )
        found = branches_of((str(gid) for (gid,) in rows), self._name, sub_branches=True)
        self._purge_markers()
        return found

    def forget(self, xid: Xid) -> None:
        facts = self._server_facts()
        if facts.marker_table is not None:
            self._pool.run(f"DELETE FROM {facts.marker_table} WHERE gid = %s", [xid.to_gid()])

    def prepared_stats(self) -> tuple[int, float]:
        """(count, age in seconds of the oldest) of this database's prepared transactions.

        Every prepared transaction holds its locks and the VACUUM horizon, ours or not.
        """
        rows = self._pool.query(
            "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(prepared)), 0) "
            "FROM pg_prepared_xacts WHERE database = current_database()"
        )
        count, age = rows[0]
        return int(count), float(age)

    def gauges(self) -> dict[str, Callable[[], float]]:
        """Read by the manager's metrics (`TransactionManager.register`)."""
        return {
            "prepared_transactions": lambda: self._gauge(0),
            "oldest_prepared_age_seconds": lambda: self._gauge(1),
        }

    def _gauge(self, index: int) -> float:
        """NaN while the server is unreachable: one down database must not break the export."""
        try:
            return float(self.prepared_stats()[index])
        except TransientError:
            return math.nan

    def _marker_exists(self, xid: Xid) -> bool:
        facts = self._server_facts()
        if facts.marker_table is None:
            return False
        try:
            rows = self._pool.query(
                f"SELECT 1 FROM {facts.marker_table} WHERE gid = %s", [xid.to_gid()]
            )
        except Exception as exc:
            raise TransientError(
                f"{self._name}: cannot read the outcome marker of {xid}: {_errors.describe(exc)}"
            ) from exc
        return bool(rows)

    def _purge_markers(self) -> None:
        """Markers and abort fences past ``marker_retention``, once a minute at most."""
        facts = self._server_facts()
        now = time.monotonic()
        if now - self._last_purge < 60:
            return
        self._last_purge = now
        if facts.marker_table is not None:
            self._pool.run(
                f"DELETE FROM {facts.marker_table} "
                "WHERE committed_at < now() - make_interval(secs => %s)",
                [self._marker_retention],
            )
        if facts.decisions is not None:
            self._pool.run(*facts.decisions.purge_fences(self._marker_retention))

    # -- plumbing ----------------------------------------------------------------------------------

    def _server_facts(self) -> ServerFacts:
        """Looked up once (`_server`)."""
        facts = self._facts
        if facts is None:
            tables = Tables(
                self._marker_name if self._markers else None,
                self._decision_name if self._last else None,
            )
            facts = self._facts = look_up(self._pool, self._driver, self._name, tables)
        return facts

    def _branch(self, xid: Xid) -> Branch:
        with self._lock:
            branch = self._branches.get(xid)
        if branch is None:
            raise ProgrammingError(f"{self._name}: no active branch {xid}")
        return branch

    def _has_xid(self, branch: Branch) -> bool:
        """Did any statement write? Only asked when every statement looked like a read."""
        rows = self._driver.query(branch.dbapi, "SELECT txid_current_if_assigned() IS NOT NULL")
        return bool(rows[0][0])

    def _end_local(self, branch: Branch) -> None:
        """Roll back an unprepared branch (if its BEGIN was ever sent) and give its connection
        back."""
        if branch.begin is None and self._driver.status(branch.dbapi) != IDLE:
            try:
                self._driver.run(branch.dbapi, "ROLLBACK")
            except Exception as exc:
                log.debug("%s: rollback of %s failed: %r", self._name, branch.gid, exc)
                self._discard(branch, broken=True)
                return
        self._discard(branch, broken=False)

    def _discard(self, branch: Branch, *, broken: bool) -> None:
        with self._lock:
            self._branches.pop(branch.xid, None)
        self._release(branch, broken=broken)

    def _release(self, branch: Branch, *, broken: bool) -> None:
        """Close the branch's handles and give its connection back to the pool (or drop it)."""
        try:
            if branch.session is not None:
                branch.session.info.pop(BRANCH, None)
                branch.session.close()
            self._driver.detach(branch.dbapi)
            if broken:
                (branch.connection or branch.pooled).invalidate()
            else:
                self._driver.autocommit(branch.dbapi, False)
            if branch.connection is not None:
                branch.connection.end_of_branch()
            else:
                branch.pooled.close()
        except Exception as exc:
            log.debug("%s: releasing the connection of %s: %r", self._name, branch.gid, exc)


class _UnknownGid(Exception):
    """The prepared transaction does not exist (any more)."""


def _default_name(engine: Engine) -> str:
    database = engine.url.database or "postgres"
    cleaned = re.sub(r"[^A-Za-z0-9_.:-]", "_", database)
    return f"pg-{cleaned}"[:64]
