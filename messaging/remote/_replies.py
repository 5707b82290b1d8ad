"""Decoders of the remote services' reply results, one per shape, checked before they are trusted.

A reply of the wrong shape raises `_Bad`: the server broke the protocol, so
`_RemoteResource._exchange` closes the connection and treats the request as sent and unanswered
(the server may have acted), never as an answer. Keeping every shape here means both remote
resources and the cursor's administration read replies the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from coordinator.resource import Outcome, Vote
from messaging.frames import Value
from resource_managers.cursor import Delivery, QueueDepth, Subscription
from resource_managers.message_log import InvalidMessageError

from .protocol import (
    BadRequestError,
    delivery_from_value,
    outcome_from_value,
    subscription_from_value,
    vote_from_value,
)

Result = Mapping[str, Value]


class _Bad(Exception):
    """A reply of the wrong shape: the server broke the protocol."""


def _outcome(result: Result) -> Outcome | None:
    try:
        return outcome_from_value(result["outcome"])
    except BadRequestError as exc:
        raise _Bad(exc.message) from exc


def _vote(result: Result) -> Vote:
    try:
        return vote_from_value(result["vote"])
    except BadRequestError as exc:
        raise _Bad(exc.message) from exc


def _staged(result: Result) -> int:
    """The answer to a producer's ``XA_START op=stage``: messages the server holds so far."""
    count = result["staged"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise _Bad("staged must be a count")
    return count


def _gids(result: Result) -> list[str]:
    xids = result["xids"]
    if not isinstance(xids, list) or not all(isinstance(g, str) for g in xids):
        raise _Bad("xids must be a list of strings")
    return [g for g in xids if isinstance(g, str)]


def _deliveries(result: Result, least: int = 1) -> list[Delivery]:
    values = result["deliveries"]
    if not isinstance(values, list):
        raise _Bad("deliveries must be a list")
    try:
        return [delivery_from_value(v, least=least) for v in values]
    except (BadRequestError, InvalidMessageError) as exc:
        raise _Bad(exc.message) from exc


def _dead_letters(result: Result) -> list[Delivery]:
    return _deliveries(result, least=0)  # a rejected message was never handed out


def _subscription(result: Result) -> Subscription:
    try:
        return subscription_from_value(result["subscription"])
    except BadRequestError as exc:
        raise _Bad(exc.message) from exc


def _subscriptions(result: Result) -> list[Subscription]:
    values = result["subscriptions"]
    if not isinstance(values, list):
        raise _Bad("subscriptions must be a list")
    try:
        return [subscription_from_value(v) for v in values]
    except BadRequestError as exc:
        raise _Bad(exc.message) from exc


def _number(key: str) -> Callable[[Result], int]:
    def decode(result: Result) -> int:
        value = result[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _Bad(f"{key} must be an integer >= 0")
        return value

    return decode


def _text(key: str) -> Callable[[Result], str]:
    def decode(result: Result) -> str:
        value = result[key]
        if not isinstance(value, str):
            raise _Bad(f"{key} must be a string")
        return value

    return decode


def _queues(result: Result) -> list[QueueDepth]:
    values = result["queues"]
    if not isinstance(values, list):
        raise _Bad("queues must be a list")
    try:
        return [QueueDepth(**v) for v in values]
    except TypeError as exc:
        raise _Bad(f"a bad queue row: {exc}") from exc


def _flag(result: Result) -> bool:
    value = result["transactional"]
    if not isinstance(value, bool):
        raise _Bad("transactional must be a bool")
    return value
