"""Phase two's lazy commit for the journal-backed stores (`coordinator.lazy_commit`).

The message log and the cursor answer ``commit_lazily`` the same way: a branch that is not
prepared there (a repeat, a heuristic rollback) or a resource with ``lazy_commit=False`` takes the
durable ``commit`` and reports durable at once; a prepared one writes its commit record lazily,
with a crash point after the record is queued (``<kind>.<name>.after_lazy_commit``) and one
when it is on disk, before the coordinator hears so (``<kind>.<name>.commit_durable``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from coordinator.crashpoints import crash_point
from coordinator.errors import ProgrammingError
from coordinator.resource import Outcome
from coordinator.xid import Xid


class LazyStore(Protocol):
    def is_tombstoned(self, gid: str) -> bool: ...

    def is_prepared(self, gid: str) -> bool: ...

    def commit_lazily(self, gid: str, on_durable: Callable[[], None]) -> None: ...


def commit_lazily(
    store: LazyStore,
    xid: Xid,
    on_durable: Callable[[], None],
    *,
    active: bool,
    lazy: bool,
    durable_commit: Callable[[Xid], Outcome | None],
    points: str,
) -> Outcome | None:
    """``active``: the branch was never prepared (misuse); ``points``: the crash points'
    prefix, ``<kind>.<resource name>``."""
    if active:
        raise ProgrammingError(f"{points}: commit of {xid} before it was prepared")
    gid = xid.to_gid()
    if store.is_tombstoned(gid):
        on_durable()
        return Outcome.HEURISTIC_ROLLBACK
    if not lazy or not store.is_prepared(gid):
        outcome = durable_commit(xid)
        on_durable()
        return outcome

    def durable() -> None:
        crash_point(f"{points}.commit_durable")
        on_durable()

    store.commit_lazily(gid, durable)
    crash_point(f"{points}.after_lazy_commit")
    return None
