"""Routes: which cursor a log sends each destination to (``twopc serve log --route``).

A route is ``PATTERN=HOST:PORT``: every destination matching the glob ``PATTERN`` (`fnmatch`'s
syntax, case-sensitive: ``*``, ``?``, ``[seq]``) goes to that cursor. Routes are tried in the
order given and the first match wins; a destination no route matches goes to the default cursor
(``--cursor``). A destination's non-persistent twin (``<destination>#np``) follows its
destination, and a topic (``topic:<name>``) is matched by that whole name. A log runs one
transfer per cursor (`messaging.server.LogServer`), each with its own window, acknowledgments
and reconnects, so a cursor that is down holds back only the destinations routed to it.

A route is configuration, not state: the log does not remember which cursor a stream went to.
Moving a destination to another cursor while the log still holds unacknowledged messages of it
sends those to the new cursor as well, and the ones the old cursor had already accepted are then
delivered twice; move a route only once the log holds nothing unacknowledged for it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.errors import ConfigurationError
from resource_managers.message_log import VOLATILE_SUFFIX

from .connection import Address, parse_address


@dataclass(frozen=True)
class Route:
    """Destinations matching ``pattern`` go to ``cursor``."""

    pattern: str
    cursor: Address

    def matches(self, destination: str) -> bool:
        return fnmatch.fnmatchcase(destination, self.pattern)


def parse_route(text: str) -> Route:
    """``PATTERN=HOST:PORT``; a clear `ConfigurationError` for anything else. Several cursors
    (``PATTERN=HOST:PORT,HOST:PORT``) would partition the destination by message key, which
    this version does not do: refused, rather than sending everything to the first."""
    pattern, sep, where = text.partition("=")
    if not sep or not pattern.strip() or not where.strip():
        raise ConfigurationError(f"bad route {text!r}: expected PATTERN=HOST:PORT")
    cursors = [w.strip() for w in where.split(",")]
    if len(cursors) != 1:
        raise ConfigurationError(
            f"bad route {text!r}: a route names one cursor (partitioning a destination over "
            "several cursors is not supported)"
        )
    return Route(pattern.strip(), parse_address(cursors[0]))


class Router:
    """The cursor of every stream: the first route whose pattern matches its destination, else
    ``default``."""

    def __init__(self, default: Address, routes: Sequence[Route] = ()) -> None:
        self.default = default
        self.routes = tuple(routes)
        #: stream -> cursor: each transfer asks for every stream whenever the log publishes
        self._known: dict[str, Address] = {}

    def cursor_for(self, stream: str) -> Address:
        known = self._known.get(stream)
        if known is not None:
            return known
        destination = stream.removesuffix(VOLATILE_SUFFIX)
        found = next((r.cursor for r in self.routes if r.matches(destination)), self.default)
        self._known[stream] = found  # the same answer whichever thread stores it
        return found

    def cursors(self) -> list[Address]:
        """Every cursor a stream may go to, the default first, each once."""
        return list(dict.fromkeys([self.default, *(r.cursor for r in self.routes)]))
