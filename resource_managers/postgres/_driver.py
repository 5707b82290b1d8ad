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

from typing import Any

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

    @staticmethod
    def keeps_prepared(dbapi: Any) -> bool:
        """A statement twopc prepares on this connection stays until the session ends (psycopg
        3 deallocates everything whenever its own prepared statements may be stale)."""
        return True

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
