"""The values a session deals in: its acknowledgment mode, the messages it hands out, and the
shapes of the branches it joins (local or remote alike)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from resource_managers.cursor import Delivery, Subscription
from resource_managers.message_log import Message, SendKwargs

if TYPE_CHECKING:  # Unpack is in typing from Python 3.11
    from typing_extensions import Unpack


class AckMode(enum.Enum):
    """When a received message is acknowledged (deleted from the cursor); JMS's modes."""

    AUTO = "auto"
    CLIENT = "client"
    DUPS_OK = "dups-ok"
    TRANSACTED = "transacted"


class ConsumerHandle(Protocol):
    """What ``tx.join(cursor)`` returns: `ConsumerBranch` or `RemoteConsumerBranch`."""

    def receive_many(
        self, destination: str, max_messages: int, timeout: float | None = 0.0
    ) -> list[Delivery]: ...


class ProducerHandle(Protocol):
    """What ``tx.join(log)`` returns: `ProducerBranch` or `RemoteProducerBranch`."""

    def send(
        self, destination: str, body: bytes, headers: dict[str, str] | None = None,
        **options: Unpack[SendKwargs],
    ) -> str: ...  # fmt: skip

    def send_to_list(
        self, destinations: list[str], body: bytes, headers: dict[str, str] | None = None,
        **options: Unpack[SendKwargs],
    ) -> list[str]: ...  # fmt: skip


class TopicVerbs(Protocol):
    """The subscription verbs of `CursorResource` and `RemoteCursor` (JMS's topics)."""

    def subscribe(self, topic: str, name: str, *, durable: bool = True) -> Subscription: ...

    def unsubscribe(self, topic: str, name: str) -> int: ...

    def attach(self, topic: str, name: str) -> Subscription: ...

    def detach(self, topic: str, name: str) -> None: ...


class SessionLike(Protocol):
    """What a received message and a subscriber ask of the session they came by (`Session` is
    one): narrow, so these values need not know the session's class."""

    def receive(self, queue: str, timeout: float | None = 0.0) -> Received | None: ...

    def consume(
        self,
        queue: str,
        handler: Handler,
        *,
        max_messages: int | None = None,
        timeout: float | None = 0.0,
    ) -> int: ...

    def acknowledge(self) -> None: ...

    def recover(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...


@dataclass(frozen=True)
class Received:
    """A message as a session hands it out: the cursor's `Delivery` and the session it came by.

    ``redelivered`` and ``delivery_count`` are JMS's JMSRedelivered and its count: a message
    that comes back after a rollback, a `Session.recover` or a crash has ``redelivered`` set."""

    delivery: Delivery
    session: SessionLike = field(repr=False, compare=False)

    @property
    def message(self) -> Message:
        return self.delivery.message

    @property
    def body(self) -> bytes:
        return self.delivery.body

    @property
    def headers(self) -> dict[str, str]:
        return self.delivery.headers

    @property
    def message_id(self) -> str:
        return self.delivery.message_id

    @property
    def redelivered(self) -> bool:
        return self.delivery.redelivered

    @property
    def delivery_count(self) -> int:
        return self.delivery.delivery_count

    @property
    def priority(self) -> int:
        return self.delivery.message.priority

    @property
    def queue(self) -> str:
        return self.delivery.queue

    def acknowledge(self) -> None:
        """JMS's ``Message.acknowledge``: acknowledges the *session* (every message it delivered
        so far), since acknowledgment is a commit of the session's one open transaction."""
        self.session.acknowledge()


Handler = Callable[[Received], None]
