"""Every branch of the pure decision rules in `coordinator.protocol`, one case at a time.

The model test (tests/model) checks that these rules, composed by the driver's step order,
keep ``atomicity`` under every crash; these tests pin down each rule on its own, so a change
that the model would only catch as a long counterexample fails here with a one-line diff.
"""

from __future__ import annotations

import pytest

from coordinator.protocol import (
    Action,
    BranchResult,
    Plan,
    Tally,
    Verdict,
    branch_result,
    outcome,
    plan,
    recovery_action,
    tally,
)
from coordinator.resource import Outcome, Vote

C, R, N = Vote.COMMIT, Vote.READ_ONLY, Vote.ROLLBACK
DONE = BranchResult.DONE
UNREACHABLE = BranchResult.UNREACHABLE
H_COMMIT = BranchResult.HEURISTIC_COMMIT
H_ROLLBACK = BranchResult.HEURISTIC_ROLLBACK
H_HAZARD = BranchResult.HEURISTIC_HAZARD

# -- plan --------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 2, 5])
def test_plan_rollback_only_wins_whatever_the_branch_count(count: int) -> None:
    assert plan(count, rollback_only=True) is Plan.ROLLBACK


@pytest.mark.parametrize(
    ("count", "expected"),
    [(0, Plan.NOTHING), (1, Plan.ONE_PHASE), (2, Plan.TWO_PHASE), (3, Plan.TWO_PHASE)],
)
def test_plan_by_branch_count(count: int, expected: Plan) -> None:
    """One branch needs no log record (one-phase); two or more need the full protocol."""
    assert plan(count, rollback_only=False) is expected


# -- tally -------------------------------------------------------------------------------------


def test_tally_all_commit_commits_in_sort_order() -> None:
    """The commit list follows ``order``, not the order votes happened to arrive in."""
    assert tally(["a", "b", "c"], {"c": C, "a": C, "b": C}) == Tally(
        Verdict.COMMIT, commit=("a", "b", "c")
    )


def test_tally_read_only_branches_leave_the_commit_list() -> None:
    assert tally("abc", {"a": R, "b": C, "c": R}) == Tally(Verdict.COMMIT, commit=("b",))


def test_tally_all_read_only_needs_no_decision() -> None:
    assert tally("abc", {"a": R, "b": R, "c": R}) == Tally(Verdict.READ_ONLY)


def test_tally_no_branch_is_read_only() -> None:
    """Zero branches never reach the tally (plan says NOTHING); if they did, nothing to commit."""
    assert tally([], {}) == Tally(Verdict.READ_ONLY)


def test_tally_a_no_vote_aborts_and_rolls_back_all_but_the_read_only() -> None:
    """Presumed abort: nothing is logged; every branch that may hold work is rolled back."""
    assert tally("abcd", {"a": C, "b": R, "c": N, "d": C}) == Tally(
        Verdict.ABORT, rollback=("a", "c", "d")
    )


def test_tally_a_raised_prepare_votes_no_and_is_rolled_back() -> None:
    """None means prepare raised or timed out: it may have prepared, so it is rolled back too."""
    assert tally("abc", {"a": C, "b": None, "c": C}) == Tally(
        Verdict.ABORT, rollback=("a", "b", "c")
    )


def test_tally_unasked_branches_are_rolled_back() -> None:
    """Sequential prepare stops at the first no: the branches never asked still hold work."""
    assert tally("abc", {"a": N}) == Tally(Verdict.ABORT, rollback=("a", "b", "c"))


def test_tally_a_missing_vote_alone_aborts() -> None:
    """A missing vote is not a yes, even when every answer received was commit."""
    assert tally("abc", {"a": C, "b": C}) == Tally(Verdict.ABORT, rollback=("a", "b", "c"))


def test_tally_accepts_a_one_shot_iterable() -> None:
    assert tally(iter(["a", "b"]), {"a": C, "b": C}).commit == ("a", "b")


# -- branch_result -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reported", "expected"),
    [
        (None, DONE),  # the contract: returning None means committed
        (Outcome.COMMITTED, DONE),
        (Outcome.HEURISTIC_COMMIT, DONE),  # committed, as decided
        (Outcome.HEURISTIC_ROLLBACK, H_ROLLBACK),
        (Outcome.HEURISTIC_HAZARD, H_HAZARD),
        (Outcome.HEURISTIC_MIXED, H_HAZARD),  # one branch both ways: its fate is unknowable
    ],
)
def test_branch_result(reported: Outcome | None, expected: BranchResult) -> None:
    assert branch_result(reported) is expected


# -- outcome -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verdict", "results", "expected"),
    [
        (Verdict.COMMIT, [], Outcome.COMMITTED),
        (Verdict.COMMIT, [DONE, DONE], Outcome.COMMITTED),
        # a branch that was committed by someone else, on a commit decision, did no harm
        (Verdict.COMMIT, [DONE, H_COMMIT], Outcome.COMMITTED),
        (Verdict.COMMIT, [DONE, UNREACHABLE], Outcome.COMMIT_PENDING),
        (Verdict.COMMIT, [UNREACHABLE, UNREACHABLE], Outcome.COMMIT_PENDING),
        (Verdict.COMMIT, [DONE, H_ROLLBACK], Outcome.HEURISTIC_MIXED),
        (Verdict.COMMIT, [UNREACHABLE, H_ROLLBACK], Outcome.HEURISTIC_MIXED),
        (Verdict.COMMIT, [DONE, H_ROLLBACK, H_HAZARD], Outcome.HEURISTIC_MIXED),
        (Verdict.COMMIT, [H_ROLLBACK, H_ROLLBACK], Outcome.HEURISTIC_ROLLBACK),
        (Verdict.COMMIT, [DONE, H_HAZARD], Outcome.HEURISTIC_HAZARD),
        (Verdict.COMMIT, [H_ROLLBACK, H_HAZARD], Outcome.HEURISTIC_HAZARD),
        (Verdict.ABORT, [], Outcome.ROLLED_BACK),
        (Verdict.ABORT, [DONE, DONE], Outcome.ROLLED_BACK),
        (Verdict.ABORT, [DONE, UNREACHABLE], Outcome.ROLLED_BACK),  # recovery presumes abort
        (Verdict.ABORT, [DONE, H_ROLLBACK], Outcome.ROLLED_BACK),
        (Verdict.ABORT, [DONE, H_COMMIT], Outcome.HEURISTIC_MIXED),
        (Verdict.ABORT, [H_COMMIT, H_COMMIT], Outcome.HEURISTIC_COMMIT),
        (Verdict.ABORT, [DONE, H_HAZARD], Outcome.HEURISTIC_HAZARD),
    ],
)
def test_outcome(verdict: Verdict, results: list[BranchResult], expected: Outcome) -> None:
    named = {f"b{i}": result for i, result in enumerate(results)}
    assert outcome(verdict, named) is expected


def test_outcome_of_a_read_only_verdict_is_read_only() -> None:
    assert outcome(Verdict.READ_ONLY, {}) is Outcome.READ_ONLY


# -- recovery_action ---------------------------------------------------------------------------


@pytest.mark.parametrize("ours", [True, False])
@pytest.mark.parametrize("has_decision", [True, False])
def test_recovery_leaves_a_transaction_in_flight_alone(ours: bool, has_decision: bool) -> None:
    """The live manager's own thread finishes it; two committers racing on a branch is a bug."""
    action = recovery_action(ours=ours, has_decision=has_decision, maybe_in_flight=True)
    assert action is Action.LEAVE_ALONE


def test_recovery_commits_a_decided_branch() -> None:
    assert recovery_action(ours=True, has_decision=True, maybe_in_flight=False) is Action.COMMIT


def test_recovery_presumes_abort_of_our_undecided_branch() -> None:
    assert recovery_action(ours=True, has_decision=False, maybe_in_flight=False) is Action.ROLLBACK


def test_recovery_never_rolls_back_a_foreign_branch() -> None:
    """Another node's branch has its decision in another node's log: absence here proves nothing."""
    action = recovery_action(ours=False, has_decision=False, maybe_in_flight=False)
    assert action is Action.LEAVE_ALONE


def test_recovery_never_commits_a_foreign_branch() -> None:
    action = recovery_action(ours=False, has_decision=True, maybe_in_flight=False)
    assert action is Action.LEAVE_ALONE


def test_recovery_presumes_nothing_while_a_last_resource_is_unanswered() -> None:
    """No decision found proves nothing when a last resource's table could not be read: the
    decision may be a row there. A decision found still commits."""
    unknown = {"ours": True, "maybe_in_flight": False, "decision_known": False}
    assert recovery_action(has_decision=False, **unknown) is Action.LEAVE_ALONE
    assert recovery_action(has_decision=True, **unknown) is Action.COMMIT


def test_recovery_action_takes_keywords_only() -> None:
    """Three booleans in a row are too easy to swap; the signature refuses positions."""
    with pytest.raises(TypeError):
        recovery_action(True, False, False)  # type: ignore[call-arg]


def test_a_commit_that_reports_rolled_back_is_a_heuristic_rollback() -> None:
    """A branch overruled by someone else must never be counted as committed."""
    assert branch_result(Outcome.ROLLED_BACK) is BranchResult.HEURISTIC_ROLLBACK
