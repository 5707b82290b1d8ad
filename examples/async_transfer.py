"""Move money between PostgreSQL and Redis with concurrent asyncio transactions, then audit.

Plain asyncio, no framework. It starts a throwaway PostgreSQL cluster and a throwaway
``redis-server`` from local binaries (`resource_managers.throwaway`), opens accounts with 1000
on each side (a PostgreSQL table, Redis counters), and runs ``--transfers`` transfers, at most
``--concurrency`` at once on one event loop. Each transfer is one two-phase transaction
(`coordinator.aio`): a random amount leaves an account on one side and arrives on the other, a
``transfers`` row in PostgreSQL and a ``t:<gtrid>`` key in Redis record it, a notice message
goes to the ``transfers`` queue of a message log in the same transaction, and a transfer that
would overdraw raises, so its transaction rolls back (its message with it). Branches that
collide (a watched Redis balance changed by another transfer) vote no and the transfer is tried
again.

The audit, after every transfer ended: the money in both stores together is what was put in;
every transfer is recorded on both sides or on neither; every recorded transfer has exactly one
notice and no other transfer has one; nothing is left prepared in PostgreSQL, staged or locked in
Redis, or pending in the decision log. The message log is embedded (`MessageLogResource`, a
synchronous resource: an async transaction joins it on a worker thread, its ``send`` only stages
in memory, and its forced prepare runs with the completion, off the loop). The exit status is
0 only if all of that holds.

    .venv/bin/python examples/async_transfer.py [--transfers 200] [--concurrency 20]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.ext.asyncio import create_async_engine

from coordinator import FileDecisionLog, TransactionManager, TransactionRolledBack
from coordinator.aio import AsyncTransaction, AsyncTransactionManager
from resource_managers.message_log import MessageLog, MessageLogResource
from resource_managers.postgres.aio import AsyncPostgresResource
from resource_managers.redis.aio import AsyncRedisResource
from resource_managers.throwaway import PostgresServer, RedisServer

OPENING = 1000
QUEUE = "transfers"


class Overdrawn(Exception):
    """The transfer would leave an account below zero: its transaction rolls back."""


@dataclass
class Tally:
    committed: int = 0
    overdrawn: int = 0
    retries: int = 0
    given_up: list[str] = field(default_factory=list)


@dataclass
class Bank:
    atm: AsyncTransactionManager
    pg: AsyncPostgresResource[Any]
    cache: AsyncRedisResource
    notices: MessageLogResource
    accounts: int
    tally: Tally


async def transfer(bank: Bank, rng: random.Random) -> None:
    account, amount = rng.randrange(bank.accounts), rng.randint(1, 50)
    to_redis = rng.random() < 0.5
    for attempt in range(20):
        try:
            async with bank.atm.atransaction() as tx:
                await move(tx, bank, account, amount if to_redis else -amount)
            bank.tally.committed += 1
            return
        except Overdrawn:
            bank.tally.overdrawn += 1
            return
        except TransactionRolledBack:  # a branch voted no (a watched key changed): again
            bank.tally.retries += 1
            await asyncio.sleep(rng.uniform(0, 0.01 * (attempt + 1)))
    bank.tally.given_up.append(f"account {account} amount {amount}")


async def move(tx: AsyncTransaction, bank: Bank, account: int, amount: int) -> None:
    """``amount`` from PostgreSQL to Redis (negative: the other way)."""
    session = await tx.join(bank.pg)
    left = (
        await session.execute(
            text("UPDATE accounts SET balance = balance - :a WHERE id = :i RETURNING balance"),
            {"a": amount, "i": account},
        )
    ).scalar_one()
    await session.execute(
        text("INSERT INTO transfers (id, account, amount) VALUES (:g, :i, :a)"),
        {"g": tx.gtrid, "i": account, "a": amount},
    )
    branch = await tx.join(bank.cache)
    in_redis = await branch.incrby(f"balance:{account}", amount)  # reads and watches the key
    await branch.set(f"t:{tx.gtrid}", amount)
    notices = await tx.join(bank.notices)
    notices.send(QUEUE, str(amount).encode(), headers={"transfer": tx.gtrid})
    if left < 0 or (in_redis is not None and in_redis < 0):
        raise Overdrawn(f"account {account}")


async def run(
    pg_url: str, redis_url: str, work: Path, args: argparse.Namespace
) -> tuple[Tally, list[str]]:
    """The transfers; the tally and the transfer named by every notice in the message log."""
    engine = create_async_engine(pg_url, pool_size=args.concurrency, max_overflow=0)
    pg = AsyncPostgresResource(engine, "bank-pg")
    cache = AsyncRedisResource.from_url(redis_url, "bank-redis")
    mlog = MessageLog(work / "notices")
    notices = MessageLogResource(mlog, "bank-notices")
    tm = TransactionManager("bank", FileDecisionLog(work / "log"), [pg, cache, notices])
    atm = AsyncTransactionManager(tm, max_workers=args.concurrency)
    rng = random.Random(args.seed)
    tally = Tally()
    bank = Bank(atm, pg, cache, notices, args.accounts, tally)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(seed: int) -> None:
        async with gate:
            await transfer(bank, random.Random(seed))

    try:
        await asyncio.gather(*(one(rng.randrange(2**32)) for _ in range(args.transfers)))
        # the notices' commit records are lazy: a moment after the last commit returned, the
        # last ones may still be on their way to disk, their decisions not ended yet
        notices.flush_commits()
        in_doubt = tm.in_doubt()
        if in_doubt:
            tally.given_up.append(f"in doubt: {in_doubt}")
        sent = [message.headers["transfer"] for _, message in mlog.pending(QUEUE)]
    finally:
        await atm.aclose()
        await engine.dispose()
        await pg.aclose()
        await cache.aclose()
        mlog.close()
    return tally, sent


def audit(pg_url: str, redis_url: str, accounts: int, sent: list[str]) -> list[str]:
    """Every rule the module docstring names; an empty list when they all hold."""
    problems = []
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        in_pg = int(conn.execute(text("SELECT sum(balance) FROM accounts")).scalar_one())
        rows = {str(g) for (g,) in conn.execute(text("SELECT id FROM transfers"))}
        prepared = list(conn.execute(text("SELECT gid FROM pg_prepared_xacts")))
    engine.dispose()
    client = redis.Redis.from_url(redis_url)
    in_redis = sum(int(client.get(f"balance:{i}") or 0) for i in range(accounts))
    recorded = {key.decode()[2:] for key in client.scan_iter("t:*")}
    staged = [key for key in client.scan_iter("twopc:*") if b":lock:" in key or b":ws:" in key]
    staged += client.zrange("twopc:{twopc}:prepared", 0, -1)
    client.close()
    if in_pg + in_redis != 2 * accounts * OPENING:
        problems.append(f"conservation: {in_pg} + {in_redis} != {2 * accounts * OPENING}")
    if rows != recorded:
        problems.append(f"atomicity: recorded on one side only: {sorted(rows ^ recorded)[:5]}")
    twice = sorted(g for g in set(sent) if sent.count(g) > 1)
    if twice:
        problems.append(f"notices sent more than once: {twice[:5]}")
    if set(sent) != rows:
        problems.append(f"notices and transfers differ: {sorted(set(sent) ^ rows)[:5]}")
    if prepared:
        problems.append(f"PostgreSQL still holds prepared transactions: {prepared}")
    if staged:
        problems.append(f"Redis still holds staged writes or locks: {staged[:5]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transfers", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--accounts", type=int, default=50)
    parser.add_argument("--seed", type=int, default=18)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="twopc-async-transfer-"))
    pg_server, redis_server = PostgresServer(), RedisServer()  # in temporary directories
    try:
        pg_server.start()
        redis_server.start()
        sync_url = pg_server.url(pg_server.create_database("bank"))
        engine = create_engine(sync_url)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint)"))
            conn.execute(
                text("CREATE TABLE transfers (id text PRIMARY KEY, account int, amount int)")
            )
            conn.execute(
                text("INSERT INTO accounts SELECT g, :o FROM generate_series(0, :n - 1) g"),
                {"o": OPENING, "n": args.accounts},
            )
        engine.dispose()
        seed = redis.Redis.from_url(redis_server.url())
        seed.mset({f"balance:{i}": OPENING for i in range(args.accounts)})
        seed.close()
        pg_url = make_url(sync_url).set(drivername="postgresql+psycopg").render_as_string(False)
        started = time.perf_counter()
        tally, sent = asyncio.run(run(pg_url, redis_server.url(), work, args))
        took = time.perf_counter() - started
        print(
            f"{args.transfers} transfers, {args.concurrency} at once, in {took:.2f} s: "
            f"{tally.committed} committed, {tally.overdrawn} refused (overdrawn), "
            f"{tally.retries} retries after a no vote"
        )
        problems = audit(sync_url, redis_server.url(), args.accounts, sent)
        problems += [f"gave up: {what}" for what in tally.given_up]
    finally:
        redis_server.remove()
        pg_server.remove()
        shutil.rmtree(work, ignore_errors=True)
    for problem in problems:
        print("AUDIT FAILED:", problem)
    if not problems:
        print(
            "audit: ok (money conserved, every transfer on both sides or neither, "
            "one notice per transfer, nothing prepared, staged or pending)"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
