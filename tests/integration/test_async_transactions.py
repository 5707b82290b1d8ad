"""asyncio transactions (`coordinator.aio`) over real PostgreSQL (SQLAlchemy `AsyncSession` on
psycopg 3) and real Redis (`redis.asyncio`): commit, rollback on an exception, a no vote rolls
back both, many transactions at once on one loop, and a task cancelled mid-commit whose commit
still reaches its outcome."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from coordinator import FileDecisionLog, ProgrammingError, TransactionRolledBack, Xid
from coordinator.aio import AsyncTransactionManager
from resource_managers.postgres.aio import AsyncPostgresResource
from resource_managers.redis import UnsupportedCommandError
from resource_managers.redis.aio import AsyncRedisResource
from tests.support.hold_at import held_at
from tests.support.managers import make_manager

pytestmark = pytest.mark.timeout(120)

OPENING = 1000


def psycopg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


@dataclass
class Stores:
    atm: AsyncTransactionManager
    pg: AsyncPostgresResource[AsyncSession]
    cache: AsyncRedisResource


@pytest.fixture
def schema(pg_url: str) -> str:
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)"))
        conn.execute(
            text("INSERT INTO accounts SELECT g, :o FROM generate_series(0, 9) g"), {"o": OPENING}
        )
    engine.dispose()
    return psycopg_url(pg_url)


@pytest.fixture
def stores_factory(
    schema: str, redis_url: str, tmp_path: Path, managers: list[Any]
) -> Callable[[], Any]:
    """An async context manager: the stores on the running loop, closed after."""

    @asynccontextmanager
    async def open_stores() -> AsyncIterator[Stores]:
        engine = create_async_engine(schema)
        pg = AsyncPostgresResource(engine, "pg")
        cache = AsyncRedisResource.from_url(redis_url, "cache")
        tm = make_manager(managers, [pg, cache], FileDecisionLog(tmp_path / "log"))
        atm = AsyncTransactionManager(tm, max_workers=8)
        try:
            yield Stores(atm, pg, cache)
        finally:
            await engine.dispose()
            await pg.aclose()
            await cache.aclose()

    return open_stores


def balances(url: str) -> dict[int, int]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, balance FROM accounts")).all()
    engine.dispose()
    return {int(i): int(b) for i, b in rows}


def prepared(url: str) -> list[str]:
    engine = create_engine(url)
    with engine.connect() as conn:
        gids = [str(g) for (g,) in conn.execute(text("SELECT gid FROM pg_prepared_xacts")).all()]
    engine.dispose()
    return gids


async def move(session: AsyncSession, account: int, amount: int) -> None:
    await session.execute(
        text("UPDATE accounts SET balance = balance + :a WHERE id = :i"),
        {"a": amount, "i": account},
    )


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_commit_reaches_both_stores(
    stores_factory: Callable[[], Any], schema: str, redis_url: str
) -> None:
    async def main() -> None:
        async with stores_factory() as s, s.atm.atransaction() as tx:
            session = await tx.join(s.pg)
            assert await tx.join(s.pg) is session  # joining twice: the same handle
            await move(session, 1, -5)
            branch = await tx.join(s.cache)
            assert await branch.incr("balance:1", 5) == 5
            assert await branch.get("balance:1") == b"5"  # read-your-writes
            await branch.set("note", "x")
            assert await branch.mget(["note", "missing"]) == [b"x", None]
            await branch.delete("note")
            assert await branch.get("note") is None

    run(main())
    assert balances(schema)[1] == OPENING - 5
    client = redis.Redis.from_url(redis_url)
    assert client.get("balance:1") == b"5" and client.get("note") is None
    assert prepared(schema) == []


def test_exception_rolls_back_both(
    stores_factory: Callable[[], Any], schema: str, redis_url: str
) -> None:
    async def main() -> None:
        async with stores_factory() as s:
            with pytest.raises(ValueError, match="changed my mind"):
                async with s.atm.atransaction() as tx:
                    await move(await tx.join(s.pg), 1, -5)
                    await (await tx.join(s.cache)).incr("balance:1", 5)
                    raise ValueError("changed my mind")

    run(main())
    assert balances(schema)[1] == OPENING
    assert redis.Redis.from_url(redis_url).get("balance:1") is None


@pytest.mark.parametrize("failure", ["failed statement", "lost connection"])
def test_a_no_vote_rolls_back_both(
    failure: str, stores_factory: Callable[[], Any], schema: str, redis_url: str
) -> None:
    """PostgreSQL's branch failed a statement (the application caught the error), or lost its
    connection: it votes no, and the Redis branch, prepared first, is rolled back with it."""
    sync_url = make_url(schema).set(drivername="postgresql+psycopg2").render_as_string(False)

    async def main() -> None:
        async with stores_factory() as s:
            with pytest.raises(TransactionRolledBack):
                async with s.atm.atransaction() as tx:
                    await (await tx.join(s.cache)).incr("balance:1", 5)
                    session = await tx.join(s.pg)
                    await move(session, 1, -5)
                    if failure == "failed statement":
                        with pytest.raises(DBAPIError):
                            await session.execute(text("INSERT INTO accounts VALUES (1, 0)"))
                    else:
                        pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
                        await asyncio.to_thread(terminate, sync_url, pid)

    run(main())
    assert balances(schema)[1] == OPENING
    assert redis.Redis.from_url(redis_url).get("balance:1") is None
    assert prepared(schema) == []


def test_the_application_cannot_commit_the_branch_itself(
    stores_factory: Callable[[], Any], schema: str
) -> None:
    async def main() -> None:
        async with stores_factory() as s:
            with pytest.raises(TransactionRolledBack):
                async with s.atm.atransaction() as tx:
                    session = await tx.join(s.pg)
                    await move(session, 1, -5)
                    connection = await session.connection()
                    with pytest.raises(ProgrammingError, match="committed by the coordinator"):
                        await connection.commit()

    run(main())
    assert balances(schema)[1] == OPENING


def test_unsupported_redis_command_is_named(stores_factory: Callable[[], Any]) -> None:
    async def main() -> None:
        async with stores_factory() as s, s.atm.atransaction() as tx:
            branch = await tx.join(s.cache)
            with pytest.raises(UnsupportedCommandError, match="'blpop'"):
                branch.blpop("k")

    run(main())


def test_many_transactions_on_one_loop(
    stores_factory: Callable[[], Any], schema: str, redis_url: str
) -> None:
    """40 transfers from PostgreSQL to Redis at once, 8 completion workers: all commit, and the
    money is where the transfers put it."""
    count = 40

    async def transfer(s: Stores, index: int) -> None:
        async with s.atm.atransaction() as tx:
            await move(await tx.join(s.pg), index % 10, -1)
            await (await tx.join(s.cache)).incr(f"balance:{index % 10}", 1)

    async def main() -> None:
        async with stores_factory() as s:
            await asyncio.gather(*(transfer(s, i) for i in range(count)))
            assert s.atm.manager.metrics_dict()["outcome_committed"] == count

    run(main())
    client = redis.Redis.from_url(redis_url)
    in_redis = sum(int(client.get(f"balance:{i}") or 0) for i in range(10))
    assert in_redis == count
    assert sum(balances(schema).values()) == 10 * OPENING - count
    assert prepared(schema) == []


def test_cancelled_mid_commit_still_reaches_its_outcome(
    stores_factory: Callable[[], Any], schema: str, redis_url: str
) -> None:
    """The task is cancelled while its commit waits right after the decision is forced: the
    commit runs on to COMMITTED on both stores, and then the task sees its cancellation."""

    async def main(decided: threading.Event, go_on: threading.Event) -> None:
        async with stores_factory() as s:

            async def transfer() -> None:
                async with s.atm.atransaction() as tx:
                    await move(await tx.join(s.pg), 1, -7)
                    await (await tx.join(s.cache)).incr("balance:1", 7)

            task = asyncio.create_task(transfer())
            await asyncio.to_thread(decided.wait, 10)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done()  # still waiting for its commit
            go_on.set()
            with pytest.raises(asyncio.CancelledError):
                await task

    with held_at("tm.after_decision_fsync") as (decided, go_on):
        run(main(decided, go_on))
    assert balances(schema)[1] == OPENING - 7
    assert redis.Redis.from_url(redis_url).get("balance:1") == b"7"
    assert prepared(schema) == []


def test_cancelled_during_its_work_rolls_back(
    stores_factory: Callable[[], Any], schema: str, redis_url: str
) -> None:
    """A cancellation while a statement runs is an exception like any other: the block rolls
    back (the interrupted connection is dropped, not reused) and the next transaction works."""

    async def main() -> None:
        async with stores_factory() as s:

            async def slow() -> None:
                async with s.atm.atransaction() as tx:
                    await (await tx.join(s.cache)).incr("balance:1", 3)
                    session = await tx.join(s.pg)
                    await move(session, 1, -3)
                    await session.execute(text("SELECT pg_sleep(5)"))

            task = asyncio.create_task(slow())
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            async with s.atm.atransaction() as tx:
                await move(await tx.join(s.pg), 2, -1)
                await (await tx.join(s.cache)).incr("balance:2", 1)

    run(main())
    assert balances(schema)[1] == OPENING and balances(schema)[2] == OPENING - 1
    client = redis.Redis.from_url(redis_url)
    assert client.get("balance:1") is None and client.get("balance:2") == b"1"
    assert prepared(schema) == []


def test_verbs_on_the_loop_thread_are_refused(stores_factory: Callable[[], Any]) -> None:
    """A synchronous verb called on the loop's own thread would wait for the loop forever: it is
    refused with a message that names the async API."""

    async def main() -> None:
        async with stores_factory() as s:
            with pytest.raises(TransactionRolledBack):
                async with s.atm.atransaction() as tx:
                    await move(await tx.join(s.pg), 1, -1)
                    with pytest.raises(ProgrammingError, match="where it would wait for itself"):
                        s.pg.prepare(Xid.branch_of(tx.gtrid, "pg"))
                    tx.set_rollback_only()

    run(main())


def test_redis_commands_read_their_writes(
    stores_factory: Callable[[], Any], redis_url: str
) -> None:
    async def main() -> None:
        async with stores_factory() as s, s.atm.atransaction() as tx:
            b = await tx.join(s.cache)
            assert await b.hset("h", mapping={"f": "1", "g": "2"}) == 2
            await b.hdel("h", "g")
            assert await b.hgetall("h") == {b"f": b"1"}
            assert await b.hmget("h", ["f", "g"]) == [b"1", None]
            assert await b.sadd("s", "x", "y") == 2
            await b.srem("s", "y")
            assert await b.smembers("s") == {b"x"}
            await b.rpush("l", "a", "b")
            await b.lpush("l", "z")
            assert await b.lrange("l", 0, -1) == [b"z", b"a", b"b"]
            await b.setex("t", 100, "v")
            assert await b.ttl("t") == 100
            assert await b.exists("t", "h", "nope") == 2
            await b.mset({"m1": "1", "m2": "2"})
            assert await b.decr("m1") == 0

    run(main())
    client = redis.Redis.from_url(redis_url)
    assert client.hgetall("h") == {b"f": b"1"} and client.lrange("l", 0, -1) == [b"z", b"a", b"b"]
    assert 0 < client.ttl("t") <= 100 and client.get("m1") == b"0"


def test_the_sync_api_cannot_join_an_async_resource(stores_factory: Callable[[], Any]) -> None:
    async def main() -> None:
        async with stores_factory() as s:
            tx = s.atm.manager.begin()
            try:
                for resource in (s.pg, s.cache):
                    with pytest.raises(ProgrammingError, match="an async resource joins through"):
                        tx.join(resource)
            finally:
                tx.rollback()  # no branch joined: nothing to wait for on the loop

    run(main())


def terminate(url: str, pid: int) -> None:
    """End one backend from outside, as a network cut or an operator would."""
    engine = create_engine(url)
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
    engine.dispose()


def test_a_lost_connection_after_the_decision_commits_by_gid(
    stores_factory: Callable[[], Any], schema: str, redis_url: str
) -> None:
    """The branch's own connection dies between its prepare and COMMIT PREPARED: phase two
    falls back to the synchronous twin, which commits the prepared transaction by its gid."""
    sync_url = make_url(schema).set(drivername="postgresql+psycopg2").render_as_string(False)

    async def main(decided: threading.Event, go_on: threading.Event) -> None:
        async with stores_factory() as s:

            async def transfer() -> Any:
                async with s.atm.atransaction() as tx:
                    session = await tx.join(s.pg)
                    await move(session, 1, -6)
                    pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
                    await (await tx.join(s.cache)).incr("balance:1", 6)
                    pids.append(pid)
                return tx.tx.outcome

            task = asyncio.create_task(transfer())
            await asyncio.to_thread(decided.wait, 10)
            await asyncio.to_thread(terminate, sync_url, pids[0])
            go_on.set()
            assert (await task).value == "committed"

    pids: list[int] = []
    with held_at("tm.after_decision_fsync") as (decided, go_on):
        run(main(decided, go_on))
    assert balances(schema)[1] == OPENING - 6
    assert redis.Redis.from_url(redis_url).get("balance:1") == b"6"
    assert prepared(schema) == []
