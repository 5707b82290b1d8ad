"""Drives a transaction to its end: the I/O around the pure rules in `protocol`.

The ordering rules this module enforces (each marked by a crash point):
- Nothing is logged before every branch voted (a prepare in flight, `early_prepare`, is read
  before the tally like any other vote); a no vote rolls back and logs nothing.
- The COMMIT record is forced before any branch is told to commit: that write is the commit point.
- END is written only after every branch has committed, and it need not be forced; with a branch
  whose commit record is lazy (`lazy_commit`), only once that record is durable.
- If the log cannot say whether the COMMIT record is on disk, nothing is rolled back: the outcome
  is unknown until recovery reads the log again.

Why one module: the completion protocol is kept in one module so that a reviewer reads every path
to the decision (one phase, two phase, last resource, batched and lazy phase two, heuristics, END)
in one place, in the order its crash points mark.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, NoReturn, cast

from . import _last_resource, protocol, tracing
from ._verbs import BATCH, LAZY, SEND, verbs_of_branches
from .batch_commit import batch_committer, batches
from .carried import carries, rides, rides_branch
from .crashpoints import crash_point
from .decision_log import Decision, DecisionLog, HeuristicRecord
from .early_prepare import send_prepare, senders
from .errors import (
    CompletionPending,
    FencedError,
    HeuristicError,
    HeuristicHazard,
    HeuristicMixed,
    HeuristicRollback,
    LogError,
    LogWriteError,
    OutcomeUnknownError,
    TransactionRolledBack,
    TransactionTimedOut,
)
from .lazy_commit import EndLatch, commits_lazily
from .protocol import BranchResult, Plan, Verdict
from .resource import Outcome, Vote
from .states import TxState

if TYPE_CHECKING:
    from .carried import CarriedBranches, CarryingLastResource
    from .transaction import Branch, Transaction

log = logging.getLogger("twopc.completion")

_HEURISTIC_ERRORS: dict[Outcome, type[HeuristicError]] = {
    Outcome.HEURISTIC_MIXED: HeuristicMixed,
    Outcome.HEURISTIC_ROLLBACK: HeuristicRollback,
    Outcome.HEURISTIC_HAZARD: HeuristicHazard,
}


def commit(tx: Transaction) -> Outcome:
    """Complete ``tx``; bounded by its timeout when it has one.

    By default (``inline_completion``) it runs on the caller's thread, as JTA managers do: no
    thread hop, which cost a pooled job and two wake-ups per transaction (about 50 us of CPU and
    more than a Redis round trip on a busy two-core machine). The deadline is enforced on the
    caller's thread: no branch is asked to prepare once it has passed, and the decision log
    refuses a decision past it, so the commit point is fenced; but a resource that hangs holds
    the caller until its own socket or statement timeout ends the call.

    With ``inline_completion=False`` and a timeout, the completion runs as one job on the
    manager's pool and the caller waits at most until the deadline (plus ``phase_two_grace``
    once the decision is made). A caller that gives up before the commit point fences the job:
    it will abort instead of writing a decision.
    """
    started = time.perf_counter()
    try:
        left = tx.remaining()
        if left is None or tx.runtime.inline_completion:
            outcome = _settling(tx)
        else:
            # copy_context: hooks and resources see the caller's context variables there too
            job = tx.runtime.executor().submit(contextvars.copy_context().run, _settling, tx)
            outcome = _wait(tx, job, left)
    finally:
        took = ("commit", time.perf_counter() - started)
        if tx.handed_off:  # the worker records the other phases when it is done
            tx.runtime.metrics.observe_many([took])
        else:
            tx.timings.append(took)
            tx.runtime.metrics.observe_many(tx.timings)
    if outcome == Outcome.COMMIT_PENDING:
        warnings.warn(
            f"transaction {tx.gtrid} committed; some branches are not told yet and recovery "
            "will finish them",
            CompletionPending,
            stacklevel=3,
        )
    return outcome


def _wait(tx: Transaction, job: Future[Outcome], left: float) -> Outcome:
    try:
        return job.result(timeout=max(left, 0.0))
    except FutureTimeout:
        pass
    # The commit point is written under tx._lock, so here it has either happened or never will.
    with tx._lock:
        state = tx.state
        tx.caller_gave_up = state in (TxState.ACTIVE, TxState.MARKED_ROLLBACK, TxState.PREPARING)
    if state == TxState.UNKNOWN:
        raise OutcomeUnknownError(
            f"the decision for {tx.gtrid} may or may not be on disk", gtrid=tx.gtrid
        )
    if tx.caller_gave_up:
        tx.rollback_reason = "timeout"
        raise TransactionTimedOut(
            f"transaction {tx.gtrid} timed out before its commit point; it rolls back",
            gtrid=tx.gtrid,
            reason="timeout",
        )
    try:  # committing (or rolling back for its own reason): give it the grace to finish
        return job.result(timeout=tx.runtime.phase_two_grace)
    except FutureTimeout:
        return _late(tx, state)


def _late(tx: Transaction, state: TxState) -> Outcome:
    """What the caller may be told when phase two outlives the grace period."""
    if state in (TxState.ROLLING_BACK, TxState.ROLLED_BACK):
        raise tx.rolled_back_error("rollback still running after the timeout")
    if tx.one_phase:  # no decision record: only the resource's answer says what happened
        raise OutcomeUnknownError(
            f"one-phase commit of {tx.gtrid} did not answer in time", gtrid=tx.gtrid
        )
    return Outcome.COMMIT_PENDING


def _settling(tx: Transaction) -> Outcome:
    """`_complete`, marking the transaction settled however it ends: a retry that waits for the
    attempt to settle must never wait on a job that died of an unexpected error."""
    try:
        return _complete(tx)
    finally:
        # the reaper's rollback, or an asynchronous phase two, settles it when it ends
        if not tx.reaped and not tx.handed_off:
            tx.mark_settled()


def _complete(tx: Transaction) -> Outcome:
    if tx.reaped:  # the reaper rolled it back (or is doing so) while its owner was away
        raise tx.rolled_back_error("commit refused: abandoned past its timeout, rolled back")
    if tx.state == TxState.ACTIVE:
        _before_completion(tx)
    with tx._lock:  # the reaper may mark the transaction until it leaves ACTIVE, not after
        if tx.state == TxState.ACTIVE and tx.timed_out():
            tx.set_rollback_only("timeout")
        chosen = protocol.plan(len(tx.branches), tx.state == TxState.MARKED_ROLLBACK)
        if chosen == Plan.ONE_PHASE:
            tx.move_to(TxState.COMMITTING)
            tx.one_phase = True
        elif chosen == Plan.TWO_PHASE:
            tx.move_to(TxState.PREPARING)
    if chosen == Plan.ROLLBACK:
        rollback(tx)
        raise tx.rolled_back_error("commit refused")
    if chosen == Plan.NOTHING:
        return _finish(tx, TxState.COMMITTED, Outcome.COMMITTED)
    if chosen == Plan.ONE_PHASE:
        return _one_phase(tx, tx.ordered_branches()[0])
    if tx.last_branch is not None:
        return _two_phase_last(tx, tx.last_branch)
    return _two_phase(tx)


def rollback(tx: Transaction) -> None:
    """Roll back every branch; what cannot be reached is left to recovery's presumed abort."""
    with tx._lock:
        if tx.state in (TxState.ROLLING_BACK, TxState.ROLLED_BACK):
            return
        tx.move_to(TxState.ROLLING_BACK)
    tx.rollback_reason = tx.rollback_reason or "application"
    try:
        _rollback_branches(tx, [b.resource.name for b in tx.ordered_branches()])
        _finish(tx, TxState.ROLLED_BACK, Outcome.ROLLED_BACK)
    finally:
        tx.mark_settled()


def _before_completion(tx: Transaction) -> None:
    for sync in list(tx.synchronizations):
        try:
            sync.before_completion()
        except Exception as exc:
            tx.set_rollback_only("before_completion failed")
            rollback(tx)
            raise TransactionRolledBack(
                f"before-completion hook failed: {exc!r}", gtrid=tx.gtrid, reason="hook"
            ) from exc


# -- one phase ---------------------------------------------------------------------------------


def _one_phase(tx: Transaction, branch: Branch) -> Outcome:
    started = time.time_ns() if tx.trace is not None else 0
    try:
        branch.resource.commit(branch.xid, one_phase=True)
    except OutcomeUnknownError as exc:
        if tx.trace is not None:
            _traced(tx, "one_phase_commit", started, branch, exc)
        _finish(tx, TxState.UNKNOWN, None)
        raise
    except Exception as exc:
        if tx.trace is not None:
            _traced(tx, "one_phase_commit", started, branch, exc)
        tx.rollback_reason = "one-phase commit failed"
        _rollback_branches(tx, [branch.resource.name])  # release what the server may still hold
        _finish(tx, TxState.ROLLED_BACK, Outcome.ROLLED_BACK)
        raise TransactionRolledBack(
            f"one-phase commit of {branch.xid} failed: {exc!r}", gtrid=tx.gtrid, reason="error"
        ) from exc
    if tx.trace is not None:
        _traced(tx, "one_phase_commit", started, branch)
    crash_point("tm.one_phase.before_ack")
    tx.runtime.metrics.incr("one_phase")
    return _finish(tx, TxState.COMMITTED, Outcome.COMMITTED)


# -- two phase ---------------------------------------------------------------------------------


def _two_phase(tx: Transaction) -> Outcome:
    started = time.perf_counter()
    branches = tx.ordered_branches()
    order = [b.resource.name for b in branches]
    votes, error = _phase_one(tx, branches)
    took = time.perf_counter() - started
    tx.timings.append(("prepare", took))
    if tx.trace is not None:
        tx.trace.step("prepare", time.time_ns() - int(took * 1e9))
    result = protocol.tally(order, votes)
    if result.verdict == Verdict.ABORT:
        return _abort(tx, result.rollback, error)
    if result.verdict == Verdict.READ_ONLY:
        tx.runtime.metrics.incr("read_only")
        return _finish(tx, TxState.COMMITTED, Outcome.READ_ONLY)
    read_only = [n for n in order if votes.get(n) == Vote.READ_ONLY]
    if read_only:
        crash_point("tm.read_only.after_vote")
    _force_decision(tx, result)
    return _commit_decided(tx, result.commit)


def _two_phase_last(tx: Transaction, last: Branch) -> Outcome:
    """Logging last resource: prepare every other branch, then commit ``last`` in one phase
    with the decision row inside it (the commit point), then commit the others.

    A branch that can ride the last resource's commit (`carried`) stages its state instead of
    preparing it: the decision row carries the payload, and after the commit the branch applies
    it with a lazy record, which the end latch waits for before the row may go."""
    started = time.perf_counter()
    others = [b for b in tx.ordered_branches() if b is not last]
    riders = (
        [b for b in others if rides(b.resource) and rides_branch(b.resource, b.xid)]
        if carries(last.resource)
        else []
    )
    carried: list[tuple[str, bytes]] = []
    if riders:
        riding = {id(b) for b in riders}
        others = [b for b in others if id(b) not in riding]
        failure = _stage(tx, riders, carried)
        if failure is not None:
            names = [b.resource.name for b in (*riders, *others)]
            return _abort(tx, (*names, last.resource.name), failure)
    votes, error = _phase_one(tx, others)
    took = time.perf_counter() - started
    tx.timings.append(("prepare", took))
    if tx.trace is not None:
        tx.trace.step("prepare", time.time_ns() - int(took * 1e9))
    result = protocol.tally([b.resource.name for b in others], votes)
    staged = tuple(name for name, _ in carried)
    if result.verdict == Verdict.ABORT:
        return _abort(tx, (*staged, *result.rollback, last.resource.name), error)
    if result.verdict == Verdict.READ_ONLY and not carried:
        # alone now: its own commit decides, no row needed
        refused = _last_resource.commit_alone(tx)
        if refused is not None:
            _abort(tx, (last.resource.name,), refused)
        return _one_phase(tx, last)
    if len(result.commit) < len(others):
        crash_point("tm.read_only.after_vote")
    failure = _last_resource.commit_point(tx, last, result.commit, tuple(carried))
    if isinstance(failure, OutcomeUnknownError):
        _finish(tx, TxState.UNKNOWN, None)  # tx.llr_in_doubt: recovery reads the row
        raise OutcomeUnknownError(
            f"the last resource's commit of {tx.gtrid} may or may not have happened; the other "
            "branches stay prepared until recovery reads its decision table",
            gtrid=tx.gtrid,
        ) from failure
    if failure is not None:
        _abort(tx, (*staged, *result.commit, last.resource.name), failure)
    crash_point("tm.llr.after_commit")
    if tx.last_carries:  # the log's own record: END into the log, as after a forced decision
        return _commit_decided(tx, result.commit)
    resource = _last_resource.as_last(last.resource)
    if not carried:
        return _commit_decided(tx, result.commit, lambda: resource.end_decision(tx.gtrid))
    latch = EndLatch()
    _apply_carried(tx, carried, latch)
    holder = cast("CarryingLastResource", resource)
    forget = functools.partial(_forget_carried, tx, staged)
    end = functools.partial(holder.end_decision, tx.gtrid, then=forget)
    return _commit_decided(tx, result.commit, end, latch)


def _stage(
    tx: Transaction, riders: list[Branch], carried: list[tuple[str, bytes]]
) -> BaseException | None:
    """Stage every rider (`carried`): its payload joins ``carried``; a failure is a no vote."""
    for branch in riders:
        started = time.time_ns() if tx.trace is not None else 0
        try:
            payload = cast("CarriedBranches", branch.resource).stage(branch.xid)
        except Exception as exc:
            log.info("branch %s voted no: %r", branch.xid, exc)
            if tx.trace is not None:
                _traced(tx, "prepare", started, branch, exc)
            return exc
        if tx.trace is not None:
            _traced(tx, "prepare", started, branch)
        if payload is not None:
            carried.append((branch.resource.name, payload))
    crash_point("tm.carried.after_stage")
    return None


def _apply_carried(tx: Transaction, carried: list[tuple[str, bytes]], latch: EndLatch) -> None:
    """After the commit point: each rider applies its payload lazily; the latch holds the row
    until every one is durable. A rider that fails is left to recovery, which restores it from
    the row (its hold is never released, so the row stays)."""
    for name, payload in carried:
        branch = tx.branches[name]
        started = time.time_ns() if tx.trace is not None else 0
        try:
            rider = cast("CarriedBranches", branch.resource)
            rider.commit_carried(branch.xid, payload, latch.hold())
        except Exception as exc:
            if tx.trace is not None:
                _traced(tx, "commit", started, branch, exc)
            _unconfirmed(tx, branch, exc)
            tx.unconfirmed.add(name)
            continue
        if tx.trace is not None:
            _traced(tx, "commit", started, branch)
    tx.runtime.metrics.incr("carried_branches", len(carried))


def _forget_carried(tx: Transaction, names: tuple[str, ...]) -> None:
    """The decision row is gone: the riders may stop remembering their carried commits (a
    lost forget is repeated by recovery, which finds the gid remembered and no row)."""
    crash_point("tm.carried.before_forget")
    tx.runtime.forget_gate.forget(functools.partial(_forget_now, tx, names))


def _forget_now(tx: Transaction, names: tuple[str, ...]) -> None:
    for name in names:
        branch = tx.branches[name]
        try:
            cast("CarriedBranches", branch.resource).forget_carried([branch.xid.to_gid()])
        except Exception as exc:  # housekeeping: the next recovery pass forgets it
            log.warning("forget of carried commit %s failed: %r", branch.xid, exc)


def _commit_decided(
    tx: Transaction,
    names: tuple[str, ...],
    end: Callable[[], None] | None = None,
    latch: EndLatch | None = None,
) -> Outcome:
    """Phase two of a decided transaction: here, or with ``async_phase_two`` on a background
    worker while the caller goes on (Narayana's asyncCommit).

    Handing off is safe because the decision is durable before it: a crash before the worker
    is done leaves a COMMIT record (or a last resource's row) that recovery re-drives, exactly
    as after a crash in phase two on the caller's thread. The transaction stays in flight (and
    unsettled) until the worker ends, so recovery leaves its branches alone meanwhile. When no
    worker slot is free (phase two falls behind the commits) it runs here instead: back-pressure,
    never an unbounded queue."""
    runtime = tx.runtime
    if runtime.async_phase_two and runtime.async_slots.acquire(blocking=False):
        tx.handed_off = True
        try:
            runtime.phase_two_executor().submit(
                contextvars.copy_context().run, _phase_two_behind, tx, names, end, latch
            )
        except RuntimeError:  # the manager is closing: recovery re-drives it after restart
            runtime.async_slots.release()
            tx.handed_off = False
            return _phase_two(tx, names, end, latch)
        crash_point("tm.async_phase_two.handed_off")
        runtime.metrics.incr("async_phase_two")
        return Outcome.COMMITTED
    return _phase_two(tx, names, end, latch)


def _phase_two_behind(
    tx: Transaction,
    names: tuple[str, ...],
    end: Callable[[], None] | None,
    latch: EndLatch | None,
) -> None:
    """The background half of `_commit_decided`: nobody waits for it, so what it cannot tell a
    caller it logs (a heuristic outcome is also forced into the decision log by `judge_commit`,
    where `twopc heuristics` shows it)."""
    try:
        _phase_two(tx, names, end, latch)
    except HeuristicError as exc:
        log.error("asynchronous phase two of %s: %s", tx.gtrid, exc)
    except Exception:
        log.exception("asynchronous phase two of %s failed; recovery will finish it", tx.gtrid)
    finally:
        tx.runtime.metrics.observe_many(tx.timings)
        tx.runtime.async_slots.release()
        tx.mark_settled()


def _phase_one(
    tx: Transaction, branches: list[Branch]
) -> tuple[dict[str, Vote | None], BaseException | None]:
    """Collect votes; stop at the first no (sequential) or wait for all (parallel). With two or
    more branches, prepares that can be in flight (`early_prepare`) are sent first and read last,
    always. Either way every vote asked for is read before this returns."""
    crash_point("tm.before_prepare")
    votes: dict[str, Vote | None] = {}
    tx.verbs = verbs_of_branches(branches)
    if tx.runtime.parallel and len(branches) > 1:
        return _parallel_prepare(tx, branches)
    if tx.verbs & SEND and len(branches) > 1:
        return _prepare_in_flight(tx, branches)
    for index, branch in enumerate(branches, 1):
        if tx.caller_gave_up or (index > 1 and tx.timed_out()):
            # no decision can follow (the log refuses one past the deadline): stop making
            # branches promise
            tx.rollback_reason = "timeout"
            return votes, TransactionTimedOut(f"{tx.gtrid} timed out", gtrid=tx.gtrid)
        vote, error = _prepare_one(tx, branch)
        votes[branch.resource.name] = vote
        crash_point(f"tm.after_prepare.{index}")
        if vote in (None, Vote.ROLLBACK):
            return votes, error
    return votes, None


def _prepare_in_flight(
    tx: Transaction, branches: list[Branch]
) -> tuple[dict[str, Vote | None], BaseException | None]:
    """Sequential phase one with prepares in flight (`early_prepare`): send the prepares that
    can be sent, prepare the other branches in order (stopping at a no or the deadline), then
    read every vote in flight, whatever happened meanwhile: none is left unread."""
    votes: dict[str, Vote | None] = {}
    error: BaseException | None = None
    pending: list[tuple[Branch, Callable[[], Vote]]] = []
    sending = senders(branches)
    sent = {b.resource.name for b in sending}
    for branch in sending:
        try:
            pending.append((branch, send_prepare(branch)))
        except Exception as exc:
            log.info("branch %s voted no: %r", branch.xid, exc)
            votes[branch.resource.name], error = None, exc
            crash_point(f"tm.after_prepare.{len(votes)}")
            break
    for branch in branches if error is None else ():
        if branch.resource.name in sent:
            continue
        if tx.caller_gave_up or tx.timed_out():  # a prepare is already out: check every time
            tx.rollback_reason = "timeout"
            error = TransactionTimedOut(f"{tx.gtrid} timed out", gtrid=tx.gtrid)
            break
        vote, error = _prepare_one(tx, branch)
        votes[branch.resource.name] = vote
        crash_point(f"tm.after_prepare.{len(votes)}")
        if vote in (None, Vote.ROLLBACK):
            break
    return votes, _read_votes(tx, pending, votes, error)


def _read_votes(
    tx: Transaction,
    pending: Sequence[tuple[Branch, Callable[[], Vote]]],
    votes: dict[str, Vote | None],
    error: BaseException | None,
) -> BaseException | None:
    """Read every vote ``pending`` (each ``finish`` once, in order) into ``votes``; returns
    ``error``, or the first no among them."""
    for branch, finish in pending:
        vote, refused = _prepare_one(tx, branch, finish)
        votes[branch.resource.name] = vote
        error = error or refused
        crash_point(f"tm.after_prepare.{len(votes)}")
    return error


def _prepare_one(
    tx: Transaction, branch: Branch, finish: Callable[[], Vote] | None = None
) -> tuple[Vote | None, BaseException | None]:
    """``branch``'s vote: its ``prepare``, or ``finish`` of a prepare in flight."""
    started = time.time_ns() if tx.trace is not None else 0
    try:
        vote = branch.resource.prepare(branch.xid) if finish is None else finish()
    except Exception as exc:
        log.info("branch %s voted no: %r", branch.xid, exc)
        if tx.trace is not None:
            _traced(tx, "prepare", started, branch, exc)
        return None, exc
    if tx.trace is not None:
        _traced(tx, "prepare", started, branch)
    answer: object = vote  # a resource outside the type checker may return anything
    if not isinstance(answer, Vote):
        return None, TypeError(f"{branch.resource.name}.prepare returned {answer!r}, not a Vote")
    return answer, None


def _parallel_prepare(
    tx: Transaction, branches: list[Branch]
) -> tuple[dict[str, Vote | None], BaseException | None]:
    pool = tx.runtime.branch_executor()
    pending = [(b, pool.submit(b.resource.prepare, b.xid).result) for b in branches]
    votes: dict[str, Vote | None] = {}
    return votes, _read_votes(tx, pending, votes, None)


def _abort(tx: Transaction, names: tuple[str, ...], error: BaseException | None) -> NoReturn:
    if tx.state != TxState.ROLLING_BACK:
        tx.move_to(TxState.ROLLING_BACK)
    tx.rollback_reason = tx.rollback_reason or "vote"
    _rollback_branches(tx, list(names))
    _finish(tx, TxState.ROLLED_BACK, Outcome.ROLLED_BACK)
    cls = TransactionTimedOut if tx.rollback_reason == "timeout" else TransactionRolledBack
    raise cls(
        f"transaction {tx.gtrid} rolled back: a branch voted no ({error!r})",
        gtrid=tx.gtrid,
        reason=tx.rollback_reason,
    ) from error


def _force_decision(tx: Transaction, result: protocol.Tally) -> None:
    """Write the commit point. On failure decide, from what the log says, who may roll back.

    Everything, the write and the state it leads to, happens under ``tx._lock``: a caller
    timing out meanwhile then sees either no decision (and fences it) or the final state.
    """
    crash_point("tm.before_decision_write")
    decision = Decision(tx.gtrid, result.commit, tx.wall_deadline, time.time())
    started = time.perf_counter()
    with tx._lock:
        failure = _write_decision(tx, decision)
    if isinstance(failure, LogWriteError) and failure.durable is None:
        tx.runtime.log_failed(failure)
        _finish(tx, TxState.UNKNOWN, None)
        raise OutcomeUnknownError(
            f"the decision for {tx.gtrid} may or may not be on disk; its branches stay prepared "
            "until recovery reads the log after a restart",
            gtrid=tx.gtrid,
        ) from failure
    if failure is not None:
        _abort(tx, result.commit, failure)
    took = time.perf_counter() - started
    tx.timings.append(("decision", took))
    if tx.trace is not None:
        tx.trace.step("decision", time.time_ns() - int(took * 1e9))
    crash_point("tm.after_decision_fsync")


def _write_decision(tx: Transaction, decision: Decision) -> BaseException | None:
    """Force the record and move to the state it implies; returns why it failed, if it did."""
    try:
        if tx.caller_gave_up:
            raise FencedError(f"the caller of {tx.gtrid} gave up waiting (timeout)")
        tx.runtime.log.log_commit(decision)
    except FencedError as exc:
        tx.fenced(exc)
        return exc
    except LogWriteError as exc:
        if exc.durable is None:
            tx.move_to(TxState.UNKNOWN)
        else:
            tx.rollback_reason = "log write failed"
            tx.move_to(TxState.ROLLING_BACK)
        return exc
    tx.move_to(TxState.COMMITTING)
    return None


def _phase_two(
    tx: Transaction,
    names: tuple[str, ...],
    end: Callable[[], None] | None = None,
    latch: EndLatch | None = None,
) -> Outcome:
    """Commit ``names``; once all answered, ``end`` (default: END into the decision log).
    ``latch``: one already holding carried branches' records (`_apply_carried`)."""
    started = time.perf_counter()
    branches = [tx.branches[name] for name in names]
    verbs = tx.verbs  # phase one looked them up: these branches are among the ones it asked
    # a latch only where a branch can commit lazily: the plain path allocates nothing
    if latch is None and verbs & LAZY:
        latch = EndLatch()
    grouped = batches(branches) if verbs & BATCH and len(branches) > 1 else None
    answers: Iterator[BranchResult]
    if grouped is not None:
        answers = _batched_answers(tx, branches, grouped, latch)
    elif tx.runtime.parallel and len(branches) > 1:
        pool = tx.runtime.branch_executor()
        pending = [pool.submit(_commit_branch, tx, b, latch) for b in branches]
        answers = (future.result() for future in pending)  # _commit_branch never raises
    else:
        answers = (_commit_branch(tx, b, latch) for b in branches)
    results: dict[str, BranchResult] = {}
    for index, (name, result) in enumerate(zip(names, answers, strict=True), 1):
        results[name] = result
        crash_point(f"tm.after_commit.{index}")
    took = time.perf_counter() - started
    tx.timings.append(("commit_phase", took))
    if tx.trace is not None:
        tx.trace.step("commit_phase", time.time_ns() - int(took * 1e9))
    outcome = protocol.outcome(Verdict.COMMIT, results)
    if BranchResult.UNREACHABLE not in results.values():
        crash_point("tm.before_end_record")
        if latch is None:  # the common path: no closure made
            if end is None:
                write_end(tx.runtime.log, tx.gtrid)
            else:
                end()
        elif not latch.arm(end or functools.partial(write_end, tx.runtime.log, tx.gtrid)):
            crash_point("tm.end_deferred")  # a lazy commit record is not durable yet
    _finish(tx, TxState.COMMITTED, outcome)
    if outcome.is_heuristic:
        raise _HEURISTIC_ERRORS.get(outcome, HeuristicMixed)(
            f"transaction {tx.gtrid} ended {outcome.value}: "
            + ", ".join(f"{n}={r.value}" for n, r in results.items()),
            gtrid=tx.gtrid,
            outcome=outcome.value,
        )
    return outcome


def _commit_branch(tx: Transaction, branch: Branch, latch: EndLatch | None) -> BranchResult:
    """Commit one branch; a store that can write its commit record lazily does (`lazy_commit`):
    the decision outlives it, since ``latch`` holds the transaction's end until it is durable."""
    started = time.time_ns() if tx.trace is not None else 0
    try:
        lazy = commits_lazily(branch.resource) if latch is not None else None
        if lazy is not None and latch is not None:
            reported = lazy.commit_lazily(branch.xid, latch.hold())
        else:
            reported = branch.resource.commit(branch.xid)
    except Exception as exc:
        if tx.trace is not None:
            _traced(tx, "commit", started, branch, exc)
        return _unconfirmed(tx, branch, exc)
    if tx.trace is not None:
        _traced(tx, "commit", started, branch)
    return judge_commit(tx.runtime.log, branch.xid.gtrid, branch.resource.name, reported)


def _unconfirmed(tx: Transaction, branch: Branch, exc: BaseException) -> BranchResult:
    log.warning("commit of %s not confirmed, left to recovery: %r", branch.xid, exc)
    tx.runtime.metrics.incr("commit_unreachable")
    return BranchResult.UNREACHABLE


def _batched_answers(
    tx: Transaction,
    branches: list[Branch],
    grouped: dict[str, list[Branch]],
    latch: EndLatch | None,
) -> Iterator[BranchResult]:
    """Each branch's result in commit order, a batch (`batch_commit`) committed when its first
    branch comes up; with ``parallel``, every batch and lone branch side by side."""
    units: list[list[Branch]] = []
    for branch in branches:
        unit = grouped.get(branch.resource.name)
        if unit is None:
            units.append([branch])
        elif unit[0] is branch:
            units.append(unit)
    if tx.runtime.parallel and len(units) > 1:
        pool = tx.runtime.branch_executor()
        pending = [pool.submit(_commit_unit, tx, unit, latch) for unit in units]
        done: dict[str, BranchResult] = {}
        for branch in branches:
            if branch.resource.name not in done:
                done.update(pending.pop(0).result())  # _commit_unit never raises
            yield done[branch.resource.name]
        return
    done = {}
    for branch in branches:
        if branch.resource.name not in done:
            done.update(_commit_unit(tx, units.pop(0), latch))
        yield done[branch.resource.name]


def _commit_unit(
    tx: Transaction, unit: list[Branch], latch: EndLatch | None
) -> dict[str, BranchResult]:
    """Commit one branch alone, or a batch in one call to its first resource's
    ``commit_batch``; never raises: what is not confirmed is left to recovery."""
    if len(unit) == 1:
        return {unit[0].resource.name: _commit_branch(tx, unit[0], latch)}
    leader = batch_committer(unit[0].resource)
    assert leader is not None  # batches() grouped only batch committers
    try:
        answers = leader.commit_batch([(b.resource, b.xid) for b in unit])
        if len(answers) != len(unit):
            raise TypeError(f"commit_batch answered {len(answers)} of {len(unit)} branches")
    except Exception as exc:
        answers = [exc] * len(unit)
    results = {}
    for branch, answer in zip(unit, answers, strict=True):
        name = branch.resource.name
        if isinstance(answer, BaseException):
            results[name] = _unconfirmed(tx, branch, answer)
        else:
            results[name] = judge_commit(tx.runtime.log, tx.gtrid, name, answer)
    return results


def judge_commit(
    log_: DecisionLog, gtrid: str, branch: str, reported: Outcome | None
) -> BranchResult:
    """Map a commit's answer to a phase-two result, forcing a heuristic record if it went
    against the decision. Phase two and recovery both judge commits through here."""
    result = protocol.branch_result(reported)
    if result != BranchResult.DONE:
        record_heuristic(log_, gtrid, branch, Outcome(result.value))
    return result


def record_heuristic(log_: DecisionLog, gtrid: str, branch: str, outcome: Outcome) -> None:
    """Force a heuristic record: the evidence must outlive the process that saw it.

    If the log cannot take it, the outcome is still raised to the caller (or reported by
    recovery) and logged here at CRITICAL, which is all that is left to do.
    """
    log.error("heuristic outcome %s on branch %s of %s", outcome.value, branch, gtrid)
    try:
        log_.log_heuristic(HeuristicRecord(gtrid, branch, outcome.value, "", time.time()))
    except (LogError, FencedError) as exc:
        log.critical("heuristic %s of %s/%s NOT recorded: %r", outcome.value, gtrid, branch, exc)


def write_end(log_: DecisionLog, gtrid: str) -> bool:
    """Write END; a failure only means recovery re-drives an already committed transaction."""
    try:
        log_.log_end(gtrid)
    except (LogError, FencedError) as exc:
        log.warning("END of %s not written (%r); recovery will re-drive it", gtrid, exc)
        return False
    return True


def _rollback_branches(tx: Transaction, names: list[str]) -> None:
    for index, name in enumerate(names, 1):
        branch = tx.branches[name]
        started = time.time_ns() if tx.trace is not None else 0
        try:
            reported = branch.resource.rollback(branch.xid)
            if tx.trace is not None:
                _traced(tx, "rollback", started, branch)
        except Exception as exc:
            if tx.trace is not None:
                _traced(tx, "rollback", started, branch, exc)
            log.warning("rollback of %s failed, recovery will retry: %r", branch.xid, exc)
            tx.runtime.metrics.incr("rollback_unreachable")
            tx.unconfirmed.add(name)
            reported = None
        else:
            tx.unconfirmed.discard(name)
        if reported == Outcome.HEURISTIC_COMMIT:
            record_heuristic(tx.runtime.log, tx.gtrid, name, reported)
        crash_point(f"tm.after_rollback.{index}")


def _finish(tx: Transaction, state: TxState, outcome: Outcome | None) -> Outcome:
    if tx.state != state:
        tx.move_to(state)
    tx.outcome = outcome
    tx.runtime.ended(tx)
    if tx.trace is not None:
        tracing.end(tx.trace, outcome.value if outcome is not None else state.value)
    for sync in tx.synchronizations:
        try:
            sync.after_completion(outcome or Outcome.HEURISTIC_HAZARD)
        except Exception:
            log.exception("after-completion hook of %s failed (ignored)", tx.gtrid)
    tx.mark_settled()
    return outcome or Outcome.HEURISTIC_HAZARD


def _traced(
    tx: Transaction,
    verb: str,
    started: int,
    branch: Branch,
    error: BaseException | None = None,
) -> None:
    """A branch's verb as a step of the trace (the caller checked that ``tx`` is traced)."""
    assert tx.trace is not None
    tx.trace.step(verb, started, branch.resource.name, None if error is None else repr(error))
