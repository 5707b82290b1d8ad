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

One class over one lock, written by concern: this module builds the resource and the handles
the application works through; `._phases` prepares, commits and rolls back; `._last_resource`
carries the decision; `._recovery` lists prepared branches and reads the gauges; `._base` holds
the shared state (the open branches, the connections held for phase two, the queue of ended
decision rows) and the plumbing that ends and releases a branch. What stands apart from the class
lives apart too: the drivers (`_driver`, `_psycopg2`, `_psycopg3`), the branch and its cursors
(`_branch`), the resource's own statements (`_pooled`), what it learns from the server
(`_server`), the session hook (`_sessions`), the decision table's SQL (`_decision_table`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, TypedDict, TypeVar, overload

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from coordinator import ConfigurationError, Transaction, TransientError, Xid
from resource_managers.bookkeeping import Branches

from . import _drivers, _errors
from ._base import BranchFailed, NotPreparable
from ._branch import Branch, BranchConnection
from ._last_resource import LastResourceOps
from ._phases import PhaseOps
from ._pooled import Pooled
from ._prepared import PreparedStatements
from ._recovery import RecoveryOps
from ._server import ServerFacts
from ._sessions import BRANCH, default_session, watch

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")
H = TypeVar("H")  # what ``tx.join`` returns: `Session`, Core `Connection`, or the driver's
Handle = Literal["session", "connection", "dbapi"]

_ISOLATION_LEVELS = ("READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE")
_HANDLES = ("session", "connection", "dbapi")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")

__all__ = ["BranchFailed", "NotPreparable", "PostgresResource"]


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
    prepared_statements: bool


class PostgresResource(PhaseOps, LastResourceOps, RecoveryOps, Generic[H]):
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
    ``prepared_statements``: a last resource prepares its decision row's statements once per
    pooled connection (`._prepared`); pass False behind a pooler in transaction mode.
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
        prepared_statements: bool = True,
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
        Branches.__init__(self, name or _default_name(engine), sort_key)
        self._handle: Handle = handle
        self._session_factory = session_factory or default_session
        self._begin_sql = "BEGIN"
        self._isolation = (isolation_level or "READ COMMITTED").upper()
        if isolation_level is not None:
            self._begin_sql += f" ISOLATION LEVEL {isolation_level.upper()}"
        self._hold = hold_prepared
        self._markers = outcome_markers
        self._marker_name = marker_table
        self._marker_retention = marker_retention
        self._busy_retries = busy_retries
        self._busy_delay = busy_delay
        #: prepared branches keeping their connection for phase two, oldest first
        self._held: dict[Xid, Branch] = {}
        self._wanted = threading.local()  # the handle `connection`/`dbapi_connection` asked for
        self._facts: ServerFacts | None = None
        self._pool = Pooled(engine, self._driver, self._name)
        self._last_purge = 0.0
        self._last = last_resource
        self._decision_name = decision_table
        self._ended: list[str] = []  # decision rows to delete with the next commit or cleanup
        #: what runs once an ended row's deletion committed (`LastResourceOps.end_decision`)
        self._after_drop: dict[str, Callable[[], None]] = {}
        #: node -> this process's epoch of it, for commits that carry branches (`fence_node`)
        self._epochs: dict[str, int] = {}
        self._fencing = threading.RLock()
        self._statements = PreparedStatements(self._name, prepared_statements)

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
            self._begin(xid, branch)
        except BaseException:
            self._release(branch, broken=False)
            raise
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
        branch = self._get(xid)
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
        branch = Branch(xid, xid.to_gid(), pooled, dbapi, self._begin_sql)
        try:
            self._driver.autocommit(dbapi, True)
            decisions = self._facts.decisions if self._facts is not None else None
            if decisions is not None:
                self._statements.on_open(self._driver, dbapi, decisions)
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


def _default_name(engine: Engine) -> str:
    database = engine.url.database or "postgres"
    cleaned = re.sub(r"[^A-Za-z0-9_.:-]", "_", database)
    return f"pg-{cleaned}"[:64]
