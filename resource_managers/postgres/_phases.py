"""Phases one and two of a PostgreSQL branch: ``PREPARE TRANSACTION`` with its outcome marker
and its tag checked, the connection held for phase two, ``COMMIT``/``ROLLBACK PREPARED`` and the
one-phase ``COMMIT``, each with the failure handling the `.resource` docstring explains."""

from __future__ import annotations

import time

from coordinator import Outcome, OutcomeUnknownError, ProgrammingError, TransientError, Vote, Xid
from coordinator.crashpoints import crash_point

from . import _errors
from ._base import BranchFailed, NotPreparable, PostgresBase, UnknownGid
from ._branch import Branch


def prepare_statement(marker_table: str | None, gid: str) -> tuple[str, list[str]]:
    """``PREPARE TRANSACTION``, with the outcome marker's insert before it in the same message
    (one round trip: the marker commits, or not, with the branch, never on its own). Its
    parameters are bound on the client: the server takes none in PREPARE. The async resource
    (`.aio`) sends the same statement."""
    if marker_table is None:
        return "PREPARE TRANSACTION %s", [gid]
    return f"INSERT INTO {marker_table} (gid) VALUES (%s); PREPARE TRANSACTION %s", [gid, gid]


def one_phase_failure(name: str, xid: Xid, exc: Exception) -> Exception:
    """What a failed one-phase ``COMMIT`` raises: unknown if the connection was lost on the way
    (it may have committed), else the branch's failure (it did not)."""
    if _errors.is_unreachable(exc):
        return OutcomeUnknownError(
            f"{name}: connection lost during a one-phase COMMIT; it may or may not have "
            f"committed: {_errors.describe(exc)}",
            gtrid=xid.gtrid,
        )
    return BranchFailed(f"{name}: COMMIT failed: {_errors.describe(exc)}")


def check_commit_tag(name: str, tag: str) -> None:
    """A transaction that failed earlier answers COMMIT with ``ROLLBACK``, and no error."""
    if tag != "COMMIT":
        raise BranchFailed(f"{name}: the server answered COMMIT with {tag!r}")


class PhaseOps(PostgresBase):
    """`PostgresResource`'s XA verbs after the work: prepare, commit, rollback."""

    # -- phase one ---------------------------------------------------------------------------------

    def prepare(self, xid: Xid) -> Vote:
        branch = self._branch(xid)
        self._flush_for_commit(branch)
        if branch.begin is not None or (not branch.may_write and not self._has_xid(branch)):
            self._end_local(branch)  # no statement ran, or none wrote
            return Vote.READ_ONLY
        self._prepare_on_server(branch)
        crash_point(f"postgres.{self._name}.after_prepare")
        return Vote.COMMIT

    def _prepare_on_server(self, branch: Branch) -> None:
        sql, params = prepare_statement(self._server_facts().marker_table, branch.gid)
        branch.prepare_sent = True
        try:
            tag = self._driver.run(branch.dbapi, sql, params)
        except Exception as exc:
            if _errors.is_unreachable(exc):
                # The PREPARE may have landed before the connection died: roll back by gid later.
                self._discard(branch, broken=True)
                raise TransientError(
                    f"{self._name}: connection lost during PREPARE; the branch is rolled back "
                    f"(now or by recovery): {_errors.describe(exc)}"
                ) from exc
            self._end_local(branch)
            if _errors.is_not_preparable(exc):
                raise NotPreparable(
                    f"{self._name}: PostgreSQL cannot prepare this branch: "
                    f"{_errors.describe(exc)}. A two-phase branch must not use temporary tables, "
                    "LISTEN/UNLISTEN/NOTIFY or cursors WITH HOLD; do that work outside the "
                    "transaction"
                ) from exc
            raise BranchFailed(
                f"{self._name}: PREPARE TRANSACTION failed: {_errors.describe(exc)}"
            ) from exc
        if tag != "PREPARE TRANSACTION":
            # e.g. "ROLLBACK": the server threw the transaction away instead of preparing it
            self._discard(branch, broken=False)
            raise BranchFailed(
                f"{self._name}: the server answered PREPARE TRANSACTION with {tag!r}; "
                "nothing was prepared"
            )
        self._hold_for_phase_two(branch)

    def _hold_for_phase_two(self, branch: Branch) -> None:
        """The prepared transaction belongs to the server now; its connection waits for phase
        two (one checkout per transaction), for ``hold_prepared`` seconds at most."""
        with self._lock:
            self._branches.pop(branch.xid, None)
            if self._hold > 0:
                branch.held_until = time.monotonic() + self._hold
                self._held[branch.xid] = branch
                return
        self._release(branch, broken=False)

    # -- phase two ---------------------------------------------------------------------------------

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if one_phase:
            return self._commit_one_phase(self._branch(xid))
        with self._lock:
            stray = self._branches.get(xid)
            held = self._held.pop(xid, None) if stray is None else None
        if stray is not None:
            raise ProgrammingError(f"{self._name}: commit of {xid} before it was prepared")
        try:
            self._finish_prepared("COMMIT PREPARED", xid, held)
        except UnknownGid:
            if not self._markers or self._marker_exists(xid):
                return None  # committed before; the answer was lost
            return Outcome.HEURISTIC_ROLLBACK
        return None

    def _commit_one_phase(self, branch: Branch) -> Outcome | None:
        self._flush_for_commit(branch)
        if branch.begin is not None:  # no statement ran: nothing to commit
            self._discard(branch, broken=False)
            return None
        try:
            tag = self._driver.run(branch.dbapi, "COMMIT")
        except Exception as exc:
            self._discard(branch, broken=True)
            raise one_phase_failure(self._name, branch.xid, exc) from exc
        self._discard(branch, broken=False)
        check_commit_tag(self._name, tag)
        return None

    def rollback(self, xid: Xid) -> Outcome | None:
        with self._lock:
            branch = self._branches.get(xid)
            held = self._held.pop(xid, None)
        if branch is not None:
            if not branch.prepare_sent:
                self._end_local(branch)
                return None
            self._discard(branch, broken=True)
        try:
            self._finish_prepared("ROLLBACK PREPARED", xid, held)
        except UnknownGid:
            if self._markers and self._marker_exists(xid):
                return Outcome.HEURISTIC_COMMIT
        return None

    def _finish_prepared(self, verb: str, xid: Xid, held: Branch | None = None) -> None:
        """``COMMIT/ROLLBACK PREPARED``: on the branch's own connection if it still holds one,
        else (or if that fails for any reason but an unknown gid) on a pooled connection,
        retrying while the gid is busy."""
        gid = xid.to_gid() if held is None else held.gid
        if held is not None:
            try:
                self._driver.run(held.dbapi, f"{verb} %s", [gid])
            except Exception as exc:
                self._release(held, broken=_errors.is_unreachable(exc))
                if _errors.is_unknown_gid(exc):
                    raise UnknownGid(gid) from exc
            else:
                self._release(held, broken=False)
                return

        def finish() -> None:
            with self._pool.connection() as connection:
                self._driver.run(connection, f"{verb} %s", [gid])

        for attempt in range(self._busy_retries + 1):
            try:
                self._pool.once_more(finish)
                return
            except Exception as exc:
                if _errors.is_unknown_gid(exc):
                    raise UnknownGid(gid) from exc
                if _errors.is_busy(exc) and attempt < self._busy_retries:
                    time.sleep(self._busy_delay)
                    continue
                raise TransientError(
                    f"{self._name}: {verb} of {gid} did not complete, will retry: "
                    f"{_errors.describe(exc)}"
                ) from exc
