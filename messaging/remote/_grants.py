"""What each remote request needs of a client's grants (`messaging.authz`), read from the request
before the service touches anything (a producer's messages decoded first, once), and what a
listing may show it.

- producer ``XA_PREPARE``, one-phase ``XA_COMMIT``: ``produce`` on every message's destination
  and on its ``twopc-admin-queue`` (where its negative acknowledgment would go);
- consumer ``XA_START`` (a receive): ``consume`` on the destination (a queue, a subscription's
  queue ``topic:<t>/<name>``, a ``.DLQ``);
- ``subscribe``, ``unsubscribe``, ``attach``, ``detach``: ``consume`` or ``administer`` on the
  subscription's queue;
- ``dead_letters`` of one queue, ``replay_dead_letters``, ``purge_dead_letters``: ``administer``
  on the dead-letter queue (``<queue>.DLQ``);
- ``set_transactional``, ``is_transactional``: ``administer`` on the queue;
- every verb with an xid: the xid's node among ``nodes`` (checked by the service).

Listings are filtered instead of refused: ``subscriptions`` shows the subscriptions whose queue
the client may consume or administer, ``dead_letters`` (of every queue) the dead letters of
queues it may administer, and ``XA_RECOVER`` the branches of its nodes.

A value of the wrong shape is skipped here: the service's own checks refuse it as a bad request
(a producer's messages are decoded, and refused if malformed, before this runs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from messaging.authz import Authoriser
from messaging.clients import Client
from messaging.frames import FrameType, Value, XaRequest
from resource_managers.cursor import DLQ_SUFFIX
from resource_managers.message_log import ADMIN_QUEUE_HEADER, Message

from .protocol import STATS_OP

Result = dict[str, Value]
_SUBSCRIPTION_OPS = frozenset({"subscribe", "unsubscribe", "attach", "detach"})
_QUEUE_OPS = frozenset({"set_transactional", "is_transactional"})
_DLQ_OPS = frozenset({"replay_dead_letters", "purge_dead_letters"})
#: listings answered with only what the client may see (`filter_admin_result`)
_LISTINGS = frozenset({"subscriptions", "queues"})


def authorise_producer(
    authoriser: Authoriser, client: Client, request: XaRequest, messages: Sequence[Message]
) -> None:
    """``messages``: the request's, decoded and checked by the service (from a list of maps or
    a packed run alike)."""
    if request.verb == FrameType.XA_RECOVER and request.args.get("op") == STATS_OP:
        _authorise_stats(authoriser, client)
    for message in messages:
        authoriser.check_produce(client, message.destination)
        admin_queue = message.headers.get(ADMIN_QUEUE_HEADER)
        if admin_queue is not None:
            authoriser.check_produce(client, admin_queue)


def authorise_consumer(authoriser: Authoriser, client: Client, request: XaRequest) -> None:
    args = request.args
    if request.verb == FrameType.XA_START:
        destination = args.get("destination")
        if isinstance(destination, str):
            authoriser.check_consume(client, destination)
    elif request.verb == FrameType.XA_RECOVER:
        op = args.get("op")
        if isinstance(op, str):
            _authorise_admin(authoriser, client, op, args)


def _authorise_admin(
    authoriser: Authoriser, client: Client, op: str, args: Mapping[str, Value]
) -> None:
    if op in _SUBSCRIPTION_OPS:
        topic, name = args.get("topic"), args.get("name")
        if isinstance(topic, str) and isinstance(name, str):
            authoriser.check_subscription(client, f"{topic}/{name}")
    elif op in _QUEUE_OPS:
        queue = args.get("queue")
        if isinstance(queue, str):
            authoriser.check_administer(client, queue)
    elif op in _DLQ_OPS:
        dlq = args.get("dlq")
        if isinstance(dlq, str):
            authoriser.check_administer(client, dlq)
    elif op == "dead_letters":
        queue = args.get("queue")
        if isinstance(queue, str):
            authoriser.check_administer(client, _dlq(queue))
    elif op == "remove_message":  # dropping or dead-lettering a message: its administrator's
        queue = args.get("queue")
        if isinstance(queue, str):
            authoriser.check_administer(client, queue)
    elif op == STATS_OP:
        _authorise_stats(authoriser, client)
    elif op not in _LISTINGS:  # an op this table does not know is refused, never let through
        authoriser.check_administer(client, "*")


def _authorise_stats(authoriser: Authoriser, client: Client) -> None:
    """A server's statistics name every destination it holds: only a client that may
    administer them all (an ``administer`` glob matching ``*``, such as ``"*"``) reads them."""
    authoriser.check_administer(client, "*")


def filter_admin_result(client: Client, op: str, result: Result) -> Result:
    """A listing with only what ``client`` may see (see the module docstring)."""
    if op == "subscriptions":
        return _only(result, "subscriptions", lambda q: _may_use(client, q))
    if op == "dead_letters":
        return _only(result, "deliveries", client.administer.allows)
    if op == "queues":
        return _only(result, "queues", lambda q: _may_use(client, q))
    return result


def _only(result: Result, key: str, allowed: Callable[[str], bool]) -> Result:
    items = result.get(key)
    if not isinstance(items, list):
        return result
    kept: list[Value] = [
        v for v in items
        if isinstance(v, Mapping) and isinstance(v.get("queue"), str) and allowed(str(v["queue"]))
    ]  # fmt: skip
    return {**result, key: kept}


def _may_use(client: Client, queue: str) -> bool:
    return client.consume.allows(queue) or client.administer.allows(queue)


def _dlq(queue: str) -> str:
    return queue if queue.endswith(DLQ_SUFFIX) else queue + DLQ_SUFFIX
