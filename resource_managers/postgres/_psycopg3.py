"""psycopg 3 for a branch (`_driver` says how it differs from psycopg2); imported only when an
engine is ``postgresql+psycopg``, so psycopg 3 stays optional."""

from __future__ import annotations

import functools
import threading
from typing import Any

import psycopg

from ._branch import Branch
from ._driver import Driver


class _Psycopg3(Driver):
    name = "psycopg"

    @staticmethod
    def keeps_prepared(dbapi: Any) -> bool:
        """psycopg 3 prepares the statements it runs often on its own, and once it holds any it
        sends ``DEALLOCATE ALL`` after a rollback, a ``ROLLBACK TO SAVEPOINT``, DDL and more:
        ours would go with them. Only a connection with its preparation off
        (``prepare_threshold=None``) keeps them."""
        return getattr(dbapi, "prepare_threshold", 0) is None

    def __init__(self) -> None:
        self._classes: dict[type[Any], type[Any]] = {}
        self._lock = threading.Lock()

    def run(self, dbapi: Any, sql: str, params: list[Any] | None = None) -> str:
        with psycopg.ClientCursor(dbapi) as cursor:
            cursor.execute(sql, params)
            while cursor.nextset():  # a multi-statement message: the last statement's tag
                pass
            return str(cursor.statusmessage)

    def query(self, dbapi: Any, sql: str, params: list[Any] | None = None) -> list[Any]:
        with psycopg.ClientCursor(dbapi) as cursor:
            cursor.execute(sql, params)
            while cursor.nextset():
                pass
            return list(cursor.fetchall())

    def attach(self, dbapi: Any, branch: Branch) -> None:
        dbapi.__class__ = self._branch_class(type(dbapi))
        dbapi.cursor_factory = functools.partial(_Cursor.make, branch)
        dbapi.server_cursor_factory = functools.partial(_ServerCursor.make, branch)

    def detach(self, dbapi: Any) -> None:
        dbapi.cursor_factory = psycopg.Cursor
        dbapi.server_cursor_factory = psycopg.ServerCursor
        base = getattr(type(dbapi), "_twopc_base", None)
        if base is not None:
            dbapi.__class__ = base

    def _branch_class(self, cls: type[Any]) -> type[Any]:
        """``cls`` with ``commit``/``rollback`` that leave the branch alone (module docstring)."""
        if getattr(cls, "_twopc_base", None) is not None:
            return cls
        found = self._classes.get(cls)
        if found is None:
            with self._lock:
                found = self._classes.get(cls)
                if found is None:
                    found = type(
                        f"Branch{cls.__name__}",
                        (cls,),
                        {
                            "__slots__": (),
                            "_twopc_base": cls,
                            "commit": _leave_alone,
                            "rollback": _leave_alone,
                        },
                    )
                    self._classes[cls] = found
        return found


def _leave_alone(self: Any) -> None:
    """The branch's transaction ends by the coordinator's word only."""


PSYCOPG3 = _Psycopg3()


class _Cursor(psycopg.Cursor[Any]):
    """A cursor of a branch's connection (psycopg 3)."""

    branch: Branch

    @classmethod
    def make(cls, branch: Branch, connection: Any, **kwargs: Any) -> _Cursor:
        cursor = cls(connection, **kwargs)
        cursor.branch = branch
        return cursor

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> _Cursor:
        branch = self.branch
        branch.saw(query)
        begin = branch.begin
        connection = self.connection
        try:
            if begin is None:
                super().execute(query, params, **kwargs)
            else:  # BEGIN and the statement in one flush; the statement keeps its binding
                branch.begin = None
                with connection.pipeline():
                    psycopg.Cursor(connection).execute(begin)
                    super().execute(query, params, **kwargs)
        except Exception as exc:
            branch.failed(exc, PSYCOPG3.status(connection), begin)
            raise
        return self

    def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:
        self.branch.saw(query)
        PSYCOPG3.send_begin(self.connection, self.branch)
        super().executemany(query, params_seq, **kwargs)

    def copy(self, statement: Any, params: Any = None, **kwargs: Any) -> Any:
        self.branch.may_write = True
        PSYCOPG3.send_begin(self.connection, self.branch)
        return super().copy(statement, params, **kwargs)

    def stream(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        self.branch.saw(query)
        PSYCOPG3.send_begin(self.connection, self.branch)
        return super().stream(query, params, **kwargs)


class _ServerCursor(psycopg.ServerCursor[Any]):
    """A named (server-side) cursor of a branch's connection: its DECLARE needs the BEGIN first."""

    branch: Branch

    @classmethod
    def make(cls, branch: Branch, connection: Any, name: str, **kwargs: Any) -> _ServerCursor:
        cursor = cls(connection, name, **kwargs)
        cursor.branch = branch
        return cursor

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> _ServerCursor:
        self.branch.saw(query)
        PSYCOPG3.send_begin(self.connection, self.branch)
        super().execute(query, params, **kwargs)
        return self
