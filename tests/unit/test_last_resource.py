"""Logging last resource on the durable test resource: the commit point is the last resource's
own commit, with the decision row inside it; recovery reads (and fences) that row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coordinator import (
    CompletionPending,
    MemoryDecisionLog,
    Outcome,
    OutcomeUnknownError,
    ProgrammingError,
    TransactionManager,
    TransactionRolledBack,
    TransactionTimedOut,
)
from coordinator.decision_log import Decision
from coordinator.errors import FencedError
from coordinator.last_resource import LastResource, is_last_resource
from coordinator.xid import Xid
from tests.support.file_resource import COMMITTED, ROLLED_BACK, FileResource
from tests.support.flaky_resource import FlakyResource
from tests.support.managers import make_manager


@pytest.fixture
def parts(tmp_path: Path) -> tuple[FileResource, FileResource, FileResource]:
    """Two two-phase resources a, b and the last resource L."""
    a = FileResource("a", tmp_path / "a")
    b = FileResource("b", tmp_path / "b")
    last = FileResource("L", tmp_path / "L", last_resource=True)
    return a, b, last


def move(tx: Any, *resources: Any) -> None:
    for resource in resources:
        tx.join(resource).add("n", 1)


def fates(gtrid: str, *resources: FileResource) -> list[str]:
    return [r.state().outcome(gtrid) for r in resources]


class CountingLog(MemoryDecisionLog):
    def __init__(self) -> None:
        super().__init__()
        self.commits = 0

    def log_commit(self, decision: Decision) -> None:
        self.commits += 1
        super().log_commit(decision)


def test_the_decision_rides_the_last_resource_commit(
    parts: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, last = parts
    log = CountingLog()
    tm = make_manager(managers, [a, b, last], log)
    assert is_last_resource(last) and isinstance(last, LastResource)
    assert not is_last_resource(a)
    with tm.transaction() as tx:
        move(tx, last, a, b)  # joined first, still committed after the others prepared
    assert fates(tx.gtrid, a, b, last) == [COMMITTED] * 3
    assert log.commits == 0 and log.pending() == []  # no decision-log record at all
    assert tm.metrics_dict()["last_resource_commits"] == 1
    assert last.committed_decisions("node-1") == {tx.gtrid: ("a", "b")}
    with tm.transaction() as tx2:  # the next commit deletes the ended row in the same write
        move(tx2, a, last)
    assert last.committed_decisions("node-1") == {tx2.gtrid: ("a",)}
    tm.recover()  # and recovery deletes what no branch needs any more
    assert last.committed_decisions("node-1") == {}


def test_at_most_one_last_resource(tmp_path: Path, managers: list[TransactionManager]) -> None:
    one = FileResource("L1", tmp_path / "1", last_resource=True)
    two = FileResource("L2", tmp_path / "2", last_resource=True)
    tm = make_manager(managers, [one, two])
    tx = tm.begin()
    tx.join(one)
    with pytest.raises(ProgrammingError, match="at most one last resource"):
        tx.join(two)
    tx.rollback()


def test_alone_or_with_read_only_branches_it_is_plain_one_phase(
    parts: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, last = parts
    tm = make_manager(managers, [a, b, last])
    with tm.transaction() as tx:
        move(tx, last)
    with tm.transaction() as tx2:
        move(tx2, last)
        tx2.join(a).get("n")  # read-only: votes READ_ONLY and leaves
    assert fates(tx.gtrid, last) == fates(tx2.gtrid, last) == [COMMITTED]
    assert last.committed_decisions("node-1") == {}


@pytest.mark.parametrize(
    ("vetoed", "reason"),
    [
        (1, "vote"),  # b votes no: the last resource's local transaction rolls back too
        (2, "last resource commit failed"),  # the last resource's commit refuses: certainly not
    ],
)
def test_a_no_vote_or_a_failed_last_commit_rolls_back_everything(
    parts: tuple[FileResource, ...], managers: list[TransactionManager], vetoed: int, reason: str
) -> None:
    a, b, last = parts
    tm = make_manager(managers, [a, b, last])
    tx = tm.begin()
    move(tx, a, b, last)
    tx.join(parts[vetoed]).veto()
    with pytest.raises(TransactionRolledBack) as caught:
        tx.commit()
    assert caught.value.reason == reason
    assert COMMITTED not in fates(tx.gtrid, a, b, last)
    assert not a.state().prepared and not b.state().prepared
    assert last.committed_decisions("node-1") == {}


def test_a_caller_past_its_deadline_is_fenced_before_the_last_commit(
    parts: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, last = parts
    slow_b = FlakyResource(b, stall={"prepare": 0.5})
    tm = make_manager(managers, [a, slow_b, last])
    tx = tm.begin(timeout=0.2)
    move(tx, a, slow_b, last)
    with pytest.raises(TransactionTimedOut):
        tx.commit()
    assert slow_b.wait_finished("rollback")
    assert COMMITTED not in fates(tx.gtrid, a, b, last)
    assert not a.state().prepared and not b.state().prepared


def test_an_unreachable_branch_is_committed_by_recovery_from_the_row(
    parts: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, last = parts
    flaky_b = FlakyResource(b, fail_on={"commit"})
    tm = make_manager(managers, [a, flaky_b, last])
    tx = tm.begin()
    move(tx, a, flaky_b, last)
    with pytest.warns(CompletionPending):
        assert tx.commit() == Outcome.COMMIT_PENDING
    assert fates(tx.gtrid, a, b, last) == [COMMITTED, "prepared", COMMITTED]
    down = tm.recover()
    assert down.failures and fates(tx.gtrid, b) == ["prepared"]  # not presumed aborted
    flaky_b.fail_on.clear()
    report = tm.recover(force=True)  # past the back-off
    assert report.committed == [tx.gtrid] and not report.rolled_back
    assert fates(tx.gtrid, a, b, last) == [COMMITTED] * 3
    assert last.committed_decisions("node-1") == {}  # the same pass dropped the row


class DownLast(FileResource):
    """A last resource whose decision table cannot be read (its database is down)."""

    down = True

    def decisions_of(self, gtrids: Any) -> set[str]:
        if self.down:
            raise ConnectionRefusedError("decision table unreachable (injected)")
        return super().decisions_of(gtrids)


def orphan(resource: FileResource, gtrid: str) -> Xid:
    """A prepared branch of an earlier incarnation of node-1, with no decision anywhere."""
    xid = Xid.branch_of(gtrid, resource.name)
    resource.start(xid).add("n", 1)
    resource.prepare(xid)
    return xid


def test_no_presumed_abort_while_a_last_resource_cannot_answer(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    a = FileResource("a", tmp_path / "a")
    last = DownLast("L", tmp_path / "L", last_resource=True)
    orphan(a, "node-1:old-1")
    tm = make_manager(managers, [a, last], recover_on_start=False)
    report = tm.recover()
    assert report.failures and not report.rolled_back
    assert fates("node-1:old-1", a) == ["prepared"]
    last.down = False
    report = tm.recover(force=True)
    assert len(report.rolled_back) == 1 and fates("node-1:old-1", a) == [ROLLED_BACK]


def test_presumed_abort_fences_a_late_last_commit(
    parts: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    """A coordinator whose node recovery took over commits its last resource too late: the abort
    row recovery left makes that commit fail instead of contradicting the rollback."""
    a, _, last = parts
    gtrid = "node-1:old-2"
    orphan(a, gtrid)
    make_manager(managers, [a, last])  # recovers on start
    assert fates(gtrid, a) == [ROLLED_BACK]
    late = Xid.branch_of(gtrid, "L")
    last.start(late).add("n", 1)
    with pytest.raises(FencedError):
        last.commit_with_decision(late, Decision(gtrid, ("a",)))
    assert fates(gtrid, a, last) == [ROLLED_BACK, "absent"]


class LostReply(FileResource):
    """A last resource whose commit lands but whose answer is lost."""

    def commit_with_decision(self, xid: Xid, decision: Decision) -> None:
        super().commit_with_decision(xid, decision)
        raise OutcomeUnknownError("connection lost during COMMIT (injected)", gtrid=xid.gtrid)


def test_an_unknown_last_commit_is_settled_by_recovery_reading_the_row(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    a = FileResource("a", tmp_path / "a")
    last = LostReply("L", tmp_path / "L", last_resource=True)
    tm = make_manager(managers, [a, last])
    tx = tm.begin()
    move(tx, a, last)
    with pytest.raises(OutcomeUnknownError):
        tx.commit()
    assert fates(tx.gtrid, a, last) == ["prepared", COMMITTED]
    report = tm.recover()  # the same live manager: the row, not its memory, decides
    assert report.committed == [tx.gtrid]
    assert fates(tx.gtrid, a, last) == [COMMITTED] * 2
