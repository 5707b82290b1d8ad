"""The overlay that lets a Redis branch's reads see its own buffered writes.

Pure code, no I/O. It answers a read (or computes a buffered write's redis-py-like return value)
by replaying the branch's ops on one key over a *partial* picture of the server's value: a `View`
holds the key's type, if known, and only the facts asked about (the string, one hash field, one
set member, one sorted-set score, the list length, the time to live, or a whole hash, set or
list). What the ops alone cannot decide stays `UNKNOWN`; the caller then loads those facts from
the server (`Base`) and replays again, which always decides. Errors Redis would raise at the call
(``WRONGTYPE``, not an integer, overflow, NaN score) are raised as `redis.ResponseError`, as
redis-py would.

Removing the last member of a hash, set or sorted set deletes the key in Redis, and what the
branch does next may depend on that (``set(nx=True)``, a command of another type). So for a key
that loses members somewhere in the branch, `queries_for` asks for the collection's size and for
every member the branch touches, which lets the replay count exactly. A whole hash or set is
answered the same way: what was read, less the touched members, plus the touched members as the
replay left them.

Why one module: every command family's replay over the server's values must agree with the
commit script's effect of the same command, so the replays are kept in one place to be compared,
one function per family, with the queries that feed them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from redis.exceptions import ResponseError

from ._writeset import INT64_MAX, INT64_MIN, Op

WRONGTYPE: Final = "WRONGTYPE Operation against a key holding the wrong kind of value"
# as redis-py words them: it drops the "ERR " that Redis puts in front
NOT_INTEGER: Final = "value is not an integer or out of range"
HASH_NOT_INTEGER: Final = "hash value is not an integer"
OVERFLOW: Final = "increment or decrement would overflow"
NAN_SCORE: Final = "resulting score is not a number (NaN)"

_INT_TEXT = re.compile(rb"-?[1-9][0-9]{0,18}\Z|0\Z")


class _Unknown:
    """What the branch's own ops cannot tell; the server must be asked."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()

#: A fact about one key: ("S", b"") its string, ("F", field), ("M", member) set membership,
#: ("Z", member) sorted-set score, ("L", b"") list length, ("T", b"") time to live (TTL's
#: answer), and whole collections: ("H", b"") every field of a hash, ("A", b"") every member of
#: a set, ("R", b"") every item of a list.
Query = tuple[str, bytes]
STRING: Final[Query] = ("S", b"")
LENGTH: Final[Query] = ("L", b"")
TTL: Final[Query] = ("T", b"")
HASH_ALL: Final[Query] = ("H", b"")
SET_ALL: Final[Query] = ("A", b"")
LIST_ALL: Final[Query] = ("R", b"")
#: the number of fields or members of a hash, set or sorted set
SIZE: Final[Query] = ("N", b"")
_FACT_TYPE: Final = {
    "S": "string",
    "F": "hash",
    "M": "set",
    "Z": "zset",
    "L": "list",
    "H": "hash",
    "A": "set",
    "R": "list",
}
_EMPTY: Final[dict[str, Any]] = {"S": None, "F": None, "M": False, "Z": None, "L": 0, "N": 0}
#: TTL's answer for a missing key, and for a key without a time to live
NO_KEY_TTL: Final = -2
NO_TTL: Final = -1
_COLLECTIONS: Final = ("hash", "set", "zset")
_REMOVALS: Final = ("HDEL", "SREM", "ZREM")


# -- the overlay --------------------------------------------------------------------------------


@dataclass
class Base:
    """What the server held for one key when it was read: its type and some facts."""

    kind: str
    facts: dict[Query, Any] = field(default_factory=dict)

    def covers(self, queries: Iterable[Query]) -> bool:
        return all(q in self.facts for q in queries)


@dataclass
class View:
    """A key's state after replaying ops: ``kind`` None while unknown, facts possibly UNKNOWN."""

    kind: str | None
    facts: dict[Query, Any]

    @classmethod
    def start(cls, queries: Iterable[Query], base: Base | None) -> View:
        if base is None:
            return cls(None, dict.fromkeys(queries, UNKNOWN))
        facts = {}
        for q in queries:
            if q == TTL:
                known = base.kind != "none"
                facts[q] = base.facts.get(q, UNKNOWN) if known else NO_KEY_TTL
                continue
            matches = base.kind in _COLLECTIONS if q == SIZE else base.kind == _FACT_TYPE[q[0]]
            # a copy: the replay changes a whole collection in place, the base stays as read
            facts[q] = _copy(base.facts.get(q, UNKNOWN)) if matches else _empty(q, base.kind)
        return cls(base.kind, facts)

    def get(self, query: Query) -> Any:
        return self.facts.get(query, UNKNOWN)

    def put(self, query: Query, value: Any) -> None:
        if query in self.facts:
            self.facts[query] = value

    def reset(self, kind: str | None) -> None:
        """The key was replaced (SET, DEL): nothing of its old content is left, nor its time to
        live."""
        self.kind = kind
        for query in self.facts:
            self.facts[query] = UNKNOWN if kind is None else _empty(query, kind)

    def require(self, kind: str) -> None:
        if self.kind not in (None, "none", kind):
            raise ResponseError(WRONGTYPE)

    def exists(self) -> Any:
        return UNKNOWN if self.kind is None else self.kind != "none"

    def answer(self, query: Query) -> Any:
        """The fact as a read would see it: WRONGTYPE if the key holds another type."""
        if query == TTL:  # any type has one
            return (
                NO_KEY_TTL
                if self.kind == "none"
                else UNKNOWN
                if self.kind is None
                else self.get(query)
            )
        wanted = _FACT_TYPE[query[0]]
        if self.kind == "none":
            return _empty(query, "none")
        if self.kind is not None and self.kind != wanted:
            raise ResponseError(WRONGTYPE)
        if self.kind is None and query[0] in "SLHAR":
            return UNKNOWN
        if query[0] in "HA":
            return self._whole(query)
        return self.get(query)

    def _whole(self, query: Query) -> Any:
        """Every field or member: what was read and not touched since, then the touched ones
        as the replay left them (the per-member facts are exact, see `queries_for`)."""
        rest = self.get(query)
        if rest is UNKNOWN:
            return UNKNOWN
        member_kind = "F" if query == HASH_ALL else "M"
        touched = {q[1]: v for q, v in self.facts.items() if q[0] == member_kind}
        if UNKNOWN in touched.values():
            return UNKNOWN
        if query == HASH_ALL:
            fields = {f: v for f, v in rest.items() if f not in touched}
            fields.update({f: v for f, v in touched.items() if v is not None})
            return fields
        return {m for m in rest if m not in touched} | {m for m, v in touched.items() if v}


def _empty(query: Query, kind: str | None) -> Any:
    """A fact of a key that does not hold its type (or was just replaced by ``kind``)."""
    if query == TTL:
        return NO_KEY_TTL if kind == "none" else NO_TTL
    whole = {"H": dict, "A": set, "R": list}.get(query[0])
    return whole() if whole is not None else _EMPTY[query[0]]


def _copy(value: Any) -> Any:
    return type(value)(value) if isinstance(value, dict | set | list) else value


def result_queries(op: Op) -> list[Query]:
    """The facts a write's return value depends on (besides the key's type)."""
    cmd, args = op.cmd, op.args
    if cmd == "INCRBY":
        return [STRING]
    if cmd == "HSET":
        return [("F", f) for f in args[0::2]]
    if cmd == "HDEL":
        return [("F", f) for f in args]
    if cmd == "HINCRBY":
        return [("F", args[0])]
    if cmd in ("SADD", "SREM"):
        return [("M", m) for m in args]
    if cmd == "ZADD":
        return [("Z", m) for m in args[1::2]]
    if cmd == "ZREM":
        return [("Z", m) for m in args]
    if cmd == "ZINCRBY":
        return [("Z", args[1])]
    if cmd in ("LPUSH", "RPUSH"):
        return [LENGTH]
    return []


def queries_for(ops: Sequence[Op], queries: Iterable[Query]) -> list[Query]:
    """``queries``, plus what exact counting needs when members of this key are removed."""
    wanted = list(queries)
    if any(op.cmd in _REMOVALS for op in ops):
        wanted.append(SIZE)
        for op in ops:
            wanted += [q for q in result_queries(op) if q[0] in "FMZ"]
    if HASH_ALL in wanted or SET_ALL in wanted:  # a whole collection: every touched member too
        for op in ops:
            wanted += [q for q in result_queries(op) if q[0] in "FM"]
    return list(dict.fromkeys(wanted))


def list_range(items: list[Any], start: int, end: int) -> list[Any]:
    """``LRANGE``'s slice: both ends inclusive, negative counted from the end, clamped."""
    length = len(items)
    start = max(length + start, 0) if start < 0 else start
    end = min(length + end if end < 0 else end, length - 1)
    return items[start : end + 1] if start <= end else []


def replay(ops: Iterable[Op], queries: Iterable[Query], base: Base | None) -> View:
    view = View.start(queries, base)
    for op in ops:
        step(view, op)
    return view


def _count(values: Iterable[Any]) -> Any:
    total = 0
    for value in values:
        if value is UNKNOWN:
            return UNKNOWN
        total += int(value)
    return total


def _add_int(current: Any, amount: int, not_integer: str) -> Any:
    if current is UNKNOWN:
        return UNKNOWN
    if current is None:
        current = b"0"
    if not _INT_TEXT.match(current) or not INT64_MIN <= int(current) <= INT64_MAX:
        raise ResponseError(not_integer)
    new = int(current) + amount
    if not INT64_MIN <= new <= INT64_MAX:
        raise ResponseError(OVERFLOW)
    return new


def step(view: View, op: Op) -> Any:
    """Apply ``op`` to ``view``; return redis-py's answer to it, or UNKNOWN."""
    cmd, args = op.cmd, op.args
    if cmd == "SET":
        nx, xx = op.set_flags()
        if nx or xx:
            existed = view.exists()
            if existed is UNKNOWN:
                view.reset(None)
                return UNKNOWN
            if (nx and existed) or (xx and not existed):
                return None
        view.reset("string")
        view.put(STRING, args[0])
        flags = args[1:]  # the value is first: it may itself read b"EX"
        if len(flags) >= 2 and flags[-2] in (b"EX", b"PX"):
            view.put(TTL, _ttl_seconds(flags[-2], int(flags[-1])))
        return True
    if cmd == "DEL":
        existed = view.exists()
        view.reset("none")
        return UNKNOWN if existed is UNKNOWN else int(existed)
    if cmd == "EXPIRE":
        existed = view.exists()
        if op.expire_seconds() <= 0:  # Redis deletes the key at once
            view.reset("none")
        elif existed is UNKNOWN or existed:  # counted from the commit, where it is applied
            view.put(TTL, UNKNOWN if existed is UNKNOWN else op.expire_seconds())
        return existed
    if cmd == "INCRBY":
        return _incrby(view, int(args[0]))
    return _collection_step(view, op)


def _incrby(view: View, amount: int) -> Any:
    """INCRBY: the new value; a string keeps its time to live, a new key has none."""
    view.require("string")
    current = None if view.kind == "none" else view.get(STRING)
    if view.kind is None:
        current = UNKNOWN
    new = _add_int(current, amount, NOT_INTEGER)
    if view.kind != "string":
        unknown = view.kind is None  # a string then, whose TTL INCRBY keeps, or no key
        view.reset("string")
        if unknown:
            view.put(TTL, UNKNOWN)
    view.put(STRING, UNKNOWN if new is UNKNOWN else str(new).encode())
    return new


def _ttl_seconds(unit: bytes, number: int) -> int:
    """What TTL answers right after ``SET ... EX|PX number``: Redis rounds milliseconds."""
    return number if unit == b"EX" else (number + 500) // 1000


def _counted(view: View, existed: Any, adding: bool) -> Any:
    """Keep the collection's size as members come and go; returns whether it changed."""
    size = view.get(SIZE)
    if existed is UNKNOWN:
        view.put(SIZE, UNKNOWN)
        return UNKNOWN
    changed = bool(existed) != adding
    if changed and size is not UNKNOWN:
        view.put(SIZE, size + (1 if adding else -1))
    return changed


def _after_removal(view: View) -> None:
    """Redis deletes a collection with its last member; if the size is unknown, so is the type."""
    size = view.get(SIZE)
    if size is UNKNOWN:
        view.kind = None
    elif size == 0:
        view.reset("none")


def _remove(view: View, op: Op) -> Any:
    """HDEL, SREM, ZREM on a key that exists (or may): how many members went."""
    query_kind = {"HDEL": "F", "SREM": "M", "ZREM": "Z"}[op.cmd]
    gone = []
    for member in op.args:
        query = (query_kind, member)
        before = view.get(query)
        # identity, not equality: a score of 0.0 == False, and it exists
        existed = UNKNOWN if before is UNKNOWN else before is not None and before is not False
        gone.append(_counted(view, existed, adding=False))
        view.put(query, False if query_kind == "M" else None)
    _after_removal(view)
    return _count(gone)


def _push(items: Any, cmd: str, args: tuple[bytes, ...]) -> None:
    """A push on the whole list, when the overlay holds it: ``LPUSH a b`` puts b first."""
    if isinstance(items, list):
        if cmd == "LPUSH":
            items[:0] = reversed(args)
        else:
            items += args


def _collection_step(view: View, op: Op) -> Any:  # noqa: PLR0912
    cmd, args = op.cmd, op.args
    kind = {"H": "hash", "S": "set", "Z": "zset", "L": "list", "R": "list", "X": "stream"}[cmd[0]]
    view.require(kind)
    was_none = view.kind == "none"
    if cmd in _REMOVALS:
        return 0 if was_none else _remove(view, op)
    view.kind = kind  # the others create the key; a wrong type is caught above or at prepare
    if was_none:  # a key created now has no time to live
        view.put(TTL, NO_TTL)
    if cmd == "HSET":
        new = []
        for name, value in zip(args[0::2], args[1::2], strict=True):
            before = view.get(("F", name))
            new.append(_counted(view, UNKNOWN if before is UNKNOWN else before is not None, True))
            view.put(("F", name), value)
        return _count(new)
    if cmd == "HINCRBY":
        query = ("F", args[0])
        before = view.get(query)
        new_value = _add_int(before, int(args[1]), HASH_NOT_INTEGER)
        _counted(view, UNKNOWN if before is UNKNOWN else before is not None, True)
        view.put(query, UNKNOWN if new_value is UNKNOWN else str(new_value).encode())
        return new_value
    if cmd == "SADD":
        added = []
        for member in args:
            before = view.get(("M", member))
            added.append(_counted(view, before, adding=True))
            view.put(("M", member), True)
        return _count(added)
    if cmd == "ZADD":
        new = []
        for value, member in zip(args[0::2], args[1::2], strict=True):
            before = view.get(("Z", member))
            new.append(_counted(view, UNKNOWN if before is UNKNOWN else before is not None, True))
            view.put(("Z", member), float(value))
        return _count(new)
    if cmd == "ZINCRBY":
        query = ("Z", args[1])
        current = view.get(query)
        if current is UNKNOWN:
            view.put(SIZE, UNKNOWN)
            return UNKNOWN
        total = (current or 0.0) + float(args[0])
        if math.isnan(total):
            raise ResponseError(NAN_SCORE)
        _counted(view, current is not None, adding=True)
        view.put(query, total)
        return total
    if cmd in ("LPUSH", "RPUSH"):
        length = view.get(LENGTH)
        length = UNKNOWN if length is UNKNOWN else length + len(args)
        view.put(LENGTH, length)
        _push(view.get(LIST_ALL), cmd, args)
        return length
    return None  # XADD: the id is assigned when the commit script runs
