"""Exhaustive model check of presumed-abort 2PC with three participants and crashes everywhere.

The explorer (``explorer.py`` beside this file) walks every state reachable when each participant
votes commit, read-only or no (or raises, or times out after preparing), when any participant is
unreachable in phase two or recovery, when the log force succeeds, fails or cannot tell, and when
the coordinator, and then recovery, crash between any two steps, several times over. Each decision
along the way is made by the real `coordinator.protocol` functions. The invariants are those of
TLA+'s TCommit/TwoPhase specs plus what presumed abort promises a caller:

- ``atomicity``: never one participant committed and another rolled back (checked in every state);
- ``decision_stable``: after recovery, every branch ended as the log decided and as the caller
  was told;
- ``no_in_doubt_residue``: after recovery, nothing is still prepared and every COMMIT has its END;
- ``recovery_idempotent``: recovery run again on a quiescent state changes nothing.

A model that found nothing proves little unless it can find something, so the mutation tests
feed it deliberately wrong rules and require the named violation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import pytest

from coordinator import protocol
from coordinator.protocol import Action, BranchResult, Tally, Verdict
from coordinator.resource import Outcome, Vote

from .explorer import INVARIANTS, PROGRESS, Explorer, Report, Rules, Told

# Budgets: one coordinator crash plus three nested crashes of recovery (or four of recovery);
# three times a participant cannot be reached. Raising them adds states, not new kinds of state.
CRASHES = 4
OUTAGES = 3


@pytest.fixture(scope="module")
def report() -> Report:
    return Explorer(crashes=CRASHES, outages=OUTAGES).explore()


def test_model_explores_every_crash_site(
    report: Report, record_property: Callable[[str, object], None]
) -> None:
    """The search really went where the invariants claim to have looked.

    Without this, a model bug that stops early (every test below passing on a handful of states)
    would look like a proof.
    """
    print(f"model: {report.states} states, {report.terminal} terminal")
    record_property("model_states", report.states)
    record_property("model_terminal", report.terminal)
    expected_sites = {
        "before commit begins",
        *(f"before prepare {n}" for n in "abc"),  # i.e. after each prepare
        "before the decision write",
        *(f"before commit {n}" for n in "abc"),  # "a": just after the decision was forced
        "before END",
        "before the caller is answered",
        *(f"before rollback {n}" for n in "abc"),
        "restart after an unknown log write",
        *(f"in recovery before commit {n}" for n in "abc"),  # after each re-driven branch
        "in recovery before END",
        *(f"in recovery after presumed abort of {n}" for n in "abc"),
    }
    assert expected_sites <= report.crash_sites, sorted(expected_sites - report.crash_sites)
    # the coordinator crashed, then recovery crashed twice (and thrice) before a pass finished
    assert {(3, 2), (4, 3)} <= report.crash_profiles, sorted(report.crash_profiles)
    assert report.max_recovery_crashes == CRASHES
    assert report.told_at_end == set(Told) - {Told.HEURISTIC}
    # both decisions are reached, including a commit whose caller heard nothing or "unknown"
    assert {(True, Told.COMMITTED), (True, Told.NOTHING), (True, Told.UNKNOWN)} <= (
        report.outcomes_at_end
    )
    assert {(False, Told.ROLLED_BACK), (False, Told.NOTHING), (False, Told.UNKNOWN)} <= (
        report.outcomes_at_end
    )
    assert report.states > 10_000 and report.terminal > 1_000


@pytest.mark.parametrize("invariant", [*INVARIANTS, PROGRESS])
def test_invariant_holds_in_every_state(report: Report, invariant: str) -> None:
    """One test per invariant, so a failure names the property broken and its shortest trace."""
    found = report.violations.get(invariant, [])
    assert not found, f"{invariant} violated ({len(found)} shortest traces shown):\n" + (
        "\n\n".join(found)
    )


# -- mutations: wrong rules the checker must catch ------------------------------------------------


def _tally_ignores_no_votes(order: Iterable[str], votes: Mapping[str, Vote | None]) -> Tally:
    """Commits whoever voted commit even though another branch voted no."""
    names = tuple(order)
    committing = tuple(n for n in names if votes.get(n) == Vote.COMMIT)
    return Tally(Verdict.COMMIT, commit=committing) if committing else protocol.tally(names, votes)


def _tally_commits_missing_vote(order: Iterable[str], votes: Mapping[str, Vote | None]) -> Tally:
    """Counts a branch that raised, or was never asked, as a commit vote."""
    names = tuple(order)
    return protocol.tally(names, {n: votes.get(n) or Vote.COMMIT for n in names})


def _recovery_ignores_decision(*, ours: bool, has_decision: bool, maybe_in_flight: bool) -> Action:
    """Presumes abort even when a COMMIT record says otherwise."""
    return protocol.recovery_action(ours=ours, has_decision=False, maybe_in_flight=maybe_in_flight)


def _recovery_ignores_guard(*, ours: bool, has_decision: bool, maybe_in_flight: bool) -> Action:
    """Presumes abort of a transaction the live manager is still running."""
    return protocol.recovery_action(ours=ours, has_decision=has_decision, maybe_in_flight=False)


def _recovery_commits_undecided(*, ours: bool, has_decision: bool, maybe_in_flight: bool) -> Action:
    """Says COMMIT for a prepared branch with no decision (presumed commit).

    recovery.py leaves COMMIT actions to step 1, which only re-drives logged decisions, so the
    branch is never finished: the residue check must see it.
    """
    return protocol.recovery_action(ours=ours, has_decision=True, maybe_in_flight=maybe_in_flight)


def _outcome_pending_is_rollback(verdict: Verdict, results: Mapping[str, BranchResult]) -> Outcome:
    """Tells the caller "rolled back" when a branch of a committed transaction was unreachable."""
    if BranchResult.UNREACHABLE in results.values():
        return Outcome.ROLLED_BACK
    return protocol.outcome(verdict, results)


MUTATIONS: dict[str, tuple[Rules, str]] = {
    "tally_ignores_no_votes": (Rules(tally=_tally_ignores_no_votes), "atomicity"),
    "tally_commits_missing_vote": (Rules(tally=_tally_commits_missing_vote), "atomicity"),
    "recovery_ignores_decision": (Rules(recovery_action=_recovery_ignores_decision), "atomicity"),
    "recovery_ignores_in_flight_guard": (
        Rules(recovery_action=_recovery_ignores_guard),
        "atomicity",
    ),
    "outcome_reports_pending_as_rollback": (
        Rules(outcome=_outcome_pending_is_rollback),
        "decision_stable",
    ),
    "recovery_commits_undecided": (
        Rules(recovery_action=_recovery_commits_undecided),
        "no_in_doubt_residue",
    ),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_checker_catches_a_wrong_rule(mutation: str) -> None:
    """The same search, with one rule replaced by a plausible wrong one, must find the breach."""
    rules, invariant = MUTATIONS[mutation]
    found = Explorer(rules, crashes=CRASHES, outages=OUTAGES).explore(stop_on=invariant)
    assert invariant in found.violations, (
        f"{mutation}: expected a {invariant} violation, found {sorted(found.violations)}"
    )


def test_real_rules_are_the_default() -> None:
    """The explorer asks `coordinator.protocol` itself unless a test says otherwise."""
    defaults = {f.name: f.default for f in dataclasses.fields(Rules)}
    assert defaults == {
        "plan": protocol.plan,
        "tally": protocol.tally,
        "branch_result": protocol.branch_result,
        "outcome": protocol.outcome,
        "recovery_action": protocol.recovery_action,
    }


# -- a logging last resource -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llr_report() -> Report:
    return Explorer(crashes=CRASHES, outages=OUTAGES, last=True).explore()


def test_llr_model_explores_every_crash_site(
    llr_report: Report, record_property: Callable[[str, object], None]
) -> None:
    """a and b prepare, c is the last resource: its commit carries the decision row."""
    print(f"llr model: {llr_report.states} states, {llr_report.terminal} terminal")
    record_property("llr_model_states", llr_report.states)
    expected_sites = {
        *(f"before prepare {n}" for n in "ab"),
        "before the last resource commits",
        *(f"before commit {n}" for n in "ab"),  # "a": just after the last resource committed
        "before the caller is answered",
        *(f"before rollback {n}" for n in "abc"),
        "in recovery before the table lookup",
        "in recovery before presumed abort",  # the lookup answered, nothing acted on yet
        *(f"in recovery after presumed abort of {n}" for n in "ab"),  # or commit from the row
    }
    assert expected_sites <= llr_report.crash_sites, sorted(expected_sites - llr_report.crash_sites)
    # committed by the row with the caller told committed, nothing, or unknown (answer lost)
    assert {(True, Told.COMMITTED), (True, Told.NOTHING), (True, Told.UNKNOWN)} <= (
        llr_report.outcomes_at_end
    )
    assert {(False, Told.ROLLED_BACK), (False, Told.NOTHING), (False, Told.UNKNOWN)} <= (
        llr_report.outcomes_at_end
    )
    assert llr_report.states > 5_000 and llr_report.terminal > 500


@pytest.mark.parametrize("invariant", [*INVARIANTS, PROGRESS])
def test_llr_invariant_holds_in_every_state(llr_report: Report, invariant: str) -> None:
    found = llr_report.violations.get(invariant, [])
    assert not found, f"{invariant} violated ({len(found)} shortest traces shown):\n" + (
        "\n\n".join(found)
    )


def _llr_ignores_row(
    *, ours: bool, has_decision: bool, maybe_in_flight: bool, decision_known: bool = True
) -> Action:
    """Presumes abort although the last resource's table holds the commit row."""
    return protocol.recovery_action(
        ours=ours, has_decision=False, maybe_in_flight=maybe_in_flight, decision_known=True
    )


def _llr_presumes_when_unknown(
    *, ours: bool, has_decision: bool, maybe_in_flight: bool, decision_known: bool = True
) -> Action:
    """Presumes abort while the last resource's table could not be read."""
    return protocol.recovery_action(
        ours=ours, has_decision=has_decision, maybe_in_flight=maybe_in_flight
    )


@pytest.mark.parametrize("rule", [_llr_ignores_row, _llr_presumes_when_unknown])
def test_llr_checker_catches_a_wrong_rule(rule: Callable[..., Action]) -> None:
    found = Explorer(
        Rules(recovery_action=rule), crashes=CRASHES, outages=OUTAGES, last=True
    ).explore(stop_on="atomicity")
    assert "atomicity" in found.violations, sorted(found.violations)


# -- lazy commit records ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["file log", "last resource"])
def lazy_report(request: pytest.FixtureRequest) -> Report:
    return Explorer(crashes=CRASHES, outages=OUTAGES, last=request.param, lazy=True).explore()


@pytest.mark.parametrize("invariant", [*INVARIANTS, PROGRESS])
def test_lazy_invariant_holds_in_every_state(lazy_report: Report, invariant: str) -> None:
    """The stores write their phase-two commit records lazily; END waits for them."""
    print(f"lazy model: {lazy_report.states} states, {lazy_report.terminal} terminal")
    found = lazy_report.violations.get(invariant, [])
    assert not found, f"{invariant} violated ({len(found)} shortest traces shown):\n" + (
        "\n\n".join(found)
    )


@pytest.mark.parametrize("last", [False, True], ids=["file log", "last resource"])
def test_lazy_checker_catches_an_end_before_the_records(last: bool) -> None:
    """END written while a lazy commit record is still in memory: a crash then leaves a
    prepared branch with no decision, which recovery presumes aborted."""
    found = Explorer(
        crashes=CRASHES, outages=OUTAGES, last=last, lazy=True, eager_end=True
    ).explore(stop_on="lazy_covered")
    assert "lazy_covered" in found.violations, sorted(found.violations)


# -- prepares in flight ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["file log", "last resource"])
def in_flight_report(request: pytest.FixtureRequest) -> Report:
    """Two prepares in flight: b and c beside a (file log, as the Redis crash matrix runs), or
    both preparers beside the last resource."""
    return Explorer(crashes=CRASHES, outages=OUTAGES, last=request.param, in_flight=2).explore()


@pytest.mark.parametrize("invariant", [*INVARIANTS, PROGRESS])
def test_in_flight_invariant_holds_in_every_state(in_flight_report: Report, invariant: str) -> None:
    """Prepares sent first and read after the others (`coordinator.early_prepare`)."""
    print(
        f"in-flight model: {in_flight_report.states} states, {in_flight_report.terminal} terminal"
    )
    found = in_flight_report.violations.get(invariant, [])
    assert not found, f"{invariant} violated ({len(found)} shortest traces shown):\n" + (
        "\n\n".join(found)
    )


def test_in_flight_model_asks_every_preparer(in_flight_report: Report) -> None:
    assert {f"before prepare {n}" for n in "ab"} <= in_flight_report.crash_sites


@pytest.mark.parametrize("last", [False, True], ids=["file log", "last resource"])
def test_in_flight_checker_catches_a_decision_before_every_vote_is_read(last: bool) -> None:
    """Tallying a vote still in flight as a commit: a sender that votes no is rolled back while
    the others commit."""
    found = Explorer(
        crashes=CRASHES, outages=OUTAGES, last=last, in_flight=2, guess_in_flight=True
    ).explore(stop_on="atomicity")
    assert "atomicity" in found.violations, sorted(found.violations)
