"""The transaction manager: begins transactions, owns the decision log, runs recovery.

Why one module: it is the one object users hold, and its methods are mostly short delegations to
`_completion`, `recovery`, `_reaper` and the decision log; splitting it would spread one API over
several files without shortening any path through it.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from . import _completion, _reaper, tracing
from ._runtime import Runtime
from .backoff import Backoff, ExponentialBackoff
from .decision_log import DecisionLog, HeuristicRecord
from .errors import (
    ConfigurationError,
    HeuristicError,
    IllegalStateError,
    LogWriteError,
    NoTransactionError,
    OutcomeUnknownError,
    ProgrammingError,
    TransientError,
)
from .last_resource import CarryingLog
from .metrics import Metrics
from .recovery import Recovery, RecoveryReport
from .resource import Outcome, Resource
from .states import TxState
from .transaction import Transaction
from .xid import GtridFactory, Xid, custom_gtrid, resource_of, validate_resource_name

log = logging.getLogger("twopc.manager")
T = TypeVar("T")
_UNSET: Any = object()

#: the transaction of the current thread or task (contextvars follow asyncio tasks too)
_current: ContextVar[Transaction | None] = ContextVar("twopc_current_transaction", default=None)


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ProgrammingError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ProgrammingError(f"timeout must be finite and positive, not {timeout!r}")
    return float(timeout)


def current() -> Transaction | None:
    """The live transaction of this context; None once it has ended (as `TransactionManager.current`
    raises then). ``begin``/``commit`` leave the ended one in the variable: completion may run on
    another thread, which cannot reset this context's variable."""
    tx = _current.get()
    return None if tx is None or not tx.live else tx


@dataclass(frozen=True)
class InDoubt:
    """A committed transaction some of whose branches have not been told yet."""

    gtrid: str
    branches: tuple[str, ...]
    age_s: float
    last_error: str | None


class _Guard:
    """The in-flight guard for one recovery pass (see `recovery`), snapshotted at its start."""

    def __init__(self, manager: TransactionManager) -> None:
        self._manager = manager
        with manager._lock:
            self._snapshot = set(manager._in_flight)
            self._high_water = manager._gtrids.high_water
            manager._custom_since_snapshot = set()

    def maybe_in_flight(self, gtrid: str) -> bool:
        m = self._manager
        if gtrid in self._snapshot or gtrid in m._in_flight or gtrid in m._unknown:
            return True
        if gtrid in m._custom_since_snapshot:
            return True
        seq = m._gtrids.own_seq(gtrid)
        return seq is not None and seq > self._high_water


#: the counter each outcome of a transaction raises (None: unknown)
_OUTCOME_COUNTER: dict[Outcome | None, str] = {
    None: "outcome_unknown",
    **{o: f"outcome_{o.value.replace('-', '_')}" for o in Outcome},
}


class _Block:
    """The context manager `TransactionManager.transaction` returns. A class rather than a
    generator-based ``contextlib.contextmanager``: every transaction enters one, and the
    generator machinery cost more than the rest of the block's own work."""

    __slots__ = ("_kwargs", "_manager", "_timeout", "_tx")

    def __init__(self, manager: TransactionManager, timeout: Any, kwargs: dict[str, Any]) -> None:
        self._manager, self._timeout, self._kwargs = manager, timeout, kwargs
        self._tx: Transaction | None = None

    def __enter__(self) -> Transaction:
        self._tx = self._manager.begin(self._timeout, **self._kwargs)
        return self._tx

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tx = self._tx
        assert tx is not None
        try:
            if exc_type is not None:
                if tx.live:
                    tx.rollback()
                return  # the exception propagates
            if tx.reaped:  # never let a block the reaper rolled back exit as if committed
                raise tx.rolled_back_error("transaction rolled back by the reaper")
            if tx.live:
                tx.commit()
        finally:
            if _current.get() is tx:
                _current.set(None)


class TransactionManager:
    """Coordinates two-phase commit for one node.

    ``node_id`` prefixes every gtrid this manager creates; recovery only ever touches branches
    with this prefix, so give each live manager its own id (and its own log). ``resources`` must
    list every resource that may hold branches, so that recovery can reach them after a crash.
    ``sub_branch_grace``: seconds before recovery presumes a stamped sub-branch (one begun by a
    process this manager does not know, such as a Spark executor) aborted; longer than such a
    process can take from its prepare to its coordinator's decision (`coordinator.xid`).
    ``async_phase_two``: return to the caller once the decision is durable and commit the
    branches on a background worker (off by default: see docs/concepts.md, §4).
    ``settle_timeout``: how long `run` waits, before a retry, for the failed attempt to settle
    (its completion to end and every branch to confirm its rollback; see `await_settled`).
    """

    def __init__(
        self,
        node_id: str,
        log: DecisionLog,
        resources: Iterable[Resource[Any]] = (),
        *,
        default_timeout: float | None = 60.0,
        parallel: bool = False,
        max_workers: int = 16,
        phase_two_grace: float = 30.0,
        inline_completion: bool = True,
        recovery_interval: float | None = 30.0,
        recover_on_start: bool = True,
        reaper_interval: float | None = 1.0,
        abandon_after: float = 60.0,
        backoff: Backoff | None = None,
        sub_branch_grace: float = 900.0,
        settle_timeout: float = 60.0,
        async_phase_two: bool = False,
    ) -> None:
        if not settle_timeout > 0:
            raise ProgrammingError("settle_timeout must be > 0 seconds")
        self.node_id = node_id
        self.settle_timeout = settle_timeout
        self.log = log
        self.default_timeout = default_timeout
        self.metrics = Metrics()
        self._gtrids = GtridFactory(node_id)
        self._resources: dict[str, Resource[Any]] = {}
        self._lock = threading.Lock()
        self._recovery_lock = threading.Lock()
        self._in_flight: dict[str, Transaction] = {}
        self._custom_since_snapshot: set[str] = set()
        self._unknown: set[str] = set()
        #: ended attempts with a branch that did not confirm its rollback (see `unsettled`)
        self._loose: dict[str, Transaction] = {}
        self._log_error: LogWriteError | None = None
        self._runtime: Runtime[Transaction] = Runtime(
            log, self.metrics, parallel=parallel, inline_completion=inline_completion,
            phase_two_grace=phase_two_grace, max_workers=max_workers,
            async_phase_two=async_phase_two, register=self.register,
            ended=self._ended, log_failed=self._log_failed, complete=_completion.commit,
            abort=_completion.rollback,
        )  # fmt: skip
        self._recovery = Recovery(
            node_id,
            log,
            self._resources,
            self.metrics,
            backoff or ExponentialBackoff(),
            sub_branch_grace=sub_branch_grace,
            forget_gate=self._runtime.forget_gate,
        )
        self._recovery.retries_later = bool(recovery_interval)
        self._tickers: list[_reaper.Ticker] = []
        self._closed = False
        for resource in resources:
            self.register(resource)
        self.metrics.gauges["in_doubt"] = lambda: float(len(self.in_doubt()))
        self.metrics.gauges["oldest_in_doubt_age_seconds"] = self._oldest_in_doubt_age
        if recover_on_start:
            self.recover()
        if reaper_interval:
            self._start(
                "twopc-reaper",
                reaper_interval,
                lambda: _reaper.reap(self.in_flight, self.metrics, abandon_after),
            )
        if recovery_interval:
            self._start("twopc-recovery", recovery_interval, self._periodic_recovery)

    # -- resources -----------------------------------------------------------------------------

    def register(self, resource: Resource[Any]) -> None:
        """Make ``resource`` known for recovery; its name must be unique in this manager."""
        if self._resources.get(resource.name) is resource:
            return  # every join calls this: the known case must cost a dict lookup, no more
        name = validate_resource_name(resource.name)
        with self._lock:
            known = self._resources.get(name)
            if known is not None and known is not resource:
                raise ConfigurationError(f"two different resources are named {name!r}")
            self._resources[name] = resource
        if isinstance(self.log, CarryingLog) and self.log.carried_by(resource):
            self._runtime.carriers.add(name)
        gauges = getattr(resource, "gauges", None)
        if callable(gauges):
            # optional: a resource may export its own gauges (PostgreSQL: prepared count and age)
            prefix = "resource_" + "".join(c if c.isalnum() else "_" for c in name)
            for key, read in gauges().items():
                self.metrics.gauges[f"{prefix}_{key}"] = read

    def resource(self, name: str) -> Resource[Any]:
        return self._resources[name]

    # -- transactions ----------------------------------------------------------------------------

    def begin(
        self, timeout: float | None = _UNSET, *, gtrid_suffix: str | None = None
    ) -> Transaction:
        """Start a transaction and make it the current one of this thread or task."""
        self._check_open()
        active = _current.get()
        if active is not None and active.live:
            raise IllegalStateError("a transaction is already active in this context")
        timeout = _check_timeout(self.default_timeout if timeout is _UNSET else timeout)
        # One acquisition for the gtrid and the in-flight entry: a recovery snapshot taken
        # between the two would count the sequence number but miss the transaction.
        with self._lock:
            gtrid = self._new_gtrid(gtrid_suffix)
            tx = Transaction(self._runtime, gtrid, timeout)
            self._in_flight[gtrid] = tx
        if tracing.installed() is not None:
            tx.trace = tracing.begin(gtrid, self.node_id)
        _current.set(tx)
        self.metrics.incr("begun")
        return tx

    def transaction(self, timeout: float | None = _UNSET, **kwargs: Any) -> _Block:
        """``with tm.transaction() as tx:`` commits on normal exit and rolls back on an exception
        (which is re-raised)."""
        return _Block(self, timeout, kwargs)

    def current(self) -> Transaction:
        tx = _current.get()
        if tx is None or not tx.live:
            raise NoTransactionError("no transaction is active in this context")
        return tx

    def run(
        self, work: Callable[[Transaction], T], *, tries: int = 3, timeout: float | None = _UNSET
    ) -> T:
        """Run ``work`` in a transaction, retrying the whole of it on a transient error.

        A retry is safe only once the failed attempt rolled back completely, so before each retry
        `run` waits (up to ``settle_timeout``) for the attempt to settle (`await_settled`): a
        caller that timed out while a branch was preparing leaves a completion job still waiting
        for that branch's answer, and a branch that did not confirm its rollback may still hold
        the attempt's locks or messages. Retrying at once would let the next attempt overtake
        the work the first still holds (a consumer would take message k+1 before k comes back).
        An attempt that does not settle in time is not retried: its error is raised, and
        `unsettled` lists it until `settle` (or recovery) resolves it. An
        `OutcomeUnknownError` is never retried, since the attempt may have committed.
        """
        backoff = ExponentialBackoff(base=0.05, cap=2.0)
        for attempt in range(1, tries + 1):
            tx: Transaction | None = None
            try:
                with self.transaction(timeout) as tx:
                    return work(tx)
            except Exception as exc:
                if attempt == tries or not self._is_transient(exc, tx):
                    raise
                if tx is not None and not self.await_settled(tx, self.settle_timeout):
                    log.warning("%s did not settle in %.1fs; not retried", tx.gtrid,
                                self.settle_timeout)  # fmt: skip
                    raise
                self.metrics.incr("retries")
                time.sleep(backoff.compute(attempt))
        raise AssertionError("unreachable")

    def await_settled(self, tx: Transaction, timeout: float | None = None) -> bool:
        """Wait until nothing of ``tx`` can still hold its work; False if ``timeout`` ran out.

        Settled means: its completion has ended (a caller that timed out may have left while
        the completion job still waits for a branch), and, if it rolled back, every branch
        confirmed the rollback. Branches that did not are told again, with back-off, until they
        answer (rollback is idempotent, and presumed abort makes it the only possible outcome
        of an attempt without a commit decision). A committed or unknown outcome is never rolled
        back here: it is settled once completion has ended (recovery finishes the rest).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not tx.wait_settled(timeout):
            return False
        if tx.llr_in_doubt:  # its other branches stay prepared until recovery reads the row
            with self._lock:
                return tx.gtrid not in self._loose
        if tx.state != TxState.ROLLED_BACK or not tx.unconfirmed:
            return True
        backoff = ExponentialBackoff(base=0.05, cap=1.0)
        for attempt in itertools.count(1):
            for name in sorted(tx.unconfirmed):
                branch = tx.branches[name]
                try:
                    branch.resource.rollback(branch.xid)
                except Exception as exc:
                    log.debug("rollback of %s still unconfirmed: %r", branch.xid, exc)
                else:
                    tx.unconfirmed.discard(name)
            if not tx.unconfirmed:
                with self._lock:
                    self._loose.pop(tx.gtrid, None)
                return True
            pause = backoff.compute(attempt)
            if deadline is not None and time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
        raise AssertionError("unreachable")

    def unsettled(self) -> list[str]:
        """Gtrids of attempts this manager began that may still hold work although their
        caller has moved on: a completion still running after its caller timed out (or after
        the reaper took it over), a rollback some branch never confirmed, or a last-resource
        commit whose answer was lost (its other branches stay prepared until recovery). A
        consumer that must keep a stream's order receives nothing more until this is empty
        (`settle`)."""
        with self._lock:
            running = [
                tx.gtrid for tx in self._in_flight.values() if tx.caller_gave_up or tx.reaped
            ]
            return sorted({*running, *self._loose})

    def settle(self, timeout: float | None = None, *, stop: threading.Event | None = None) -> bool:
        """Until `unsettled` is empty and a recovery pass finds nothing of this manager's left
        in doubt; returns False if ``timeout`` ran out (None: no limit) or ``stop`` was set.

        What it waits for: abandoned completions to end, unconfirmed rollbacks to be confirmed
        (`await_settled`), and recovery to resolve what those cannot reach (a branch prepared
        behind a lost answer). A store that is down keeps it waiting: going on would hand the
        work behind the held one out first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for gtrid in self.unsettled():
                with self._lock:
                    tx = self._in_flight.get(gtrid) or self._loose.get(gtrid)
                if tx is not None:  # a second at a time, so ``stop`` and the deadline are heard
                    left = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
                    self.await_settled(tx, min(left, 1.0))
            if self.recover(force=True).clean and not self.unsettled():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if stop is not None and stop.wait(0.2):
                return False
            if stop is None:
                time.sleep(0.2)

    @staticmethod
    def _is_transient(exc: BaseException, tx: Transaction | None) -> bool:
        cause: BaseException | None = exc
        while cause is not None:
            # The attempt may have committed: no transient cause below this makes a retry safe.
            if isinstance(cause, OutcomeUnknownError | HeuristicError):
                return False
            if isinstance(cause, TransientError):
                return True
            for branch in tx.branches.values() if tx else ():
                judge = getattr(branch.resource, "is_transient", None)
                if judge is not None and judge(cause):
                    return True
            cause = cause.__cause__
        return False

    def _new_gtrid(self, suffix: str | None) -> str:
        """Called with ``_lock`` held."""
        if suffix is None:
            return self._gtrids.next()[0]
        gtrid = custom_gtrid(self.node_id, suffix)
        if gtrid in self._in_flight:
            raise IllegalStateError(f"gtrid {gtrid} is already in flight")
        self._custom_since_snapshot.add(gtrid)
        return gtrid

    # -- called by transactions ------------------------------------------------------------------

    def _ended(self, tx: Transaction) -> None:
        with self._lock:
            self._in_flight.pop(tx.gtrid, None)
            if tx.state == TxState.UNKNOWN and not tx.llr_in_doubt:
                self._unknown.add(tx.gtrid)
            if tx.unconfirmed or tx.llr_in_doubt:
                self._loose[tx.gtrid] = tx
        self.metrics.incr(_OUTCOME_COUNTER[tx.outcome])

    def in_flight(self) -> list[Transaction]:
        with self._lock:
            return list(self._in_flight.values())

    def _log_failed(self, error: LogWriteError) -> None:
        """The log may hold a record we cannot see: stop deciding, stop presuming aborts."""
        log.critical("decision log failed (%r); restart the process to recover", error)
        self._log_error = error

    def _check_open(self) -> None:
        if self._closed:
            raise IllegalStateError("transaction manager is closed")
        if self._log_error is not None:
            raise self._log_error

    # -- recovery and operations -----------------------------------------------------------------

    def recover(self, *, force: bool = False) -> RecoveryReport:
        """One recovery pass (see `recovery`); passes never overlap."""
        with self._recovery_lock:
            guard = _Guard(self)
            with self._lock:
                loose = list(self._loose)
            presume = self._log_error is None
            report = self._recovery.run(guard, presume_abort=presume, force=force)
            if report.clean and presume and loose:
                # every resource answered and every prepared branch of ours was resolved: what
                # ended loose before this pass holds nothing prepared any more
                with self._lock:
                    for gtrid in loose:
                        self._loose.pop(gtrid, None)
            return report

    def in_doubt(self) -> list[InDoubt]:
        now = time.time()
        retries = self._recovery.retries.last_error
        return [
            InDoubt(d.gtrid, d.branches, now - d.written_at, retries.get(d.gtrid))
            for d in self.log.pending()
            if d.gtrid not in self._in_flight
        ]

    def _oldest_in_doubt_age(self) -> float:
        return max((d.age_s for d in self.in_doubt()), default=0.0)

    def heuristics(self) -> list[HeuristicRecord]:
        return self.log.heuristics()

    def forget_heuristic(self, gtrid: str, branch: str | None = None) -> None:
        """An operator has dealt with it: let the resource and the log drop the record."""
        for record in self.log.heuristics():
            if record.gtrid == gtrid and branch in (None, record.branch):
                owner = resource_of(record.branch, self._resources)
                resource = None if owner is None else self._resources.get(owner)
                if resource is not None:
                    resource.forget(Xid.branch_of(gtrid, record.branch))
        self.log.forget_heuristic(gtrid, branch)

    def metrics_dict(self) -> dict[str, Any]:
        return self.metrics.as_dict()

    # -- lifecycle -------------------------------------------------------------------------------

    def _periodic_recovery(self) -> None:
        if not self._closed:
            self.recover()

    def _start(self, name: str, interval: float, work: Callable[[], None]) -> None:
        ticker = _reaper.Ticker(name, interval, work)
        self._tickers.append(ticker)
        ticker.start()

    def close(self) -> None:
        """Stop background work and close the log. In-flight transactions are left to recovery."""
        if self._closed:
            return
        self._closed = True
        for ticker in self._tickers:
            ticker.stop()
        self._runtime.shutdown()
        for resource in list(self._resources.values()):  # lazy commit records: END them now
            flush = getattr(resource, "flush_commits", None)
            if flush is not None:
                try:
                    flush()
                except Exception as exc:  # their decisions stay; recovery ends them later
                    log.warning("flushing the commits of %s failed: %r", resource.name, exc)
        self.log.close()

    def __enter__(self) -> TransactionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
