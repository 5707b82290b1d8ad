"""Topic names and the values the topic surface of `Cursor` returns (JMS's publish/subscribe).

A topic is a destination ``topic:<name>`` (no ``/``). Each subscription has a queue of its own,
``<topic>/<subscription name>``, where the dispatcher puts one copy of every publication; its
consumers receive from that queue like from any other, with delivery counts, redelivery and a
dead-letter queue per subscription.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from resource_managers.message_log import (
    TOPIC_PREFIX,
    InvalidMessageError,
    Message,
    validate_destination,
)

from ._state import is_subscription_queue, is_topic

__all__ = [
    "TOPIC_PREFIX",
    "Subscription",
    "TopicPublication",
    "is_subscription_queue",
    "is_topic",
    "subscription_queue",
    "validate_topic",
]

_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}\Z")


def validate_topic(topic: object) -> str:
    if not isinstance(topic, str) or not is_topic(topic) or topic == TOPIC_PREFIX:
        raise InvalidMessageError(
            f"invalid topic {str(topic)[:80]!r}: {TOPIC_PREFIX!r} then a name without '/'"
        )
    return validate_destination(topic)


def subscription_queue(topic: str, name: str) -> str:
    """The queue a subscription's consumers receive from."""
    validate_topic(topic)
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidMessageError(
            f"invalid subscription name {str(name)[:80]!r}: 1-100 letters, digits, '.', '_', '-'"
        )
    return validate_destination(f"{topic}/{name}")


@dataclass(frozen=True)
class Subscription:
    """A subscription as `Cursor.subscriptions` reports it. ``connected``: a subscriber is
    attached (a non-durable subscription exists only while one is); ``available`` and
    ``in_flight`` count its copies waiting and handed out."""

    topic: str
    name: str
    durable: bool
    queue: str
    connected: bool
    available: int
    in_flight: int


@dataclass(frozen=True)
class TopicPublication:
    """A publication a dispatcher thread took off the topic input (an in-doubt list entry):
    the message and the subscription queues it fans out to."""

    message: Message
    queues: tuple[str, ...]
    worker: str

    @property
    def message_id(self) -> str:
        return self.message.message_id

    @property
    def publisher(self) -> str:
        return self.message.publisher


def subscription_name(queue: str) -> tuple[str, str]:
    """(topic, name) of a subscription queue."""
    if not is_subscription_queue(queue):
        raise InvalidMessageError(f"{queue[:80]!r} is not a subscription queue")
    topic, _, name = queue.partition("/")
    return topic, name
