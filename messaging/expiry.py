"""`ExpirySweeper`: the thread of ``twopc serve cursor`` that moves expired messages from
anywhere in their queues to the dead-letter queues, every ``interval`` seconds
(`resource_managers.cursor.Cursor.sweep_expired`; ``--expiry-sweep SECONDS``, 0 for none).

Why a thread and not only the receive path: a receive looks at the head of the queue it reads,
so an expired message behind a live one, or in a queue nobody reads, would wait there, counted
as work to do, until it reached a head. A sweep that fails (the journal refusing) is logged and
tried again at the next interval: nothing it does is needed for correctness, only for the
operator's view (a receive never hands out an expired message anyway).
"""

from __future__ import annotations

import logging
import threading

from coordinator.errors import TransactionError
from resource_managers.cursor import Cursor

log = logging.getLogger("twopc.cursor")

#: seconds between sweeps of `twopc serve cursor`
DEFAULT_SWEEP_INTERVAL = 5.0


class ExpirySweeper:
    """Sweeps ``cursor`` every ``interval`` seconds until `stop`; ``swept`` counts the messages
    moved since start (a metric, ``twopc_cursor_expired_swept_total``)."""

    def __init__(self, cursor: Cursor, interval: float = DEFAULT_SWEEP_INTERVAL) -> None:
        if interval <= 0:
            raise ValueError("the sweep interval must be > 0")
        self.cursor = cursor
        self.interval = interval
        self.swept = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="twopc-expiry-sweep", daemon=True)

    def start(self) -> ExpirySweeper:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def sweep_once(self) -> int:
        """One sweep now; how many messages moved (0 when it failed: logged)."""
        try:
            moved = self.cursor.sweep_expired()
        except TransactionError as exc:  # a refusing journal: the next sweep tries again
            log.warning("expiry sweep failed (will retry in %.0f s): %s", self.interval, exc)
            return 0
        except Exception:  # a defect: said loudly, and the thread goes on sweeping
            log.exception("expiry sweep failed (will retry in %.0f s)", self.interval)
            return 0
        if moved:
            log.info("expiry sweep moved %d expired message(s) to dead-letter queues", moved)
        self.swept += moved
        return moved

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sweep_once()
