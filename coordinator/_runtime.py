"""`Runtime`: what a transaction's completion needs of its manager, and nothing more.

Why a separate object: completion (`_completion`, `_last_resource`) used to reach into the
`TransactionManager` for its log, metrics, settings, thread pools and a few callbacks, which made
those internals public on the manager and tied manager, transaction and completion in an import
circle. The manager now builds one `Runtime` and hands it to every transaction; completion sees
only this narrow surface, and the manager's public surface is what applications call.

It imports nothing of the rest of the coordinator but the log and metrics types, so it sits
below `transaction` and `_completion` in the import graph (``tools/check_layering.py`` checks
that ``coordinator/`` has no import circle).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from .carried import ForgetGate
from .decision_log import DecisionLog
from .errors import LogWriteError
from .metrics import Metrics
from .resource import Outcome, Resource

#: the transaction type; a parameter so this module need not import `transaction`
TxT = TypeVar("TxT")


class Runtime(Generic[TxT]):
    """The log, metrics, settings and pools of one manager, and the calls back into it."""

    def __init__(
        self,
        log: DecisionLog,
        metrics: Metrics,
        *,
        parallel: bool,
        inline_completion: bool,
        phase_two_grace: float,
        max_workers: int,
        async_phase_two: bool = False,
        register: Callable[[Resource[Any]], None],
        ended: Callable[[TxT], None],
        log_failed: Callable[[LogWriteError], None],
        complete: Callable[[TxT], Outcome],
        abort: Callable[[TxT], None],
    ) -> None:
        self.log = log
        self.metrics = metrics
        self.parallel = parallel
        self.inline_completion = inline_completion
        self.phase_two_grace = phase_two_grace
        #: phase two on a background worker once the decision is durable (`_completion`)
        self.async_phase_two = async_phase_two
        #: at most this many handed-off phase twos pending: beyond it, the caller runs its own
        self.async_slots = threading.BoundedSemaphore(max_workers * 4)
        #: enlist a resource with the manager, for recovery (every join calls it)
        self.register = register
        #: a transaction reached its final state: the manager forgets it (or keeps it loose)
        self.ended = ended
        #: the decision log may hold a record nobody can see: the manager stops deciding
        self.log_failed = log_failed
        #: the completion entry points `Transaction.commit` and `Transaction.rollback` call
        self.complete = complete
        self.abort = abort
        #: names of the resources whose commit can carry the log's own record (`CarryingLog`)
        self.carriers: set[str] = set()
        #: carried branches' forgets wait here while recovery reads rows (`carried.ForgetGate`)
        self.forget_gate = ForgetGate()
        self._max_workers = max_workers
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        """Runs whole completions bounded by a timeout (``inline_completion=False``)."""
        return self._pool("completion")

    def branch_executor(self) -> ThreadPoolExecutor:
        """Runs parallel prepares and commits; separate, so a completion never waits on its own
        pool."""
        return self._pool("branch")

    def phase_two_executor(self) -> ThreadPoolExecutor:
        """Runs asynchronous phase twos; its own pool, so they never wait behind a prepare."""
        return self._pool("phase-two")

    def _pool(self, kind: str) -> ThreadPoolExecutor:
        pool = self._pools.get(kind)
        if pool is None:
            with self._lock:
                pool = self._pools.get(kind)
                if pool is None:
                    pool = ThreadPoolExecutor(self._max_workers, f"twopc-{kind}")
                    self._pools[kind] = pool
        return pool

    def shutdown(self) -> None:
        """Stop the pools. Handed-off phase twos are finished first (their transactions are
        decided: leaving them would keep their branches prepared, holding locks, until the next
        recovery); anything else still running is left to recovery."""
        phase_two = self._pools.get("phase-two")
        if phase_two is not None:
            phase_two.shutdown(wait=True)
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
