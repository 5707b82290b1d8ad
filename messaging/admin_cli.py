"""``twopc subscription``, ``twopc dlq`` and ``twopc queue``: a cursor's administration from the
command line (subscriptions, JMS; dead letters and non-transactional queues, MSMQ; queue depths
and taking one waiting message out of a queue its consumers cannot get past). ``twopc stats``
(`stats_cli`) is registered here too.

Each command works **online** (``--connect HOST:PORT``, with the secret and TLS flags of
``twopc serve``) against a running ``twopc serve cursor``, through `RemoteCursor`, or **offline**
(``--dir DIR``) on the cursor's directory itself. Both, because an operator needs the second
when the server will not start (a queue full of poison to purge first) and the first whenever it
runs: the directory is locked by the server then, and opening it is refused rather than risked.

Only durable subscriptions are made here: a non-durable one lives while its subscriber is
attached, and this process exits at once. Replay and purge name their messages (``--id``,
repeated) or say ``--all``; nothing is purged by default.

Output is an aligned table, or JSON with ``--json`` (one document on stdout). Errors print
``twopc: [code] message`` and exit with the code of `coordinator.cli_edge.Exit` (2 usage,
configuration or a ``--dir`` its running server holds, 5 no server answers at ``--connect``); a
replay or purge whose ids were not all found exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.cli_output import cell as _cell
from coordinator.cli_output import emit_json as _json
from coordinator.cli_output import table, when
from coordinator.errors import ConfigurationError, IllegalStateError, LogLockedError
from resource_managers.cursor import (
    DEAD_LETTER,
    DEFAULT_MAX_DELIVERIES,
    DLQ_SUFFIX,
    DROP,
    TOPIC_PREFIX,
    Cursor,
    Delivery,
    QueueDepth,
    Subscription,
)

from . import stats_cli
from .auth import AuthError, TlsConfig
from .cli import client_flags, secret_from
from .connection import parse_address

if TYPE_CHECKING:
    from .remote import RemoteCursor


class AdminTarget(Protocol):
    """What the commands need; a local `Cursor` and a `RemoteCursor` both have it."""

    def subscribe(self, topic: str, name: str, *, durable: bool = True) -> Subscription: ...
    def unsubscribe(self, topic: str, name: str) -> int: ...
    def subscriptions(self, topic: str | None = None) -> list[Subscription]: ...
    def dead_letters(self, queue: str | None = None) -> list[Delivery]: ...
    def replay_dead_letters(self, dlq: str, ids: list[str] | None = None) -> int: ...
    def purge_dead_letters(self, dlq: str, ids: list[str] | None = None) -> int: ...
    def set_transactional(self, queue: str, transactional: bool) -> None: ...
    def queues(self) -> list[QueueDepth]: ...
    def remove_message(self, queue: str, message_id: str, action: str, why: str = "") -> str: ...


def register(sub: Any) -> None:
    """Add the ``subscription``, ``dlq`` and ``queue`` command groups, and ``stats``
    (`stats_cli`)."""
    _register_subscription(sub)
    _register_dlq(sub)
    _register_queue(sub)
    stats_cli.register(sub)


def _register_subscription(sub: Any) -> None:
    group = sub.add_parser("subscription", help="durable topic subscriptions of a cursor")
    cmds = group.add_subparsers(dest="subscription_command", required=True)
    create = cmds.add_parser("create", help="create a durable subscription (idempotent)")
    create.add_argument("topic", help="the topic, with or without 'topic:'")
    create.add_argument("name", help="1-100 of A-Z a-z 0-9 . _ -")
    create.set_defaults(func=cmd_subscription_create)
    listing = cmds.add_parser("list", help="list subscriptions")
    listing.add_argument("topic", nargs="?", help="only this topic's")
    listing.set_defaults(func=cmd_subscription_list)
    remove = cmds.add_parser("remove", help="remove a subscription and the copies waiting in it")
    remove.add_argument("topic")
    remove.add_argument("name")
    remove.set_defaults(func=cmd_subscription_remove)
    for p in (create, listing, remove):
        _target(p)


def _register_dlq(sub: Any) -> None:
    group = sub.add_parser("dlq", help="dead-letter queues of a cursor")
    cmds = group.add_subparsers(dest="dlq_command", required=True)
    listing = cmds.add_parser("list", help="list dead letters with why they are there")
    listing.add_argument("queue", nargs="?", help="a queue or its DLQ (default: every DLQ)")
    listing.set_defaults(func=cmd_dlq_list)
    replay = cmds.add_parser("replay", help="put dead letters back at the tail of their queue")
    purge = cmds.add_parser("purge", help="delete dead letters for good")
    for p, func in ((replay, cmd_dlq_replay), (purge, cmd_dlq_purge)):
        p.add_argument("dlq", help="the dead-letter queue (or the queue it belongs to)")
        which = p.add_mutually_exclusive_group(required=True)
        which.add_argument("--id", action="append", dest="ids", metavar="ID", help="repeatable")
        which.add_argument("--all", action="store_true", help="every dead letter of the queue")
        p.set_defaults(func=func)
    for p in (listing, replay, purge):
        _target(p)


def _register_queue(sub: Any) -> None:
    group = sub.add_parser("queue", help="a cursor's queues: depth, settings, one message out")
    cmds = group.add_subparsers(dest="queue_command", required=True)
    mark = cmds.add_parser(
        "set-transactional",
        help="mark a queue transactional (the default) or not: a non-transactional queue "
        "rejects transactional messages to its DLQ",
    )
    mark.add_argument("queue")
    mark.add_argument("transactional", choices=("true", "false"))
    mark.set_defaults(func=cmd_queue_set_transactional)
    listing = cmds.add_parser("list", help="every queue's depth: waiting, in flight, dead letters")
    listing.set_defaults(func=cmd_queue_list)
    drop = cmds.add_parser(
        "drop", help="delete one waiting message for good, so its queue moves past it"
    )  # fmt: skip
    dead = cmds.add_parser(
        "dead-letter", help="move one waiting message to the queue's DLQ, so its queue moves on"
    )  # fmt: skip
    for p, action in ((drop, DROP), (dead, DEAD_LETTER)):
        p.add_argument("queue", help="the destination (or subscription queue; for drop, a DLQ)")
        p.add_argument("message_id", metavar="MSGID")
        p.set_defaults(func=cmd_queue_remove, action=action)
    dead.add_argument("--why", default="", help="recorded in the dead-letter reason")
    drop.set_defaults(why="")
    for p in (mark, listing, drop, dead):
        _target(p)


def _target(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", metavar="HOST:PORT", help="a running twopc serve cursor")
    where.add_argument("--dir", help="the cursor's directory (offline: no server running)")
    client_flags(p)
    p.add_argument(
        "--max-deliveries", type=int, default=DEFAULT_MAX_DELIVERIES,
        help="offline: what the server uses (opening rolls back branches a crash left handed "
        "out, counting this against them)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


# -- opening the cursor ---------------------------------------------------------------------------


@contextlib.contextmanager
def open_cursor(args: argparse.Namespace) -> Iterator[AdminTarget]:
    """The cursor ``args`` name: its server (``--connect``) or its directory (``--dir``)."""
    if args.dir is not None:
        with _offline(Path(args.dir), args.max_deliveries) as cursor:
            yield cursor
        return
    with _online(args) as remote:
        yield remote


@contextlib.contextmanager
def _offline(path: Path, max_deliveries: int) -> Iterator[Cursor]:
    if not path.is_dir():  # a typo must not create an empty cursor and report it empty
        raise ConfigurationError(f"no cursor directory {path}")
    try:
        cursor = Cursor(path, max_deliveries=max_deliveries)
    except LogLockedError as exc:
        raise LogLockedError(
            f"cursor directory {path} is in use (is `twopc serve cursor` running on it?); "
            f"administer it online with --connect HOST:PORT. ({exc.message})",
            directory=str(path),
        ) from exc
    with cursor:
        yield cursor


@contextlib.contextmanager
def _online(args: argparse.Namespace) -> Iterator[RemoteCursor]:
    from .remote import RemoteCursor, RemoteUnavailable  # noqa: PLC0415 - `twopc` loads us at start

    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca).client_context()
    address = parse_address(args.connect)
    remote = RemoteCursor(
        address, secret_from(args), client_id="twopc-admin", tls=tls,
        server_hostname=args.tls_server_name, timeout=args.timeout,
    )  # fmt: skip
    where = f"{address[0]}:{address[1]}"
    try:
        with remote:
            yield remote
    except AuthError as exc:
        raise ConfigurationError(
            f"the server at {where} refused this client: a wrong secret, or not a cursor "
            f"server ({exc.message})"
        ) from exc
    except RemoteUnavailable as exc:
        raise RemoteUnavailable(
            f"no cursor server answers at {where} (is `twopc serve cursor` running?): {exc.message}"
        ) from exc


def topic_of(text: str) -> str:
    """A topic named with or without its ``topic:`` prefix."""
    return text if text.startswith(TOPIC_PREFIX) else TOPIC_PREFIX + text


# -- subscriptions ------------------------------------------------------------------------------

_SUBSCRIPTION_COLUMNS = ("topic", "name", "durable", "connected", "available", "in_flight", "queue")


def cmd_subscription_create(args: argparse.Namespace) -> int:
    with open_cursor(args) as cursor:
        created = cursor.subscribe(topic_of(args.topic), args.name, durable=True)
    _print_subscriptions(args, [created])
    return 0


def cmd_subscription_list(args: argparse.Namespace) -> int:
    topic = None if args.topic is None else topic_of(args.topic)
    with open_cursor(args) as cursor:
        found = cursor.subscriptions(topic)
    _print_subscriptions(args, sorted(found, key=lambda s: (s.topic, s.name)))
    return 0


def cmd_subscription_remove(args: argparse.Namespace) -> int:
    topic = topic_of(args.topic)
    with open_cursor(args) as cursor:
        dropped = cursor.unsubscribe(topic, args.name)
    if args.json:
        _json({"topic": topic, "name": args.name, "dropped": dropped})
    else:
        print(f"removed {topic}/{args.name} ({dropped} waiting cop{'y' if dropped == 1 else 'ies'} "
              "dropped)")  # fmt: skip
    return 0


def _print_subscriptions(args: argparse.Namespace, subs: Sequence[Subscription]) -> None:
    rows = [[getattr(s, c) for c in _SUBSCRIPTION_COLUMNS] for s in subs]
    if args.json:
        _json([dict(zip(_SUBSCRIPTION_COLUMNS, row, strict=True)) for row in rows])
    else:
        print(table(_SUBSCRIPTION_COLUMNS, [[_cell(v) for v in row] for row in rows]))


# -- dead letters -------------------------------------------------------------------------------


def cmd_dlq_list(args: argparse.Namespace) -> int:
    with open_cursor(args) as cursor:
        letters = cursor.dead_letters(args.queue)
    rows = [dead_letter_row(d) for d in letters]
    if args.json:
        _json(rows)
    else:
        columns = ("id", "dlq", "reason", "deliveries", "size", "destination")
        print(table(columns, [[_cell(r[c]) for c in columns] for r in rows]))
    return 0


def dead_letter_row(d: Delivery) -> dict[str, Any]:
    """What an operator needs to judge a dead letter; the body stays out (it may be large, or
    private), its size does not."""
    m = d.message
    return {
        "id": m.message_id,
        "dlq": d.queue,
        "reason": d.reason,
        "deliveries": d.delivery_count,
        "size": m.size,
        "destination": m.destination,
        "priority": m.priority,
        "persistent": m.persistent,
        "expires_at": when(m.expires_at),
        "headers": dict(m.headers),
    }


def cmd_dlq_replay(args: argparse.Namespace) -> int:
    return _settle(args, replay=True)


def cmd_dlq_purge(args: argparse.Namespace) -> int:
    return _settle(args, replay=False)


def _settle(args: argparse.Namespace, *, replay: bool) -> int:
    dlq = args.dlq if args.dlq.endswith(DLQ_SUFFIX) else args.dlq + DLQ_SUFFIX
    ids: list[str] | None = None if args.all else list(dict.fromkeys(args.ids))
    done = "replayed" if replay else "purged"
    with open_cursor(args) as cursor:
        settle = cursor.replay_dead_letters if replay else cursor.purge_dead_letters
        count = settle(dlq, ids)
    missing = 0 if ids is None else len(ids) - count
    if args.json:
        _json({"dlq": dlq, done: count, "not_found": missing})
    else:
        print(f"{done} {count} dead letter{'' if count == 1 else 's'} of {dlq}")
    if missing:
        print(f"twopc: {missing} of {len(ids or ())} ids not found among the dead letters "
              f"waiting in {dlq} (unknown, or handed out)", file=sys.stderr)  # fmt: skip
        return 1
    return 0


# -- queues -------------------------------------------------------------------------------------


def cmd_queue_set_transactional(args: argparse.Namespace) -> int:
    transactional = args.transactional == "true"
    with open_cursor(args) as cursor:
        cursor.set_transactional(args.queue, transactional)
    if args.json:
        _json({"queue": args.queue, "transactional": transactional})
    else:
        print(f"{args.queue} is {'' if transactional else 'non-'}transactional")
    return 0


_QUEUE_COLUMNS = ("queue", "available", "in_flight", "dead_letters", "transactional")


def cmd_queue_list(args: argparse.Namespace) -> int:
    with open_cursor(args) as cursor:
        found = cursor.queues()
    rows = [[getattr(q, c) for c in _QUEUE_COLUMNS] for q in found]
    if args.json:
        _json([dict(zip(_QUEUE_COLUMNS, row, strict=True)) for row in rows])
    else:
        print(table(_QUEUE_COLUMNS, [[_cell(v) for v in row] for row in rows]))
    return 0


def cmd_queue_remove(args: argparse.Namespace) -> int:
    """Drop or dead-letter one waiting message. What that means for order: the queue's
    consumers receive the next message at once; a dead-lettered one, replayed later, comes
    back at the tail, after everything sent since (docs/operations.md)."""
    with open_cursor(args) as cursor:
        try:
            queue = cursor.remove_message(args.queue, args.message_id, args.action, args.why)
        except IllegalStateError as exc:  # not waiting there: something to look at, as `dlq`
            print(f"twopc: [{exc.code}] {exc.message}", file=sys.stderr)
            return 1
    done = "dropped" if args.action == DROP else f"dead-lettered to {queue}{DLQ_SUFFIX}"
    if args.json:
        _json({"queue": queue, "id": args.message_id, "action": args.action})
    else:
        print(f"{done}: {args.message_id} of {queue}")
    return 0
