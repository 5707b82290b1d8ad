"""The two drivers a branch runs on: psycopg2 (the default) and psycopg 3 (``postgresql+psycopg``).

Both are driven the same way: the connection is in autocommit mode (so the driver never believes
it owns the transaction, see `resource`), the branch's ``BEGIN`` rides with the application's
first statement, and the connection's cursor factory hands out cursors that report to the branch
(`_branch`). What differs is how a message carries more than one statement:

- **psycopg2** interpolates parameters on the client, so ``BEGIN; INSERT ...`` is one simple-query
  message and its results are the last statement's.
- **psycopg 3** binds parameters on the server, one statement per message; the BEGIN and the
  first statement go out together in *pipeline mode* (one flush, one wait, the statement keeps
  its server-side binding). twopc's own statements (``PREPARE TRANSACTION``, ``COMMIT
  PREPARED``, the decision row) take parameters where the server allows none, so they go through
  a `psycopg.ClientCursor`: quoted literals, one message, and we read the last result.

psycopg 3's ``commit()`` and ``rollback()`` send COMMIT/ROLLBACK whenever the server is in a
transaction, autocommit or not, so a ``session.commit()`` inside a branch would commit it behind
the coordinator's back. While a branch holds a psycopg 3 connection, the connection's class is a
subclass whose ``commit`` and ``rollback`` do nothing, which is what psycopg2 does in autocommit
mode: the branch ends only by the coordinator's word.
"""

from __future__ import annotations

import functools
from typing import Any

import psycopg2.extensions as ext
from sqlalchemy.engine import Engine

from coordinator import ConfigurationError

from ._branch import Branch


class Driver:
    """What the resource asks of a driver; the subclasses fill in the differences."""

    name = ""

    @staticmethod
    def autocommit(dbapi: Any, on: bool) -> None:
        """Flipped on the driver directly: no round trip, unlike SQLAlchemy's isolation-level
        option, whose reset on every return to the pool costs a SET. The pool sees the
        connection exactly as it lent it."""
        if dbapi.autocommit != on:
            dbapi.autocommit = on

    @staticmethod
    def status(dbapi: Any) -> int:
        """libpq's transaction status (`_branch.IDLE` ...), read without a round trip."""
        return int(dbapi.info.transaction_status)

    def run(self, dbapi: Any, sql: str, params: list[Any] | None = None) -> str:
        """Our own statement(s), past the branch's cursors: the last statement's command tag."""
        raise NotImplementedError

    def query(self, dbapi: Any, sql: str, params: list[Any] | None = None) -> list[Any]:
        """Our own statement(s): the last statement's rows."""
        raise NotImplementedError

    def attach(self, dbapi: Any, branch: Branch) -> None:
        """From now on the connection's cursors report to ``branch``."""
        raise NotImplementedError

    def detach(self, dbapi: Any) -> None:
        raise NotImplementedError

    def send_begin(self, dbapi: Any, branch: Branch) -> None:
        """The BEGIN on its own, for the statements that cannot carry it (COPY, executemany,
        server-side cursors): one round trip more, only there."""
        begin, branch.begin = branch.begin, None
        if begin is None:
            return
        try:
            self.run(dbapi, begin)
        except Exception as exc:
            branch.failed(exc, self.status(dbapi), begin)
            raise


def for_engine(engine: Engine) -> Driver:
    driver = engine.dialect.driver
    if driver == "psycopg2":
        return PSYCOPG2
    if driver == "psycopg":
        from ._psycopg3 import PSYCOPG3  # noqa: PLC0415 - optional: only with psycopg 3

        return PSYCOPG3
    raise ConfigurationError(
        "PostgresResource needs a postgresql+psycopg2 or postgresql+psycopg engine, not "
        f"{engine.url.drivername}"
    )


# -- psycopg2 --------------------------------------------------------------------------------------


class _Psycopg2(Driver):
    name = "psycopg2"

    def run(self, dbapi: Any, sql: str, params: list[Any] | None = None) -> str:
        cursor = ext.cursor(dbapi)
        try:
            cursor.execute(sql, params)
            return str(cursor.statusmessage)
        finally:
            cursor.close()

    def query(self, dbapi: Any, sql: str, params: list[Any] | None = None) -> list[Any]:
        cursor = ext.cursor(dbapi)
        try:
            cursor.execute(sql, params)
            return list(cursor.fetchall())
        finally:
            cursor.close()

    def attach(self, dbapi: Any, branch: Branch) -> None:
        dbapi.cursor_factory = functools.partial(_Psycopg2Cursor.make, branch)

    def detach(self, dbapi: Any) -> None:
        dbapi.cursor_factory = None


PSYCOPG2 = _Psycopg2()


def joined(begin: str, query: Any, cursor: Any) -> Any:
    """``BEGIN; <query>`` as one message, or None when the query cannot carry it."""
    if isinstance(query, str):
        return f"{begin}; {query}"
    if isinstance(query, bytes):
        return begin.encode() + b"; " + query
    as_string = getattr(query, "as_string", None)  # psycopg2.sql.Composable
    return None if as_string is None else f"{begin}; {as_string(cursor)}"


class _Psycopg2Cursor(ext.cursor):
    """A cursor of a branch's connection (psycopg2)."""

    branch: Branch

    @classmethod
    def make(cls, branch: Branch, connection: Any, name: str | None = None) -> _Psycopg2Cursor:
        cursor = cls(connection, name)
        cursor.branch = branch
        return cursor

    def execute(self, query: Any, vars: Any = None) -> None:
        branch = self.branch
        branch.saw(query)
        begin = branch.begin
        if begin is not None:
            carried = None if self.name is not None else joined(begin, query, self)
            if carried is None:  # a named cursor's DECLARE, or a query we cannot prefix
                PSYCOPG2.send_begin(self.connection, branch)
                begin = None
            else:
                branch.begin, query = None, carried
        try:
            super().execute(query, vars)
        except Exception as exc:
            branch.failed(exc, PSYCOPG2.status(self.connection), begin)
            raise

    def executemany(self, query: Any, vars_list: Any) -> None:
        self.branch.saw(query)
        PSYCOPG2.send_begin(self.connection, self.branch)
        super().executemany(query, vars_list)

    def callproc(self, procname: Any, parameters: Any = None) -> Any:
        self.branch.may_write = True
        PSYCOPG2.send_begin(self.connection, self.branch)
        return super().callproc(procname, parameters)

    def copy_expert(self, sql: Any, file: Any, size: int = 8192) -> None:
        self.branch.may_write = True
        PSYCOPG2.send_begin(self.connection, self.branch)
        super().copy_expert(sql, file, size)

    def copy_from(self, *args: Any, **kwargs: Any) -> None:
        self.branch.may_write = True
        PSYCOPG2.send_begin(self.connection, self.branch)
        super().copy_from(*args, **kwargs)

    def copy_to(self, *args: Any, **kwargs: Any) -> None:
        PSYCOPG2.send_begin(self.connection, self.branch)
        super().copy_to(*args, **kwargs)
