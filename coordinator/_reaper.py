"""Background threads of a manager: the timeout reaper and periodic recovery.

The reaper does not roll back under the application's feet: past its deadline a transaction is
marked rollback-only (every later join or commit fails fast and rolls back on the owner's thread).
Only a transaction abandoned for ``abandon_after`` more seconds, whose owner never came back, is
rolled back by the reaper itself, so its locks do not stay held forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .states import TxState

if TYPE_CHECKING:
    from .metrics import Metrics
    from .transaction import Transaction

log = logging.getLogger("twopc.reaper")


class Ticker:
    """Calls ``work`` every ``interval`` seconds on a daemon thread until stopped."""

    def __init__(self, name: str, interval: float, work: Callable[[], None]) -> None:
        self.interval, self.work = interval, work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.interval))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.work()
            except Exception:
                log.exception("%s failed; trying again in %.1fs", self._thread.name, self.interval)


def reap(
    in_flight: Callable[[], list[Transaction]], metrics: Metrics, abandon_after: float
) -> None:
    """One reaper sweep over a manager's live transactions (``in_flight`` lists them)."""
    now = time.monotonic()
    for tx in in_flight():
        if tx.deadline is None or now < tx.deadline:
            continue
        if tx.state == TxState.ACTIVE:
            log.warning(
                "transaction %s timed out after %.1fs; marked rollback-only", tx.gtrid, tx.timeout
            )
            tx.set_rollback_only("timeout")
            metrics.incr("timeouts")
        elif tx.state == TxState.MARKED_ROLLBACK and now >= tx.deadline + abandon_after:
            log.warning("transaction %s abandoned by its owner; rolling it back", tx.gtrid)
            metrics.incr("abandoned")
            tx.reaped = True  # before the rollback, so the owner can never see it unflagged
            tx.rollback()
