"""Which pooled connections hold a last resource's decision statements prepared on the server.

Parsing and planning the decision row's statements (the epoch check, the row, the deletion of
ended rows) is most of what a commit with a decision costs PostgreSQL beyond the branch's own
work (`DecisionTable.prepared_statements`). Prepared once per server session they are only
executed. psycopg2 has no prepared statements of its own and psycopg 3 prepares one statement per
message, never a multi-statement commit, so twopc prepares its own with ``PREPARE``.

When: at a branch's open, on a connection's second use (a pool that hands out a new connection
every time, such as ``NullPool``, would pay a round trip per transaction and never gain), while
the connection is idle in autocommit mode, so a failure cannot touch a transaction. The server
is asked which of the names it holds (`pg_prepared_statements`) and the missing ones are
prepared: two round trips, once per connection.

When it cannot work: psycopg 3 deallocates every prepared statement of a session whenever its
own (it prepares what runs often) may be stale, so there only a connection with
``prepare_threshold=None`` gets ours. Behind a pooler in transaction mode (PgBouncer's
``pool_mode = transaction``), or with an application that runs ``DISCARD ALL`` or ``DEALLOCATE``
on the branch's connection, a statement prepared in one transaction is gone in the next. A
commit that finds it gone fails before its ``COMMIT`` (the server rolls the transaction back, a
definite outcome the coordinator reports as such), and the resource stops using prepared
statements from then on, with a warning that says why; ``prepared_statements=False`` avoids the
rollbacks of the commits in flight then.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from . import _errors
from ._decision_table import DecisionTable
from ._driver import Driver

log = logging.getLogger("twopc.postgres")

#: SQLSTATE 26000: the prepared statement does not exist
_MISSING = "26000"
#: SQLSTATE classes of errors that preparing again would meet again (syntax, access; feature)
_FOR_GOOD = ("42", "0A")
#: a PREPARE waits at most this long for a lock on the table (behind an ALTER TABLE, say)
_LOCK_TIMEOUT_MS = 2000


class PreparedStatements:
    """One resource's record of its connections: seen once, or holding the statements."""

    def __init__(self, resource: str, enabled: bool) -> None:
        self._resource = resource
        self.enabled = enabled
        self._lock = threading.Lock()
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self._ready: weakref.WeakSet[Any] = weakref.WeakSet()

    def holds(self, dbapi: Any) -> bool:
        """The connection holds the statements (no round trip)."""
        return self.enabled and dbapi in self._ready

    def on_open(self, driver: Driver, dbapi: Any, table: DecisionTable) -> None:
        """A branch opened on ``dbapi`` (idle, autocommit): on its second use, prepare what
        the server does not hold yet. Never raises: the commit runs unprepared instead."""
        if not self.enabled or dbapi in self._ready or not driver.keeps_prepared(dbapi):
            return
        with self._lock:
            first = dbapi not in self._seen
            self._seen.add(dbapi)
        if first:
            return
        statements = table.prepared_statements()
        try:
            held = driver.query(
                dbapi,
                "SELECT name FROM pg_prepared_statements WHERE name = ANY(%s)",
                [list(statements)],
            )
            missing = [sql for name, sql in statements.items() if name not in {r[0] for r in held}]
            if missing:  # one implicit transaction: the lock timeout holds for all of them
                bound = f"SELECT set_config('lock_timeout', '{_LOCK_TIMEOUT_MS}', true)"
                driver.run(dbapi, "; ".join([bound, *missing]))
        except Exception as exc:  # a lost connection fails the branch anyway; a timeout: later
            if (_errors.sqlstate(exc) or "").startswith(_FOR_GOOD):
                self.disable(f"preparing them failed: {_errors.describe(exc)}")
            return
        with self._lock:
            self._ready.add(dbapi)

    def check_failure(self, error: BaseException) -> None:
        """A commit with a decision failed with ``error``: if a prepared statement was missing
        (a pooler in transaction mode, a ``DISCARD ALL``), stop using them."""
        cause = error.__cause__ if error.__cause__ is not None else error
        if _errors.sqlstate(cause) == _MISSING:
            self.disable(
                "a connection lost them between transactions (a pooler in transaction mode, "
                "or DISCARD ALL / DEALLOCATE on the branch's connection); the commits using "
                "them rolled back. Pass prepared_statements=False to avoid that"
            )

    def disable(self, why: str) -> None:
        with self._lock:
            was, self.enabled = self.enabled, False
        if was:
            log.warning(
                "%s: the decision row's statements are no longer prepared on the server (%s); "
                "commits with a decision go on unprepared, parsed and planned each time",
                self._resource,
                why,
            )
