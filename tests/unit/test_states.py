"""The transaction state machine refuses everything its one transition table does not allow.

Every pair of states is tried against `TRANSITIONS`, so adding a state or an edge cannot slip
through untested, and the paths the driver (`_completion`) actually takes are checked to be legal,
so tightening the table cannot silently break a commit.
"""

from __future__ import annotations

import itertools
import pickle

import pytest

from coordinator.errors import IllegalStateError, ProgrammingError
from coordinator.states import TRANSITIONS, TxState, check_transition, require

S = TxState
PAIRS = list(itertools.product(TxState, TxState))
LEGAL = [(a, b) for a, b in PAIRS if b in TRANSITIONS[a]]
ILLEGAL = [(a, b) for a, b in PAIRS if b not in TRANSITIONS[a]]


def _details(error: IllegalStateError) -> dict[str, object]:
    """The keyword details an error carries (they are attributes, set from ``**details``)."""
    return {k: v for k, v in vars(error).items() if k != "message"}


def _id(pair: tuple[TxState, TxState]) -> str:
    return f"{pair[0].value}->{pair[1].value}"


def test_the_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(TxState)


@pytest.mark.parametrize("pair", LEGAL, ids=_id)
def test_legal_transition_is_allowed(pair: tuple[TxState, TxState]) -> None:
    check_transition(*pair)


@pytest.mark.parametrize("pair", ILLEGAL, ids=_id)
def test_illegal_transition_is_refused(pair: tuple[TxState, TxState]) -> None:
    current, target = pair
    with pytest.raises(IllegalStateError) as caught:
        check_transition(current, target)
    assert _details(caught.value) == {"current": current.value, "target": target.value}
    assert current.value in str(caught.value) and target.value in str(caught.value)


def test_no_state_moves_to_itself() -> None:
    """A repeated move is a double call (commit twice): refused, not silently accepted."""
    assert all(s not in TRANSITIONS[s] for s in TxState)


def test_final_states_are_exactly_those_with_no_way_out() -> None:
    assert {s for s in TxState if not TRANSITIONS[s]} == {s for s in TxState if s.is_final}
    assert {s for s in TxState if s.is_final} == {S.COMMITTED, S.ROLLED_BACK, S.UNKNOWN}


def test_every_state_can_reach_an_end() -> None:
    """No dead end: whatever state a transaction is in, some legal path finishes it."""
    for start in TxState:
        seen, frontier = {start}, [start]
        while frontier:
            nxt = {t for s in frontier for t in TRANSITIONS[s]} - seen
            seen |= nxt
            frontier = list(nxt)
        assert any(s.is_final for s in seen), start


def test_nothing_returns_to_active() -> None:
    """Once completion starts there is no going back to work (join after prepare)."""
    assert all(S.ACTIVE not in targets for targets in TRANSITIONS.values())


@pytest.mark.parametrize(
    "path",
    [
        [S.ACTIVE, S.COMMITTED],  # no branch
        [S.ACTIVE, S.COMMITTING, S.COMMITTED],  # one phase
        [S.ACTIVE, S.COMMITTING, S.ROLLED_BACK],  # one-phase commit failed
        [S.ACTIVE, S.COMMITTING, S.UNKNOWN],  # one-phase commit, outcome unknown
        [S.ACTIVE, S.PREPARING, S.COMMITTING, S.COMMITTED],  # two phase
        [S.ACTIVE, S.PREPARING, S.COMMITTED],  # all read-only
        [S.ACTIVE, S.PREPARING, S.ROLLING_BACK, S.ROLLED_BACK],  # a no vote, or log not written
        [S.ACTIVE, S.PREPARING, S.UNKNOWN],  # log write with durable=None
        [S.ACTIVE, S.ROLLING_BACK, S.ROLLED_BACK],  # tx.rollback()
        [S.ACTIVE, S.MARKED_ROLLBACK, S.ROLLING_BACK, S.ROLLED_BACK],  # rollback-only, timeout
    ],
    ids=lambda path: "->".join(s.value for s in path),
)
def test_every_path_the_driver_takes_is_legal(path: list[TxState]) -> None:
    for current, target in itertools.pairwise(path):
        check_transition(current, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.ROLLED_BACK, S.COMMITTING),  # commit after rollback
        (S.COMMITTED, S.ROLLING_BACK),  # rollback after commit
        (S.COMMITTING, S.ROLLING_BACK),  # abort after the commit point
        (S.MARKED_ROLLBACK, S.PREPARING),  # commit of a rollback-only transaction
        (S.UNKNOWN, S.ROLLED_BACK),  # guessing an unknown outcome
    ],
    ids=lambda s: s.value,
)
def test_the_dangerous_moves_are_refused(current: TxState, target: TxState) -> None:
    """The few illegal moves that would lose money, named, on top of the exhaustive sweep."""
    with pytest.raises(IllegalStateError):
        check_transition(current, target)


# -- require ---------------------------------------------------------------------------------


@pytest.mark.parametrize("current", list(TxState), ids=lambda s: s.value)
def test_require_accepts_an_allowed_state(current: TxState) -> None:
    require(current, current, action="use")
    require(current, *TxState, action="use")


@pytest.mark.parametrize("current", list(TxState), ids=lambda s: s.value)
def test_require_refuses_every_other_state(current: TxState) -> None:
    others = [s for s in TxState if s is not current]
    with pytest.raises(IllegalStateError) as caught:
        require(current, *others, action="join a resource to")
    message = str(caught.value)
    assert "join a resource to" in message and current.value in message
    assert _details(caught.value) == {"current": current.value}


def test_require_with_no_allowed_state_refuses_all() -> None:
    for current in TxState:
        with pytest.raises(IllegalStateError):
            require(current, action="touch")


def test_illegal_state_is_a_programming_error_that_pickles() -> None:
    """Misuse is the caller's bug, and Spark must be able to ship it between processes."""
    with pytest.raises(IllegalStateError) as caught:
        check_transition(S.COMMITTED, S.ACTIVE)
    error = caught.value
    assert isinstance(error, ProgrammingError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is IllegalStateError
    assert (_details(copy), str(copy)) == (_details(error), str(error))
