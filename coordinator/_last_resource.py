"""The commit point of a transaction with a last resource (`coordinator.last_resource`).

`_completion` drives the transaction; these are the steps where the LLR path differs from the
decision-log path. The rules mirror ``_completion._write_decision``: the commit, and the state it
leads to, happen under ``tx._lock``, after the same fences the log's write gets (the caller's
give-up flag, the decision's deadline, the log's lease), so a caller timing out meanwhile sees
either no decision (and fences it) or the final state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .crashpoints import crash_point
from .decision_log import Decision
from .decision_log._memory import admit
from .errors import FencedError, OutcomeUnknownError, TransactionTimedOut
from .last_resource import CarryingLog, LastResource, is_last_resource
from .resource import Resource
from .states import TxState

if TYPE_CHECKING:
    from .transaction import Branch, Transaction


def as_last(resource: Resource[Any]) -> LastResource:
    if not is_last_resource(resource):  # the transaction only records last resources
        raise TypeError(f"{resource.name!r} is not a last resource")
    return resource


def as_carrying(log: object) -> CarryingLog:
    if not isinstance(log, CarryingLog):  # the manager names carriers only for such a log
        raise TypeError(f"{log!r} cannot carry decisions in a participant's commit")
    return log


def commit_alone(tx: Transaction) -> TransactionTimedOut | None:
    """Every other branch voted read-only: the last resource commits in plain one phase.

    Leaving PREPARING happens under the lock with the give-up check, as a decision write would;
    returns why it may not commit (the caller gave up), else None with the state COMMITTING.
    """
    with tx._lock:
        if tx.caller_gave_up:
            tx.rollback_reason = "timeout"
            tx.move_to(TxState.ROLLING_BACK)
            return TransactionTimedOut(f"{tx.gtrid} timed out", gtrid=tx.gtrid)
        tx.move_to(TxState.COMMITTING)
        tx.one_phase = True
    return None


def commit_point(
    tx: Transaction,
    last: Branch,
    branches: tuple[str, ...],
    carried: tuple[tuple[str, bytes], ...] = (),
) -> BaseException | None:
    """Commit ``last`` with the decision for ``branches`` (and the ``carried`` branches'
    payloads, `coordinator.carried`); returns why it did not, if it did not.

    State afterwards: COMMITTING (committed), UNKNOWN (`OutcomeUnknownError` returned: the row
    may exist; recovery reads it), or ROLLING_BACK (certainly not committed).
    """
    crash_point("tm.llr.before_commit")
    started = time.perf_counter()
    with tx._lock:
        failure = _commit(tx, last, Decision(tx.gtrid, branches, tx.wall_deadline, 0.0, carried))
    if failure is None:
        took = time.perf_counter() - started
        tx.timings.append(("decision", took))
        if tx.trace is not None:  # the last resource's commit is the decision
            tx.trace.step("decision", time.time_ns() - int(took * 1e9), last.resource.name)
        tx.runtime.metrics.incr("carried_decisions" if tx.last_carries else "last_resource_commits")
    return failure


def _commit(tx: Transaction, last: Branch, decision: Decision) -> BaseException | None:
    try:
        if tx.caller_gave_up:
            raise FencedError(f"the caller of {tx.gtrid} gave up waiting (timeout)")
        decision = admit(decision, time.time)  # past its deadline: FencedError, nothing sent
        tx.runtime.log.check_owner()  # the node's lease (SQL log) is still ours
        if tx.last_carries:  # the log's own record rides the carrier's commit
            as_carrying(tx.runtime.log).commit_carried(last.resource, last.xid, decision)
        else:
            as_last(last.resource).commit_with_decision(last.xid, decision)
    except OutcomeUnknownError as exc:
        tx.llr_in_doubt = True
        tx.move_to(TxState.UNKNOWN)
        return exc
    except FencedError as exc:
        tx.fenced(exc)
        return exc
    except Exception as exc:
        tx.rollback_reason = "last resource commit failed"
        tx.move_to(TxState.ROLLING_BACK)
        return exc
    tx.move_to(TxState.COMMITTING)
    return None
