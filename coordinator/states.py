"""The transaction state machine: one enum, one transition table.

Every state change goes through `check_transition`, so an illegal call (commit after rollback, join
after prepare) is refused with `IllegalStateError` instead of silently doing something.
"""

from __future__ import annotations

import enum

from .errors import IllegalStateError


class TxState(enum.Enum):
    #: members are singletons compared by identity: hash them so too, in C, not through
    #: Enum.__hash__ (a Python call on every state check and vote tally)
    __hash__ = object.__hash__

    ACTIVE = "active"
    #: set_rollback_only() or a timeout: work continues to fail fast, commit will roll back
    MARKED_ROLLBACK = "marked-rollback"
    PREPARING = "preparing"
    #: the decision is commit (logged, or one-phase under way); phase two runs
    COMMITTING = "committing"
    ROLLING_BACK = "rolling-back"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled-back"
    #: we cannot tell now whether it committed; recovery decides from the log
    UNKNOWN = "unknown"

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({TxState.COMMITTED, TxState.ROLLED_BACK, TxState.UNKNOWN})

S = TxState
TRANSITIONS: dict[TxState, frozenset[TxState]] = {
    S.ACTIVE: frozenset(
        {S.MARKED_ROLLBACK, S.PREPARING, S.COMMITTING, S.ROLLING_BACK, S.COMMITTED}
    ),
    S.MARKED_ROLLBACK: frozenset({S.ROLLING_BACK}),
    S.PREPARING: frozenset({S.COMMITTING, S.ROLLING_BACK, S.COMMITTED, S.UNKNOWN}),
    S.COMMITTING: frozenset({S.COMMITTED, S.ROLLED_BACK, S.UNKNOWN}),
    S.ROLLING_BACK: frozenset({S.ROLLED_BACK}),
    S.COMMITTED: frozenset(),
    S.ROLLED_BACK: frozenset(),
    S.UNKNOWN: frozenset(),
}
del S


def check_transition(current: TxState, target: TxState) -> None:
    if target not in TRANSITIONS[current]:
        raise IllegalStateError(
            f"a transaction in state {current.value} cannot become {target.value}",
            current=current.value,
            target=target.value,
        )


def require(current: TxState, *allowed: TxState, action: str) -> None:
    """Refuse ``action`` unless the transaction is in one of ``allowed``."""
    if current not in allowed:
        names = ", ".join(s.value for s in allowed)
        raise IllegalStateError(
            f"cannot {action} a transaction in state {current.value} (needs {names})",
            current=current.value,
        )
