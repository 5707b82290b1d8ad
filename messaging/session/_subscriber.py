"""`Subscriber`: a session's attachment to a topic subscription (seed 003's durable
subscribers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from coordinator import IllegalStateError, ProgrammingError, Resource
from resource_managers.cursor import Subscription

from ._types import Handler, Received, SessionLike, TopicVerbs


def topic_verbs(cursor: Resource[Any]) -> TopicVerbs:
    """``cursor`` as the subscription verbs, or a clear error if it has none."""
    if not callable(getattr(cursor, "subscribe", None)):
        raise ProgrammingError(f"{cursor!r} has no topic subscriptions")
    return cast(TopicVerbs, cursor)


class Subscriber:
    """One attachment to a topic subscription (`Session.subscriber`), receiving from its queue
    through its session. `close` detaches: a durable subscription keeps collecting publications
    until someone attaches again; a non-durable one ends with its last attachment."""

    def __init__(
        self,
        session: SessionLike,
        verbs: TopicVerbs,
        subscription: Subscription,
        on_close: Callable[[Subscriber], None],
    ) -> None:
        self.session = session
        self.topic = subscription.topic
        self.name = subscription.name
        self.queue = subscription.queue
        self.durable = subscription.durable
        self.closed = False
        self._verbs = verbs
        self._on_close = on_close

    def __repr__(self) -> str:
        kind = "durable" if self.durable else "non-durable"
        return f"<Subscriber {kind} {self.queue!r}{' closed' if self.closed else ''}>"

    def receive(self, timeout: float | None = 0.0) -> Received | None:
        self._check_open()
        return self.session.receive(self.queue, timeout)

    def consume(
        self, handler: Handler, *, max_messages: int | None = None, timeout: float | None = 0.0
    ) -> int:
        self._check_open()
        return self.session.consume(self.queue, handler, max_messages=max_messages, timeout=timeout)

    def close(self) -> None:
        """Detach (idempotent). Messages received and not yet acknowledged stay with the
        session, which acknowledges or rolls them back as its mode says."""
        if self.closed:
            return
        self.closed = True
        self._on_close(self)
        self._verbs.detach(self.topic, self.name)

    def _check_open(self) -> None:
        if self.closed:
            raise IllegalStateError(f"subscriber of {self.queue!r} is closed")

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
