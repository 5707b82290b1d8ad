"""Phase one with prepares in flight (`coordinator.early_prepare`): what can be sent is sent first,
the other branches prepare meanwhile, and every vote in flight is read before the tally, whatever
happened in between; a no anywhere rolls back every branch (``atomicity``, ``presumed_abort``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator import Outcome, TransactionRolledBack, TransactionTimedOut, Vote
from coordinator.xid import Xid
from tests.support.file_resource import COMMITTED, ROLLED_BACK, FileResource, read_state
from tests.support.managers import make_manager
from tests.support.trace import traced

EVENTS: list[str] = []


class Sending(FileResource):
    """A file resource whose prepare is 'sent' by ``send_prepare`` and done by ``finish``."""

    refuse_send = False
    refuse_vote = False
    after_send: Callable[[], None] = staticmethod(lambda: None)

    def send_prepare(self, xid: Xid) -> Callable[[], Vote]:
        EVENTS.append(f"send {self.name}")
        if self.refuse_send:
            raise ConnectionError("cannot send")
        self.after_send()

        def finish() -> Vote:
            EVENTS.append(f"read {self.name}")
            if self.refuse_vote:
                raise ConnectionError("lost the reply")
            return self.prepare(xid)

        return finish


class Plain(FileResource):
    no = False

    def prepare(self, xid: Xid) -> Vote:
        EVENTS.append(f"prepare {self.name}")
        if self.no:
            raise RuntimeError("no")
        return super().prepare(xid)


@pytest.fixture
def abc(tmp_path: Path) -> Iterator[tuple[Plain, Sending, Sending]]:
    EVENTS.clear()
    yield Plain("a", tmp_path / "a"), Sending("b", tmp_path / "b"), Sending("c", tmp_path / "c")


def run(tm: object, resources: tuple[FileResource, ...]) -> tuple[str, Outcome | None]:
    tx = tm.begin()  # type: ignore[attr-defined]
    for r in resources:
        tx.join(r).set("k", 1)
    try:
        return tx.gtrid, tx.commit()
    except TransactionRolledBack:
        return tx.gtrid, None


def outcomes(tmp_path: Path, gtrid: str) -> list[str]:
    return [read_state(tmp_path / n).outcome(gtrid) for n in "abc"]


def test_prepares_in_flight_are_sent_first_and_read_last(
    abc: tuple[Plain, Sending, Sending], tmp_path: Path, managers: list
) -> None:
    with traced() as seen:
        gtrid, outcome = run(make_manager(managers, list(abc)), abc)
    assert outcome == Outcome.COMMITTED
    assert EVENTS == ["send b", "send c", "prepare a", "read b", "read c"]
    votes = [p for p in seen if p.startswith("tm.after_prepare") or p == "tm.after_decision_fsync"]
    assert votes == [f"tm.after_prepare.{n}" for n in (1, 2, 3)] + ["tm.after_decision_fsync"]
    assert outcomes(tmp_path, gtrid) == [COMMITTED] * 3


@pytest.mark.parametrize(
    ("who", "events"),
    [
        # a votes no: b's and c's prepares are out, and their votes are still read
        ("a", ["send b", "send c", "prepare a", "read b", "read c"]),
        # b cannot send: nothing else is asked, nothing is in flight
        ("b-send", ["send b"]),
        # b's reply is lost: a and c prepared, all three rolled back
        ("b-vote", ["send b", "send c", "prepare a", "read b", "read c"]),
    ],
)
def test_a_no_anywhere_rolls_back_every_branch_and_leaves_no_vote_unread(
    abc: tuple[Plain, Sending, Sending],
    tmp_path: Path,
    managers: list,
    who: str,
    events: list[str],
) -> None:
    a, b, _ = abc
    a.no = who == "a"
    b.refuse_send = who == "b-send"
    b.refuse_vote = who == "b-vote"
    tm = make_manager(managers, list(abc))
    gtrid, outcome = run(tm, abc)
    assert outcome is None
    assert events == EVENTS
    assert outcomes(tmp_path, gtrid) == [ROLLED_BACK] * 3
    assert not tm.log.pending()


def test_the_deadline_stops_the_others_but_not_the_reading(
    abc: tuple[Plain, Sending, Sending], tmp_path: Path, managers: list
) -> None:
    tm = make_manager(managers, list(abc))
    tx = tm.begin(timeout=60)
    for r in abc:
        tx.join(r).set("k", 1)

    def deadline_passes() -> None:  # once the sends are out: a must not be asked
        tx.deadline = 0.0

    abc[2].after_send = deadline_passes  # type: ignore[method-assign]
    with pytest.raises(TransactionTimedOut):
        tx.commit()
    assert EVENTS == ["send b", "send c", "read b", "read c"]
    assert outcomes(tmp_path, tx.gtrid) == [ROLLED_BACK] * 3


def test_not_with_the_parallel_pool_or_a_lone_branch(
    abc: tuple[Plain, Sending, Sending], managers: list
) -> None:
    tm = make_manager(managers, list(abc), parallel=True)
    assert run(tm, abc)[1] == Outcome.COMMITTED
    assert not [e for e in EVENTS if e.startswith("send")]
    tm2 = make_manager(managers, [abc[1]], node_id="node-2")
    assert run(tm2, abc[1:2])[1] == Outcome.COMMITTED  # one phase: no prepare at all
    assert not [e for e in EVENTS if e.startswith("send")]
