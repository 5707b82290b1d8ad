"""The process the async messaging crash tests kill: a relay through the asyncio messaging API,
or a recovery pass with no event loop at all.

    python tests/crash/amsg_worker.py relay   --pg URL --log DIR --log-port P --cursor-port P
        --queue IN --out OUT --count N
    python tests/crash/amsg_worker.py recover --pg URL --log DIR --log-port P --cursor-port P

``relay``: rounds of `messaging.aio_consumer.aconsume_once`, one message each, each its own
two-phase transaction over three branches (`AsyncRemoteCursor` ``cursor``, then
`AsyncRemoteMessageLog` ``mlog``, then `AsyncPostgresResource` ``pg``, prepared in that order):
the message taken from ``IN``, a ``consumed`` row with its body, and the same body sent on to
``OUT``; until ``consumed`` holds ``N`` rows for ``IN``. Crashes come from ``TWOPC_CRASH_AT``.
Prints ``BEGIN <body>`` when a round's work is done, ``ACK <body>`` once it committed.

``recover``: a manager over the same resources, one ``recover(force=True)`` outside any loop (the
async resources fall back to blocking connections) and ``RECOVERED <json>``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from coordinator import FileDecisionLog, TransactionManager
from coordinator.aio import AsyncTransaction, AsyncTransactionManager
from messaging.aio_consumer import aconsume_once
from messaging.auth import SharedSecret
from messaging.remote.aio import AsyncRemoteCursor, AsyncRemoteMessageLog
from resource_managers.cursor import Delivery
from resource_managers.postgres.aio import AsyncPostgresResource
from tests.crash.async_worker import recover_and_report, say
from tests.integration.cursor_stack import SECRET

NODE_ID = "amsg-crash"
SCHEMA = ("CREATE TABLE consumed (queue text NOT NULL, body text NOT NULL)",)


def open_manager(
    args: argparse.Namespace, *, recover_on_start: bool
) -> tuple[
    TransactionManager, AsyncPostgresResource[Any], AsyncRemoteMessageLog, AsyncRemoteCursor
]:
    secret = SharedSecret(SECRET.encode())
    pg = AsyncPostgresResource(create_async_engine(args.pg), "pg")
    mlog = AsyncRemoteMessageLog(("127.0.0.1", args.log_port), secret, name="mlog", timeout=10)
    cursor = AsyncRemoteCursor(("127.0.0.1", args.cursor_port), secret, name="cursor", timeout=10)
    tm = TransactionManager(
        NODE_ID, FileDecisionLog(Path(args.log)), [pg, mlog, cursor], recovery_interval=None,
        reaper_interval=None, recover_on_start=recover_on_start,
    )  # fmt: skip
    return tm, pg, mlog, cursor


async def relay(args: argparse.Namespace) -> None:
    tm, pg, mlog, cursor = open_manager(args, recover_on_start=True)
    atm = AsyncTransactionManager(tm)

    async def handle(tx: AsyncTransaction, delivery: Delivery) -> None:
        body = delivery.body.decode()
        session = await tx.join(pg)
        await session.execute(
            text("INSERT INTO consumed VALUES (:q, :b)"), {"q": args.queue, "b": body}
        )
        (await tx.join(mlog)).send(args.out, delivery.body)
        say("BEGIN", body)

    async def done() -> int:
        async with pg.engine.connect() as conn:
            query = text("SELECT count(*) FROM consumed WHERE queue = :q")
            return int((await conn.execute(query, {"q": args.queue})).scalar_one())

    while await done() < args.count:
        await aconsume_once(atm, cursor, args.queue, handle, timeout=5.0)
        say("ACK")
    say("DONE")
    await atm.aclose()
    await pg.engine.dispose()
    await pg.aclose()
    await mlog.aclose()
    await cursor.aclose()


def recover(args: argparse.Namespace) -> None:
    tm, _, _, _ = open_manager(args, recover_on_start=False)
    recover_and_report(tm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("relay", "recover"))
    parser.add_argument("--pg", required=True)
    parser.add_argument("--log", required=True, help="decision log directory")
    parser.add_argument("--log-port", type=int, required=True)
    parser.add_argument("--cursor-port", type=int, required=True)
    parser.add_argument("--queue", default="in")
    parser.add_argument("--out", default="out")
    parser.add_argument("--count", type=int, default=3)
    args = parser.parse_args(argv)
    if args.command == "relay":
        asyncio.run(relay(args))
    else:
        recover(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
