"""Pure decisions of presumed-abort two-phase commit: no I/O, no clocks, no threads.

The driver (`_completion`) asks these functions what to do and performs it; the model test asks
the same functions while exploring every crash and vote. Keeping the rules here, as plain
functions of votes and log state, is what lets a test cover all of them without a server.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .resource import Outcome, Vote


class Plan(enum.Enum):
    """How to end a transaction that asked to commit."""

    #: members are singletons compared by identity: hash them so too, in C, not through
    #: Enum.__hash__ (a Python call on every state check and vote tally)
    __hash__ = object.__hash__

    NOTHING = "nothing"  # no branch: nothing to do
    ONE_PHASE = "one-phase"  # one branch: commit it directly, log nothing
    TWO_PHASE = "two-phase"
    ROLLBACK = "rollback"  # marked rollback-only


def plan(branch_count: int, rollback_only: bool) -> Plan:
    if rollback_only:
        return Plan.ROLLBACK
    if branch_count == 0:
        return Plan.NOTHING
    return Plan.ONE_PHASE if branch_count == 1 else Plan.TWO_PHASE


class Verdict(enum.Enum):
    #: members are singletons compared by identity: hash them so too, in C, not through
    #: Enum.__hash__ (a Python call on every state check and vote tally)
    __hash__ = object.__hash__

    COMMIT = "commit"  # force a COMMIT record, then phase two on ``commit``
    ABORT = "abort"  # log nothing; roll back ``rollback``
    READ_ONLY = "read-only"  # every branch read-only: nothing to log, nothing to finish


@dataclass(frozen=True)
class Tally:
    verdict: Verdict
    commit: tuple[str, ...] = ()
    rollback: tuple[str, ...] = ()


def tally(order: Iterable[str], votes: Mapping[str, Vote | None]) -> Tally:
    """Decide from phase one.

    ``order`` lists every branch in sort order; ``votes`` maps those that answered (None: it
    raised or timed out). A branch missing from ``votes`` was never asked because an earlier one
    already said no. Any no aborts; branches that voted read-only have left and are not rolled
    back; every other branch is, including the unasked and the failed (rollback is idempotent).
    """
    names = tuple(order)
    if any(votes.get(n, Vote.ROLLBACK) in (None, Vote.ROLLBACK) for n in names):
        return Tally(
            Verdict.ABORT, rollback=tuple(n for n in names if votes.get(n) != Vote.READ_ONLY)
        )
    committing = tuple(n for n in names if votes[n] == Vote.COMMIT)
    if not committing:
        return Tally(Verdict.READ_ONLY)
    return Tally(Verdict.COMMIT, commit=committing)


class BranchResult(enum.Enum):
    """What phase two learnt from one branch."""

    #: members are singletons compared by identity: hash them so too, in C, not through
    #: Enum.__hash__ (a Python call on every state check and vote tally)
    __hash__ = object.__hash__

    DONE = "done"  # committed (or rolled back, on the abort path) as decided
    UNREACHABLE = "unreachable"  # could not be told now; recovery retries
    HEURISTIC_COMMIT = "heuristic-commit"  # committed by someone else against an abort
    HEURISTIC_ROLLBACK = "heuristic-rollback"  # rolled back by someone else against a commit
    HEURISTIC_HAZARD = "heuristic-hazard"  # its fate cannot be known


_HEURISTIC_OF = {
    # a commit that reports the branch rolled back was overruled: a heuristic, not success
    Outcome.ROLLED_BACK: BranchResult.HEURISTIC_ROLLBACK,
    # "committed by someone else" is what we decided anyway: nothing against the decision
    Outcome.HEURISTIC_COMMIT: BranchResult.DONE,
    Outcome.HEURISTIC_ROLLBACK: BranchResult.HEURISTIC_ROLLBACK,
    Outcome.HEURISTIC_HAZARD: BranchResult.HEURISTIC_HAZARD,
    Outcome.HEURISTIC_MIXED: BranchResult.HEURISTIC_HAZARD,
}


def branch_result(reported: Outcome | None) -> BranchResult:
    """Map what a resource's commit returned to a phase-two result."""
    return _HEURISTIC_OF.get(reported, BranchResult.DONE) if reported else BranchResult.DONE


def outcome(verdict: Verdict, results: Mapping[str, BranchResult]) -> Outcome:
    """The transaction's outcome from the verdict and each branch's phase-two result.

    A branch that went the other way makes the outcome heuristic: all of them the other way is
    HEURISTIC_ROLLBACK (or _COMMIT), some each way is MIXED, an unknowable branch is HAZARD.
    Unreachable branches alone only make it pending: recovery will finish them as decided.
    """
    committed = verdict == Verdict.COMMIT
    against = BranchResult.HEURISTIC_ROLLBACK if committed else BranchResult.HEURISTIC_COMMIT
    values = list(results.values())
    n_against = values.count(against)
    as_decided = sum(v in (BranchResult.DONE, BranchResult.UNREACHABLE) for v in values)
    if n_against and as_decided:
        return Outcome.HEURISTIC_MIXED
    if BranchResult.HEURISTIC_HAZARD in values:
        return Outcome.HEURISTIC_HAZARD
    if n_against:
        return Outcome.HEURISTIC_ROLLBACK if committed else Outcome.HEURISTIC_COMMIT
    if verdict == Verdict.READ_ONLY:
        return Outcome.READ_ONLY
    if not committed:
        return Outcome.ROLLED_BACK
    return Outcome.COMMIT_PENDING if BranchResult.UNREACHABLE in values else Outcome.COMMITTED


class Action(enum.Enum):
    """What recovery does with one prepared branch a resource listed."""

    #: members are singletons compared by identity: hash them so too, in C, not through
    #: Enum.__hash__ (a Python call on every state check and vote tally)
    __hash__ = object.__hash__

    COMMIT = "commit"  # a COMMIT record without END names it
    ROLLBACK = "rollback"  # presumed abort: ours, not in flight, no decision
    LEAVE_ALONE = "leave-alone"  # another node's, another format's, or possibly still in flight


def recovery_action(
    *, ours: bool, has_decision: bool, maybe_in_flight: bool, decision_known: bool = True
) -> Action:
    """Presumed abort with the coordinator's in-flight guard.

    A transaction still in flight in this live manager belongs to its own thread, decision or not:
    its phase two is running, and two committers racing on one branch is how servers answer
    "prepared transaction is busy". Past that, a logged decision (or a last resource's decision
    row) means commit; foreign branches are never touched; and what is ours, settled, and
    undecided was never committed -- provided every place a decision can live answered:
    ``decision_known`` is False while a last resource's table cannot be read, and then the
    absence of a decision proves nothing.
    """
    if maybe_in_flight or not ours:
        return Action.LEAVE_ALONE
    if has_decision:
        return Action.COMMIT
    return Action.ROLLBACK if decision_known else Action.LEAVE_ALONE
