"""Recovery: finish what a crash or an unreachable server left in doubt.

One pass does, in this order:
1. every COMMIT without END: commit each branch again (idempotent), then write END;
2. every prepared branch a resource lists that is ours, not possibly in flight, and has no
   decision in the log: commit it if a last resource holds its decision row, else roll it back
   (presumed abort). The last resources are asked once per pass, for every such gtrid at once,
   and the question fences the gtrids without a row (`coordinator.last_resource`); if one cannot
   answer, nothing is presumed this pass;
3. branches carried in a decision row (`coordinator.carried`) whose store lost their commit are
   restored from the row (`_carried_recovery`);
4. decision rows of last resources whose transactions have ended are deleted, and the carried
   branches' stores forget them.
What cannot finish now is retried with back-off on a later pass; nothing is guessed.

Why one module: the steps share one pass's state (the guard, the report, the retries), and their
order is the safety argument (a row goes only after every branch it decides is settled), so a
reviewer reads that argument here in one place.

Sub-branches (``<resource>~<tag>``, see `coordinator.xid`) are branches begun by processes this
manager does not know (Spark executors), so the in-flight guard cannot vouch for them: one whose
tag carries its birth time is left alone until it is older than ``sub_branch_grace``.

The in-flight guard is exact, not timed: the manager that runs recovery holds the log (the
directory lock or the lease), so no other process can own our branches, and it knows which of its
own transactions are alive. The guard is snapshotted *before* the resources are listed, so a
transaction that begins after the snapshot is never mistaken for an orphan.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import protocol
from ._carried_recovery import forget_carried, restore_carried
from ._completion import judge_commit, record_heuristic, write_end
from .backoff import Backoff
from .carried import ForgetGate
from .crashpoints import crash_point
from .decision_log import Decision, DecisionLog
from .errors import InvalidXidError, TransactionError
from .last_resource import LastResource, is_last_resource
from .metrics import Metrics
from .protocol import Action, BranchResult
from .resource import Outcome, Resource
from .xid import Xid, is_sub_branch_of, resource_of, sub_branch_born

log = logging.getLogger("twopc.recovery")
#: one INFO line per resource listed and per `PROGRESS_EVERY` branches resolved, so a long pass
#: shows it is moving (`twopc recover` prints this logger on stderr)
progress = logging.getLogger("twopc.recovery.progress")
PROGRESS_EVERY = 100


class InFlightGuard(Protocol):
    """Answers "might this gtrid still be in flight in the live manager?" for one pass."""

    def maybe_in_flight(self, gtrid: str) -> bool: ...


@dataclass
class RecoveryReport:
    """What one pass did. Lines name a branch as ``gtrid on branch``, never by its base64 gid."""

    committed: list[str] = field(default_factory=list)  # gtrids whose decision was finished
    rolled_back: list[str] = field(default_factory=list)  # gids rolled back by presumed abort
    heuristics: list[str] = field(default_factory=list)  # "gtrid on branch: outcome"
    failures: list[str] = field(default_factory=list)  # "what: error", for a later pass
    deferred: int = 0  # waiting for their back-off
    left_alone: int = 0  # foreign or in flight

    @property
    def clean(self) -> bool:
        return not self.failures and not self.deferred


class _Retries:
    """Per-key failure counts and next-due times, so a dead server is not hammered."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.failures: dict[str, int] = {}
        self.due: dict[str, float] = {}
        self.last_error: dict[str, str] = {}

    def is_due(self, key: str) -> bool:
        return self.due.get(key, 0.0) <= time.monotonic()

    def failed(self, key: str, error: BaseException) -> None:
        n = self.failures[key] = self.failures.get(key, 0) + 1
        self.due[key] = time.monotonic() + self.backoff.compute(n)
        self.last_error[key] = repr(error)

    def succeeded(self, key: str) -> None:
        for table in (self.failures, self.due, self.last_error):
            table.pop(key, None)


class Recovery:
    def __init__(
        self,
        node_id: str,
        log_: DecisionLog,
        resources: Mapping[str, Resource[Any]],
        metrics: Metrics,
        backoff: Backoff,
        *,
        sub_branch_grace: float = 900.0,
        clock: Callable[[], float] = time.time,
        forget_gate: ForgetGate | None = None,
    ) -> None:
        self.node_id = node_id
        self.sub_branch_grace = sub_branch_grace
        #: the manager's: live forgets wait while this reads rows (`carried.ForgetGate`)
        self.forget_gate = forget_gate or ForgetGate()
        self._clock = clock
        self.log = log_
        self.resources = resources
        self.metrics = metrics
        self.retries = _Retries(backoff)
        #: whether a later pass will come by itself (a manager with a recovery interval); a
        #: one-shot pass (`twopc recover`) must not promise a retry
        self.retries_later = True
        self._resolved = 0  # counts resolutions for the crash points recovery.after_resolve.<n>

    def run(
        self, guard: InFlightGuard, *, presume_abort: bool = True, force: bool = False
    ) -> RecoveryReport:
        """One pass. ``force`` ignores back-off (an operator asked now)."""
        started = time.perf_counter()
        report = RecoveryReport()
        pending = self.log.pending()
        if pending:
            progress.info("%d logged decisions to finish", len(pending))
        for decision in pending:
            self._finish_decision(decision, guard, report, force)
        if presume_abort:
            decided = {d.gtrid for d in self.log.pending()}
            self._presume_abort(decided, guard, report, force)
        self.metrics.observe("recovery", time.perf_counter() - started)
        self.metrics.incr("recovery_passes")
        return report

    def _ordered_resources(self) -> list[Resource[Any]]:
        return sorted(self.resources.values(), key=lambda r: (r.sort_key, r.name))

    # -- 1. re-drive decisions -----------------------------------------------------------------

    def _finish_decision(
        self, decision: Decision, guard: InFlightGuard, report: RecoveryReport, force: bool
    ) -> None:
        if guard.maybe_in_flight(decision.gtrid):
            report.left_alone += 1
            return
        if not (force or self.retries.is_due(decision.gtrid)):
            report.deferred += 1
            return
        # Every branch is tried, even past one that fails: the reachable ones must not stay
        # prepared (holding locks) until a dead server comes back. END only once all answered.
        answered = [self._commit_branch(decision.gtrid, n, report) for n in decision.branches]
        if all(answered):
            write_end(self.log, decision.gtrid)
            self.retries.succeeded(decision.gtrid)
            report.committed.append(decision.gtrid)
            self.metrics.incr("recovered_commits")

    def _commit_branch(self, gtrid: str, name: str, report: RecoveryReport) -> bool:
        owner = resource_of(name, self.resources)
        resource = None if owner is None else self.resources.get(owner)
        xid = Xid.branch_of(gtrid, name)
        if resource is None:
            why = f"branch {name!r} names no configured resource (add it, same name)"
            return self._failed(gtrid, why, report)
        try:
            reported = resource.commit(xid)
        except Exception as exc:
            return self._failed(gtrid, exc, report)
        self._resolved_one()
        result = judge_commit(self.log, gtrid, name, reported)
        if result != BranchResult.DONE:
            report.heuristics.append(f"{describe(xid)}: {result.value}")
        return True

    # -- 2. presumed abort ---------------------------------------------------------------------

    def _presume_abort(
        self, decided: set[str], guard: InFlightGuard, report: RecoveryReport, force: bool
    ) -> None:
        """List every resource, then ask the last resources about the undecided, then act."""
        candidates: list[tuple[Resource[Any], Xid]] = []
        prepared: Counter[str] = Counter()  # listed branches per gtrid still prepared
        complete = True  # every resource listed: a decision row without prepared branches is done
        for resource in self._ordered_resources():
            listed = self._list(resource, report, force)
            if listed is None:
                complete = False
                continue
            prepared.update(xid.gtrid for xid in listed)
            candidates += self._undecided(resource, listed, decided, guard, report, force=force)
        lasts = [r for r in self._ordered_resources() if is_last_resource(r)]
        committed, known = self._last_decisions(lasts, {x.gtrid for _, x in candidates}, report)
        for resource, xid in candidates:
            action = protocol.recovery_action(
                ours=True,
                has_decision=xid.gtrid in committed,
                maybe_in_flight=False,
                decision_known=known,
            )
            if action == Action.COMMIT:
                done = self._commit_listed(resource, xid, report)
            elif action == Action.ROLLBACK:
                done = self._rollback(resource, xid, report)
            else:
                done = False
                report.deferred += 1
            prepared[xid.gtrid] -= done
        if complete:
            # The rows a deletion may take are read before the carried restore reads them: a
            # row committed between the two reads (a commit the server was still finishing for
            # a process that died) is then never deleted without having been restored.
            rows = self._decision_rows(lasts)
            run = _CarriedPass(self, guard, report)
            with self.forget_gate.holding():
                unsettled = restore_carried(run, lasts)
            if unsettled is not None:  # else a store or a row could not be read: keep every row
                dropped = self._drop_ended_decisions(rows, set(+prepared) | unsettled, guard)
                forget_carried(run, dropped)

    def _list(
        self, resource: Resource[Any], report: RecoveryReport, force: bool
    ) -> list[Xid] | None:
        key = f"recover:{resource.name}"
        if not (force or self.retries.is_due(key)):
            report.deferred += 1
            return None
        try:
            prepared = resource.recover()
        except Exception as exc:
            self._failed(key, exc, report)
            return None
        self.retries.succeeded(key)
        progress.info("resource %s lists %d prepared branches", resource.name, len(prepared))
        return prepared

    def _undecided(
        self,
        resource: Resource[Any],
        prepared: list[Xid],
        decided: set[str],
        guard: InFlightGuard,
        report: RecoveryReport,
        *,
        force: bool,
    ) -> list[tuple[Resource[Any], Xid]]:
        """The listed branches that are ours, settled, due, and without a logged decision."""
        found = []
        for xid in prepared:
            mine = xid.bqual == resource.name or is_sub_branch_of(xid.bqual, resource.name)
            action = protocol.recovery_action(
                ours=xid.belongs_to(self.node_id) and mine,
                has_decision=xid.gtrid in decided,
                maybe_in_flight=guard.maybe_in_flight(xid.gtrid) or self._young(xid),
            )
            if action != Action.ROLLBACK:
                report.left_alone += action == Action.LEAVE_ALONE
            elif force or self.retries.is_due(xid.to_gid()):
                found.append((resource, xid))
            else:
                report.deferred += 1
        return found

    def _last_decisions(
        self, lasts: list[LastResource], gtrids: set[str], report: RecoveryReport
    ) -> tuple[set[str], bool]:
        """(gtrids with a decision row, whether every last resource answered).

        Asking fences: a gtrid without a row gets an abort row, so its commit can no longer
        happen. Only the node's owner may do that (a lease taken over: its transactions).
        """
        if not gtrids or not lasts:
            return set(), True
        committed: set[str] = set()
        for resource in lasts:
            try:
                self.log.check_owner()
                committed |= resource.decisions_of(sorted(gtrids))
            except Exception as exc:
                self._failed(f"decisions:{resource.name}", exc, report)
                return set(), False
            self.retries.succeeded(f"decisions:{resource.name}")
        crash_point("recovery.llr.after_lookup")
        return committed, True

    def _commit_listed(self, resource: Resource[Any], xid: Xid, report: RecoveryReport) -> bool:
        """A branch whose decision is a last resource's row: commit it (idempotent)."""
        try:
            reported = resource.commit(xid)
        except Exception as exc:
            return self._failed(xid.to_gid(), exc, report)
        self._resolved_one()
        self.retries.succeeded(xid.to_gid())
        if xid.gtrid not in report.committed:
            report.committed.append(xid.gtrid)
        self.metrics.incr("recovered_commits")
        result = judge_commit(self.log, xid.gtrid, xid.bqual, reported)
        if result != BranchResult.DONE:
            report.heuristics.append(f"{describe(xid)}: {result.value}")
        return True

    def _decision_rows(
        self, lasts: list[LastResource]
    ) -> list[tuple[LastResource, dict[str, tuple[str, ...]]]]:
        """Each last resource's commit rows of this node (one that cannot be read is left out:
        its rows stay until a later pass)."""
        out = []
        for resource in lasts:
            try:
                out.append((resource, resource.committed_decisions(self.node_id)))
            except Exception as exc:  # only housekeeping: the rows are retried next pass
                log.warning("decision rows of %s not read: %r", resource.name, exc)
        return out

    def _drop_ended_decisions(
        self,
        read: list[tuple[LastResource, dict[str, tuple[str, ...]]]],
        prepared: set[str],
        guard: InFlightGuard,
    ) -> set[str]:
        """Delete decision rows no branch needs, of those ``read`` (`_decision_rows`): not in
        flight, nothing of theirs prepared (every resource was listed after the guard's
        snapshot), every branch a configured resource. Returns the gtrids whose rows were
        deleted."""
        dropped: set[str] = set()
        for resource, rows in read:
            try:
                ended = {
                    gtrid
                    for gtrid, branches in rows.items()
                    if gtrid not in prepared
                    and not guard.maybe_in_flight(gtrid)
                    and all(resource_of(b, self.resources) for b in branches)
                }
                resource.drop_decisions(sorted(ended))
                dropped |= ended
            except Exception as exc:  # only housekeeping: the rows are retried next pass
                log.warning("decision rows of %s not cleaned up: %r", resource.name, exc)
        return dropped

    def _rollback(self, resource: Resource[Any], xid: Xid, report: RecoveryReport) -> bool:
        try:
            # Presumed abort is a decision too: once another process owns our node (a lease taken
            # over), the branch may be its in-flight transaction, so a fenced log stops us here.
            self.log.check_owner()
            reported = resource.rollback(xid)
        except Exception as exc:
            return self._failed(xid.to_gid(), exc, report)
        self._resolved_one()
        self.retries.succeeded(xid.to_gid())
        report.rolled_back.append(xid.to_gid())
        self.metrics.incr("presumed_aborts")
        if reported == Outcome.HEURISTIC_COMMIT:
            record_heuristic(self.log, xid.gtrid, resource.name, reported)
            report.heuristics.append(f"{describe(xid)}: {reported.value}")
        return True

    def _young(self, xid: Xid) -> bool:
        """A stamped sub-branch within its grace: its unknown owner may still be deciding."""
        born = sub_branch_born(xid.bqual)
        return born is not None and self._clock() - born < self.sub_branch_grace

    # -- bookkeeping ---------------------------------------------------------------------------

    def _failed(self, key: str, error: BaseException | str, report: RecoveryReport) -> bool:
        exc = error if isinstance(error, BaseException) else RuntimeError(error)
        self.retries.failed(key, exc)
        what, why = describe_key(key), error if isinstance(error, str) else describe_error(exc)
        report.failures.append(f"{what}: {why}")
        self.metrics.incr("recovery_failures")
        if self.retries_later:
            log.warning("recovery: %s failed, will retry: %s", what, why)
        else:
            log.warning("recovery: %s failed: %s", what, why)
        return False

    def _resolved_one(self) -> None:
        self._resolved += 1
        if self._resolved % PROGRESS_EVERY == 0:
            progress.info("%d branches resolved so far", self._resolved)
        crash_point(f"recovery.after_resolve.{self._resolved}")


class _CarriedPass:
    """What `_carried_recovery` needs of one pass (its `Pass` protocol)."""

    def __init__(self, recovery: Recovery, guard: InFlightGuard, report: RecoveryReport) -> None:
        self.node_id = recovery.node_id
        self._recovery, self._guard, self._report = recovery, guard, report

    def ordered(self) -> list[Resource[Any]]:
        return self._recovery._ordered_resources()

    def owner_of(self, branch: str) -> Resource[Any] | None:
        owner = resource_of(branch, self._recovery.resources)
        return None if owner is None else self._recovery.resources.get(owner)

    def in_flight(self, gtrid: str) -> bool:
        return self._guard.maybe_in_flight(gtrid)

    def failed(self, key: str, error: BaseException | str) -> bool:
        return self._recovery._failed(key, error, self._report)

    def restored(self, gtrid: str, gid: str) -> None:
        self._recovery._resolved_one()
        self._recovery.retries.succeeded(gid)
        if gtrid not in self._report.committed:
            self._report.committed.append(gtrid)
        self._recovery.metrics.incr("recovered_commits")


def describe(xid: Xid) -> str:
    """A branch as an operator reads it (the gtrid `twopc forget` takes), not its base64 gid."""
    return f"{xid.gtrid} on {xid.bqual}"


def describe_key(key: str) -> str:
    """A retry key (a gtrid, a branch's gid, ``recover:<resource>``, ``decisions:<resource>``)
    in words."""
    kind, sep, name = key.partition(":")
    if sep and kind == "recover":
        return f"listing resource {name}"
    if sep and kind == "decisions":
        return f"asking last resource {name} for its decisions"
    try:
        return describe(Xid.from_gid(key))
    except InvalidXidError:
        return key  # a gtrid


def describe_error(exc: BaseException) -> str:
    """An error in one line, without a Python repr: twopc's carry their code already."""
    if isinstance(exc, TransactionError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
