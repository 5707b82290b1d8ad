"""psycopg2 for a branch (`_driver` says how it differs from psycopg 3): the default driver."""

from __future__ import annotations

import functools
from typing import Any

import psycopg2.extensions as ext

from ._branch import Branch
from ._driver import Driver


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
