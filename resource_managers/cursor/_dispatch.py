"""The cursor's topic dispatch: the topic input, the in-doubt list and the monitor queue
(concurrent dispatch that keeps each publisher's order; duplicate elimination when several
dispatcher threads recover). A mixin of `Cursor` (`._base`); the dispatcher threads that drive
it are the messaging layer's.
"""

from __future__ import annotations

import time

from coordinator.errors import IllegalStateError

from ._base import CursorBase
from ._topics import TopicPublication


class DispatchOps(CursorBase):
    """`Cursor`'s topic input: take a publication (``I``), copy it (``K``), finish it (``E``)."""

    # -- topic dispatch: the input, the in-doubt list, the monitor queue (seeds 002, 001) -------

    def next_publication(self, worker: str, timeout: float | None = 0.0) -> TopicPublication | None:
        """Take the oldest publication off the topic input for dispatcher thread ``worker``:
        a lazy ``I`` record puts it in the in-doubt list with the subscription queues it goes
        to. Waits up to ``timeout`` seconds (None: for ever) for one."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._take_lock:
            while True:
                with self.changed:
                    mid = next(iter(self._state.inbox), None)
                    if mid is None:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            return None
                        self.changed.wait(remaining)
                        continue
                    entry = self._state.entries[mid]
                    queues = self._state.topic_queues(entry.message.destination)
                record = {"k": "I", "m": mid, "w": worker, "z": list(queues)}
                self._append(record, force=False)
                return TopicPublication(entry.message, queues, worker)

    def deliver_copy(self, message_id: str, queue: str, by: str) -> bool:
        """Put a publication's copy into a subscription queue with its monitor entry, in one
        ``K`` record; False (nothing written) if the monitor queue already has this copy or the
        subscription is gone. Forced only for a non-persistent message while a durable
        subscriber is disconnected: JMS stores that one as if it were persistent."""
        with self._lock:
            taken = self._state.taken.get(message_id)
            if taken is None:
                raise IllegalStateError(f"publication {message_id} is not in the in-doubt list")
            sub = self._state.subscriptions.get(queue)
            if queue in taken.monitor or sub is None:
                return False
            message = self._state.entries[message_id].message
            force = not message.persistent and sub.durable and self._attached[queue] == 0
        self._append({"k": "K", "m": message_id, "u": queue, "w": by}, force=force)
        with self._lock:
            self.changed.notify_all()
        return True

    def finish_publication(self, message_id: str) -> None:
        """The publication reached every subscription: it leaves the in-doubt list (lazy ``E``;
        if lost, recovery finds every copy in the monitor queue and sends none again)."""
        with self._lock:
            if message_id not in self._state.taken:
                return
        self._append({"k": "E", "m": message_id}, force=False)
        self._compaction.maybe()

    def in_doubt(self) -> list[TopicPublication]:
        """The in-doubt list, in take order."""
        with self._lock:
            return [TopicPublication(self._state.entries[mid].message, t.queues, t.worker)
                    for mid, t in self._state.taken.items()]  # fmt: skip

    def monitored(self, message_id: str, queue: str) -> bool:
        """Whether the monitor queue records this publication's copy in ``queue``."""
        with self._lock:
            taken = self._state.taken.get(message_id)
            return taken is not None and queue in taken.monitor

    def topic_backlog(self) -> int:
        """Publications not yet taken by a dispatcher thread."""
        with self._lock:
            return len(self._state.inbox)
