"""`SyncTwin`: what an async resource leaves to the synchronous resource it wraps.

The async resources (`resource_managers.postgres.aio`, `resource_managers.redis.aio`,
`messaging.remote.aio`) are the synchronous ones driven from an event loop: the same name (in
every gid), the same data, and so the same recovery, markers and gauges, which need no loop. This
base hands those verbs to the twin in ``sync``, in one place for all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from coordinator import ProgrammingError, Xid


class _Twin(Protocol):
    """The synchronous resource's verbs a `SyncTwin` hands on."""

    @property
    def name(self) -> str: ...

    @property
    def sort_key(self) -> str: ...

    def recover(self) -> list[Xid]: ...

    def forget(self, xid: Xid) -> None: ...


class SyncTwin:
    """Name, sort key, recovery, ``forget`` and gauges of an async resource: its twin's."""

    sync: _Twin

    @property
    def name(self) -> str:
        return self.sync.name

    @property
    def sort_key(self) -> str:
        return self.sync.sort_key

    def recover(self) -> list[Xid]:
        """The prepared branches, read by the synchronous twin (no loop needed)."""
        return self.sync.recover()

    def forget(self, xid: Xid) -> None:
        self.sync.forget(xid)

    def gauges(self) -> dict[str, Callable[[], float]]:
        """The twin's gauges, if it exports any (a remote log or cursor does not)."""
        gauges: Callable[[], dict[str, Callable[[], float]]] | None = getattr(
            self.sync, "gauges", None
        )
        return {} if gauges is None else gauges()


def not_opened(name: str, xid: Xid) -> ProgrammingError:
    """``start`` of a branch ``open_branch`` never opened: the resource was joined through the
    synchronous API, which cannot open its connection on a loop."""
    return ProgrammingError(
        f"{name}: an async resource joins through coordinator.aio (await tx.join(resource) in "
        f"an AsyncTransactionManager transaction), not through Transaction.join ({xid})"
    )
