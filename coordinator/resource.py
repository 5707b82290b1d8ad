"""The resource contract: what a resource manager promises the coordinator.

Everything is keyed by `Xid`, never by a live object, so recovery can finish a branch after a
crash with nothing but the resource's name and the xid. The obligations below are the whole of
what the coordinator relies on; a resource that breaks one can lose money.
"""

from __future__ import annotations

import enum
from typing import Protocol, TypeVar, runtime_checkable

from .xid import Xid


class Vote(enum.Enum):
    """A branch's answer to prepare. Raising an exception from ``prepare`` also votes no."""

    #: members are singletons compared by identity: hash them so too, in C, not through
    #: Enum.__hash__ (a Python call on every state check and vote tally)
    __hash__ = object.__hash__

    COMMIT = "commit"
    READ_ONLY = "read-only"
    ROLLBACK = "rollback"


class Outcome(enum.Enum):
    """How a transaction or a branch ended. Outcomes are values; only misuse raises.

    Do not re-order or rename: values are written into the decision log.
    """

    #: members are singletons compared by identity: hash them so too, in C, not through
    #: Enum.__hash__ (a Python call on every state check and vote tally)
    __hash__ = object.__hash__

    COMMITTED = "committed"
    ROLLED_BACK = "rolled-back"
    READ_ONLY = "read-only"
    #: committed, but some branch could not be told yet; recovery will finish it
    COMMIT_PENDING = "commit-pending"
    HEURISTIC_COMMIT = "heuristic-commit"
    HEURISTIC_ROLLBACK = "heuristic-rollback"
    HEURISTIC_MIXED = "heuristic-mixed"
    HEURISTIC_HAZARD = "heuristic-hazard"

    @property
    def is_heuristic(self) -> bool:
        return self.value.startswith("heuristic")


#: the handle a resource's branch gives the application (a `Session`, a `RedisBranch`, ...)
Handle_co = TypeVar("Handle_co", covariant=True)


@runtime_checkable
class Resource(Protocol[Handle_co]):
    """An XA-style resource manager that can enlist in a two-phase-commit transaction.

    Generic in the handle its branches give the application, so ``tx.join(resource)`` is typed:
    a `Resource[Session]` joins as a `Session`. ``Resource[Any]`` accepts every resource.

    ``name``
        Stable and unique within a manager; it is written into the decision log and becomes the
        bqual, so renaming a resource with in-doubt branches strands them (1-64 printable ASCII).
    ``sort_key``
        Participants prepare and commit in ascending ``sort_key`` order, so lock order, logs and
        transcripts repeat run after run. Use the name unless there is a reason not to.
    """

    @property
    def name(self) -> str: ...

    @property
    def sort_key(self) -> str: ...

    def start(self, xid: Xid) -> Handle_co:
        """Open a branch and return the handle the application works with (``tx.join`` returns it).

        Called once per transaction and resource. Raising here fails the join, not the transaction.
        """

    def prepare(self, xid: Xid) -> Vote:
        """Make the branch durable and promise to commit it; the last chance to vote no.

        ``Vote.COMMIT``: the branch survives any crash and commits or rolls back only on our
        word. ``Vote.READ_ONLY``: nothing to commit; the branch is finished and phase two skips
        it. Raising (or ``Vote.ROLLBACK``) votes no; the coordinator will roll the branch back.
        A resource that can fence must refuse to prepare an xid it has already rolled back.
        """

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        """Commit the branch. Must be idempotent: committing a committed or unknown branch succeeds.

        With ``one_phase=True`` the branch was never prepared; commit it directly (raising means
        it did not commit, unless the error is `OutcomeUnknownError`). Otherwise this should never
        fail for a logical reason: raise `TransientError` (or any infrastructure error) when the
        server cannot be reached and recovery will call again. Return a heuristic `Outcome` when
        the branch was completed differently by someone else (an operator rolled it back);
        returning None means committed.
        """

    def rollback(self, xid: Xid) -> Outcome | None:
        """Roll the branch back, prepared or not. Idempotent: an unknown branch is already done.

        Where the resource can, leave a tombstone so a late ``prepare`` of this xid fails. Return
        `Outcome.HEURISTIC_COMMIT` if the branch had already been committed by someone else.
        """

    def recover(self) -> list[Xid]:
        """Every branch that is prepared and not yet completed, of any age, any node.

        The coordinator filters by node and format id and guards branches still in flight;
        a resource must not hide young branches, or a restarted manager cannot finish them.
        """

    def forget(self, xid: Xid) -> None:
        """Drop what the resource remembers of a heuristically completed branch."""


@runtime_checkable
class Synchronization(Protocol):
    """Before/after-completion hooks, as in JTA.

    ``before_completion`` runs before phase one while the transaction can still change (flush an
    ORM session here); raising rolls the transaction back. ``after_completion`` receives the
    outcome and must not raise: its errors are logged and swallowed, since the outcome is final.
    """

    def before_completion(self) -> None: ...

    def after_completion(self, outcome: Outcome) -> None: ...
