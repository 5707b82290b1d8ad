"""Regression tests: one per bug found by probing the coordinator, each named after its invariant.

Invariants named here (as in test_manager): ``atomicity`` (every branch of a gtrid ends the same
way), ``presumed_abort`` (no decision, no commit, and a decision that may be on disk is never
presumed away), ``in_flight_guard`` (recovery never rolls back a live transaction's branch), and
the caller's contract: an answer is only given when it is true, otherwise `OutcomeUnknownError`.
"""

from __future__ import annotations

import contextvars
import errno
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import coordinator
from coordinator import (
    CompletionPending,
    FileDecisionLog,
    LogWriteError,
    Outcome,
    OutcomeUnknownError,
    ProgrammingError,
    Transaction,
    TransactionManager,
    TransactionRolledBack,
    Xid,
    _reaper,
)
from coordinator.backoff import NoBackoff
from coordinator.manager import _current, _Guard
from coordinator.states import TxState
from tests.support.faulty_ops import FaultyOps
from tests.support.file_resource import COMMITTED, PREPARED, ROLLED_BACK, FileResource
from tests.support.flaky_resource import FlakyResource
from tests.support.managers import make_manager
from tests.support.threads import run_threads


@pytest.fixture(autouse=True)
def _own_context() -> Iterator[None]:
    """Each test starts with no current transaction, and one it leaves behind does not leak."""
    token = _current.set(None)
    yield
    _current.reset(token)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def outcomes(gtrid: str, *resources: FileResource) -> list[str]:
    return [r.state().outcome(gtrid) for r in resources]


def pair(root: Path) -> tuple[FileResource, FileResource]:
    """Resources a and b over ``root``; called again after a "restart" it reopens the same data."""
    return FileResource("a", root / "a"), FileResource("b", root / "b")


# -- timeouts are checked before anything starts (p1, p7) ------------------------------------------

BAD_TIMEOUTS = [float("inf"), float("-inf"), float("nan"), 0, 0.0, -1, -0.5, True, False, "5"]


@pytest.mark.parametrize("via", ["begin", "transaction", "run", "default_timeout"])
@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_bad_timeout_is_refused_before_anything_starts(
    timeout: Any, via: str, tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """Before: timeout=inf/0/-1/True/"5" was accepted; commit failed, branches left prepared."""
    a, b = pair(tmp_path)
    options = {"default_timeout": timeout} if via == "default_timeout" else {}
    tm = make_manager(managers, [a, b], **options)
    bodies: list[Transaction] = []

    def work(tx: Transaction) -> None:
        bodies.append(tx)
        tx.join(a).add("n", 1)
        tx.join(b).add("n", 1)

    with pytest.raises(ProgrammingError):
        if via == "begin":
            work(tm.begin(timeout=timeout))
        elif via == "transaction":
            with tm.transaction(timeout=timeout) as tx:
                work(tx)
        elif via == "run":
            tm.run(work, tries=3, timeout=timeout)
        else:
            work(tm.begin())
    assert bodies == []  # refused before any work, not after it
    assert tm.in_flight() == []
    assert coordinator.current() is None
    assert a.recover() == [] and b.recover() == []  # nothing left prepared
    with tm.transaction(timeout=5.0) as tx:  # and the manager (and this context) still work
        work(tx)
    assert outcomes(tx.gtrid, a, b) == [COMMITTED, COMMITTED]


# -- a decision that may be on disk is an unknown outcome (p2, p5) ---------------------------------


class StallThenFailOps(FaultyOps):
    """`FaultyOps` whose armed fsync error is raised only once ``stall_until`` (monotonic) passed:
    a disk that hangs past the caller's deadline, then reports EIO."""

    def __init__(self) -> None:
        super().__init__()
        self.stall_until = 0.0

    def fsync(self, fd: int) -> None:
        if self.fsync_errno is not None:
            time.sleep(max(0.0, self.stall_until - time.monotonic()))
        super().fsync(fd)


@pytest.mark.parametrize(
    ("timeout", "stall"),
    [(None, False), (5.0, False), (0.5, True)],
    ids=["no-timeout", "with-timeout", "fsync-stalls-past-deadline"],
)
def test_maybe_durable_decision_is_outcome_unknown_and_never_presumed_aborted(
    timeout: float | None, stall: bool, tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """Before: a decision fsync EIO (after a stall) was reported as timed out/rolled back."""
    ops = StallThenFailOps()
    a, b = pair(tmp_path)
    tm = make_manager(managers, [a, b], FileDecisionLog(tmp_path / "log", file_ops=ops))
    attempts: list[Transaction] = []

    def work(tx: Transaction) -> None:
        attempts.append(tx)
        tx.join(a).add("n", 1)
        tx.join(b).add("n", 1)
        ops.fsync_errno = errno.EIO  # only the decision log fsyncs through ops
        if stall:
            assert tx.deadline is not None
            ops.stall_until = tx.deadline + 0.2

    with pytest.raises(OutcomeUnknownError) as caught:
        tm.run(work, tries=3, timeout=timeout)
    assert len(attempts) == 1  # never retried: the attempt may have committed
    (tx,) = attempts
    assert caught.value.gtrid == tx.gtrid
    assert wait_for(lambda: tm.in_flight() == [])
    assert tx.state == TxState.UNKNOWN
    assert outcomes(tx.gtrid, a, b) == [PREPARED, PREPARED]

    report = tm.recover(force=True)
    assert report.rolled_back == [] and report.committed == []
    assert outcomes(tx.gtrid, a, b) == [PREPARED, PREPARED]  # presumed_abort: not presumed
    with pytest.raises(LogWriteError):  # no more decisions until the log is reopened
        tm.begin()

    tm.close()  # "restart": a fresh log, manager and resources over the same directories
    log = FileDecisionLog(tmp_path / "log")
    a2, b2 = pair(tmp_path)
    assert [d.gtrid for d in log.pending()] == [tx.gtrid]  # the COMMIT record is in the segment
    tm2 = make_manager(managers, [a2, b2], log, recover_on_start=False)
    report = tm2.recover()
    assert report.committed == [tx.gtrid] and report.rolled_back == []
    assert outcomes(tx.gtrid, a2, b2) == [COMMITTED, COMMITTED]  # atomicity
    assert a2.snapshot() == b2.snapshot() == {"n": 1}
    assert log.pending() == []


# -- END is best effort once every branch committed (p3) -------------------------------------------


class CallsBackAfterCommit(FileResource):
    """Runs ``after_commit`` (once) right after a two-phase commit of one of its branches."""

    after_commit: Callable[[], None] | None = None

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        reported = super().commit(xid, one_phase)
        hook, self.after_commit = self.after_commit, None
        if hook is not None and not one_phase:
            hook()
        return reported


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["no-timeout", "with-timeout"])
def test_end_write_failure_does_not_unsettle_a_committed_transaction(
    timeout: float | None,
    tmp_path: Path,
    managers: list[TransactionManager],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: END failing on a journal another tx poisoned left a committed tx stuck in flight."""
    ops = FaultyOps()
    a = FileResource("a", tmp_path / "a")
    b = CallsBackAfterCommit("b", tmp_path / "b")  # sorts last: its commit is the last one
    c, d = FileResource("c", tmp_path / "c"), FileResource("d", tmp_path / "d")
    tm = make_manager(managers, [a, b, c, d], FileDecisionLog(tmp_path / "log", file_ops=ops))
    others: list[Transaction] = []
    errors: list[BaseException] = []

    def other_transaction() -> None:  # its own thread, so its own current transaction
        tx2 = tm.begin(timeout=None)
        others.append(tx2)
        tx2.join(c).add("n", 1)
        tx2.join(d).add("n", 1)
        ops.fsync_errno = errno.EIO
        try:
            tx2.commit()
        except OutcomeUnknownError as exc:
            errors.append(exc)

    b.after_commit = lambda: run_threads([threading.Thread(target=other_transaction)])
    tx = tm.begin(timeout=timeout)
    tx.join(a).add("n", 1)
    tx.join(b).add("n", 1)
    with caplog.at_level(logging.WARNING, logger="twopc.completion"):
        assert tx.commit() == Outcome.COMMITTED
    (tx2,) = others
    assert len(errors) == 1 and tx2.state == TxState.UNKNOWN  # the poisoning really happened
    assert tx.state == TxState.COMMITTED and tx.outcome == Outcome.COMMITTED
    assert tm.in_flight() == []
    assert any(f"END of {tx.gtrid} not written" in r.getMessage() for r in caplog.records)
    assert outcomes(tx.gtrid, a, b) == [COMMITTED, COMMITTED]

    tm.close()  # after a restart recovery re-drives both decisions, applying nothing twice
    log = FileDecisionLog(tmp_path / "log")
    reopened = [FileResource(n, tmp_path / n) for n in "abcd"]
    tm2 = make_manager(managers, reopened, log, recover_on_start=False)
    assert sorted(tm2.recover().committed) == sorted([tx.gtrid, tx2.gtrid])
    assert [r.snapshot() for r in reopened] == [{"n": 1}] * 4
    assert log.pending() == []


# -- a one-phase commit that outlives the grace period (p4) ----------------------------------------


class SlowFailingOnePhase(FileResource):
    """A one-phase commit that hangs until `release`, then fails: the server went away."""

    def __init__(self, name: str, directory: Path) -> None:
        super().__init__(name, directory)
        self.release = threading.Event()

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        if one_phase:
            self.release.wait(5.0)
            raise ConnectionResetError("server went away during the one-phase commit")
        return super().commit(xid, one_phase)


def test_late_one_phase_commit_is_outcome_unknown_never_pending(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """Before: a one-phase commit outliving deadline + grace was reported COMMIT_PENDING."""
    r = SlowFailingOnePhase("a", tmp_path / "a")
    tm = make_manager(managers, [r], phase_two_grace=0.2, inline_completion=False)
    tx = tm.begin(timeout=0.3)
    tx.join(r).add("n", 1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(OutcomeUnknownError) as caught:
                tx.commit()
    finally:
        r.release.set()
    assert caught.value.gtrid == tx.gtrid
    assert not [w for w in seen if issubclass(w.category, CompletionPending)]
    assert wait_for(lambda: tx.state.is_final)
    assert tx.state == TxState.ROLLED_BACK  # what really happened: "committed" would have lied
    assert r.snapshot() == {}
    assert tm.in_flight() == []


# -- the in-flight guard and the gtrid counter (p6) ------------------------------------------------


def test_in_flight_guard_gtrid_is_issued_and_registered_under_one_lock(
    tmp_path: Path, managers: list[TransactionManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a recovery snapshot between gtrid issue and registration missed the transaction."""
    a, b = pair(tmp_path)
    tm = make_manager(managers, [a, b])
    real_next = tm._gtrids.next
    lock_held: list[bool] = []
    guards: list[_Guard] = []
    snapshots: list[threading.Thread] = []

    def checked_next() -> tuple[str, int]:
        got = tm._lock.acquire(blocking=False)
        if got:
            tm._lock.release()
        lock_held.append(not got)
        issued = real_next()
        # A recovery pass starting now, the gtrid issued, must wait until it is registered.
        snapshot = threading.Thread(target=lambda: guards.append(_Guard(tm)))
        snapshots.append(snapshot)
        snapshot.start()
        snapshot.join(timeout=0.05)
        return issued

    monkeypatch.setattr(tm._gtrids, "next", checked_next)
    with tm.transaction(timeout=5.0) as tx:
        tx.join(a).add("n", 1)
        tx.join(b).add("n", 1)
    for snapshot in snapshots:
        snapshot.join(timeout=5.0)
    assert lock_held == [True]
    (guard,) = guards
    assert guard.maybe_in_flight(tx.gtrid)  # in its snapshot, or newer than its high water


class ListsSlowly(FileResource):
    """Lists its prepared branches late, so transactions can finish during a recovery pass."""

    def recover(self) -> list[Xid]:
        time.sleep(0.02)
        return super().recover()


class FirstCommitFails(FileResource):
    """Unreachable for the first (phase-two) commit of each branch; recovery's retry succeeds."""

    def __init__(self, name: str, directory: Path) -> None:
        super().__init__(name, directory)
        self.refused: set[Xid] = set()

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        with self._lock:
            first = xid not in self.refused
            self.refused.add(xid)
        if first:
            raise ConnectionRefusedError(f"{self.name} unreachable for a moment")
        return super().commit(xid, one_phase)


@pytest.mark.filterwarnings("ignore::coordinator.CompletionPending")
def test_atomicity_while_recovery_races_begin_and_phase_two(
    tmp_path: Path, managers: list[TransactionManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: recovery racing begin rolled back b of a transaction already committed on a."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # no crash here: only the interleaving counts
    a = ListsSlowly("a", tmp_path / "a")  # sorts first: listed before b, and slowly
    b = FirstCommitFails("b", tmp_path / "b")
    tm = make_manager(managers, [a, b], backoff=NoBackoff())
    real_next = tm._gtrids.next
    begun = threading.Event()

    def next_then_linger() -> tuple[str, int]:
        issued = real_next()
        begun.set()  # a recovery pass starts now, with the gtrid issued...
        time.sleep(0.002)  # ...and its transaction not registered yet, unless under one lock
        return issued

    monkeypatch.setattr(tm._gtrids, "next", next_then_linger)
    stop = threading.Event()
    rolled_back: list[str] = []

    def recovery_loop() -> None:
        while not stop.is_set():
            if begun.wait(0.05):
                begun.clear()
                rolled_back.extend(tm.recover(force=True).rolled_back)

    gtrids: list[str] = []

    def worker() -> None:
        for _ in range(100):
            with tm.transaction(timeout=None) as tx:
                tx.join(a).add("n", 1)
                tx.join(b).add("n", 1)
            gtrids.append(tx.gtrid)

    recoverer = threading.Thread(target=recovery_loop)
    recoverer.start()
    try:
        run_threads([threading.Thread(target=worker) for _ in range(2)])
    finally:
        stop.set()
        recoverer.join()
    assert wait_for(lambda: tm.recover(force=True).clean and not tm.log.pending())
    assert len(gtrids) == 200
    broken = {g: outcomes(g, a, b) for g in gtrids if len(set(outcomes(g, a, b))) != 1}
    assert broken == {}  # atomicity
    assert rolled_back == []  # every transaction had a decision: nothing to presume
    assert all(outcomes(g, a, b) == [COMMITTED, COMMITTED] for g in gtrids)
    assert a.snapshot() == b.snapshot() == {"n": 200}
    assert tm.heuristics() == []


# -- the reaper and commit at the deadline ---------------------------------------------------------


class SlowSortKey(FileResource):
    """A resource whose ``sort_key`` takes a moment (a lookup): completion calls it often."""

    @property
    def sort_key(self) -> str:
        time.sleep(0.0005)
        return self.name


@pytest.mark.parametrize("branches", [1, 2], ids=["one-phase", "two-phase"])
def test_reaper_marking_during_commit_never_raises_illegal_state(
    branches: int,
    tmp_path: Path,
    managers: list[TransactionManager],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the reaper marking rollback-only mid-commit made commit raise IllegalStateError."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # no crash here: only the interleaving counts
    resources = [SlowSortKey(n, tmp_path / n) for n in "ab"[:branches]]
    tm = make_manager(managers, resources, reaper_interval=0.0005, abandon_after=60.0)
    committed: list[str] = []
    refused: list[str] = []
    unexpected: list[BaseException] = []
    offsets = itertools.cycle([0.0015, 0.001, 0.0005, 0.0002, 0.0, -0.0005])

    for offset in itertools.islice(offsets, 120):
        gtrid = ""
        try:
            with tm.transaction(timeout=0.01) as tx:
                gtrid = tx.gtrid
                for r in resources:
                    tx.join(r).add("n", 1)
                while (tx.remaining() or 0.0) > offset:  # commit right at the deadline
                    pass
        except TransactionRolledBack:  # TransactionTimedOut included
            refused.append(gtrid)
        except Exception as exc:
            unexpected.append(exc)
        else:
            assert tx.outcome == Outcome.COMMITTED
            committed.append(gtrid)
    assert unexpected == []
    assert wait_for(lambda: tm.in_flight() == [])
    tm.recover(force=True)
    assert all(r.recover() == [] for r in resources)  # nothing left prepared
    for gtrid in committed:
        assert outcomes(gtrid, *resources) == [COMMITTED] * branches
    for gtrid in refused:
        assert COMMITTED not in outcomes(gtrid, *resources)
    assert all(r.snapshot().get("n", 0) == len(committed) for r in resources)


def abandon(tm: TransactionManager, tx: Transaction) -> None:
    """What the reaper does to a transaction whose owner stays away past ``abandon_after``."""
    assert wait_for(tx.timed_out)
    _reaper.reap(tm.in_flight, tm.metrics, abandon_after=0.0)  # marks it rollback-only
    _reaper.reap(tm.in_flight, tm.metrics, abandon_after=0.0)  # and, abandoned, rolls it back


@pytest.mark.parametrize("branches", [1, 2], ids=["one-phase", "two-phase"])
def test_owner_committing_after_the_reaper_rolled_back_is_told_rolled_back(
    branches: int, tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """Was broken: commit after the reaper rolled back an abandoned tx: IllegalStateError."""
    resources = list(pair(tmp_path))[:branches]
    tm = make_manager(managers, resources)  # the reaper is run by hand
    tx = tm.begin(timeout=0.01)
    for r in resources:
        tx.join(r).add("n", 1)
    abandon(tm, tx)
    assert tx.state == TxState.ROLLED_BACK
    with pytest.raises(TransactionRolledBack):
        tx.commit()


def test_owner_committing_while_the_reaper_rolls_back_is_told_rolled_back(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """Was broken: commit while the reaper rolls back an abandoned tx raises IllegalStateError."""
    a, inner_b = pair(tmp_path)
    rolling, go_on = threading.Event(), threading.Event()

    def hold(xid: Xid) -> None:
        rolling.set()
        go_on.wait(5.0)

    b = FlakyResource(inner_b, before={"rollback": hold})
    tm = make_manager(managers, [a, b])
    tx = tm.begin(timeout=0.01)
    tx.join(a).add("n", 1)
    tx.join(b).add("n", 1)
    assert wait_for(tx.timed_out)
    _reaper.reap(tm.in_flight, tm.metrics, abandon_after=0.0)  # marks it rollback-only
    reaper = threading.Thread(target=_reaper.reap, args=(tm.in_flight, tm.metrics, 0.0))
    reaper.start()
    try:
        assert rolling.wait(5.0) and tx.state == TxState.ROLLING_BACK
        with pytest.raises(TransactionRolledBack):
            tx.commit()
    finally:
        go_on.set()
        reaper.join(5.0)
    assert outcomes(tx.gtrid, a, inner_b) == [ROLLED_BACK, ROLLED_BACK]


def test_transaction_block_the_reaper_rolled_back_does_not_exit_as_committed(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """Was broken: a with-block whose tx the reaper rolled back exits as if it had committed."""
    a, b = pair(tmp_path)
    tm = make_manager(managers, [a, b])
    raised: BaseException | None = None
    try:
        with tm.transaction(timeout=0.01) as tx:
            tx.join(a).add("n", 1)
            tx.join(b).add("n", 1)
            abandon(tm, tx)
    except TransactionRolledBack as exc:
        raised = exc
    assert a.snapshot() == b.snapshot() == {}  # it did roll back...
    assert raised is not None, "the block exited normally: the caller thinks it committed"


# -- completion on the pool thread keeps the caller's context --------------------------------------

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def test_hooks_on_the_completion_pool_see_the_callers_context(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """Before: hooks on the completion pool saw neither current() nor the caller's contextvars."""
    a, b = pair(tmp_path)
    tm = make_manager(managers, [a, b], inline_completion=False)  # completion on the pool
    seen: dict[str, object] = {}

    def hook() -> None:
        seen.update(
            request=REQUEST_ID.get(), current=coordinator.current(), thread=threading.get_ident()
        )

    token = REQUEST_ID.set("req-42")
    try:
        with tm.transaction() as tx:
            assert tx.timeout is not None
            tx.join(a).add("n", 1)
            tx.join(b).add("n", 1)
            tx.before_completion(hook)
    finally:
        REQUEST_ID.reset(token)
    assert seen["thread"] != threading.get_ident()  # it did run on another thread
    assert seen["request"] == "req-42"
    assert seen["current"] is tx
    assert outcomes(tx.gtrid, a, b) == [COMMITTED, COMMITTED]
