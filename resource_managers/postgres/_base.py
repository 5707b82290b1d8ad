"""The state and plumbing shared by the parts of `PostgresResource` (`.resource`): its errors,
and ending, flushing and releasing a branch. Its name, sort key and the lock over its branches
are every resource's (`resource_managers.bookkeeping.Branches`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.engine import Engine

from coordinator import ProgrammingError, TransactionRolledBack, TransientError, Xid
from resource_managers.bookkeeping import Branches

from . import _errors
from ._branch import IDLE, INERROR, INTRANS, Branch
from ._driver import Driver
from ._pooled import Pooled
from ._prepared import PreparedStatements
from ._server import ServerFacts, Tables, look_up
from ._sessions import BRANCH

log = logging.getLogger("twopc.postgres")


class BranchFailed(TransactionRolledBack):
    """The branch's own work failed, so it votes no; the message carries the server's error."""

    code = "postgres-branch-failed"
    reason = "vote"


class NotPreparable(ProgrammingError):
    """The branch did something PostgreSQL cannot prepare (temporary tables, LISTEN, WITH HOLD)."""

    code = "postgres-not-preparable"


class UnknownGid(Exception):
    """The prepared transaction does not exist (any more)."""


class PostgresBase(Branches[Branch]):
    """What every part of `PostgresResource` shares: its settings, one lock (`Branches`') over
    the open branches (``_branches``), the prepared ones holding their connection (``_held``)
    and the queue of ended decision rows (``_ended``); and the plumbing that ends or releases a
    branch.
    ``PostgresResource.__init__`` sets every attribute; the phases (`._phases`), the last
    resource (`._last_resource`) and recovery (`._recovery`) are mixins of this class."""

    engine: Engine
    _driver: Driver
    _begin_sql: str  # the BEGIN each branch sends with its first statement
    _hold: float
    _markers: bool
    _marker_name: str
    _marker_retention: float
    _busy_retries: int
    _busy_delay: float
    #: prepared branches keeping their connection for phase two, oldest first
    _held: dict[Xid, Branch]
    _facts: ServerFacts | None
    _pool: Pooled
    _last_purge: float
    _last: bool
    _decision_name: str
    _ended: list[str]  # decision rows to delete with the next commit or cleanup
    _after_drop: dict[str, Callable[[], None]]  # gtrid -> what runs once its row is deleted
    _epochs: dict[str, int]  # node -> this process's epoch of it (`LastResourceOps.fence_node`)
    _fencing: threading.RLock  # one fence at a time
    _statements: PreparedStatements  # which connections hold the decision row's statements

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
