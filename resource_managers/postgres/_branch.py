"""A branch's state, and what its connection's cursors tell it while the application works.

No statement of its own opens a branch: ``BEGIN`` waits in ``Branch.begin`` and travels in the
same network flush as the application's first statement (`_driver` has the two ways, one per
driver). The cursors of the branch's connection report each statement here, which replaces a
session hook per statement: writes are noted (a branch that only read votes read-only after one
cheap question to the server), and the last error is kept for the no vote's message. The same
cursors serve every handle (`Session`, Core `Connection`, DBAPI connection), so no handle can
slip past them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection

from coordinator import Xid

from . import _errors

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_READ_ONLY_STATEMENT = re.compile(r"\s*(SELECT|SHOW|VALUES|TABLE)\b", re.IGNORECASE)

# the libpq transaction status, as both drivers report it (PQtransactionStatus)
IDLE, ACTIVE, INTRANS, INERROR, UNKNOWN = range(5)


@dataclass(eq=False)
class Branch:
    """One transaction's work on this database, from its first statement to phase two."""

    xid: Xid
    gid: str
    pooled: Any  # SQLAlchemy's pooled connection (checked out once, given back at the end)
    dbapi: Any  # the driver's connection inside it
    begin: str | None  # the BEGIN still to send with the first statement, or None once sent
    connection: BranchConnection | None = None  # the Core handle, made only when asked for
    session: Session | None = None
    may_write: bool = False  # a False is confirmed by the server before a read-only vote
    failure: str | None = None  # why the branch must vote no, as the server said it
    last_error: str | None = None  # the server's latest error, for the vote's message
    prepare_sent: bool = False
    held_until: float = 0.0  # a prepared branch gives its connection back by then at the latest

    def saw(self, query: Any) -> None:
        """A statement is about to run: note a possible write (anything not plainly a read)."""
        if self.may_write:
            return
        if isinstance(query, bytes):
            query = query[:64].decode("ascii", "replace")
        if not isinstance(query, str) or not _READ_ONLY_STATEMENT.match(query):
            self.may_write = True

    def failed(self, error: BaseException, status: int, begin: str | None) -> None:
        """A statement failed. Remembered for the no vote's message only: a failure the
        application recovered from (ROLLBACK TO SAVEPOINT) must not doom the branch, and the
        server's transaction status at prepare says whether it did. If the BEGIN that rode with
        it never ran (the whole message was refused, e.g. a syntax error), the next statement
        carries it again, so nothing can ever run outside the branch's transaction."""
        self.last_error = _errors.describe(error)
        if begin is not None and status == IDLE:
            self.begin = begin


class BranchConnection(Connection):
    """A branch's Core `Connection`. Closing it (as a ``with`` block does) leaves the database
    connection with the branch: it must not go back to the pool, where another thread could get
    it, before the transaction ended. The resource closes it after phase two."""

    def close(self) -> None:
        """Nothing yet: the connection is the branch's until the transaction ends."""

    def end_of_branch(self) -> None:
        super().close()
