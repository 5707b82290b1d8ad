"""The consumer helper: receive, handle, commit, in one transaction per batch.

The delivery side of US 8,200,836 as a loop. Each round begins a transaction, receives up to
``batch`` messages from the cursor (local `CursorResource` or `messaging.remote.RemoteCursor`),
calls the user's handler for each with the transaction, so the handler joins its own resources
(``tx.join(pg)``...), and commits: the database work and the deletion of the messages commit or
roll back together, which is what makes consumption exactly-once. A handler that raises rolls the
round back: its messages come back with ``redelivered`` set and their count raised, and after the
cursor's ``max_deliveries`` they move to the dead-letter queue, so one poison message cannot stall
the destination for ever. A transient failure (a serialization conflict, a full destination) is
retried by `TransactionManager.run`.

After a round that failed inside two-phase commit (a prepare whose answer was late or lost, a
cursor that crashed, a rollback the cursor never confirmed), the round's messages may sit in a
branch until it is rolled back. Receiving on at once would hand out the messages behind them
first and break the stream's order for a single consumer. Three guards keep it:

- `TransactionManager.run` retries a failed round only once it has settled (its completion ended,
  every rollback confirmed), so a retry never overtakes the round it replaces;
- `consume_once` receives nothing while its manager lists anything `unsettled` (a round that
  `run` gave up on): it settles first (`TransactionManager.settle`, bounded by the manager's
  ``settle_timeout``) and raises `UnsettledError`, having done nothing, if that runs out;
- the `Consumer` loop settles after any failed round, waiting as long as it takes.

So a hand-written loop of `consume_once` calls keeps the order without doing anything more; it may
catch `UnsettledError` (a store is down) and call again later.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

from coordinator import Transaction, TransactionManager, tracing
from coordinator.errors import TransactionError, UnsettledError
from resource_managers.cursor import Delivery

log = logging.getLogger("twopc.consumer")

Handler = Callable[[Transaction, Delivery], None]


def consume_once(
    tm: TransactionManager,
    cursor: Any,
    destination: str,
    handler: Handler,
    *,
    batch: int = 1,
    timeout: float | None = 1.0,
    tries: int = 3,
) -> int:
    """One round: how many messages were handled and committed (0 if none came within
    ``timeout``). Exceptions of the handler propagate after the rollback. Raises
    `UnsettledError` without receiving if an earlier round may still hold messages and does not
    settle within the manager's ``settle_timeout`` (see the module docstring)."""
    require_settled(tm)

    def work(tx: Transaction) -> int:
        deliveries = tx.join(cursor).receive_many(destination, batch, timeout)
        with tracing.activated(tx.gtrid):  # traced: the handler's spans nest in the transaction
            for delivery in deliveries:
                handler(tx, delivery)
        return len(deliveries)

    return tm.run(work, tries=tries)


def require_settled(tm: TransactionManager) -> None:
    """Return at once if nothing of ``tm`` is unsettled, else settle it (at most the manager's
    ``settle_timeout``) or raise `UnsettledError`: a receive now could overtake held messages."""
    if tm.unsettled() and not tm.settle(tm.settle_timeout):
        raise UnsettledError(
            f"earlier transactions may still hold messages ({', '.join(tm.unsettled()[:5])}); "
            "nothing was received: call tm.settle() and try again",
        )


def settle(tm: TransactionManager, stop: threading.Event | None = None) -> None:
    """Until nothing of this manager is unsettled or in doubt (`TransactionManager.settle`),
    retrying while a store is down. Waits for ever unless ``stop`` is set: handing out later
    messages first is the alternative."""
    tm.settle(stop=stop)


class Consumer:
    """`consume_once` in a loop on a background thread, until `stop`. ``errors`` counts rounds
    that failed (and were rolled back) by exception type name."""

    def __init__(
        self,
        tm: TransactionManager,
        cursor: Any,
        destination: str,
        handler: Handler,
        *,
        batch: int = 1,
        poll: float = 0.5,
        name: str | None = None,
    ) -> None:
        self.tm = tm
        self.cursor = cursor
        self.destination = destination
        self.handler = handler
        self.batch = batch
        self.poll = poll
        self.handled = 0
        self.errors: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=name or f"twopc-consumer-{destination}", daemon=True
        )

    def start(self) -> Consumer:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.handled += consume_once(
                    self.tm, self.cursor, self.destination, self.handler,
                    batch=self.batch, timeout=self.poll,
                )  # fmt: skip
            except (TransactionError, OSError) as exc:
                self.errors[type(exc).__name__] += 1
                log.warning("consumer of %s: round rolled back: %s", self.destination, exc)
                settle(self.tm, self._stop)
            except Exception as exc:  # the handler's own failure: rolled back, redelivered
                self.errors[type(exc).__name__] += 1
                log.warning("consumer of %s: handler failed: %r", self.destination, exc)
                settle(self.tm, self._stop)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> Consumer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
