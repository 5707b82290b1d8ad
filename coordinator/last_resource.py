"""Logging last resource (LLR): the commit decision rides one participant's own local commit.

The design Oracle WebLogic ships as "Logging Last Resource" and Narayana as the commit-markable
last resource. In a transaction with a participant marked as the last resource, every *other*
branch is prepared first; then that participant inserts the COMMIT decision as a row of its own
table inside its own local transaction, and commits that transaction in one phase. The data and
the decision become durable in one commit: no prepare, no second commit, no decision-log force.
That commit is the transaction's commit point. Phase two then commits the other branches.

Recovery, for a prepared branch of this node with no decision in the log, asks every configured
last resource (`LastResource.decisions_of`) whether the gtrid has a decision row. The same call
*fences* every gtrid without one: it records an abort row, so a late ``commit_with_decision`` of
that gtrid (a paused coordinator whose node was taken over, a commit whose connection was lost)
fails on the row's key instead of committing after recovery presumed abort. No clock is involved:
the database's unique key orders the two. A last resource that cannot answer stops every presumed
abort of the pass (the gtrid may have its row there); nothing is guessed.

A resource opts in by implementing this protocol and answering ``last_resource`` with True.

**A decision log in a participant's database.** The same commit point, with the decision written
as the *log's own* COMMIT record: a log that lives in a participant's database (`SqlDecisionLog`
beside a PostgreSQL participant) implements `CarryingLog`, and the manager makes that participant
the transaction's *carrier* whenever no explicit last resource joined. The carrier never
prepares; its one-phase commit holds its data and the log's record together. Recovery is the
log's, unchanged: the record is where the log keeps every decision, so no configuration change
can hide it, and no last-resource lookup is needed. A carrier's lost answer is fenced by the log
itself before it next reads its records (`CarryingLog.commit_carried`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol, TypeGuard, runtime_checkable

from .decision_log import Decision
from .resource import Resource
from .xid import Xid


@runtime_checkable
class LastResource(Resource[Any], Protocol):
    """A resource that can commit a branch in one phase together with the commit decision.

    ``last_resource``
        True when this resource takes the last-resource part in the transactions it joins. At
        most one such branch may join a transaction (`ProgrammingError` on the second join).
    """

    @property
    def last_resource(self) -> bool: ...

    def commit_with_decision(self, xid: Xid, decision: Decision) -> None:
        """Insert the decision row for ``decision.gtrid`` inside the branch's own transaction and
        commit it in one phase.

        Returning means committed, data and decision together. `OutcomeUnknownError` means it may
        or may not have committed (the connection was lost during the commit): recovery settles
        it by reading the row. Any other exception means it certainly did not commit and the
        branch is ended; `FencedError` in particular says recovery already fenced the gtrid.
        """

    def decisions_of(self, gtrids: Collection[str]) -> set[str]:
        """Those of ``gtrids`` that have a commit row; every other one gets an abort row first.

        The abort row is the fence: once this returns, ``commit_with_decision`` of those gtrids
        can only fail. A gtrid whose commit is still running is waited for (bounded by the
        resource's lock timeout, after which this raises). Raising means nothing is known: no
        branch of any of these gtrids may be presumed aborted.
        """

    def committed_decisions(self, node_id: str) -> dict[str, tuple[str, ...]]:
        """Every commit row of ``node_id`` not yet cleaned up: gtrid -> the decision's branches.

        Recovery deletes a row only when no branch of it is prepared and every branch names a
        configured resource (one left out of the configuration may still hold its branch).
        """

    def end_decision(self, gtrid: str) -> None:
        """Every branch of ``gtrid`` has committed: its row may go, lazily (with a later commit
        or cleanup), never on the caller's round trip."""

    def drop_decisions(self, gtrids: Collection[str]) -> None:
        """Delete the commit rows of ``gtrids`` (and what `end_decision` queued) now."""


@runtime_checkable
class CarryingLog(Protocol):
    """A decision log whose COMMIT record a participant's own local commit can carry."""

    def carried_by(self, resource: Resource[Any]) -> bool:
        """True if ``resource``'s one-phase commit can hold this log's record (it stores in the
        log's own database, writable, at an isolation level the record's fence assumes).
        Asked once per resource; any doubt answers False (the ordinary two-phase path)."""

    def commit_carried(self, resource: Resource[Any], xid: Xid, decision: Decision) -> None:
        """Write ``decision`` as this log's record inside ``resource``'s branch ``xid`` and
        commit that branch in one phase: the same answers as
        `LastResource.commit_with_decision`. After `OutcomeUnknownError` the log fences the
        commit before it next lists its records, so recovery's read cannot race a late commit.
        """


def is_last_resource(resource: Resource[Any]) -> TypeGuard[LastResource]:
    """True for a resource that takes the last-resource part (an attribute read, no isinstance
    walk over the protocol: this runs on every join)."""
    return getattr(resource, "last_resource", False) is True
