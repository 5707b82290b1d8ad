"""`AsyncPostgresResource`: a PostgreSQL branch worked through SQLAlchemy's asyncio API.

``await tx.join(pg)`` (`coordinator.aio`) hands the application an `AsyncSession` (or, with
``handle="connection"``, the `AsyncConnection`) on a connection of an async engine over psycopg 3
(``postgresql+psycopg``). Its statements run on the event loop, and so do prepare and phase two:
completion calls the synchronous verbs below on a worker thread, and each hands its coroutine to
the branch's loop (`coordinator.aio.on_loop`).

What is shared with the synchronous `PostgresResource`, so that the two are one resource to the
protocol and to an operator: the gid (`Xid.to_gid`), the PREPARE statement with its outcome
marker in the same message (`._phases.prepare_statement`), the checks of the command tags, the
crash point ``postgres.<name>.after_prepare``, and everything that needs no branch: recovery,
``COMMIT/ROLLBACK PREPARED`` of a branch this process did not prepare (after a crash, or once
the branch's own connection failed), the marker look-ups, ``forget`` and the gauges are a
synchronous `PostgresResource` of the same name over a synchronous engine (``sync_engine``,
default: one made from the async engine's URL), which runs off the loop by nature.

Plain SQL, not psycopg's ``tpc_*``: ``tpc_begin`` wants to own the transaction that SQLAlchemy
already began on the connection, ``tpc_prepare`` cannot carry the marker's insert in its round
trip, and it parses gids as XA triples of its own. So the branch runs an ordinary transaction
(the BEGIN travels with the application's first statement, psycopg's own habit), prepares it with
the sync resource's statement, and switches the connection to autocommit (no round trip) for
``COMMIT PREPARED``, which may not run inside a transaction block.

The branch ends only by the coordinator's word: a ``commit()`` of the branch's connection by the
application is refused (a hook raises before the driver sends COMMIT), and a ``rollback()`` dooms
the branch (it votes no). An `AsyncSession` bound to a connection already in a transaction leaves
that transaction alone on ``commit()`` (SQLAlchemy's ``conservative_savepoint``).

Why one module: each verb has two halves, the synchronous one completion calls on its thread and
the coroutine it sends to the loop; they are kept side by side so that a reader sees where each
statement runs and what happens when the loop cannot run it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload

import psycopg
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from coordinator import (
    ConfigurationError,
    Outcome,
    ProgrammingError,
    TransientError,
    Vote,
    Xid,
)
from coordinator.aio import on_loop
from coordinator.crashpoints import crash_point
from resource_managers.aio_twin import SyncTwin, not_opened

from . import _errors
from ._base import BranchFailed, NotPreparable
from ._branch import IDLE, INERROR, INTRANS
from ._phases import check_commit_tag, one_phase_failure, prepare_statement
from .resource import PostgresResource

log = logging.getLogger("twopc.postgres")

H = TypeVar("H")
T = TypeVar("T")
AsyncHandle = Literal["session", "connection"]

__all__ = ["AsyncPostgresResource"]


@dataclass(eq=False)
class _Branch:
    """One transaction's work on this database, on one loop and one connection."""

    xid: Xid
    gid: str
    loop: asyncio.AbstractEventLoop
    connection: AsyncConnection
    #: psycopg's `AsyncConnection` inside it, for our own statements
    dbapi: Any = None
    session: AsyncSession | None = None
    #: why the branch must vote no, found while the application worked
    failure: str | None = None
    #: our own end of the transaction is under way: the hooks leave it alone
    ending: bool = False
    prepare_sent: bool = False
    prepared: bool = False


class AsyncPostgresResource(SyncTwin, Generic[H]):
    """A PostgreSQL database, worked through an `AsyncEngine` on psycopg 3, as a resource.

    ``name`` and the marker table are the synchronous resource's (`PostgresResource`): keep the
    name stable, since it is in every gid. ``io_timeout``: how long a verb waits for its
    statement on the loop before it gives up (the statement's effect is then unknown and
    recovery finishes the branch).
    """

    sync: PostgresResource[Any]

    @overload
    def __init__(
        self: AsyncPostgresResource[AsyncSession],
        engine: AsyncEngine,
        name: str | None = None,
        *,
        handle: Literal["session"] = "session",
        sync_engine: Engine | None = None,
        sort_key: str | None = None,
        session_factory: Callable[[AsyncConnection], AsyncSession] | None = None,
        io_timeout: float = 30.0,
    ) -> None: ...

    @overload
    def __init__(
        self: AsyncPostgresResource[AsyncConnection],
        engine: AsyncEngine,
        name: str | None = None,
        *,
        handle: Literal["connection"],
        sync_engine: Engine | None = None,
        sort_key: str | None = None,
        session_factory: Callable[[AsyncConnection], AsyncSession] | None = None,
        io_timeout: float = 30.0,
    ) -> None: ...

    def __init__(
        self,
        engine: AsyncEngine,
        name: str | None = None,
        *,
        handle: AsyncHandle = "session",
        sync_engine: Engine | None = None,
        sort_key: str | None = None,
        session_factory: Callable[[AsyncConnection], AsyncSession] | None = None,
        io_timeout: float = 30.0,
    ) -> None:
        if engine.dialect.driver != "psycopg":
            raise ConfigurationError(
                "AsyncPostgresResource needs a postgresql+psycopg async engine, not "
                f"{engine.url.drivername}"
            )
        if handle not in ("session", "connection"):
            raise ConfigurationError(f"handle must be 'session' or 'connection', not {handle!r}")
        if not io_timeout > 0:
            raise ConfigurationError(f"io_timeout must be > 0 seconds, not {io_timeout!r}")
        self.engine = engine
        #: the same resource over a synchronous engine: recovery and the branches without a
        #: connection of their own (module docstring)
        self._own_sync_engine = sync_engine is None
        self.sync = PostgresResource(
            sync_engine if sync_engine is not None else create_engine(engine.url),
            name,
            sort_key=sort_key,
        )
        self._handle: AsyncHandle = handle
        self._session_factory = session_factory or _default_session
        self._io_timeout = io_timeout
        self._lock = threading.Lock()
        self._branches: dict[Xid, _Branch] = {}
        self._marker_table: str | None = None
        self._checked = False

    def __repr__(self) -> str:
        return f"AsyncPostgresResource({self.name!r}, {self.engine.url.render_as_string()!r})"

    # -- phase zero: the branch's work, on the loop ------------------------------------------

    async def open_branch(self, xid: Xid) -> None:
        """A pooled async connection, its transaction begun (the BEGIN waits for the first
        statement: no round trip here)."""
        if not self._checked:
            await asyncio.to_thread(self._check_server)
        try:
            connection = await self.engine.connect()
        except Exception as exc:
            raise TransientError(
                f"{self.name}: cannot connect to PostgreSQL: {_errors.describe(exc)}"
            ) from exc
        branch = _Branch(xid, xid.to_gid(), asyncio.get_running_loop(), connection)
        try:
            await connection.begin()
            assert connection.sync_connection is not None  # connected just now
            _watch(connection.sync_connection, branch)
            branch.dbapi = (await connection.get_raw_connection()).driver_connection
            if self._handle == "session":
                branch.session = self._session_factory(connection)
        except BaseException:
            await connection.close()
            raise
        with self._lock:
            if xid in self._branches:
                raise ProgrammingError(f"{self.name}: branch {xid} is already open")
            self._branches[xid] = branch

    async def aclose(self) -> None:
        """Dispose of the synchronous engine this resource made (not of ``engine``, which is
        the caller's, nor of a ``sync_engine`` given)."""
        if self._own_sync_engine:
            await asyncio.to_thread(self.sync.engine.dispose)

    async def abandon_branch(self, xid: Xid) -> None:
        with self._lock:
            branch = self._branches.pop(xid, None)
        if branch is not None:
            await self._close(branch)

    def start(self, xid: Xid) -> H:
        with self._lock:
            branch = self._branches.get(xid)
        if branch is None:
            raise not_opened(self.name, xid)
        handle = branch.session if branch.session is not None else branch.connection
        return handle  # type: ignore[return-value]  # the kind ``handle=`` named, i.e. H

    def _check_server(self) -> None:
        """Once: the server can prepare, and the marker table exists (the sync resource's
        look-up, off the loop)."""
        facts = self.sync._server_facts()
        if facts.max_prepared <= 0:
            raise ConfigurationError(
                f"{self.name}: the server has max_prepared_transactions = 0, so it cannot take "
                "part in two-phase commit; set max_prepared_transactions (at least "
                "max_connections) in postgresql.conf and restart PostgreSQL"
            )
        self._marker_table = facts.marker_table
        self._checked = True

    # -- phase one -----------------------------------------------------------------------------

    def prepare(self, xid: Xid) -> Vote:
        branch = self._branch(xid)
        vote = self._on_loop(branch, lambda: self._prepare(branch), "prepare")
        if vote == Vote.COMMIT:
            crash_point(f"postgres.{self.name}.after_prepare")
        return vote

    async def _prepare(self, branch: _Branch) -> Vote:
        dbapi = await self._flushed(branch)
        if dbapi is None:
            return Vote.READ_ONLY
        sql, params = prepare_statement(self._marker_table, branch.gid)
        branch.prepare_sent = True
        try:
            tag = await _run(dbapi, sql, params)
        except Exception as exc:
            if _errors.is_unreachable(exc):
                await self._end(branch, broken=True)
                raise TransientError(
                    f"{self.name}: connection lost during PREPARE; the branch is rolled back "
                    f"(now or by recovery): {_errors.describe(exc)}"
                ) from exc
            await self._end(branch, broken=False)
            if _errors.is_not_preparable(exc):
                raise NotPreparable(
                    f"{self.name}: PostgreSQL cannot prepare this branch: "
                    f"{_errors.describe(exc)}. A two-phase branch must not use temporary tables, "
                    "LISTEN/UNLISTEN/NOTIFY or cursors WITH HOLD"
                ) from exc
            raise BranchFailed(
                f"{self.name}: PREPARE TRANSACTION failed: {_errors.describe(exc)}"
            ) from exc
        if tag != "PREPARE TRANSACTION":
            await self._end(branch, broken=False)
            raise BranchFailed(
                f"{self.name}: the server answered PREPARE TRANSACTION with {tag!r}; "
                "nothing was prepared"
            )
        branch.prepared = True
        return Vote.COMMIT

    async def _flushed(self, branch: _Branch) -> Any | None:
        """Flush the session and check the transaction: the driver's connection when there is
        work to end, None (branch ended) when no statement ran. A failed branch raises."""
        session = branch.session
        if session is not None and branch.failure is None and _pending(session):
            try:
                await session.flush()
            except Exception as exc:
                branch.failure = f"flush failed: {_errors.describe(exc)}"
        dbapi = branch.dbapi
        status = int(dbapi.info.transaction_status)
        if branch.failure is None and status == INERROR:
            branch.failure = "a statement failed earlier"
        elif branch.failure is None and status not in (IDLE, INTRANS):
            branch.failure = f"the connection is not in a usable transaction (status {status})"
        if branch.failure is not None:
            await self._end(branch, broken=False)
            raise BranchFailed(f"{self.name}: the branch's work failed: {branch.failure}")
        if status == IDLE:  # no statement ran: nothing to prepare or commit
            await self._end(branch, broken=False)
            return None
        return dbapi

    # -- phase two -----------------------------------------------------------------------------

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        with self._lock:
            branch = self._branches.get(xid)
        if one_phase:
            if branch is None:
                raise ProgrammingError(f"{self.name}: no active branch {xid}")
            return self._on_loop(branch, lambda: self._commit_one_phase(branch), "commit")
        if branch is not None and not branch.prepared:
            raise ProgrammingError(f"{self.name}: commit of {xid} before it was prepared")
        if branch is not None and self._finished(branch, "COMMIT PREPARED"):
            return None
        return self.sync.commit(xid)  # no connection of its own (any more): by gid

    async def _commit_one_phase(self, branch: _Branch) -> Outcome | None:
        dbapi = await self._flushed(branch)
        if dbapi is None:
            return None
        try:
            tag = await _run(dbapi, "COMMIT")
        except Exception as exc:
            await self._end(branch, broken=True)
            raise one_phase_failure(self.name, branch.xid, exc) from exc
        await self._end(branch, broken=False)
        check_commit_tag(self.name, tag)
        return None

    def rollback(self, xid: Xid) -> Outcome | None:
        with self._lock:
            branch = self._branches.get(xid)
        if branch is None:
            return self.sync.rollback(xid)  # recovery, or a branch already ended here
        if not branch.prepare_sent:
            self._drop(branch, broken=False)
            return None
        if branch.prepared and self._finished(branch, "ROLLBACK PREPARED"):
            return None
        if not branch.prepared:  # a prepare cut short on the loop: its connection is suspect
            self._drop(branch, broken=True)
        return self.sync.rollback(xid)  # by gid: a prepare may have landed

    def _drop(self, branch: _Branch, *, broken: bool) -> None:
        """End an unprepared branch: the server rolls back what its connection held, whether
        it is given back (rolled back) or dropped."""
        try:
            self._on_loop(branch, lambda: self._end(branch, broken=broken), "rollback")
        except Exception as exc:
            log.debug("%s: rollback of %s: %r", self.name, branch.gid, exc)
            with self._lock:
                self._branches.pop(branch.xid, None)

    def _finished(self, branch: _Branch, verb: str) -> bool:
        """``verb`` on the branch's own connection; False if that did not work (the caller then
        goes by gid through the sync resource, which tells a lost answer from an operator's
        doing by the marker)."""
        try:
            self._on_loop(branch, lambda: self._finish_prepared(branch, verb), verb)
        except Exception as exc:
            log.debug("%s: %s of %s on its own connection: %r", self.name, verb, branch.gid, exc)
            with self._lock:
                self._branches.pop(branch.xid, None)
            return False
        return True

    async def _finish_prepared(self, branch: _Branch, verb: str) -> None:
        dbapi = branch.dbapi
        try:
            await dbapi.set_autocommit(True)  # no round trip; PREPARE left the session idle
            await _run(dbapi, f"{verb} %s", [branch.gid])
            await dbapi.set_autocommit(False)
        except BaseException:
            await self._end(branch, broken=True)
            raise
        await self._end(branch, broken=False)

    # -- for `TransactionManager.run` -----------------------------------------------------------

    def is_transient(self, error: BaseException) -> bool:
        """For `TransactionManager.run`, as `PostgresResource.is_transient`."""
        return _errors.is_retryable(error)

    # -- plumbing ------------------------------------------------------------------------------

    def _branch(self, xid: Xid) -> _Branch:
        with self._lock:
            branch = self._branches.get(xid)
        if branch is None:
            raise ProgrammingError(f"{self.name}: no active branch {xid}")
        return branch

    def _on_loop(self, branch: _Branch, work: Callable[[], Coroutine[Any, Any, T]], verb: str) -> T:
        return on_loop(branch.loop, work, self._io_timeout, what=f"{self.name}: {verb}")

    async def _end(self, branch: _Branch, *, broken: bool) -> None:
        """Forget the branch and give its connection back (rolled back if a transaction is
        still open there; dropped when ``broken``)."""
        with self._lock:
            self._branches.pop(branch.xid, None)
        if broken:
            try:
                await branch.connection.invalidate()
            except Exception as exc:
                log.debug("%s: invalidating the connection of %s: %r", self.name, branch.gid, exc)
        await self._close(branch)

    @staticmethod
    async def _close(branch: _Branch) -> None:
        branch.ending = True
        try:
            if branch.session is not None:
                await branch.session.close()
            await branch.connection.close()
        except Exception as exc:
            log.debug("closing the connection of %s: %r", branch.gid, exc)


def _pending(session: AsyncSession) -> bool:
    """Anything for ``flush`` to send? (A flush with nothing to do still costs a trip through
    SQLAlchemy's greenlet bridge.)"""
    return bool(session.new or session.dirty or session.deleted)


def _default_session(connection: AsyncConnection) -> AsyncSession:
    return AsyncSession(bind=connection)


def _watch(connection: Connection, branch: _Branch) -> None:
    """The branch ends by the coordinator's word only (module docstring)."""

    def on_commit(_: Connection) -> None:
        if not branch.ending:
            branch.failure = "the application committed the branch's connection itself"
            raise ProgrammingError(
                f"{branch.xid}: a transaction branch is committed by the coordinator, not by "
                "its connection; leave the async with block (or await tx.commit())"
            )

    def on_rollback(_: Connection) -> None:
        if not branch.ending and branch.failure is None:
            branch.failure = "the application rolled back the branch's connection"

    event.listen(connection, "commit", on_commit)
    event.listen(connection, "rollback", on_rollback)


async def _run(dbapi: Any, sql: str, params: list[Any] | None = None) -> str:
    """Our own statement(s) with parameters bound on the client, in one message: the last
    statement's command tag (as the sync psycopg 3 driver's ``run``)."""
    async with psycopg.AsyncClientCursor(dbapi) as cursor:
        await cursor.execute(sql, params)
        while cursor.nextset():
            pass
        return str(cursor.statusmessage)
