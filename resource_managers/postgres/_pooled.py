"""The resource's own statements (recovery, markers, decision rows, server facts) on pooled
connections, past the branches: one statement needs a DBAPI connection, not a facade."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sqlalchemy.engine import Engine

from coordinator import TransientError

from . import _errors
from ._driver import Driver

T = TypeVar("T")


class ConnectionLost(TransientError):
    """A pooled connection's server went away (crashed, restarted): retried once, then raised."""


class Pooled:
    """Statements of one resource on its engine's pool, in autocommit mode."""

    def __init__(self, engine: Engine, driver: Driver, name: str) -> None:
        self.engine = engine
        self._driver = driver
        self._name = name

    @contextlib.contextmanager
    def connection(self) -> Iterator[Any]:
        """A pooled DBAPI connection in autocommit mode; one that lost its server is not given
        back. Raw, not a SQLAlchemy `Connection`: recovery needs one statement, not a facade."""
        try:
            raw = self.engine.raw_connection()
            self._driver.autocommit(raw.dbapi_connection, True)
        except Exception as exc:
            raise TransientError(
                f"{self._name}: cannot connect to PostgreSQL: {_errors.describe(exc)}"
            ) from exc
        dbapi = raw.dbapi_connection
        try:
            yield dbapi
            self._driver.autocommit(dbapi, False)
        except BaseException as exc:
            if _errors.is_unreachable(exc):
                raw.invalidate()
                self.forget()
                raise ConnectionLost(
                    f"{self._name}: lost the connection to PostgreSQL: {_errors.describe(exc)}"
                ) from exc
            with contextlib.suppress(Exception):
                self._driver.autocommit(dbapi, False)
            raise
        finally:
            raw.close()

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        def work() -> list[tuple[Any, ...]]:
            with self.connection() as connection:
                return self._driver.query(connection, sql, params)

        return self.once_more(work)

    def run(self, sql: str, params: list[Any] | None = None) -> str:
        def work() -> str:
            with self.connection() as connection:
                return self._driver.run(connection, sql, params)

        return self.once_more(work)

    def forget(self) -> None:
        """One connection found the server gone: the rest of the pool is as stale (a restart ends
        every session), so drop them all rather than fail once per pooled connection."""
        self.engine.dispose(close=False)

    def once_more(self, work: Callable[[], T]) -> T:
        """Run ``work``; if its pooled connection was dead, once more on a fresh one."""
        try:
            return work()
        except ConnectionLost:
            return work()
