"""The consumer helper for asyncio code: receive, handle, commit, one `coordinator.aio`
transaction per round, as `messaging.consumer` does on a thread.

Two ways to use it; both give each round its own transaction, which the handler (or the loop's
body) joins its own resources to (``await tx.join(pg)``, an `AsyncPostgresResource`), so the
database work and the taking of the messages commit or roll back together::

    consumer = AsyncConsumer(atm, cursor, "orders", handle)     # handle(tx, delivery) awaited
    task = asyncio.create_task(consumer.run())  ...  consumer.stop(); await task

    async with AsyncConsumer(atm, cursor, "orders") as consumer:
        async for tx, delivery in consumer:                      # committed when the body ends
            session = await tx.join(pg)
            ...

The acknowledgement *is* the commit: the cursor's branch commits with the handler's work, never
before. What the threaded `Consumer` guarantees holds here, by the same code: a round whose
handler (or loop body) raises rolls back and its messages come back with ``redelivered`` set,
until the cursor's ``max_deliveries`` moves them to the dead-letter queue; a transient failure is
retried (`AsyncTransactionManager.run`); no round receives while an earlier one may still hold
messages (`messaging.consumer.require_settled`, run off the loop), and after a failed round the
loop settles first (`messaging.consumer.settle`), so a single consumer keeps the stream's order.

Cancellation: a task cancelled while its round commits does not stop the commit
(`AsyncTransactionManager.complete` shields it): the round reaches its outcome, then the
`asyncio.CancelledError` propagates. Cancelled before the commit, the round rolls back and its
messages are delivered again.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from types import TracebackType
from typing import Any

from coordinator import tracing
from coordinator.aio import AsyncTransaction, AsyncTransactionManager
from coordinator.errors import TransactionError
from resource_managers.cursor import Delivery

from .consumer import require_settled, settle

log = logging.getLogger("twopc.consumer")

__all__ = ["AsyncConsumer", "AsyncHandler", "aconsume_once"]

AsyncHandler = Callable[[AsyncTransaction, Delivery], Awaitable[None]]


async def aconsume_once(
    atm: AsyncTransactionManager,
    cursor: Any,
    destination: str,
    handler: AsyncHandler,
    *,
    batch: int = 1,
    timeout: float | None = 1.0,
    tries: int = 3,
) -> int:
    """`messaging.consumer.consume_once` for coroutines: how many messages were handled and
    committed in one round (0 if none came within ``timeout``). ``cursor`` is an async one
    (`messaging.remote.aio.AsyncRemoteCursor`)."""
    await atm.off_loop(require_settled, atm.manager)

    async def work(tx: AsyncTransaction) -> int:
        deliveries = await (await tx.join(cursor)).receive_many(destination, batch, timeout)
        with tracing.activated(tx.gtrid):
            for delivery in deliveries:
                await handler(tx, delivery)
        return len(deliveries)

    return await atm.run(work, tries=tries)


class AsyncConsumer:
    """`aconsume_once` in a loop (`run`), or the messages one transaction each (``async for``
    inside ``async with``), until `stop`. ``errors`` counts rounds that failed (and were rolled
    back) by exception type name, as `messaging.consumer.Consumer`'s does."""

    def __init__(
        self,
        atm: AsyncTransactionManager,
        cursor: Any,
        destination: str,
        handler: AsyncHandler | None = None,
        *,
        batch: int = 1,
        poll: float = 0.5,
    ) -> None:
        self.atm = atm
        self.cursor = cursor
        self.destination = destination
        self.handler = handler
        self.batch = batch
        self.poll = poll
        self.handled = 0
        self.errors: Counter[str] = Counter()
        self._stop = threading.Event()  # also read by `settle` on a worker thread
        self._stream: AsyncGenerator[tuple[AsyncTransaction, Delivery], None] | None = None
        #: deliveries of the open round not yet handed to the loop body (None: no round open)
        self._left: int | None = None

    def stop(self) -> None:
        """End `run` (after its round) or the iteration (before its next round)."""
        self._stop.set()

    async def run(self) -> None:
        """Rounds of `aconsume_once` with ``handler`` until `stop`; a failed round is counted,
        logged and settled, and its messages come again."""
        if self.handler is None:
            raise TypeError("AsyncConsumer.run needs a handler; or iterate it instead")
        while not self._stop.is_set():
            try:
                self.handled += await aconsume_once(
                    self.atm, self.cursor, self.destination, self.handler,
                    batch=self.batch, timeout=self.poll,
                )  # fmt: skip
            except Exception as exc:
                await self._failed(exc)

    async def _failed(self, exc: Exception) -> None:
        self.errors[type(exc).__name__] += 1
        kind = "round rolled back" if isinstance(exc, TransactionError | OSError) else "failed"
        log.warning("async consumer of %s: %s: %r", self.destination, kind, exc)
        await self.atm.off_loop(settle, self.atm.manager, self._stop)

    async def _rounds(self) -> AsyncGenerator[tuple[AsyncTransaction, Delivery], None]:
        """One transaction per round; it commits when the loop body asks for the next message
        after the round's last, and rolls back if the body raises (`__aexit__` closes this
        generator, which exits the transaction block with `GeneratorExit`)."""
        while not self._stop.is_set():
            await self.atm.off_loop(require_settled, self.atm.manager)
            try:
                async with self.atm.atransaction() as tx:
                    branch = await tx.join(self.cursor)
                    deliveries = await branch.receive_many(self.destination, self.batch, self.poll)
                    for n, delivery in enumerate(deliveries, 1):
                        self._left = len(deliveries) - n
                        yield tx, delivery
                    self._left = None
            except (TransactionError, OSError) as exc:  # the commit failed: they come again
                await self._failed(exc)
                continue
            self.handled += len(deliveries)

    def __aiter__(self) -> AsyncGenerator[tuple[AsyncTransaction, Delivery], None]:
        if self._stream is None:
            self._stream = self._rounds()
        return self._stream

    async def __aenter__(self) -> AsyncConsumer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """End the iteration here, not in the garbage collector: the open round commits if the
        body left the loop cleanly with every message of the round handled, else (an error, a
        ``break`` with messages of the round still unhandled) it rolls back."""
        stream, self._stream = self._stream, None
        self._stop.set()
        if stream is None:
            return
        try:
            if exc_type is None and self._left == 0:
                async for _ in stream:  # resumes after the last yield: the round commits
                    raise AssertionError("a round after stop")
        finally:
            self._left = None
            await stream.aclose()
