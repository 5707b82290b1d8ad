"""Routes: which cursor a log sends each destination to (``twopc serve log --route``).

A route is ``PATTERN=HOST:PORT[,HOST:PORT...]``: every destination matching the glob ``PATTERN``
(`fnmatch`'s syntax, case-sensitive: ``*``, ``?``, ``[seq]``) goes to that cursor. Routes are
tried in the order given and the first match wins; a destination no route matches goes to the
default cursor (``--cursor``). A destination's non-persistent twin (``<destination>#np``)
follows its destination, and a topic (``topic:<name>``) is matched by that whole name. A log runs
one transfer per cursor (`messaging.server.LogServer`), each with its own window,
acknowledgments and reconnects, so a cursor that is down holds back only the destinations routed
to it.

A route naming N cursors *partitions* its destinations N ways: the log numbers each message in
the stream of its key's partition (``blake2b(key) % N``, keyless messages in partition 0:
`resource_managers.message_log._partition`), and partition ``i`` goes to the ``i``-th cursor
named. The order of the cursors is therefore part of the configuration: reordering them moves
partitions between cursors, as moving a route does.

A route is configuration, not state: the log does not remember which cursor a stream went to.
Moving a destination to another cursor while the log still holds unacknowledged messages of it
sends those to the new cursor as well, and the ones the old cursor had already accepted are then
delivered twice; move a route only once the log holds nothing unacknowledged for it. A changed
partition count is checked: the log refuses to open while a destination holds unacknowledged
messages numbered under another count (`MessageLog`'s ``partitions``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.errors import ConfigurationError
from resource_managers.message_log import MAX_PARTITIONS, parse_stream

from .connection import Address, parse_address


@dataclass(frozen=True, init=False)
class Route:
    """Destinations matching ``pattern`` go to ``cursors``: ``Route("orders.*", a)`` sends them to
    cursor ``a``; ``Route("orders.*", a, b)`` partitions each of them over ``a`` (partition 0)
    and ``b`` (partition 1) by message key."""

    pattern: str
    cursors: tuple[Address, ...]

    def __init__(self, pattern: str, *cursors: Address) -> None:
        if not cursors or len(cursors) > MAX_PARTITIONS:
            raise ConfigurationError(
                f"route {pattern!r}: name 1-{MAX_PARTITIONS} cursors, not {len(cursors)}"
            )
        if len(set(cursors)) != len(cursors):
            raise ConfigurationError(f"route {pattern!r} names a cursor twice")
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "cursors", tuple(cursors))

    @property
    def cursor(self) -> Address:
        """The first cursor (the only one of an unpartitioned route)."""
        return self.cursors[0]

    def matches(self, destination: str) -> bool:
        return fnmatch.fnmatchcase(destination, self.pattern)


def parse_route(text: str) -> Route:
    """``PATTERN=HOST:PORT[,HOST:PORT...]``; a clear `ConfigurationError` for anything else.
    Several cursors partition the destinations by message key, in the order given."""
    pattern, sep, where = text.partition("=")
    if not sep or not pattern.strip() or not where.strip():
        raise ConfigurationError(f"bad route {text!r}: expected PATTERN=HOST:PORT[,HOST:PORT...]")
    cursors = [w.strip() for w in where.split(",")]
    if not all(cursors):
        raise ConfigurationError(f"bad route {text!r}: an empty HOST:PORT in the list")
    return Route(pattern.strip(), *(parse_address(c) for c in cursors))


class Router:
    """The cursor of every stream: the first route whose pattern matches its destination, else
    ``default``; of a partitioned route, the cursor of the stream's partition."""

    def __init__(self, default: Address, routes: Sequence[Route] = ()) -> None:
        self.default = default
        self.routes = tuple(routes)
        #: stream -> cursor: each transfer asks for every stream whenever the log publishes
        self._known: dict[str, Address] = {}
        #: destination -> partitions: the log asks for every message it numbers
        self._counts: dict[str, int] = {}

    def _route(self, destination: str) -> Route | None:
        return next((r for r in self.routes if r.matches(destination)), None)

    def partitions(self, destination: str) -> int:
        """How many partitions ``destination`` has: its route's cursors (1 unrouted). What the
        log numbers by (`MessageLog`'s ``partitions``)."""
        count = self._counts.get(destination)
        if count is None:
            route = self._route(destination)
            count = self._counts[destination] = 1 if route is None else len(route.cursors)
        return count

    def cursor_for(self, stream: str) -> Address:
        known = self._known.get(stream)
        if known is not None:
            return known
        parsed = parse_stream(stream)
        destination = stream if parsed is None else parsed.destination
        route = self._route(destination)
        if route is None:
            found = self.default
        else:  # a partition numbered under another count (allowed by the operator) wraps
            found = route.cursors[(0 if parsed is None else parsed.index) % len(route.cursors)]
        self._known[stream] = found  # the same answer whichever thread stores it
        return found

    def cursors(self) -> list[Address]:
        """Every cursor a stream may go to, the default first, each once."""
        return list(dict.fromkeys([self.default, *(c for r in self.routes for c in r.cursors)]))
