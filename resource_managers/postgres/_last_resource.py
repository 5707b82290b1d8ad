"""`PostgresResource` as a logging last resource (`coordinator.last_resource`): the commit that
carries the decision row, and the decision table's reads, ends and drops."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, NoReturn

from coordinator import ConfigurationError, OutcomeUnknownError, ProgrammingError, Xid
from coordinator.crashpoints import crash_point
from coordinator.decision_log import Decision
from coordinator.errors import FencedError

from . import _errors
from ._base import BranchFailed, PostgresBase
from ._branch import Branch
from ._decision_table import FENCED_EPOCH, DecisionTable


class LastResourceOps(PostgresBase):
    """`PostgresResource`'s last-resource verbs (``last_resource=True``)."""

    # -- the last resource (coordinator.last_resource) ---------------------------------------------

    def commit_with_decision(self, xid: Xid, decision: Decision) -> None:
        """The branch's data and the decision row in one server commit, one round trip."""
        table = self._decision_table()
        if decision.carried and not table.carries:  # carries_branches() said no: a caller's bug
            raise ProgrammingError(f"{self._name}: its decision table cannot carry branches")
        node = xid.node_id or ""
        fence = (self._name, self._epoch_of(node)) if decision.carried else None
        with self._lock:
            ended, self._ended = self._ended, []
        branch = self._branch(xid)
        prepared = self._statements.holds(branch.dbapi)
        sql, params = table.commit(
            decision.gtrid, node, decision.branches, ended, decision.carried, fence=fence,
            prepared=prepared,
        )  # fmt: skip
        try:
            self.commit_carrying(xid, sql, params, fence=_fenced, fenced=_FENCED)
        except BaseException as exc:
            self._requeue(ended)
            if prepared:
                self._statements.check_failure(exc)
            raise
        self._dropped(ended)

    def fence_node(self, node_id: str) -> int:
        """Start this process's incarnation of ``node_id``'s carried commits through this
        resource (`DecisionTable.fence_node`): waits for those of an earlier process that the
        server is still running, and makes any later one of theirs fail. Once per process and
        node, before its rows are first read (`carried_of`) or its first carried commit."""
        with self._fencing:  # one fence at a time: two would fence this process itself
            sql, params = self._decision_table().fence_node(node_id, self._name)
            [(epoch,)] = self._pool.query(sql, params)
            self._epochs[node_id] = int(epoch)
        return int(epoch)

    def _epoch_of(self, node_id: str) -> int:
        epoch = self._epochs.get(node_id)
        if epoch is not None:
            return epoch
        with self._fencing:  # the first commit and recovery's first read may race to fence
            epoch = self._epochs.get(node_id)
            return self.fence_node(node_id) if epoch is None else epoch

    def commit_carrying(
        self,
        xid: Xid,
        sql: str,
        params: list[Any],
        *,
        fence: Callable[[BaseException], bool],
        fenced: str = "recovery presumed {gtrid} aborted before its last resource could commit",
    ) -> None:
        """Send ``sql`` (a decision record's statements, ending in ``COMMIT``) inside the branch's
        own transaction: the branch's data and the record in one server commit, one round trip.

        Answers as `LastResource.commit_with_decision`: an error that ``fence`` recognises (the
        record's own guard refused it) is `FencedError`, with ``fenced`` as its reason.
        """
        branch = self._branch(xid)
        self._flush_for_commit(branch)
        if branch.begin is not None:  # no statement ran yet: the record opens the branch
            sql, branch.begin = f"{branch.begin}; {sql}", None
        try:
            tag = self._driver.run(branch.dbapi, sql, params)
        except Exception as exc:
            self._lost_last_commit(branch, exc, fence, fenced)
        self._discard(branch, broken=False)
        if tag != "COMMIT":  # the transaction had failed: the server rolled it back
            raise BranchFailed(f"{self._name}: the server answered COMMIT with {tag!r}")

    def _lost_last_commit(
        self,
        branch: Branch,
        exc: Exception,
        fence: Callable[[BaseException], bool],
        fenced: str,
    ) -> NoReturn:
        """Say what a failed commit with a decision leaves: unknown, fenced, or rolled back."""
        gtrid = branch.xid.gtrid
        if _errors.is_unreachable(exc):
            self._discard(branch, broken=True)
            raise OutcomeUnknownError(
                f"{self._name}: connection lost while committing with the decision of {gtrid}; "
                f"recovery reads the decision: {_errors.describe(exc)}",
                gtrid=gtrid,
            ) from exc
        self._end_local(branch)
        if fence(exc):
            raise FencedError(
                f"{self._name}: {fenced.format(gtrid=gtrid)}; it rolls back", gtrid=gtrid
            ) from exc
        raise BranchFailed(
            f"{self._name}: commit with the decision failed: {_errors.describe(exc)}"
        ) from exc

    def decisions_of(self, gtrids: Collection[str]) -> set[str]:
        crash_point(f"postgres.{self._name}.before_decision_lookup")
        wanted = sorted(gtrids)
        if not wanted:
            return set()
        rows = self._pool.query(*self._decision_table().fence_and_read(wanted))
        return {str(gtrid) for (gtrid,) in rows}

    def committed_decisions(self, node_id: str) -> dict[str, tuple[str, ...]]:
        rows = self._pool.query(*self._decision_table().committed(node_id))
        return {str(gtrid): tuple(branches) for gtrid, branches in rows}

    def end_decision(self, gtrid: str, then: Callable[[], None] | None = None) -> None:
        """Queue the row's deletion for the next commit with a decision (or `drop_decisions`);
        ``then`` runs once that deletion has committed (`coordinator.carried`: the carried
        branches may forget the commit)."""
        with self._lock:
            self._ended.append(gtrid)
            if then is not None:
                self._after_drop[gtrid] = then

    def drop_decisions(self, gtrids: Collection[str]) -> None:
        with self._lock:
            ended, self._ended = self._ended, []
        gone = sorted({*ended, *gtrids})
        if not gone:
            return
        try:
            self._pool.run(*self._decision_table().drop(gone))
        except Exception:
            self._requeue(ended)
            raise
        self._dropped(gone)

    # -- carried branches (coordinator.carried) ---------------------------------------------------

    def carries_branches(self) -> bool:
        """True if the decision table has the carried branches' columns (a table made by an
        earlier version gets them on first use where the role may add them)."""
        table = self._server_facts().decisions
        return table is not None and table.carries

    def carried_of(self, node_id: str) -> dict[str, dict[str, bytes]]:
        """The rows with payloads, read only once the node is fenced: no commit of a process
        that died can land after this read (`fence_node`)."""
        table = self._decision_table()
        if not table.columns:
            return {}
        if table.carries:
            self._epoch_of(node_id)
        rows = self._pool.query(*table.carried_rows(node_id))
        if rows and not table.carries:  # payloads of an earlier process, and no fence to read by
            raise ConfigurationError(
                f"{self._name}: {len(rows)} decision rows of node {node_id} carry branches, and "
                f"they can be read safely only once this process can fence the node: have an "
                f"administrator run {table.epochs_ddl()}; GRANT SELECT, INSERT, UPDATE ON "
                f"{table.epochs} TO <role>. The rows are kept until then"
            )
        return {
            str(gtrid): {str(n): bytes(p) for n, p in zip(names, payloads, strict=True)}
            for gtrid, names, payloads in rows
        }

    def _dropped(self, gtrids: list[str]) -> None:
        """Rows whose deletion just committed: run what `end_decision` queued for them."""
        if not self._after_drop:
            return
        with self._lock:
            then = [f for g in gtrids if (f := self._after_drop.pop(g, None)) is not None]
        for callback in then:
            callback()

    def _requeue(self, ended: list[str]) -> None:
        with self._lock:
            self._ended[:0] = ended

    def _decision_table(self) -> DecisionTable:
        table = self._server_facts().decisions
        if table is None:
            raise ProgrammingError(f"{self._name} is not a last resource (last_resource=False)")
        return table


_FENCED = (
    "{gtrid} was fenced before its last resource could commit (recovery presumed it aborted, "
    "or a newer process of its coordinator node took over its carried commits)"
)


def _fenced(error: BaseException) -> bool:
    """The decision row's guard refused the commit: recovery's abort row (a unique violation),
    or a newer incarnation of the node (the epoch check's error)."""
    return _errors.is_unique_violation(error) or _errors.is_fenced_epoch(error, FENCED_EPOCH)
