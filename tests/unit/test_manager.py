"""The transaction manager over real (file-backed) resources: every completion path, the hooks,
the current transaction, retries, phase-two trouble, heuristics, the reaper, metrics and the
in-flight guard of recovery.

Invariants named here: ``atomicity`` (every branch ends the same way), ``presumed_abort`` (no
decision, no commit), ``exactly_once`` (a retried unit of work is applied once), ``in_flight_guard``
(recovery never rolls back a live transaction's branch, always an orphan of ours, never another
node's).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import coordinator
from coordinator import (
    CompletionPending,
    FileDecisionLog,
    HeuristicMixed,
    HeuristicRollback,
    MemoryDecisionLog,
    NoTransactionError,
    Outcome,
    OutcomeUnknownError,
    Transaction,
    TransactionManager,
    TransactionRolledBack,
    TransactionTimedOut,
    TransientError,
    Xid,
)
from coordinator.backoff import NoBackoff
from coordinator.decision_log import Decision, DecisionLog
from coordinator.states import TxState
from tests.support.file_resource import COMMITTED, ROLLED_BACK, FileResource
from tests.support.flaky_resource import FlakyResource
from tests.support.managers import make_manager


class RecordingLog(MemoryDecisionLog):
    """A memory log that remembers every decision written, END or not."""

    def __init__(self) -> None:
        super().__init__()
        self.decisions: list[Decision] = []

    def log_commit(self, decision: Decision) -> None:
        super().log_commit(decision)
        self.decisions.append(decision)


@pytest.fixture
def abc(tmp_path: Path) -> tuple[FileResource, FileResource, FileResource]:
    a, b, c = (FileResource(name, tmp_path / name) for name in "abc")
    return a, b, c


def manager(
    made: list[TransactionManager],
    resources: list[Any],
    log: DecisionLog | None = None,
    **options: Any,
) -> TransactionManager:
    """`make_manager` as node-1, retrying without a pause unless a test names a backoff."""
    options.setdefault("backoff", NoBackoff())
    return make_manager(made, resources, log, node_id="node-1", **options)


def transfer(tx: Transaction, a: Any, b: Any, c: Any) -> None:
    tx.join(a).add("balance", -10)
    tx.join(b).add("balance", 10)
    tx.join(c).set("last", tx.gtrid)


def outcomes(gtrid: str, *resources: FileResource) -> list[str]:
    return [r.state().outcome(gtrid) for r in resources]


def decided_and_died(gtrid: str, resources: tuple[FileResource, ...]) -> MemoryDecisionLog:
    """A coordinator that died just after deciding: every branch of ``gtrid`` (``n`` += 1) is
    prepared, and the returned log holds its COMMIT decision over all of them, with no END."""
    log = MemoryDecisionLog()
    for r in resources:
        xid = Xid.branch_of(gtrid, r.name)
        r.start(xid).add("n", 1)
        r.prepare(xid)
    log.log_commit(Decision(gtrid, tuple(r.name for r in resources)))
    return log


# -- completion paths ----------------------------------------------------------------------------


def test_two_phase_commit_forces_one_decision_and_commits_every_branch(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    log = RecordingLog()
    tm = manager(managers, list(abc), log)
    with tm.transaction() as tx:
        transfer(tx, *abc)
    assert tx.outcome == Outcome.COMMITTED
    assert outcomes(tx.gtrid, *abc) == [COMMITTED] * 3  # atomicity
    assert [d.branches for d in log.decisions] == [("a", "b", "c")]
    assert log.pending() == []  # END written
    assert abc[0].snapshot() == {"balance": -10}
    assert abc[1].snapshot() == {"balance": 10}


def test_rollback_and_exceptions_roll_back_every_branch(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    log = RecordingLog()
    tm = manager(managers, list(abc), log)
    tx = tm.begin()
    transfer(tx, *abc)
    tx.rollback()
    assert outcomes(tx.gtrid, *abc) == [ROLLED_BACK] * 3

    with pytest.raises(KeyError), tm.transaction() as failed:
        transfer(failed, *abc)
        raise KeyError("application error")
    assert failed.state == TxState.ROLLED_BACK
    assert outcomes(failed.gtrid, *abc) == [ROLLED_BACK] * 3
    assert log.decisions == []  # presumed_abort: nothing logged
    assert all(r.snapshot() == {} for r in abc)


def test_a_no_vote_rolls_back_and_logs_nothing(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    log = RecordingLog()
    tm = manager(managers, list(abc), log)
    tx = tm.begin()
    transfer(tx, *abc)
    tx.branches["b"].handle.veto()
    with pytest.raises(TransactionRolledBack) as caught:
        tx.commit()
    assert caught.value.reason == "vote"
    assert log.decisions == []
    assert outcomes(tx.gtrid, *abc) == [ROLLED_BACK, ROLLED_BACK, ROLLED_BACK]
    assert all(not r.state().prepared for r in abc)


def test_read_only_branches_leave_the_transaction(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    log = RecordingLog()
    tm = manager(managers, list(abc), log)
    a, b, c = abc
    with tm.transaction() as tx:
        for r in abc:
            tx.join(r).get("anything")
    assert tx.outcome == Outcome.READ_ONLY
    assert log.decisions == [] and log.stats().forced_records == 0

    with tm.transaction() as mixed:
        mixed.join(a).add("balance", 1)
        mixed.join(b).add("balance", 1)
        mixed.join(c).get("balance")
    assert mixed.outcome == Outcome.COMMITTED
    assert [d.branches for d in log.decisions] == [("a", "b")]  # c is not in the record
    assert c.state().outcome(mixed.gtrid) == "absent"
    assert tm.metrics_dict()["read_only"] == 1


def test_one_branch_commits_in_one_phase_without_a_log_record(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    log = RecordingLog()
    tm = manager(managers, list(abc), log)
    with tm.transaction() as tx:
        tx.join(abc[0]).set("k", "v")
    assert tx.outcome == Outcome.COMMITTED
    assert log.decisions == [] and log.stats().forced_records == 0
    assert abc[0].snapshot() == {"k": "v"}
    assert tm.metrics_dict()["one_phase"] == 1

    with tm.transaction() as empty:
        pass
    assert empty.outcome == Outcome.COMMITTED


# -- hooks and the current transaction -----------------------------------------------------------


def fail(*args: object) -> None:
    raise RuntimeError("hook failed")


def test_hooks_run_around_completion(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    tm = manager(managers, list(abc))
    seen: list[object] = []
    with tm.transaction() as tx:
        transfer(tx, *abc)
        tx.before_completion(lambda: seen.append(("before", abc[0].state().prepared)))
        tx.after_completion(lambda outcome: seen.append(("after", outcome)))
        tx.after_completion(fail)  # a failing after-hook is logged and ignored
    assert seen == [("before", set()), ("after", Outcome.COMMITTED)]  # before ran before prepare


def test_a_failing_before_hook_rolls_back(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    tm = manager(managers, list(abc))
    after: list[Outcome] = []
    tx = tm.begin()
    transfer(tx, *abc)
    tx.before_completion(fail)
    tx.after_completion(after.append)
    with pytest.raises(TransactionRolledBack) as caught:
        tx.commit()
    assert caught.value.reason == "hook"
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert after == [Outcome.ROLLED_BACK]
    assert outcomes(tx.gtrid, *abc) == [ROLLED_BACK] * 3


def test_current_transaction_follows_the_context(managers: list[TransactionManager]) -> None:
    tm = manager(managers, [])
    assert coordinator.current() is None
    with pytest.raises(NoTransactionError):
        tm.current()
    elsewhere: list[Transaction | None] = []
    with tm.transaction() as tx:
        assert tm.current() is tx and coordinator.current() is tx
        thread = threading.Thread(target=lambda: elsewhere.append(coordinator.current()))
        thread.start()
        thread.join()
    assert elsewhere == [None]  # another thread has its own context
    assert coordinator.current() is None
    with pytest.raises(NoTransactionError):
        tm.current()


# -- retries -------------------------------------------------------------------------------------


def test_run_retries_transient_errors_and_applies_once(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    tm = manager(managers, list(abc))
    attempts: list[str] = []

    def work(tx: Transaction) -> str:
        attempts.append(tx.gtrid)
        transfer(tx, *abc)
        if len(attempts) < 3:
            raise TransientError("serialization failure")
        return tx.gtrid

    committed = tm.run(work, tries=3)
    assert committed == attempts[-1] and len(set(attempts)) == 3  # a fresh gtrid each time
    assert abc[0].snapshot() == {"balance": -10}  # exactly_once: the failed attempts rolled back
    assert tm.metrics_dict()["retries"] == 2


def test_run_gives_up_after_its_tries(managers: list[TransactionManager]) -> None:
    tm = manager(managers, [])
    calls = []

    def work(tx: Transaction) -> None:
        calls.append(1)
        raise TransientError("still busy")

    with pytest.raises(TransientError):
        tm.run(work, tries=2)
    assert len(calls) == 2


@pytest.mark.parametrize("cause", [None, TransientError("socket timeout")])
def test_run_never_retries_an_unknown_outcome(
    cause: Exception | None, managers: list[TransactionManager]
) -> None:
    tm = manager(managers, [])
    calls = []

    def work(tx: Transaction) -> None:
        calls.append(1)
        raise OutcomeUnknownError("commit sent, no answer") from cause

    with pytest.raises(OutcomeUnknownError):
        tm.run(work, tries=3)
    assert calls == [1]


def test_run_does_not_retry_ordinary_errors(managers: list[TransactionManager]) -> None:
    tm = manager(managers, [])
    calls = []

    def work(tx: Transaction) -> None:
        calls.append(1)
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        tm.run(work)
    assert calls == [1]


# -- parallel prepare and commit -------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["prepare", "commit"])
def test_parallel_mode_runs_each_phase_on_every_branch_at_once(
    phase: str, abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    # Each call waits at a barrier for the other two: only concurrent calls get through.
    barrier = threading.Barrier(3, timeout=5)

    def meet(xid: Xid) -> None:
        barrier.wait()

    wrapped = [FlakyResource(r, before={phase: meet}) for r in abc]
    tm = manager(managers, wrapped, parallel=True)
    with tm.transaction() as tx:
        for r in wrapped:
            tx.join(r).add("n", 1)
    assert tx.outcome == Outcome.COMMITTED
    assert outcomes(tx.gtrid, *abc) == [COMMITTED] * 3
    assert tm.log.pending() == []  # END written: every branch answered


def test_parallel_mode_rolls_back_on_one_no(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    tm = manager(managers, list(abc), parallel=True)
    tx = tm.begin()
    transfer(tx, *abc)
    tx.branches["a"].handle.veto()
    with pytest.raises(TransactionRolledBack):
        tx.commit()
    assert outcomes(tx.gtrid, *abc) == [ROLLED_BACK] * 3
    assert all(not r.state().prepared for r in abc)


# -- phase-two trouble ---------------------------------------------------------------------------


def test_unreachable_branch_in_phase_two_is_finished_by_recovery(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, c = abc
    flaky_b = FlakyResource(b, fail_on={"commit"})
    log = RecordingLog()
    tm = manager(managers, [a, flaky_b, c], log)
    tx = tm.begin()
    transfer(tx, a, flaky_b, c)
    with pytest.warns(CompletionPending):
        outcome = tx.commit()
    assert outcome == Outcome.COMMIT_PENDING
    assert outcomes(tx.gtrid, a, b, c) == [COMMITTED, "prepared", COMMITTED]
    assert [d.gtrid for d in log.pending()] == [tx.gtrid]  # no END yet
    assert [d.gtrid for d in tm.in_doubt()] == [tx.gtrid]

    still_down = tm.recover()
    assert still_down.failures and still_down.committed == []
    flaky_b.fail_on.clear()
    report = tm.recover()
    assert report.committed == [tx.gtrid]
    assert outcomes(tx.gtrid, a, b, c) == [COMMITTED] * 3
    assert log.pending() == [] and tm.in_doubt() == []


def test_heuristic_rollback_in_phase_two_is_reported_kept_and_forgettable(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, c = abc
    # An operator rolls b back by hand just before the coordinator tells it to commit.
    meddled = FlakyResource(b, before={"commit": b.operator_rollback})
    tm = manager(managers, [a, meddled, c])
    tx = tm.begin()
    transfer(tx, a, meddled, c)
    with pytest.raises(HeuristicMixed) as caught:
        tx.commit()
    assert vars(caught.value)["gtrid"] == tx.gtrid
    assert vars(caught.value)["outcome"] == Outcome.HEURISTIC_MIXED.value
    assert tx.outcome == Outcome.HEURISTIC_MIXED
    assert outcomes(tx.gtrid, a, b, c) == [COMMITTED, ROLLED_BACK, COMMITTED]
    [record] = tm.heuristics()
    assert (record.gtrid, record.branch, record.outcome) == (
        tx.gtrid,
        "b",
        Outcome.HEURISTIC_ROLLBACK.value,
    )
    assert tm.log.pending() == []  # every branch answered: END written

    tm.forget_heuristic(tx.gtrid)
    assert tm.heuristics() == []
    assert b.state().aborted == set()  # the resource forgot its tombstone too
    assert meddled.calls["forget"] == 1


def test_every_branch_rolled_back_by_hand_is_a_heuristic_rollback(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    wrapped = [FlakyResource(r, before={"commit": r.operator_rollback}) for r in abc]
    tm = manager(managers, wrapped)
    tx = tm.begin()
    for r in wrapped:
        tx.join(r).add("n", 1)
    with pytest.raises(HeuristicRollback):
        tx.commit()
    assert len(tm.heuristics()) == 3


def test_recovery_records_a_heuristic_it_meets(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, c = abc
    gtrid = "node-1:oldinc-7"
    log = decided_and_died(gtrid, abc)
    b.operator_rollback(Xid.branch_of(gtrid, "b"))
    tm = manager(managers, list(abc), log)  # start-up recovery re-drives the decision
    assert outcomes(gtrid, a, b, c) == [COMMITTED, ROLLED_BACK, COMMITTED]
    assert [(h.gtrid, h.branch) for h in tm.heuristics()] == [(gtrid, "b")]
    assert log.pending() == []


# -- the reaper ----------------------------------------------------------------------------------


def wait_for(condition: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_reaper_marks_a_timed_out_transaction_rollback_only(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    tm = manager(managers, list(abc), reaper_interval=0.02, abandon_after=60)
    tx = tm.begin(timeout=0.1)
    transfer(tx, *abc)
    assert wait_for(lambda: tx.rollback_only)
    assert tx.rollback_reason == "timeout"
    assert tm.metrics_dict()["timeouts"] == 1
    with pytest.raises(TransactionTimedOut):
        tx.commit()
    assert wait_for(lambda: tx.state == TxState.ROLLED_BACK)
    assert all(r.snapshot() == {} for r in abc)


def test_reaper_rolls_back_an_abandoned_transaction(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    tm = manager(managers, list(abc), reaper_interval=0.02, abandon_after=0.1)
    tx = tm.begin(timeout=0.05)
    transfer(tx, *abc)
    assert wait_for(lambda: tx.state == TxState.ROLLED_BACK)
    assert outcomes(tx.gtrid, *abc) == [ROLLED_BACK] * 3
    assert tm.metrics_dict()["abandoned"] == 1
    assert tm.in_flight() == []


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_count_outcomes_and_time_each_phase(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    tm = manager(managers, list(abc))
    with tm.transaction() as tx:
        transfer(tx, *abc)
    rolled = tm.begin()
    transfer(rolled, *abc)
    rolled.rollback()
    tm.recover()

    m = tm.metrics_dict()
    assert m["begun"] == 2
    assert m["outcome_committed"] == 1
    assert m["outcome_rolled_back"] == 1
    assert m["recovery_passes"] >= 1
    for phase in ("commit", "prepare", "decision", "commit_phase", "recovery"):
        assert m["phases"][phase]["count"] >= 1, phase
        assert m["phases"][phase]["sum_s"] >= 0
    assert m["in_doubt"] == 0.0
    assert m["oldest_in_doubt_age_seconds"] == 0.0


# -- in_flight_guard -----------------------------------------------------------------------------


def test_recovery_spares_live_transactions_and_kills_orphans_of_our_node_only(
    tmp_path: Path, abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, c = abc
    # Orphans left by an earlier incarnation of this node and by another node.
    ours, theirs = Xid.branch_of("node-1:oldinc-1", "a"), Xid.branch_of("node-2:oldinc-1", "a")
    for xid in (ours, theirs):
        a.start(xid).set("k", xid.gtrid)
        a.prepare(xid)

    in_prepare, go_on = threading.Event(), threading.Event()

    def hold(xid: Xid) -> None:
        in_prepare.set()
        assert go_on.wait(10)

    held_b = FlakyResource(b, before={"prepare": hold})
    log = FileDecisionLog(tmp_path / "log")
    tm = manager(managers, [a, held_b, c], log, recover_on_start=False)
    tx = tm.begin()
    transfer(tx, a, held_b, c)
    result: list[Outcome] = []
    committer = threading.Thread(target=lambda: result.append(tx.commit()))
    committer.start()
    try:
        assert in_prepare.wait(10)  # a is prepared; b's prepare is held
        assert a.state().outcome(tx.gtrid) == "prepared"
        report = tm.recover()
    finally:
        go_on.set()
        committer.join(10)

    assert report.rolled_back == [ours.to_gid()]  # the orphan of our earlier incarnation
    assert report.left_alone >= 2  # the live branch and the other node's
    assert result == [Outcome.COMMITTED]  # the live one was spared and committed
    assert outcomes(tx.gtrid, a, b, c) == [COMMITTED] * 3
    assert a.state().outcome(ours.gtrid) == ROLLED_BACK
    assert a.state().outcome(theirs.gtrid) == "prepared"  # never touched
    assert a.recover() == [theirs]


# -- regressions of bugs found while writing these tests -----------------------------------------


def test_recovery_commits_the_reachable_branches_of_a_decision(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, c = abc
    gtrid = "node-1:oldinc-9"
    log = decided_and_died(gtrid, abc)
    down_a = FlakyResource(a, fail_on={"commit"})
    tm = manager(managers, [down_a, b, c], log, recover_on_start=False)
    report = tm.recover()
    assert report.failures  # a is down: the decision stays pending ...
    assert outcomes(gtrid, b, c) == [COMMITTED, COMMITTED]  # ... but b and c need not wait


def test_failed_one_phase_commit_rolls_the_branch_back(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    flaky = FlakyResource(abc[0])
    tm = manager(managers, [flaky])
    tx = tm.begin()
    tx.join(flaky).set("k", "v")
    flaky.fail_on.add("commit")
    with pytest.raises(TransactionRolledBack):
        tx.commit()
    assert tx.state == TxState.ROLLED_BACK
    assert flaky.calls["rollback"] == 1


# -- settling before a retry ---------------------------------------------------------------------


def test_run_waits_for_a_timed_out_attempt_to_settle_before_retrying(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    """The caller's wait runs out while a branch prepares: the retry must not begin until the
    first attempt's completion job has rolled every branch back (else it overtakes its work)."""
    a, b, _ = abc
    slow = FlakyResource(b, stall={"prepare": 1.0})
    tm = manager(managers, [a, slow], inline_completion=False)
    seen: list[tuple[str, bool]] = []
    first: list[Transaction] = []

    def work(tx: Transaction) -> None:
        if first:
            seen.append((first[0].state.value, first[0].settled))
            slow.stall.clear()
        else:
            first.append(tx)
        tx.join(a).add("balance", -10)
        tx.join(slow).add("balance", 10)

    tm.run(work, tries=2, timeout=0.3)
    assert seen == [("rolled-back", True)]  # the retry began after the first attempt settled
    assert outcomes(first[0].gtrid, a, b) == [ROLLED_BACK, ROLLED_BACK]
    assert a.snapshot() == {"balance": -10}  # exactly_once


def test_run_confirms_an_unconfirmed_rollback_before_retrying(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    """A branch whose rollback failed may still hold the attempt's work: `run` tells it again
    (the server comes back) and only then retries."""
    a, b, _ = abc
    flaky = FlakyResource(b)
    tm = manager(managers, [a, flaky])
    attempts: list[Transaction] = []

    def work(tx: Transaction) -> None:
        attempts.append(tx)
        tx.join(a).add("balance", -10)
        tx.join(flaky).add("balance", 10)
        if len(attempts) == 1:
            flaky.fail_on.add("rollback")  # the server goes away; back 0.3 s later
            threading.Timer(0.3, flaky.fail_on.clear).start()
            raise TransientError("serialization failure")

    tm.run(work, tries=2)
    assert flaky.calls["rollback"] >= 2
    assert outcomes(attempts[0].gtrid, a, b) == [ROLLED_BACK, ROLLED_BACK]
    assert not attempts[0].unconfirmed and tm.unsettled() == []


def test_an_attempt_that_does_not_settle_is_not_retried_and_stays_unsettled(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, _ = abc
    down = FlakyResource(b)
    tm = manager(managers, [a, down], settle_timeout=0.3)
    calls: list[str] = []

    def work(tx: Transaction) -> None:
        calls.append(tx.gtrid)
        tx.join(a).add("balance", -10)
        tx.join(down).add("balance", 10)
        down.fail_on.update({"rollback", "recover"})
        raise TransientError("serialization failure")

    with pytest.raises(TransientError):
        tm.run(work, tries=3)
    assert len(calls) == 1  # not retried: its branch may still hold the work
    assert tm.unsettled() == calls
    assert tm.settle(timeout=0.3) is False  # the store is still down
    down.fail_on.clear()
    assert tm.settle(timeout=10) is True
    assert tm.unsettled() == [] and outcomes(calls[0], a, b) == [ROLLED_BACK, ROLLED_BACK]


def test_unsettled_lists_a_completion_still_running_after_its_caller_left(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, _ = abc
    slow = FlakyResource(b, stall={"prepare": 5.0})
    tm = manager(managers, [a, slow], inline_completion=False)  # the caller may leave early
    tx = tm.begin(timeout=0.2)
    tx.join(a).add("balance", -10)
    tx.join(slow).add("balance", 10)
    with pytest.raises(TransactionTimedOut):
        tx.commit()
    assert not tx.settled and tm.unsettled() == [tx.gtrid]
    slow.release()
    assert tm.settle(timeout=10) is True
    assert tx.settled and tx.state == TxState.ROLLED_BACK and tm.unsettled() == []


# -- asynchronous phase two ----------------------------------------------------------------------


def test_async_phase_two_returns_at_the_decision_and_commits_behind(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    a, b, c = abc
    release = threading.Event()
    slow = FlakyResource(b, before={"commit": lambda xid: release.wait(5.0)})
    log = RecordingLog()
    tm = manager(managers, [a, slow, c], log, async_phase_two=True)
    with tm.transaction() as tx:
        transfer(tx, a, slow, c)
    assert tx.outcome is None and tx.handed_off and not tx.settled  # decided, not yet told
    assert [d.gtrid for d in log.decisions] == [tx.gtrid]
    assert tm.unsettled() == [] and coordinator.current() is None
    with tm.transaction() as nxt:  # the context is free for the next transaction at once
        nxt.join(a).add("other", 1)
    release.set()
    assert tx.wait_settled(10) and tx.outcome == Outcome.COMMITTED
    assert outcomes(tx.gtrid, a, b, c) == [COMMITTED] * 3  # atomicity
    assert log.pending() == [] and tm.metrics_dict()["async_phase_two"] == 1


def test_async_phase_two_falls_back_to_the_caller_when_no_worker_is_free(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    tm = manager(managers, list(abc), async_phase_two=True, max_workers=1)
    slots = tm._runtime.async_slots
    while slots.acquire(blocking=False):  # every slot taken: phase two is behind
        pass
    with tm.transaction() as tx:
        transfer(tx, *abc)
    assert tx.outcome == Outcome.COMMITTED and not tx.handed_off  # ran on the caller's thread


def test_settle_hears_stop_while_a_store_stays_down(
    abc: tuple[FileResource, ...], managers: list[TransactionManager]
) -> None:
    """Was broken: without a timeout, settle retried an unconfirmed rollback for ever and never
    looked at ``stop``, so a `Consumer` could not be stopped while its cursor was down."""
    a, b, _ = abc
    down = FlakyResource(b)
    tm = manager(managers, [a, down], settle_timeout=0.2)

    def work(tx: Transaction) -> None:
        tx.join(a).add("balance", -10)
        tx.join(down).add("balance", 10)
        down.fail_on.update({"rollback", "recover"})
        raise TransientError("serialization failure")

    with pytest.raises(TransientError):
        tm.run(work, tries=2)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert tm.settle(stop=stop) is False
    assert time.monotonic() - started < 5.0
