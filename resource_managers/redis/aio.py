"""`AsyncRedisResource`: a Redis branch for asyncio code, over `redis.asyncio`.

``await tx.join(cache)`` (`coordinator.aio`) hands the application an `AsyncRedisBranch`, whose
commands are awaited: ``await branch.incr("k")``, ``await branch.get("k")``.

Why it wraps the synchronous resource instead of re-writing it: a branch's meaning lives in
`RedisResource` and its helpers (the buffered write set, the overlay that answers reads with the
branch's own writes, the watches, the Lua scripts and the staged-write format). A second copy
would drift, and a branch prepared here must be committable by a synchronous recovery. So an
`AsyncRedisResource` *is* a `RedisResource` (``.sync``), whose client is `_LoopClient`: a
redis-py look-alike that sends every command through the `redis.asyncio` client on the branch's
event loop, and waits for the answer on the thread that asked. The branch's logic runs on a worker
thread (``asyncio.to_thread`` per command, one command at a time per branch), its I/O on the loop.
Prepare, commit and rollback are called by completion on its worker thread and take the same path.

Without a running loop (a recovery pass at start-up, the manager's recovery thread after the loop
ended), and on the loop's own thread (a metrics scrape reading the gauges, where waiting for the
loop would wait forever), the same calls go to ``sync_client``, a plain `redis.Redis` on the same
server: recovery needs no loop, and a prepared branch is the same Redis data whoever prepared it.

Cost: a thread hop per command (tens of microseconds), which buys one implementation of the
branch semantics. Early prepare and batched commits (`coordinator.early_prepare`,
`coordinator.batch_commit`) need direct access to a connection pool and are not offered here.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import redis
import redis.asyncio

from coordinator import Outcome, ProgrammingError, Vote, Xid
from coordinator.aio import on_loop
from resource_managers.aio_twin import SyncTwin, not_opened

from ._errors import UnsupportedCommandError
from .branch import RedisBranch
from .resource import RedisResource

T = TypeVar("T")

__all__ = ["ASYNC_SUPPORTED_COMMANDS", "AsyncRedisBranch", "AsyncRedisResource"]


class _LoopClient:
    """The slice of a synchronous redis-py client `RedisResource` uses, answered by the async
    client on the bound loop when one runs, else by the synchronous client."""

    def __init__(
        self, client: redis.asyncio.Redis, sync_client: redis.Redis, timeout: float
    ) -> None:
        self.aclient = client
        self.sync_client = sync_client
        self.timeout = timeout
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def connection_pool(self) -> Any:
        """For the address in error messages: the same server as the async client's."""
        return self.sync_client.connection_pool

    def get_encoder(self) -> Any:
        return self.sync_client.get_encoder()

    def register_script(self, script: str) -> Any:
        """Computes the SHA only (no I/O); the script object is used for its ``sha``."""
        return self.sync_client.register_script(script)

    def execute_command(self, *args: Any, **options: Any) -> Any:
        return self._call("execute_command", args, options)

    def script_load(self, script: str) -> Any:
        return self._call("script_load", (script,), {})

    def zrange(self, *args: Any, **options: Any) -> Any:
        return self._call("zrange", args, options)

    def time(self) -> Any:
        return self._call("time", (), {})

    def _call(self, method: str, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        loop = self.loop
        if loop is None or not loop.is_running() or _running_loop() is loop:
            # no loop to use (recovery at start-up, after the loop ended), or asked on the
            # loop's own thread (a metrics scrape of the gauges): the synchronous client answers
            return getattr(self.sync_client, method)(*args, **options)

        async def call() -> Any:
            return await getattr(self.aclient, method)(*args, **options)

        return on_loop(loop, call, self.timeout, what=f"redis {args[0] if args else method}")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class AsyncRedisResource(SyncTwin):
    """A Redis server as a resource for `coordinator.aio` transactions (module docstring).

    ``client`` is a `redis.asyncio.Redis` (not a cluster); ``sync_client`` a `redis.Redis` on
    the same server, for recovery without a loop (`from_url` makes both). The other options are
    `RedisResource`'s; ``io_timeout`` bounds each command's wait on the loop.
    """

    sync: RedisResource

    def __init__(
        self,
        client: redis.asyncio.Redis,
        name: str = "redis",
        *,
        sync_client: redis.Redis,
        io_timeout: float = 30.0,
        **options: Any,
    ) -> None:
        if not isinstance(client, redis.asyncio.Redis):
            raise ProgrammingError("AsyncRedisResource needs a redis.asyncio.Redis client")
        self._client = _LoopClient(client, sync_client, io_timeout)
        #: the resource itself: every verb and all recovery are its
        self.sync = RedisResource(self._client, name, **options)
        #: branches `open_branch` prepared for ``start`` (one join each)
        self._opened: set[Xid] = set()

    @classmethod
    def from_url(cls, url: str, name: str = "redis", **options: Any) -> AsyncRedisResource:
        """Both clients from one ``redis://`` URL."""
        return cls(
            redis.asyncio.Redis.from_url(url),
            name,
            sync_client=redis.Redis.from_url(url),
            **options,
        )

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"

    async def open_branch(self, xid: Xid) -> None:
        """Bind the loop (the async client's connections belong to it) and check, once and off
        the loop, that the server keeps a prepare across a crash."""
        loop = asyncio.get_running_loop()
        bound = self._client.loop
        if bound is not None and bound is not loop and bound.is_running():
            raise ProgrammingError(
                f"{self.name}: this resource's client works on another running event loop; "
                "make one AsyncRedisResource per loop"
            )
        self._client.loop = loop
        if not self.sync._durability_checked:
            await asyncio.to_thread(self.sync._check_durability)
        self._opened.add(xid)

    async def aclose(self) -> None:
        """Close both clients (on the loop the async one works on)."""
        await self._client.aclient.aclose()
        self._client.sync_client.close()

    async def abandon_branch(self, xid: Xid) -> None:
        self._opened.discard(xid)
        with self.sync._lock:
            self.sync._branches.pop(xid, None)

    def start(self, xid: Xid) -> AsyncRedisBranch:
        if xid not in self._opened:
            raise not_opened(self.name, xid)
        self._opened.discard(xid)
        return AsyncRedisBranch(self.sync.start(xid))

    def prepare(self, xid: Xid) -> Vote:
        return self.sync.prepare(xid)

    def commit(self, xid: Xid, one_phase: bool = False) -> Outcome | None:
        return self.sync.commit(xid, one_phase)

    def rollback(self, xid: Xid) -> Outcome | None:
        return self.sync.rollback(xid)


class AsyncRedisBranch:
    """What ``await tx.join(AsyncRedisResource)`` returns: `RedisBranch`'s commands, awaited.

    Semantics are `RedisBranch`'s (buffered writes, reads that see them, watches). Commands of
    one branch run one at a time, in the order they were awaited. Any redis-py command not
    listed in `ASYNC_SUPPORTED_COMMANDS` raises `UnsupportedCommandError` naming it.
    """

    def __init__(self, branch: RedisBranch) -> None:
        #: the synchronous branch (its ``ops``, ``watches`` are there); never call it on the loop
        self.branch = branch
        self._turn = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<Async{self.branch!r}>"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(redis.Redis, name):
            raise AttributeError(f"'AsyncRedisBranch' object has no attribute {name!r}", name=name)
        raise UnsupportedCommandError(
            f"redis-py's {name!r} is not supported inside an async transaction branch; "
            f"supported: {', '.join(ASYNC_SUPPORTED_COMMANDS)}",
            command=name,
        )

    async def _run(self, command: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async with self._turn:
            return await asyncio.to_thread(command, *args, **kwargs)

    # -- strings -------------------------------------------------------------------------------

    def get(self, name: Any) -> Awaitable[Any]:
        return self._run(self.branch.get, name)

    def set(
        self, name: Any, value: Any, ex: Any = None, px: Any = None, *, nx: bool = False,
        xx: bool = False,
    ) -> Awaitable[bool | None]:  # fmt: skip
        return self._run(self.branch.set, name, value, ex, px, nx=nx, xx=xx)

    def delete(self, *names: Any) -> Awaitable[int | None]:
        return self._run(self.branch.delete, *names)

    def incr(self, name: Any, amount: int = 1) -> Awaitable[int | None]:
        return self._run(self.branch.incrby, name, amount)

    def incrby(self, name: Any, amount: int = 1) -> Awaitable[int | None]:
        return self._run(self.branch.incrby, name, amount)

    def decr(self, name: Any, amount: int = 1) -> Awaitable[int | None]:
        return self._run(self.branch.decrby, name, amount)

    def decrby(self, name: Any, amount: int = 1) -> Awaitable[int | None]:
        return self._run(self.branch.decrby, name, amount)

    def mget(self, keys: Any, *args: Any) -> Awaitable[list[Any]]:
        return self._run(self.branch.mget, keys, *args)

    def mset(self, mapping: Mapping[Any, Any]) -> Awaitable[bool]:
        return self._run(self.branch.mset, mapping)

    def exists(self, *names: Any) -> Awaitable[int]:
        return self._run(self.branch.exists, *names)

    def expire(self, name: Any, time: Any) -> Awaitable[bool | None]:
        return self._run(self.branch.expire, name, time)

    def setex(self, name: Any, time: Any, value: Any) -> Awaitable[bool | None]:
        return self._run(self.branch.setex, name, time, value)

    def ttl(self, name: Any) -> Awaitable[int]:
        return self._run(self.branch.ttl, name)

    # -- hashes, sets, lists -------------------------------------------------------------------

    def hget(self, name: Any, key: Any) -> Awaitable[Any]:
        return self._run(self.branch.hget, name, key)

    def hset(
        self, name: Any, key: Any = None, value: Any = None,
        mapping: Mapping[Any, Any] | None = None,
    ) -> Awaitable[int | None]:  # fmt: skip
        return self._run(self.branch.hset, name, key, value, mapping)

    def hgetall(self, name: Any) -> Awaitable[dict[Any, Any]]:
        return self._run(self.branch.hgetall, name)

    def hmget(self, name: Any, keys: Any, *args: Any) -> Awaitable[list[Any]]:
        return self._run(self.branch.hmget, name, keys, *args)

    def hdel(self, name: Any, *keys: Any) -> Awaitable[int | None]:
        return self._run(self.branch.hdel, name, *keys)

    def hincrby(self, name: Any, key: Any, amount: int = 1) -> Awaitable[int | None]:
        return self._run(self.branch.hincrby, name, key, amount)

    def sadd(self, name: Any, *values: Any) -> Awaitable[int | None]:
        return self._run(self.branch.sadd, name, *values)

    def srem(self, name: Any, *values: Any) -> Awaitable[int | None]:
        return self._run(self.branch.srem, name, *values)

    def smembers(self, name: Any) -> Awaitable[builtins.set[Any]]:
        return self._run(self.branch.smembers, name)

    def sismember(self, name: Any, value: Any) -> Awaitable[int]:
        return self._run(self.branch.sismember, name, value)

    def lpush(self, name: Any, *values: Any) -> Awaitable[int | None]:
        return self._run(self.branch.lpush, name, *values)

    def rpush(self, name: Any, *values: Any) -> Awaitable[int | None]:
        return self._run(self.branch.rpush, name, *values)

    def lrange(self, name: Any, start: int, end: int) -> Awaitable[list[Any]]:
        return self._run(self.branch.lrange, name, start, end)

    def watch(self, *names: Any) -> Awaitable[None]:
        return self._run(self.branch.watch, *names)


#: what an async branch offers of redis-py's commands; every other one raises
#: UnsupportedCommandError
ASYNC_SUPPORTED_COMMANDS: Final = tuple(
    sorted(n for n in vars(AsyncRedisBranch) if not n.startswith("_") and hasattr(redis.Redis, n))
)
