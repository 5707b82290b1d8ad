"""The process the async crash tests kill: money moved from PostgreSQL to Redis through the
asyncio API (`coordinator.aio`), or a recovery pass with no event loop at all.

    python tests/crash/async_worker.py run     --pg URL --redis URL --log DIR --count N
    python tests/crash/async_worker.py recover --pg URL --redis URL --log DIR
    python tests/crash/async_worker.py bank    --pg URL --redis URL --log DIR --tasks 8 --seed S

``run``: N transfers one after the other, each its own async transaction: one unit out of
``accounts`` row 1 in PostgreSQL (plus a ``transfers`` row keyed by the gtrid) and into the Redis
counter ``balance`` (plus the key ``t:<gtrid>``). Crashes come from ``TWOPC_CRASH_AT``
(`coordinator.crashpoints`). Printed, flushed (a SIGKILL loses nothing printed)::

    BEGIN <gtrid>            the work is done; the block's exit commits next
    ACK <gtrid> <outcome>    the commit returned
    DONE                     every transfer ran

``bank``: recovery at start (as a restarted service), then ``--tasks`` tasks on one loop move
random amounts between ``accounts`` row i and the Redis counter ``balance:<i>`` (either way),
each recorded as a ``transfers`` row ``(gtrid, i, amount)`` and the key ``t:<gtrid>`` =
``i:amount``, until killed (or ``--duration`` is up); a transfer whose branch voted no is tried
again. Prints ``READY`` once running.

``recover``: a manager over the same resources, one ``recover(force=True)`` outside any loop (the
async resources fall back to their synchronous twins) and ``RECOVERED <json>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from coordinator import FileDecisionLog, TransactionManager, TransactionRolledBack, crashpoints
from coordinator.aio import AsyncTransactionManager
from resource_managers.postgres.aio import AsyncPostgresResource
from resource_managers.redis.aio import AsyncRedisResource

NODE_ID = "async-crash"
SCHEMA = (
    "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)",
    "CREATE TABLE transfers (id text PRIMARY KEY, account int, amount int)",
)
ACCOUNTS = 5


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
            await session.execute(
                text("INSERT INTO transfers VALUES (:id, 1, 1)"), {"id": tx.gtrid}
            )
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


async def bank(args: argparse.Namespace) -> None:
    tm, pg, cache = open_manager(args, recover_on_start=True)
    atm = AsyncTransactionManager(tm, max_workers=args.tasks)
    stop = asyncio.get_running_loop().time() + args.duration

    async def client(rng: random.Random) -> None:
        while asyncio.get_running_loop().time() < stop:
            account, amount = rng.randrange(ACCOUNTS), rng.randint(-20, 20)
            try:
                async with atm.atransaction() as tx:
                    session = await tx.join(pg)
                    await session.execute(
                        text("UPDATE accounts SET balance = balance - :a WHERE id = :i"),
                        {"a": amount, "i": account},
                    )
                    await session.execute(
                        text("INSERT INTO transfers VALUES (:g, :i, :a)"),
                        {"g": tx.gtrid, "i": account, "a": amount},
                    )
                    branch = await tx.join(cache)
                    await branch.incrby(f"balance:{account}", amount)
                    await branch.set(f"t:{tx.gtrid}", f"{account}:{amount}")
            except TransactionRolledBack:
                continue  # a watched balance changed, or a lock was held: next transfer

    say("READY")
    await asyncio.gather(*(client(random.Random(f"{args.seed}-{n}")) for n in range(args.tasks)))
    say("DONE")
    await atm.aclose()
    await pg.engine.dispose()
    await pg.aclose()
    await cache.aclose()


def recover(args: argparse.Namespace) -> None:
    tm, _, _ = open_manager(args, recover_on_start=False)
    recover_and_report(tm)


def recover_and_report(tm: TransactionManager) -> None:
    """One forced recovery pass outside any loop, printed as ``RECOVERED <json>``."""
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
    parser.add_argument("command", choices=("run", "recover", "bank"))
    parser.add_argument("--pg", required=True, help="postgresql+psycopg URL")
    parser.add_argument("--redis", required=True)
    parser.add_argument("--log", required=True, help="decision log directory")
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--seed", default="0")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--trace", action="store_true", help="print POINT <name> at each point")
    args = parser.parse_args(argv)
    if args.trace:
        crashpoints.observe(lambda name: say("POINT", name))
    if args.command == "run":
        asyncio.run(transfers(args))
    elif args.command == "bank":
        asyncio.run(bank(args))
    else:
        recover(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
