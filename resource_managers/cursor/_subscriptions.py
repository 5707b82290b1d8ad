"""The cursor's topics and subscriptions (JMS durable and non-durable subscribers): create,
remove, attach and detach, and where a publication's copies still are. A mixin of `Cursor`
(`._base`); the values and names are in `._topics`.
"""

from __future__ import annotations

from coordinator.errors import IllegalStateError

from ._base import CursorBase
from ._state import SubscriptionState
from ._topics import Subscription, subscription_queue


class SubscriptionOps(CursorBase):
    """`Cursor`'s subscriptions: forced ``U``/``V`` records for durable ones, memory otherwise."""

    # -- topics and subscriptions (JMS) -------------------------------------------------------

    def subscribe(self, topic: str, name: str, *, durable: bool = True) -> Subscription:
        """Create a subscription (idempotent for one of the same kind). A durable one is a
        forced ``U`` record and keeps copies while no subscriber is attached; a non-durable one
        lives in memory, is attached at once, and goes with its last subscriber."""
        queue = subscription_queue(topic, name)
        with self._lock:
            existing = self._state.subscriptions.get(queue)
            if existing is not None:
                if existing.durable != durable:
                    kind = "durable" if existing.durable else "non-durable"
                    raise IllegalStateError(f"subscription {queue!r} exists and is {kind}")
                if not durable:  # one more subscriber shares it: it lives until the last detach
                    self._attached[queue] += 1
                return self._subscription(existing, queue)
            if not durable:
                self._state.subscriptions[queue] = SubscriptionState(topic, name, False)
                self._attached[queue] += 1
                return self._subscription(self._state.subscriptions[queue], queue)
        self._append({"k": "U", "u": topic, "s": name}, force=True)
        with self._lock:
            return self._subscription(self._state.subscriptions[queue], queue)

    def unsubscribe(self, topic: str, name: str) -> int:
        """Remove a subscription and the copies waiting in its queue (its dead letters stay);
        how many copies went. Refused while copies are handed out or prepared: their branches
        would commit or roll back messages of a subscription that no longer exists."""
        queue = subscription_queue(topic, name)
        with self._lock:
            sub = self._state.subscriptions.get(queue)
            if sub is None:
                raise IllegalStateError(f"no subscription {queue!r}")
            busy = self._in_flight(queue)
            if busy:
                raise IllegalStateError(
                    f"subscription {queue!r} has {busy} message(s) handed out or prepared; "
                    "end those transactions first"
                )
            if not sub.durable:
                self._attached.pop(queue, None)
                return self._state.remove_subscription(queue)
            waiting = len(self._state.available.get(queue, ()))
        self._append({"k": "V", "u": topic, "s": name}, force=True)
        with self._lock:
            self._attached.pop(queue, None)
        return waiting

    def subscriptions(self, topic: str | None = None) -> list[Subscription]:
        with self._lock:
            return [
                self._subscription(sub, queue)
                for queue, sub in self._state.subscriptions.items()
                if topic is None or sub.topic == topic
            ]

    def attach(self, topic: str, name: str) -> Subscription:
        """A subscriber connects to an existing subscription (counted, in memory)."""
        queue = subscription_queue(topic, name)
        with self._lock:
            sub = self._state.subscriptions.get(queue)
            if sub is None:
                raise IllegalStateError(f"no subscription {queue!r}: subscribe first")
            self._attached[queue] += 1
            return self._subscription(sub, queue)

    def detach(self, topic: str, name: str) -> None:
        """A subscriber disconnects. A durable subscription keeps its copies (and stores the
        non-persistent ones durably from now on); a non-durable one goes with its last
        subscriber, with the copies waiting in it."""
        queue = subscription_queue(topic, name)
        with self._lock:
            if self._attached[queue] > 1:
                self._attached[queue] -= 1
                return
            self._attached.pop(queue, None)
            sub = self._state.subscriptions.get(queue)
            if sub is not None and not sub.durable:
                self._state.remove_subscription(queue)

    def holders(self, message_id: str) -> list[str]:
        """Where the message still is: the topic input, subscription queues (handed out or
        not), dead-letter queues. Empty once every subscriber's copy is consumed: only then is
        the message gone from the store."""
        with self._lock:
            return sorted(e.queue for e in self._state.entries.values()
                          if e.message.message_id == message_id)  # fmt: skip

    def _subscription(self, sub: SubscriptionState, queue: str) -> Subscription:
        return Subscription(sub.topic, sub.name, sub.durable, queue, self._attached[queue] > 0,
                            len(self._state.available.get(queue, ())),
                            self._in_flight(queue))  # fmt: skip

    def _in_flight(self, queue: str) -> int:
        s = self._state
        return sum(1 for keys in (*s.handed.values(), *s.prepared.values()) for k in keys
                   if (e := s.entries.get(k)) is not None and e.queue == queue)  # fmt: skip
