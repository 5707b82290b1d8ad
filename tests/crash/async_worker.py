"""The process the async crash tests kill: money moved from PostgreSQL to Redis through the
asyncio API (`coordinator.aio`), or a recovery pass with no event loop at all.

    python tests/crash/async_worker.py run     --pg URL --redis URL --log DIR --count N
    python tests/crash/async_worker.py recover --pg URL --redis URL --log DIR

``run``: N transfers one after the other, each its own async transaction: one unit out of
``accounts`` row 1 in PostgreSQL (plus a ``transfers`` row keyed by the gtrid) and into the Redis
counter ``balance`` (plus the key ``t:<gtrid>``). Crashes come from ``TWOPC_CRASH_AT``
(`coordinator.crashpoints`). Printed, flushed (a SIGKILL loses nothing printed)::

    BEGIN <gtrid>            the work is done; the block's exit commits next
    ACK <gtrid> <outcome>    the commit returned
    DONE                     every transfer ran

``recover``: a manager over the same resources, one ``recover(force=True)`` outside any loop (the
async resources fall back to their synchronous twins) and ``RECOVERED <json>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from coordinator import FileDecisionLog, TransactionManager
from coordinator.aio import AsyncTransactionManager
from resource_managers.postgres.aio import AsyncPostgresResource
from resource_managers.redis.aio import AsyncRedisResource

NODE_ID = "async-crash"
SCHEMA = (
    "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)",
    "CREATE TABLE transfers (id text PRIMARY KEY)",
)


def say(*words: object) -> None:
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def open_manager(
    args: argparse.Namespace, *, recover_on_start: bool
) -> tuple[TransactionManager, AsyncPostgresResource[Any], AsyncRedisResource]:
    pg = AsyncPostgresResource(create_async_engine(args.pg), "pg")
    cache = AsyncRedisResource.from_url(args.redis, "cache")
    tm = TransactionManager(
        NODE_ID,
        FileDecisionLog(Path(args.log)),
        [pg, cache],
        recovery_interval=None,
        reaper_interval=None,
        recover_on_start=recover_on_start,
    )
    return tm, pg, cache


async def transfers(args: argparse.Namespace) -> None:
    tm, pg, cache = open_manager(args, recover_on_start=True)
    atm = AsyncTransactionManager(tm)
    for _ in range(args.count):
        async with atm.atransaction() as tx:
            session = await tx.join(pg)
            await session.execute(text("UPDATE accounts SET balance = balance - 1 WHERE id = 1"))
            await session.execute(text("INSERT INTO transfers VALUES (:id)"), {"id": tx.gtrid})
            branch = await tx.join(cache)
            await branch.incr("balance")
            await branch.set(f"t:{tx.gtrid}", "1")
            say("BEGIN", tx.gtrid)
        say("ACK", tx.gtrid, tx.tx.outcome.value if tx.tx.outcome else "?")
    say("DONE")
    await atm.aclose()
    await pg.engine.dispose()
    await pg.aclose()
    await cache.aclose()


def recover(args: argparse.Namespace) -> None:
    tm, _, _ = open_manager(args, recover_on_start=False)
    report = tm.recover(force=True)
    result = {
        "committed": report.committed,
        "rolled_back": report.rolled_back,
        "heuristics": report.heuristics,
        "failures": report.failures,
        "pending_after": [d.gtrid for d in tm.log.pending()],
    }
    tm.close()
    say("RECOVERED", json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("run", "recover"))
    parser.add_argument("--pg", required=True, help="postgresql+psycopg URL")
    parser.add_argument("--redis", required=True)
    parser.add_argument("--log", required=True, help="decision log directory")
    parser.add_argument("--count", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "run":
        asyncio.run(transfers(args))
    else:
        recover(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
