"""A global transaction: its branches, its state, its hooks.

Completion lives in `_completion`; a transaction reaches it (and its manager) only through the
`Runtime` it was begun with, so this module imports neither the manager nor completion.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ._runtime import Runtime
from .errors import (
    IllegalStateError,
    ProgrammingError,
    TransactionRolledBack,
    TransactionTimedOut,
)
from .last_resource import is_last_resource
from .resource import Outcome, Resource, Synchronization
from .states import TxState, check_transition, require
from .tracing import TransactionTrace
from .xid import Xid

log = logging.getLogger("twopc.transaction")

H = TypeVar("H")  # the handle of the resource being joined


@dataclass
class Branch:
    """One resource's part of a transaction."""

    resource: Resource[Any]
    xid: Xid
    handle: Any


class _Hooks:
    """Adapts two plain callables to the `Synchronization` protocol."""

    def __init__(
        self,
        before: Callable[[], None] | None,
        after: Callable[[Outcome], None] | None,
    ) -> None:
        self._before, self._after = before, after

    def before_completion(self) -> None:
        if self._before:
            self._before()

    def after_completion(self, outcome: Outcome) -> None:
        if self._after:
            self._after(outcome)


class Transaction:
    """A two-phase-commit transaction over any number of enlisted resources.

    Thread-safety: one application thread drives a transaction; the manager's reaper may mark it
    rollback-only concurrently, so every state change happens under ``_lock``.
    """

    def __init__(
        self,
        runtime: Runtime[Transaction],
        gtrid: str,
        timeout: float | None,
    ) -> None:
        self.runtime = runtime
        self.gtrid = gtrid
        self.timeout = timeout
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        #: the same deadline on the wall clock, written into the decision record as a fence
        self.wall_deadline = None if timeout is None else time.time() + timeout
        self.state = TxState.ACTIVE
        self.outcome: Outcome | None = None
        self.rollback_reason: str | None = None
        self.branches: dict[str, Branch] = {}
        #: the branch of the one last resource that joined (`coordinator.last_resource`), if any
        self.last_branch: Branch | None = None
        #: ``last_branch`` is not a last resource but the carrier of the decision log's own
        #: record: a participant in the log's database (`coordinator.last_resource.CarryingLog`)
        self.last_carries = False
        self.synchronizations: list[Synchronization] = []
        #: set when the caller stopped waiting before the commit point: no decision may follow
        self.caller_gave_up = False
        #: committed without a decision record: a late answer is unknown, not pending
        self.one_phase = False
        #: unknown outcome of a last resource's commit: its decision table, not this process's
        #: memory, settles it, so recovery may resolve the other branches (`recovery`)
        self.llr_in_doubt = False
        #: rolled back by the reaper behind its owner's back: the owner must hear so, not commit
        self.reaped = False
        #: decided, and phase two handed to a background worker (``async_phase_two``)
        self.handed_off = False
        #: the optional verbs (`_verbs`) of the branches phase one asked: phase two's are among
        #: them, so it need not look again
        self.verbs = 0
        #: (phase, seconds) measured by completion, recorded into the metrics in one go
        self.timings: list[tuple[str, float]] = []
        #: branches told to roll back that did not confirm it: they may still hold this attempt's
        #: work (locks, messages handed out) until a later rollback or recovery reaches them
        self.unconfirmed: set[str] = set()
        #: the steps a tracer turns into spans (`coordinator.tracing`); None while none is installed
        self.trace: TransactionTrace | None = None
        self._lock = threading.RLock()
        #: completion stopped running (final state reached, or its job ended); the event is
        #: made only for someone who waits, so the common case costs no Event per transaction
        self._settled = False
        self._settled_event: threading.Event | None = None

    def __repr__(self) -> str:
        return f"<Transaction {self.gtrid} {self.state.value} branches={sorted(self.branches)}>"

    # -- work phase --------------------------------------------------------------------------

    def join(self, resource: Resource[H]) -> H:
        """Enlist ``resource`` and return its handle; joining twice returns the same handle."""
        with self._lock:
            self._check_alive("join")
            branch = self.branches.get(resource.name)
            if branch is not None:
                if branch.resource is not resource:
                    raise IllegalStateError(f"another resource named {resource.name!r} joined")
                return branch.handle  # type: ignore[no-any-return]  # the same resource: its H
            last = is_last_resource(resource)
            if last and self.last_branch is not None and not self.last_carries:
                raise ProgrammingError(
                    f"{resource.name!r} is a last resource and {self.last_branch.resource.name!r} "
                    "already joined as one: a transaction may have at most one last resource"
                )
            self.runtime.register(resource)  # validates the name, once per resource
            xid = Xid._checked_parts(self.gtrid, resource.name)
            handle = resource.start(xid)
            branch = self.branches[resource.name] = Branch(resource, xid, handle)
            if last:  # an explicit last resource takes over from a carrier
                self.last_branch, self.last_carries = branch, False
            elif self.last_branch is None and resource.name in self.runtime.carriers:
                self.last_branch, self.last_carries = branch, True
            return handle

    def set_rollback_only(self, reason: str = "application") -> None:
        """Doom the transaction: it can only roll back now. Idempotent."""
        with self._lock:
            if self.state == TxState.ACTIVE:
                check_transition(self.state, TxState.MARKED_ROLLBACK)
                self.state = TxState.MARKED_ROLLBACK
                self.rollback_reason = reason

    @property
    def live(self) -> bool:
        """Still the application's to commit or roll back: not ended, and not decided with its
        phase two handed to a background worker (``async_phase_two``)."""
        return not self.state.is_final and not self.handed_off

    @property
    def rollback_only(self) -> bool:
        return self.state == TxState.MARKED_ROLLBACK

    def register_synchronization(self, sync: Synchronization) -> None:
        with self._lock:
            require(self.state, TxState.ACTIVE, TxState.MARKED_ROLLBACK, action="add hooks to")
            self.synchronizations.append(sync)

    def before_completion(self, fn: Callable[[], None]) -> None:
        self.register_synchronization(_Hooks(fn, None))

    def after_completion(self, fn: Callable[[Outcome], None]) -> None:
        self.register_synchronization(_Hooks(None, fn))

    # -- completion --------------------------------------------------------------------------

    def commit(self) -> Outcome:
        """Commit; returns the outcome or raises (`TransactionRolledBack`, a heuristic, unknown)."""
        return self.runtime.complete(self)

    def rollback(self) -> None:
        self.runtime.abort(self)

    @property
    def settled(self) -> bool:
        """True once nothing is completing this transaction any more. A caller that timed out
        can leave before that: its completion job still waits for a branch's answer."""
        return self._settled

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Wait until `settled` (at most ``timeout`` seconds); returns `settled`."""
        with self._lock:
            if self._settled:
                return True
            if self._settled_event is None:
                self._settled_event = threading.Event()
            event = self._settled_event
        return event.wait(timeout)

    def mark_settled(self) -> None:
        """Completion has stopped running (called by `_completion` and nobody else)."""
        with self._lock:
            self._settled = True
            event = self._settled_event
        if event is not None:
            event.set()

    # -- helpers for the driver and the reaper -----------------------------------------------

    def move_to(self, target: TxState) -> None:
        with self._lock:
            check_transition(self.state, target)
            self.state = target

    def fenced(self, error: BaseException) -> None:
        """The commit point refused (`FencedError`): roll back, and say why.

        Past the deadline (or the caller left) it is a timeout; otherwise the log's lease was
        taken over (or a last resource's row fenced the gtrid) and this manager may decide
        nothing more for it, which no retry here can change.
        """
        timed_out = self.caller_gave_up or getattr(error, "deadline", None) is not None
        self.rollback_reason = "timeout" if timed_out else "fenced"
        self.move_to(TxState.ROLLING_BACK)

    def ordered_branches(self) -> list[Branch]:
        """Branches in ascending ``sort_key`` (then name) order: the order of every phase."""
        return sorted(self.branches.values(), key=lambda b: (b.resource.sort_key, b.resource.name))

    def remaining(self) -> float | None:
        """Seconds left before the timeout (negative once past), None without a timeout."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def timed_out(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

    def _check_alive(self, action: str) -> None:
        if self.reaped:
            raise self.rolled_back_error(f"cannot {action}: the reaper rolled it back")
        if self.state == TxState.MARKED_ROLLBACK:
            raise self.rolled_back_error(f"cannot {action}: transaction is marked rollback-only")
        require(self.state, TxState.ACTIVE, action=action)
        if self.timed_out():
            self.set_rollback_only("timeout")
            raise self.rolled_back_error(f"cannot {action}: transaction timed out")

    def rolled_back_error(self, message: str) -> TransactionRolledBack:
        reason = self.rollback_reason or "rollback-only"
        cls = TransactionTimedOut if reason == "timeout" else TransactionRolledBack
        return cls(f"{message} ({self.gtrid}, reason: {reason})", gtrid=self.gtrid, reason=reason)
