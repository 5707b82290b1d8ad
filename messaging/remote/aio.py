"""Remote message logs and cursors for asyncio code: `AsyncRemoteMessageLog` (producer) and
`AsyncRemoteCursor` (consumer), joined with ``await tx.join(...)`` in a `coordinator.aio`
transaction::

    async with atm.atransaction() as tx:
        delivery = await (await tx.join(cursor)).receive("orders", timeout=1.0)
        (await tx.join(mlog)).send("invoices", delivery.body)   # staged; goes with the prepare
        session = await tx.join(pg)                               # an AsyncPostgresResource

Why they wrap the synchronous clients: a remote branch's meaning (what a broken connection means
to each verb, which verb may be repeated, the consumer's pinned connection, the predecessors a
prepare names, lazy commit answers) lives in `RemoteMessageLog` and `RemoteCursor`, and a branch
prepared here must be committable by a synchronous recovery. So each async resource *is* a
synchronous one (``.sync``) whose connection pool is bound to the branch's loop: its frames go
through ``asyncio.open_connection`` streams there (`_loop_link`), with the same codec, handshake,
auth and TLS options. Recovery, ``forget`` and a recovery pass with no loop running use blocking
connections of the same pool (`resource_managers.aio_twin.SyncTwin`).

A producer branch is the synchronous `RemoteProducerBranch`: its ``send`` only stages (no I/O), so
it is called plainly on the loop; the messages travel with the prepare, which completion runs on
its worker thread. A consumer branch's receives are awaited (`AsyncConsumerBranch`): the branch's
logic runs on a thread (one receive at a time per branch), its bytes on the loop, as
`resource_managers.redis.aio` does. The cursor's administration (subscriptions, dead letters)
stays blocking on ``cursor.sync``: call it off the loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from coordinator import Outcome, ProgrammingError, Vote, Xid
from messaging.auth import SharedSecret, TlsConfig
from messaging.connection import Address
from resource_managers.aio_twin import SyncTwin, not_opened
from resource_managers.cursor import Delivery
from resource_managers.message_log import DEFAULT_MAX_MESSAGE_BYTES

from ._remote_cursor import RemoteConsumerBranch, RemoteCursor
from ._remote_log import RemoteMessageLog, RemoteProducerBranch

__all__ = ["AsyncConsumerBranch", "AsyncRemoteCursor", "AsyncRemoteMessageLog"]


class _AsyncRemote(SyncTwin):
    """What both async remote resources share: the loop binding and the verbs handed on."""

    sync: RemoteMessageLog | RemoteCursor

    def _setup(self) -> None:
        #: branches `open_branch` prepared for ``start`` (one join each)
        self._opened: set[Xid] = set()

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"

    async def open_branch(self, xid: Xid) -> None:
        """Bind the pool to this loop: the branch's connections are opened on it."""
        loop = asyncio.get_running_loop()
        pool = self.sync._pool
        bound = pool.loop
        if bound is not None and bound is not loop and bound.is_running():
            raise ProgrammingError(
                f"{self.name}: this resource's connections work on another running event loop; "
                "make one async remote resource per loop"
            )
        pool.loop = loop
        self._opened.add(xid)

    async def abandon_branch(self, xid: Xid) -> None:
        self._opened.discard(xid)
        self.sync._drop(xid)

    def _started(self, xid: Xid) -> None:
        if xid not in self._opened:
            raise not_opened(self.name, xid)
        self._opened.discard(xid)

    def prepare(self, xid: Xid) -> Vote:
        return self.sync.prepare(xid)

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        return self.sync.commit(xid, one_phase)

    def rollback(self, xid: Xid) -> Outcome | None:
        return self.sync.rollback(xid)

    def commit_lazily(self, xid: Xid, on_durable: Callable[[], None]) -> Outcome | None:
        """`coordinator.lazy_commit`: the commit sent, its answer read on the reply thread."""
        return self.sync.commit_lazily(xid, on_durable)

    def flush_commits(self) -> None:
        self.sync.flush_commits()

    def close(self) -> None:
        """Close the idle connections (blocking: off the loop, or use `aclose`)."""
        self.sync.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.sync.close)


class AsyncRemoteMessageLog(_AsyncRemote):
    """A message log served by ``twopc serve log``, for `coordinator.aio` transactions. The
    options are `RemoteMessageLog`'s; its handle is a `RemoteProducerBranch` (``send`` stages)."""

    sync: RemoteMessageLog

    def __init__(
        self,
        address: Address,
        secret: SharedSecret | None,
        *,
        name: str = "mlog",
        client_id: str = "twopc-client",
        tls: ssl.SSLContext | TlsConfig | None = None,
        server_hostname: str | None = None,
        timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        sort_key: str | None = None,
        lazy_commit: bool = True,
    ) -> None:
        self.sync = RemoteMessageLog(
            address, secret, name=name, client_id=client_id, tls=tls,
            server_hostname=server_hostname, timeout=timeout,
            max_message_bytes=max_message_bytes, sort_key=sort_key, lazy_commit=lazy_commit,
        )  # fmt: skip
        self._setup()

    def start(self, xid: Xid) -> RemoteProducerBranch:
        self._started(xid)
        return self.sync.start(xid)


class AsyncRemoteCursor(_AsyncRemote):
    """A cursor served by ``twopc serve cursor``, for `coordinator.aio` transactions. The
    options are `RemoteCursor`'s; its handle is an `AsyncConsumerBranch`."""

    sync: RemoteCursor

    def __init__(
        self,
        address: Address,
        secret: SharedSecret | None,
        *,
        name: str = "cursor",
        client_id: str = "twopc-client",
        tls: ssl.SSLContext | TlsConfig | None = None,
        server_hostname: str | None = None,
        timeout: float = 30.0,
        sort_key: str | None = None,
        lazy_commit: bool = True,
    ) -> None:
        self.sync = RemoteCursor(
            address, secret, name=name, client_id=client_id, tls=tls,
            server_hostname=server_hostname, timeout=timeout, sort_key=sort_key,
            lazy_commit=lazy_commit,
        )  # fmt: skip
        self._setup()

    def start(self, xid: Xid) -> AsyncConsumerBranch:
        self._started(xid)
        return AsyncConsumerBranch(self.sync.start(xid))


class AsyncConsumerBranch:
    """What ``await tx.join(AsyncRemoteCursor)`` returns: `RemoteConsumerBranch`'s receives,
    awaited. Semantics are its (pinned connection, `BranchLost` once it broke)."""

    def __init__(self, branch: RemoteConsumerBranch) -> None:
        #: the synchronous branch (``deliveries``, ``xid``); never call its receives on the loop
        self.branch = branch
        self._turn = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<AsyncConsumerBranch {self.branch.xid}>"

    @property
    def deliveries(self) -> list[Delivery]:
        return self.branch.deliveries

    async def receive(self, destination: str, timeout: float | None = 0.0) -> Delivery | None:
        """The next message of ``destination``, or None after ``timeout`` seconds without one
        (None: wait for ever)."""
        got = await self.receive_many(destination, 1, timeout)
        return got[0] if got else None

    async def receive_many(
        self, destination: str, max_messages: int, timeout: float | None = 0.0
    ) -> list[Delivery]:
        """Up to ``max_messages`` messages of ``destination`` in order: waits up to ``timeout``
        for the first, then takes what is there."""
        async with self._turn:
            return await asyncio.to_thread(
                self.branch.receive_many, destination, max_messages, timeout
            )
