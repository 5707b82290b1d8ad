"""`RedisBranch`: what ``tx.join(redis_resource)`` hands the application.

A redis-py-like subset of commands (`SUPPORTED_COMMANDS`; any other redis-py command raises
`UnsupportedCommandError` naming it). Writes are buffered in the branch and reach Redis only when
the transaction commits; reads go to the server and see the branch's own buffered writes (the
ops replayed over the server's value by `_overlay`). A time to live (``expire``, ``setex``,
``set(ex=...)``) is staged as seconds and applied by the commit script, so it counts from the
commit. A
write returns what redis-py would return when that can be computed; when it depends on the
server's data (``incrby``'s new value, how many members ``sadd`` added, whether ``set(nx=True)``
applied) the branch reads the key once and *watches* it, so a change by anyone before prepare
makes the branch vote no instead of committing on a value the application never saw. With
``RedisResource(blind_writes=True)`` writes neither read nor watch and return None (``set``:
True): the fast path for counters many transactions update at once.

``watch(key)`` works like Redis's ``WATCH``: call it *before* reading a key whose value decides
what the branch writes; if the key changes before prepare, the branch votes no.

Why one module: it is the command surface users call, one short method per redis-py command, so
its length grows with `SUPPORTED_COMMANDS`; the semantics live in `_overlay` and `_writeset`.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol

import redis
from redis.exceptions import ResponseError

from coordinator import IllegalStateError, ProgrammingError, Xid

from . import _overlay as ov
from . import _writeset as ws
from ._errors import UnsupportedCommandError
from ._overlay import STRING, UNKNOWN, Base, Query
from ._writeset import Op


class BranchHost(Protocol):
    """What a branch asks of its resource (`RedisResource` is one): narrow, so the branch needs
    nothing else of it and the two modules do not import each other."""

    @property
    def name(self) -> str: ...

    blind_writes: bool

    def data_key(self, name: Any) -> bytes: ...

    def data_keys(self, names: Iterable[Any]) -> list[bytes]: ...

    def decode(self, value: Any) -> Any: ...

    def read_now(self, key: bytes, query: Query) -> Any: ...

    def read_command(self, command: list[Any]) -> Any: ...

    def read_facts(
        self, key: bytes, queries: list[Query], fingerprint: bool
    ) -> tuple[Base, bytes]: ...


#: a branch's life: ACTIVE (work) -> PREPARING (a script may be on its way) -> ENDED, or
#: ACTIVE -> FAILED (voted no before anything reached Redis) -> ENDED
ACTIVE, PREPARING, FAILED, ENDED = "active", "preparing", "failed", "ended"
_PHASE_TEXT = {PREPARING: "being prepared", FAILED: "voting no", ENDED: "finished"}


class RedisBranch:
    """One transaction's work on one Redis (or one hash slot of a cluster)."""

    def __init__(self, resource: BranchHost, xid: Xid) -> None:
        self._resource = resource
        self.xid = xid
        self.gid = xid.to_gid()
        self.ops: list[Op] = []
        self._by_key: dict[bytes, list[Op]] = {}
        #: key -> its watch: b"S" + SHA-1 of a string's value, SHA-1 of its DUMP, or b"" (missing)
        self.watches: dict[bytes, bytes] = {}
        self._bases: dict[bytes, Base] = {}  # what was read of watched keys
        self.doomed: str | None = None  # why prepare must vote no, found before prepare
        self.phase = ACTIVE
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        """Only for names the class lacks: a redis-py command the branch does not buffer is
        named, with the list of those it does, rather than an AttributeError like a typo's."""
        if name.startswith("_") or not hasattr(redis.Redis, name):
            raise AttributeError(f"'RedisBranch' object has no attribute {name!r}", name=name)
        raise UnsupportedCommandError(
            f"redis-py's {name!r} is not supported inside a transaction branch; supported: "
            f"{', '.join(SUPPORTED_COMMANDS)}. Use the plain client for it, outside the "
            "transaction's guarantees",
            command=name,
        )

    def __repr__(self) -> str:
        return f"<RedisBranch {self.xid.gtrid} on {self._resource.name}: {len(self.ops)} writes>"

    # -- strings -----------------------------------------------------------------------------------

    def get(self, name: Any) -> Any:
        return self._read(name, STRING)

    def set(
        self,
        name: Any,
        value: Any,
        ex: Any = None,
        px: Any = None,
        *,
        nx: bool = False,
        xx: bool = False,
    ) -> bool | None:
        """Buffer a SET. True, or None when ``nx``/``xx`` keeps it from applying."""
        if nx and xx:
            raise ProgrammingError("set: nx and xx are mutually exclusive")
        if ex is not None and px is not None:
            raise ProgrammingError("set: give ex or px, not both")
        args = [ws.encode(value)]
        if nx or xx:
            args.append(b"NX" if nx else b"XX")
        for flag, ttl, convert in ((b"EX", ex, ws.seconds), (b"PX", px, ws.milliseconds)):
            if ttl is not None:
                number = convert(ttl, f"set {flag.decode().lower()}")
                if number <= 0:
                    raise ProgrammingError(f"set: {flag.decode().lower()} must be positive")
                args += [flag, str(number).encode()]
        result = self._write(Op("SET", self._key(name), tuple(args)))
        if self._blind:
            return None if nx or xx else True
        return bool(result) or None

    def delete(self, *names: Any) -> int | None:
        keys = [self._key(name) for name in ws.nonempty(names, "delete")]
        results = [self._write(Op("DEL", key)) for key in keys]
        return None if self._blind else sum(results)

    def incrby(self, name: Any, amount: int = 1) -> int | None:
        amount = ws.int64(amount, "incrby amount")
        return _int(self._write(Op("INCRBY", self._key(name), (str(amount).encode(),))))

    def decrby(self, name: Any, amount: int = 1) -> int | None:
        return self.incrby(name, -ws.int64(amount, "decrby amount"))

    def incr(self, name: Any, amount: int = 1) -> int | None:
        """redis-py's ``incr`` is ``INCRBY``: the same buffered write as `incrby`."""
        return self.incrby(name, amount)

    def decr(self, name: Any, amount: int = 1) -> int | None:
        return self.decrby(name, amount)

    def setex(self, name: Any, time: Any, value: Any) -> bool | None:
        """``SET name value EX time``; the time to live starts when the branch commits."""
        return self.set(name, value, ex=time)

    def mset(self, mapping: Mapping[Any, Any]) -> bool:
        """One buffered SET per key, all applied by the same commit script (so as atomic as
        Redis's ``MSET``, unless the resource commits large branches in steps, ``commit_chunk``,
        or a commit stops part-way and its retry finishes it). Every key and value is checked
        before any is buffered."""
        self.check_active()
        keys = self._resource.data_keys(mapping)
        values = [v.encode("utf-8") if type(v) is str else ws.encode(v) for v in mapping.values()]
        ops = [Op("SET", key, (value,)) for key, value in zip(keys, values, strict=True)]
        if not ops:
            raise ProgrammingError("mset needs at least one key")
        if self._blind:  # nothing to read or answer: buffer them all at once, as `_write` would
            self.ops += ops
            by_key = self._by_key
            for op in ops:
                by_key.setdefault(op.key, []).append(op)
            return True
        for op in ops:
            self._write(op)
        return True

    def mget(self, keys: Any, *args: Any) -> list[Any]:
        """Every key's string (None for a missing key or one of another type, as ``MGET``):
        keys the branch has not touched in one ``MGET``, the others from the overlay."""
        names = [self._key(n) for n in _names(keys, args, "mget")]
        plain = [k for k in names if self._untouched(k)]
        found = (
            dict(zip(plain, self._resource.read_command(["MGET", *plain]), strict=True))
            if plain
            else {}
        )
        values = []
        for key in names:
            if key in found:
                values.append(self._resource.decode(found[key]))
                continue
            try:
                values.append(self._read_key(key, STRING))
            except ResponseError as exc:  # MGET answers None for a key of another type
                if not str(exc).startswith("WRONGTYPE"):
                    raise
                values.append(None)
        return values

    def exists(self, *names: Any) -> int:
        """How many of the keys exist once the branch's writes are applied (a key named twice
        counts twice, as in Redis)."""
        keys = [self._key(n) for n in ws.nonempty(names, "exists")]
        plain = [k for k in keys if self._untouched(k)]
        count = int(self._resource.read_command(["EXISTS", *plain])) if plain else 0
        return count + sum(self._exists(k) for k in keys if not self._untouched(k))

    def ttl(self, name: Any) -> int:
        """Seconds left, -1 for a key without a time to live, -2 for a missing key. A time to
        live this branch set (``expire``, ``setex``, ``set(ex=...)``) is answered as given:
        it starts counting when the branch commits."""
        return int(self._read(name, ov.TTL))

    def expire(self, name: Any, time: Any) -> bool | None:
        """Buffer an EXPIRE in seconds; the time to live starts when the branch commits."""
        number = ws.seconds(time, "expire time")
        result = self._write(Op("EXPIRE", self._key(name), (str(number).encode(),)))
        return None if result is None else bool(result)

    # -- hashes ------------------------------------------------------------------------------------

    def hget(self, name: Any, key: Any) -> Any:
        return self._read(name, ("F", ws.encode(key, "field")))

    def hset(
        self,
        name: Any,
        key: Any = None,
        value: Any = None,
        mapping: Mapping[Any, Any] | None = None,
    ) -> int | None:
        items: list[tuple[Any, Any]] = [] if key is None else [(key, value)]
        items += list((mapping or {}).items())
        return _int(self._write(Op("HSET", self._key(name), ws.pairs(items, "hset"))))

    def hmget(self, name: Any, keys: Any, *args: Any) -> list[Any]:
        fields = [ws.encode(f, "field") for f in _names(keys, args, "hmget")]
        key = self._key(name)
        if self._untouched(key):
            values = self._resource.read_command(["HMGET", key, *fields])
            return [self._resource.decode(v) for v in values]
        queries = [("F", f) for f in fields]
        return [
            self._shape(q, a) for q, a in zip(queries, self._answers(key, queries), strict=True)
        ]

    def hgetall(self, name: Any) -> dict[Any, Any]:
        result: dict[Any, Any] = self._read(name, ov.HASH_ALL)
        return result

    def hdel(self, name: Any, *keys: Any) -> int | None:
        fields = ws.nonempty([ws.encode(k, "field") for k in keys], "hdel")
        return _int(self._write(Op("HDEL", self._key(name), fields)))

    def hincrby(self, name: Any, key: Any, amount: int = 1) -> int | None:
        amount = ws.int64(amount, "hincrby amount")
        args = (ws.encode(key, "field"), str(amount).encode())
        return _int(self._write(Op("HINCRBY", self._key(name), args)))

    # -- sets and sorted sets ----------------------------------------------------------------------

    def sadd(self, name: Any, *values: Any) -> int | None:
        members = ws.nonempty([ws.encode(v) for v in values], "sadd")
        return _int(self._write(Op("SADD", self._key(name), members)))

    def srem(self, name: Any, *values: Any) -> int | None:
        members = ws.nonempty([ws.encode(v) for v in values], "srem")
        return _int(self._write(Op("SREM", self._key(name), members)))

    def sismember(self, name: Any, value: Any) -> int:
        return int(bool(self._read(name, ("M", ws.encode(value)))))

    def smembers(self, name: Any) -> builtins.set[Any]:
        result: builtins.set[Any] = self._read(name, ov.SET_ALL)
        return result

    def zadd(self, name: Any, mapping: Mapping[Any, Any]) -> int | None:
        args: list[bytes] = []
        for member, score in mapping.items():
            args += [repr(ws.score(score)).encode(), ws.encode(member)]
        return _int(self._write(Op("ZADD", self._key(name), ws.nonempty(args, "zadd"))))

    def zrem(self, name: Any, *values: Any) -> int | None:
        members = ws.nonempty([ws.encode(v) for v in values], "zrem")
        return _int(self._write(Op("ZREM", self._key(name), members)))

    def zincrby(self, name: Any, amount: float, value: Any) -> float | None:
        args = (repr(ws.score(amount, "zincrby amount")).encode(), ws.encode(value))
        result = self._write(Op("ZINCRBY", self._key(name), args))
        return None if result is None else float(result)

    # -- lists and streams -------------------------------------------------------------------------

    def lpush(self, name: Any, *values: Any) -> int | None:
        items = ws.nonempty([ws.encode(v) for v in values], "lpush")
        return _int(self._write(Op("LPUSH", self._key(name), items)))

    def rpush(self, name: Any, *values: Any) -> int | None:
        items = ws.nonempty([ws.encode(v) for v in values], "rpush")
        return _int(self._write(Op("RPUSH", self._key(name), items)))

    def lrange(self, name: Any, start: int, end: int) -> list[Any]:
        """Items ``start`` to ``end`` inclusive, negative from the end, as ``LRANGE``. A list the
        branch has pushed to is read whole, once, and the pushes replayed on it."""
        start, end = ws.int64(start, "lrange start"), ws.int64(end, "lrange end")
        key = self._key(name)
        if self._untouched(key):
            items = self._resource.read_command(["LRANGE", key, start, end])
            return [self._resource.decode(item) for item in items]
        return ov.list_range(self._read_key(key, ov.LIST_ALL), start, end)

    def xadd(self, name: Any, fields: Mapping[Any, Any], id: Any = "*") -> None:
        """Buffer an XADD. Returns None: with ``id="*"`` Redis assigns the id when the commit
        script runs, so it cannot be known before. An explicit ``<ms>-<seq>`` id must be greater
        than the stream's last id at commit, as Redis requires (checked at prepare)."""
        args = (ws.stream_id(id), *ws.pairs(fields, "xadd"))
        if len(args) > ws.MAX_COMMAND_ARGS:
            raise ProgrammingError(f"xadd: at most {ws.MAX_COMMAND_ARGS // 2} fields per entry")
        key = self._key(name)
        if args[0] != b"*" and any(
            op.cmd == "XADD" and op.args[0] == b"*" for op in self._by_key.get(key, ())
        ):
            raise ProgrammingError(
                "xadd: an explicit id after an automatic one on the same stream in one branch "
                "cannot be checked before commit; use one kind of id per stream and branch"
            )
        self._write(Op("XADD", key, args))

    # -- watches -----------------------------------------------------------------------------------

    def watch(self, *names: Any) -> None:
        """Vote no at prepare if any of these keys changes from now on (by anyone, twopc or not).

        Watched keys are also locked at prepare, so no other twopc branch can change them
        between this branch's prepare and its commit.
        """
        for name in ws.nonempty(names, "watch"):
            key = self._key(name)
            if key not in self.watches:
                self._load(key, [], watch=True)

    # -- the overlay -------------------------------------------------------------------------------

    @property
    def _blind(self) -> bool:
        return self._resource.blind_writes

    def _key(self, name: Any) -> bytes:
        self.check_active()
        return self._resource.data_key(name)

    def check_active(self) -> None:
        if self.phase != ACTIVE:
            raise IllegalStateError(
                f"{self._resource.name}: branch {self.xid.gtrid} takes no more commands: "
                f"it is {_PHASE_TEXT[self.phase]}"
            )

    def _read(self, name: Any, query: Query) -> Any:
        return self._read_key(self._key(name), query)

    def _read_key(self, key: bytes, query: Query) -> Any:
        if self._untouched(key):
            return self._shape(query, self._resource.read_now(key, query))
        return self._shape(query, self._answers(key, [query])[0])

    def _untouched(self, key: bytes) -> bool:
        """Neither written nor watched: a read goes to the server as it is."""
        return key not in self._by_key and key not in self.watches

    def _answers(self, key: bytes, asked: list[Query]) -> list[Any]:
        """``asked`` of a key the branch has touched: its ops replayed over what the branch
        knows of the server's value, which is read (once, in one call) if that is not enough."""
        ops = self._by_key.get(key, [])
        queries = ov.queries_for(ops, asked)
        view = ov.replay(ops, queries, self._cached(key, queries))
        answers = [view.answer(query) for query in asked]
        if any(answer is UNKNOWN for answer in answers):
            view = ov.replay(ops, queries, self._load(key, queries, watch=False))
            answers = [view.answer(query) for query in asked]
        return answers

    def _exists(self, key: bytes) -> int:
        ops = self._by_key.get(key, [])
        queries = ov.queries_for(ops, [])
        existed = ov.replay(ops, queries, self._cached(key, queries)).exists()
        if existed is UNKNOWN:
            existed = ov.replay(ops, queries, self._load(key, queries, watch=False)).exists()
        return int(existed)

    def _shape(self, query: Query, answer: Any) -> Any:
        """An answer as the client would return it (``decode_responses``)."""
        kind, decode = query[0], self._resource.decode
        if kind in "MZLNT":
            return answer
        if kind == "H":
            return {decode(f): decode(v) for f, v in answer.items()}
        if kind == "A":
            return {decode(m) for m in answer}
        if kind == "R":
            return [decode(item) for item in answer]
        return decode(answer)

    def _write(self, op: Op) -> Any:
        self.check_active()
        if not self._blind:
            ops = self._by_key.get(op.key, [])
            queries = ov.queries_for([*ops, op], ov.result_queries(op))
            result = ov.step(ov.replay(ops, queries, self._cached(op.key, queries)), op)
            if result is UNKNOWN:  # depends on the server: read it now, and watch the key
                watched = op.key in self.watches
                base = self._load(op.key, queries, watch=True)
                try:
                    result = ov.step(ov.replay(ops, queries, base), op)
                except ResponseError:
                    if not watched:  # the call is refused: it leaves nothing behind
                        self.watches.pop(op.key, None)
                        self._bases.pop(op.key, None)
                    raise
        else:
            result = None
        self.ops.append(op)
        self._by_key.setdefault(op.key, []).append(op)
        return result

    def _cached(self, key: bytes, queries: list[Query]) -> Base | None:
        base = self._bases.get(key)
        return base if base is not None and base.covers(queries) else None

    def _load(self, key: bytes, queries: list[Query], *, watch: bool) -> Base:
        """Read ``queries`` of ``key`` from the server; a watch fingerprints it in the same
        script, so the facts and the fingerprint describe the same instant."""
        fingerprint = watch and key not in self.watches
        base, seen = self._resource.read_facts(key, queries, fingerprint)
        if fingerprint:
            self.watches[key] = seen
            self._bases[key] = base
        elif key in self.watches:
            known = self._bases.setdefault(key, Base(base.kind))
            if known.kind != base.kind:
                self.doomed = f"watched key {key!r} changed type since it was read"
            known.facts.update(base.facts)
        return base

    def plain(self) -> bool:
        """Nothing but plain ``SET key value``: what the prepare script records as ``plain``,
        whose commit takes its keys from the staged set (``lua/commit.lua``)."""
        return all(op.cmd == "SET" and len(op.args) == 1 for op in self.ops)

    def plan(self) -> tuple[list[bytes], list[bytes], bytes]:
        """(keys to lock, watch arguments, the packed write set) for the scripts."""
        if not self.watches:  # blind writes: the written keys, nothing to index
            return list(self._by_key), [], ws.pack(self.ops)
        touched = list(dict.fromkeys([*self._by_key, *self.watches]))
        index = {key: i for i, key in enumerate(touched, 1)}
        watch_args: list[bytes] = []
        for key, fingerprint in self.watches.items():
            watch_args += [str(index[key]).encode(), fingerprint]
        return touched, watch_args, ws.pack(self.ops)


#: what a branch offers of redis-py's commands; every other one raises UnsupportedCommandError
SUPPORTED_COMMANDS: Final = tuple(
    sorted(n for n in vars(RedisBranch) if not n.startswith("_") and hasattr(redis.Redis, n))
)


def _names(keys: Any, args: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    """redis-py's ``mget(keys, *args)`` / ``hmget(name, keys, *args)``: a list, or names."""
    first = list(keys) if isinstance(keys, list | tuple) else [keys]
    return ws.nonempty([*first, *args], what)


def _int(result: Any) -> int | None:
    """A count or a new value as redis-py returns it; None from a blind write."""
    return None if result is None else int(result)
