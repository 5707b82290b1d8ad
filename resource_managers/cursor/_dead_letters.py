"""The cursor's queue kinds and dead letters: (non-)transactional queues (MSMQ's rejection of a
transactional message at a non-transactional queue, with a negative acknowledgment) and the
dead-letter queues an operator lists, replays and purges. A mixin of `Cursor` (`._base`).
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.errors import ProgrammingError
from resource_managers.message_log import validate_destination

from ._base import CursorBase
from ._records import DLQ_SUFFIX
from ._topics import TOPIC_PREFIX
from ._values import Delivery, shown


class DeadLetterOps(CursorBase):
    """`Cursor`'s dead-letter administration and queue kinds."""

    # -- queue kinds and dead letters (seeds 004, 003) -----------------------------------------

    def set_transactional(self, queue: str, transactional: bool) -> None:
        """Mark a queue (non-)transactional (forced ``T``). A transactional message that reaches
        a non-transactional queue is rejected into its dead-letter queue, and a negative
        acknowledgment goes to the administration queue the message named (as MSMQ does)."""
        validate_destination(queue)
        if queue.startswith(TOPIC_PREFIX):
            raise ProgrammingError(
                f"{queue!r} is a topic or a subscription's queue: those are always transactional"
            )
        if self.is_transactional(queue) != transactional:
            self._append({"k": "T", "u": queue, "v": transactional}, force=True)

    def is_transactional(self, queue: str) -> bool:
        with self._lock:
            return queue not in self._state.non_transactional

    def dead_letters(self, queue: str | None = None) -> list[Delivery]:
        """Dead letters with their reasons (``expired:``, ``max-deliveries:``, ``rejected:``),
        of one queue (its name or its dead-letter queue's) or of all, oldest first."""
        dlq = None if queue is None else self._dlq_name(queue)
        with self._lock:
            entries = sorted((e for e in self._state.entries.values()
                              if e.reason is not None and (dlq is None or e.queue == dlq)),
                             key=lambda e: e.order)  # fmt: skip
            return [Delivery(e.message, shown(e), e.queue, e.reason) for e in entries]

    def replay_dead_letters(self, dlq: str, ids: Sequence[str] | None = None) -> int:
        """Put dead letters back at the tail of their queue with their count reset (forced
        ``Y``); ``ids``: message ids, None for all. Handed-out ones are skipped; how many went."""
        return self._settle_dead_letters("Y", dlq, ids)

    def purge_dead_letters(self, dlq: str, ids: Sequence[str] | None = None) -> int:
        """Delete dead letters (forced ``Z``); ``ids`` as for `replay_dead_letters`."""
        return self._settle_dead_letters("Z", dlq, ids)

    def _settle_dead_letters(self, kind: str, dlq: str, ids: Sequence[str] | None) -> int:
        name = self._dlq_name(dlq)
        wanted = None if ids is None else set(ids)
        with self._lock:
            keys = [
                k
                for k in self._state.available.get(name, ())
                if wanted is None or self._state.entries[k].message.message_id in wanted
            ]
            if kind == "Y":  # nowhere to go back to, or a queue that would reject it again
                keys = [k for k in keys if self._state.replayable(self._state.entries[k])]
        if keys:
            self._append({"k": kind, "i": keys}, force=True)
            with self._lock:
                self.changed.notify_all()
        return len(keys)

    @staticmethod
    def _dlq_name(queue: str) -> str:
        validate_destination(queue.removesuffix(DLQ_SUFFIX))
        return queue if queue.endswith(DLQ_SUFFIX) else queue + DLQ_SUFFIX

    @staticmethod
    def dead_letter_queue(destination: str) -> str:
        return destination + DLQ_SUFFIX
