"""Async messaging (`messaging.remote.aio`, `messaging.aio_consumer`) against real ``twopc serve
log`` and ``twopc serve cursor`` processes (the log transferring to the cursor) and real
PostgreSQL (psycopg 3 async): an async producer sends with a row in the same transaction, an
async consumer takes each message with a row of its own, exactly once; a no vote rolls back the
messages and the rows together; a failing handler has its message redelivered; a task cancelled
mid-commit still commits its round; leaving the loop with part of a round unhandled rolls it
back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from coordinator import FileDecisionLog, TransactionRolledBack
from coordinator.aio import AsyncTransaction, AsyncTransactionManager
from messaging.aio_consumer import AsyncConsumer, aconsume_once
from messaging.remote.aio import AsyncRemoteCursor, AsyncRemoteMessageLog
from resource_managers.cursor import Delivery
from resource_managers.postgres.aio import AsyncPostgresResource
from tests.integration.cursor_stack import Stack, running_stack
from tests.support.managers import make_manager
from tests.support.no_voter import NoVoter

pytestmark = pytest.mark.timeout(120)


@dataclass
class Ends:
    atm: AsyncTransactionManager
    pg: AsyncPostgresResource[AsyncSession]
    log: AsyncRemoteMessageLog
    cursor: AsyncRemoteCursor


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path / "servers") as s:
        yield s


@pytest.fixture
def schema(pg_url: str) -> str:
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE produced (id text PRIMARY KEY)"))
        conn.execute(text("CREATE TABLE consumed (id text PRIMARY KEY)"))
    engine.dispose()
    return make_url(pg_url).set(drivername="postgresql+psycopg").render_as_string(False)


@pytest.fixture
def ends_factory(
    stack: Stack, schema: str, tmp_path: Path, managers: list[Any]
) -> Callable[..., Any]:
    @asynccontextmanager
    async def open_ends(*extra: Any) -> AsyncIterator[Ends]:
        engine = create_async_engine(schema)
        pg = AsyncPostgresResource(engine, "pg")
        mlog = AsyncRemoteMessageLog(("127.0.0.1", stack.log_port), stack.secret, timeout=10)
        cursor = AsyncRemoteCursor(("127.0.0.1", stack.cursor_port), stack.secret, timeout=10)
        tm = make_manager(
            managers, [pg, mlog, cursor, *extra], FileDecisionLog(tmp_path / "decisions")
        )
        atm = AsyncTransactionManager(tm, max_workers=4)
        try:
            yield Ends(atm, pg, mlog, cursor)
        finally:
            await engine.dispose()
            await pg.aclose()
            await mlog.aclose()
            await cursor.aclose()

    return open_ends


def rows(url: str, table: str) -> list[str]:
    engine = create_engine(url)
    with engine.connect() as conn:
        got = [str(i) for (i,) in conn.execute(text(f"SELECT id FROM {table}")).all()]
        prepared = conn.execute(text("SELECT count(*) FROM pg_prepared_xacts")).scalar_one()
    engine.dispose()
    assert prepared == 0, "a transaction was left prepared"
    return sorted(got)


async def produce(ends: Ends, ids: list[str], destination: str = "orders") -> None:
    for message_id in ids:
        async with ends.atm.atransaction() as tx:
            session = await tx.join(ends.pg)
            await session.execute(text("INSERT INTO produced VALUES (:i)"), {"i": message_id})
            (await tx.join(ends.log)).send(destination, message_id.encode())


async def record(tx: AsyncTransaction, pg: Any, delivery: Delivery) -> None:
    session = await tx.join(pg)
    await session.execute(text("INSERT INTO consumed VALUES (:i)"), {"i": delivery.body.decode()})


def test_exactly_once_from_async_producer_to_async_consumer(
    ends_factory: Callable[..., Any], schema: str
) -> None:
    ids = [f"m{i:03d}" for i in range(30)]

    async def main() -> None:
        async with ends_factory() as ends:
            await produce(ends, ids)
            seen: list[str] = []
            async with AsyncConsumer(ends.atm, ends.cursor, "orders", poll=5.0) as consumer:
                async for tx, delivery in consumer:
                    await record(tx, ends.pg, delivery)
                    seen.append(delivery.body.decode())
                    if len(seen) == len(ids):
                        break
            assert seen == ids  # in order, each once
            for pool in (ends.log.sync._pool, ends.cursor.sync._pool):  # bytes went on the loop
                assert pool._loop_idle  # (a blocking one too: the start-up recovery pass)
            assert consumer.handled == len(ids) and not consumer.errors
            # nothing more to take: every one was committed by the loop, the last at its exit
            assert await aconsume_once(ends.atm, ends.cursor, "orders", _fail, timeout=0.5) == 0

    asyncio.run(main())
    assert rows(schema, "produced") == ids
    assert rows(schema, "consumed") == ids


async def _fail(tx: AsyncTransaction, delivery: Delivery) -> None:
    raise AssertionError(f"unexpected {delivery.body!r}")


def test_a_no_vote_rolls_back_the_messages_and_the_rows(
    ends_factory: Callable[..., Any], schema: str
) -> None:
    no = NoVoter(TransactionRolledBack("no"))

    async def main() -> None:
        async with ends_factory(no) as ends:
            with pytest.raises(TransactionRolledBack):  # producer: row and message both gone
                async with ends.atm.atransaction() as tx:
                    session = await tx.join(ends.pg)
                    await session.execute(text("INSERT INTO produced VALUES ('lost')"))
                    (await tx.join(ends.log)).send("orders", b"lost")
                    await tx.join(no)
            await produce(ends, ["kept"])
            with pytest.raises(TransactionRolledBack):  # consumer: row gone, message back
                async with ends.atm.atransaction() as tx:
                    got = await (await tx.join(ends.cursor)).receive("orders", timeout=10)
                    assert got is not None and got.body == b"kept"
                    await record(tx, ends.pg, got)
                    await tx.join(no)
            taken: list[Delivery] = []

            async def handle(tx: AsyncTransaction, delivery: Delivery) -> None:
                taken.append(delivery)
                await record(tx, ends.pg, delivery)

            assert await aconsume_once(ends.atm, ends.cursor, "orders", handle, timeout=10) == 1
            assert [d.body for d in taken] == [b"kept"] and taken[0].redelivered

    asyncio.run(main())
    assert rows(schema, "produced") == ["kept"]
    assert rows(schema, "consumed") == ["kept"]


def test_handler_failure_redelivers_and_run_goes_on(
    ends_factory: Callable[..., Any], schema: str
) -> None:
    async def main() -> None:
        async with ends_factory() as ends:
            await produce(ends, ["a", "b"])
            failures = 0

            async def handle(tx: AsyncTransaction, delivery: Delivery) -> None:
                nonlocal failures
                await record(tx, ends.pg, delivery)
                if delivery.body == b"a" and failures == 0:
                    failures += 1
                    raise ValueError("first try fails")
                if delivery.body == b"b":
                    consumer.stop()

            consumer = AsyncConsumer(ends.atm, ends.cursor, "orders", handle, poll=5.0)
            await asyncio.wait_for(consumer.run(), 60)
            assert consumer.handled == 2 and consumer.errors == {"ValueError": 1}

    asyncio.run(main())
    assert rows(schema, "consumed") == ["a", "b"]


def test_a_task_cancelled_mid_commit_still_commits(
    ends_factory: Callable[..., Any], schema: str
) -> None:
    async def main() -> None:
        async with ends_factory() as ends:
            await produce(ends, ["c"])
            committing = asyncio.Event()

            async def handle(tx: AsyncTransaction, delivery: Delivery) -> None:
                await record(tx, ends.pg, delivery)
                committing.set()  # the round's commit starts as soon as this returns

            task = asyncio.create_task(
                aconsume_once(ends.atm, ends.cursor, "orders", handle, timeout=10)
            )
            await committing.wait()
            await asyncio.sleep(0)  # into the shielded completion
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await aconsume_once(ends.atm, ends.cursor, "orders", _fail, timeout=0.5) == 0

    asyncio.run(main())
    assert rows(schema, "consumed") == ["c"]


def test_leaving_the_loop_with_messages_of_the_round_unhandled_rolls_it_back(
    ends_factory: Callable[..., Any], schema: str
) -> None:
    async def main() -> None:
        async with ends_factory() as ends:
            await produce(ends, ["x", "y"])
            await asyncio.sleep(1.0)  # both transferred: one round takes both
            async with AsyncConsumer(ends.atm, ends.cursor, "orders", batch=2, poll=5.0) as c:
                async for tx, delivery in c:
                    await record(tx, ends.pg, delivery)
                    break  # "y" of this round never handled: the round must not commit
            taken: list[Delivery] = []

            async def handle(tx: AsyncTransaction, delivery: Delivery) -> None:
                taken.append(delivery)
                await record(tx, ends.pg, delivery)

            while len(taken) < 2:
                assert await aconsume_once(ends.atm, ends.cursor, "orders", handle, timeout=5)
            assert [d.body for d in taken] == [b"x", b"y"] and taken[0].redelivered

    asyncio.run(main())
    assert rows(schema, "consumed") == ["x", "y"]
