"""The ``twopc-eo-aio`` row of `bench/messaging.py`: the same exactly-once pipeline through the
asyncio API (`coordinator.aio`, `messaging.remote.aio`).

Each application is one process with one event loop running `TASKS` transactions at once (the
producer's batches dealt out among its tasks; the consumer's tasks receive from the one
destination, so messages are consumed out of order, which the verification does not mind). The
producing one serves its message log
to itself (``ProducerService`` on a loopback listener, authenticated) and sends through an
`AsyncRemoteMessageLog`; its log transfers to the consuming process as in the other rows. The
consuming one serves its cursor the same way (``ConsumerService`` next to the transfer receiver)
and receives through an `AsyncRemoteCursor`. Both write PostgreSQL through an
`AsyncPostgresResource` (psycopg 3 async), prepared as an ordinary branch under the file decision
log: the async API has no logging last resource, so this row compares with ``twopc-eo-file``.
Why remote clients on the same machine: the async API drives remote logs and cursors only (an
embedded store's verbs are blocking file I/O, which belongs on a thread anyway), so the row pays
one loopback round trip per verb that the embedded rows do not. The verification is the other
rows' (`messaging_outbox.verify`: every produced id consumed once).
"""

from __future__ import annotations

import asyncio
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import messaging_baselines as base  # type: ignore[import-not-found]
from sqlalchemy.ext.asyncio import create_async_engine

from coordinator import FileDecisionLog, TransactionManager
from coordinator.aio import AsyncTransactionManager
from messaging.auth import SharedSecret
from messaging.connection import Listener, connect
from messaging.remote import CONSUMER_ROLE, PRODUCER_ROLE, ConsumerService, ProducerService
from messaging.remote.aio import AsyncRemoteCursor, AsyncRemoteMessageLog
from messaging.transfer import TRANSFER_ROLE, LogTransfer, TransferReceiver
from resource_managers.cursor import Cursor
from resource_managers.message_log import MessageLog
from resource_managers.postgres.aio import AsyncPostgresResource

EXACTLY_ONCE_AIO = "twopc exactly-once, asyncio (file log, PG prepared)"
#: concurrent transactions per application, all on its one event loop
TASKS = 4


def _manager(node: str, workdir: Path, resources: list[Any]) -> AsyncTransactionManager:
    tm = TransactionManager(
        node, FileDecisionLog(workdir / f"{node}-txlog"), resources, recovery_interval=None,
        reaper_interval=None,
    )  # fmt: skip
    return AsyncTransactionManager(tm, max_workers=TASKS)


def consumer_main(  # noqa: PLR0917 - a Process target takes positional arguments
    url: str, workdir: Path, key: bytes, per_tx: int, total: int, pipe: Pipe, sql: tuple[Any, ...]
) -> None:
    destination, _, insert_consumed = sql
    cursor = Cursor(workdir / "cursor")
    secret = SharedSecret(key)
    listener = Listener(
        ("127.0.0.1", 0), secret, "bench-cursor",
        {TRANSFER_ROLE: TransferReceiver(cursor), CONSUMER_ROLE: ConsumerService(cursor)},
    ).start()  # fmt: skip
    pipe.send(listener.address)

    async def consume() -> None:
        engine = create_async_engine(url, pool_size=TASKS)
        pg = AsyncPostgresResource(engine, "pg")
        remote = AsyncRemoteCursor(listener.address, secret, name="cursor", client_id="bench-c")
        atm = _manager("bench-consumer", workdir, [remote, pg])
        latencies: list[float] = []
        rounds = 0
        finished = 0.0

        async def one_task() -> None:
            nonlocal rounds, finished
            while len(latencies) < total:
                async with atm.atransaction() as tx:
                    branch = await tx.join(remote)
                    got = await branch.receive_many(destination, per_tx, timeout=0.5)
                    if not got:
                        continue
                    session = await tx.join(pg)
                    await session.execute(insert_consumed, {"ids": [d.headers["id"] for d in got]})
                done = time.time_ns()
                latencies.extend((done - int(d.headers[base.SENT_HEADER])) / 1e6 for d in got)
                rounds += 1
                if len(latencies) >= total and not finished:
                    finished = time.perf_counter()

        try:
            await asyncio.gather(*(one_task() for _ in range(TASKS)))
            pipe.send((finished, latencies, rounds))
        finally:
            await atm.aclose()
            await remote.aclose()
            await engine.dispose()

    try:
        asyncio.run(consume())
    finally:
        listener.close()
        cursor.close()


def producer_main(  # noqa: PLR0917 - a Process target takes positional arguments
    url: str,
    workdir: Path,
    key: bytes,
    per_tx: int,
    total: int,
    cursor_address: tuple[str, int],
    pipe: Pipe,
    sql: tuple[Any, ...],
) -> None:
    destination, insert_produced, _ = sql
    mlog = MessageLog(workdir / "log")
    secret = SharedSecret(key)
    transfer = LogTransfer(
        mlog, lambda: connect(cursor_address, secret, "bench-log", TRANSFER_ROLE)
    ).start()
    listener = Listener(
        ("127.0.0.1", 0), secret, "bench-log", {PRODUCER_ROLE: ProducerService(mlog)}
    ).start()
    batches = list(base._Run(per_tx, total).batches())  # the baselines' ids and bodies

    async def produce() -> None:
        engine = create_async_engine(url, pool_size=TASKS)
        pg = AsyncPostgresResource(engine, "pg")
        remote = AsyncRemoteMessageLog(listener.address, secret, name="mlog", client_id="bench-p")
        atm = _manager("bench-producer", workdir, [remote, pg])
        try:
            pipe.send("ready")
            await asyncio.to_thread(pipe.recv)  # go

            async def one_task(mine: list[tuple[list[str], list[bytes]]]) -> None:
                for ids, bodies in mine:
                    async with atm.atransaction() as tx:
                        session = await tx.join(pg)
                        await session.execute(insert_produced, {"ids": ids, "bodies": bodies})
                        branch = await tx.join(remote)
                        sent = str(time.time_ns())
                        for mid, body in zip(ids, bodies, strict=True):
                            branch.send(
                                destination, body, headers={"id": mid, base.SENT_HEADER: sent}
                            )

            await asyncio.gather(*(one_task(batches[n::TASKS]) for n in range(TASKS)))
            pipe.send(time.perf_counter())
        finally:
            await atm.aclose()
            await remote.aclose()
            await engine.dispose()

    try:
        asyncio.run(produce())
        transfer.wait_idle(120)
    finally:
        transfer.close()
        listener.close()
        mlog.close()
