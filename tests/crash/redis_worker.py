"""The process the PostgreSQL + Redis crash tests kill: transfers, recovery or a bank.

    python tests/crash/redis_worker.py run     --pg URL --redis URL --namespace NS --log LOG
                                               [--ledger] --plan P --account N
    python tests/crash/redis_worker.py recover --pg URL --redis URL --namespace NS --log LOG
    python tests/crash/redis_worker.py bank    --pg URL --redis URL --namespace NS --log LOG
                                               --threads 4 --accounts 8 --seed S
    python tests/crash/redis_worker.py serve   (a fork server, as ``pg_worker.py serve``)

Resources, in their prepare order: ``a`` is a `PostgresResource` on ``--pg`` (the schema of
`pg_worker.SCHEMA`), ``b`` a `RedisResource` on ``--redis`` and, with ``--ledger``, ``c`` a
second `RedisResource` on the same server (the third branch the ``.3`` crash points need). Both
Redis resources keep twopc's keys under ``--namespace`` and the data under ``<NS>:``:

    <NS>:bal:<account>   a balance (a string INCRBY moves)
    <NS>:xfer:<gtrid>    b's half of a transfer: a hash {account, amount} (account "-": none)
    <NS>:ledger:<gtrid>  c's ledger entry
    <NS>:seen:<gtrid>    c's second key: c commits in steps of one SET (``commit_chunk=1``)
    <NS>:veto            the key c watches in a ``veto`` transaction

so a test can tell per transaction which branches it reached, as with the ``transfers`` rows of
PostgreSQL. Printed lines and ``--log`` are pg_worker.py's (BEGIN, ACK, ABORTED, UNKNOWN, DONE,
``RECOVERED <json>``).

``run`` kinds: ``2pc`` moves one unit from ``--account`` in a to the same account in b, and
writes c's ledger entry when there is a c; ``veto``: the same, but c watches ``<NS>:veto``, which
a plain client changes before commit, so c votes no; ``1pc``: b's record alone (Redis's one-phase
path); ``ro``: a -> b while c only reads.

``bank``: ``--threads`` clients move random amounts between random accounts of a and b until
killed, with a recovery pass every ``--recovery-interval`` seconds (a Redis that comes back must
not wait for the next start to see its prepared branches finished). Its Redis resource uses
blind writes (``INCRBY`` neither reads nor watches): the documented mode for hot counters.
Crashes come from ``TWOPC_CRASH_AT`` (`coordinator.crashpoints`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from sqlalchemy import create_engine

from coordinator import TransactionManager
from coordinator.resource import Resource
from coordinator.transaction import Transaction
from resource_managers.postgres import PostgresResource
from resource_managers.redis import RedisBranch, RedisResource
from tests.crash.pg_worker import finish, move, open_log, run_clients, say, serve

NODE_ID = "redis-crash-node"
KINDS = ("2pc", "veto", "1pc", "ro", "rob")
NONE = "-"  # the account of a record that moves no money


# -- the keys --------------------------------------------------------------------------------------


def balance_key(ns: str, account: int) -> str:
    return f"{ns}:bal:{account}"


def xfer_key(ns: str, gtrid: str) -> str:
    return f"{ns}:xfer:{gtrid}"


def ledger_key(ns: str, gtrid: str) -> str:
    return f"{ns}:ledger:{gtrid}"


def seen_key(ns: str, gtrid: str) -> str:
    return f"{ns}:seen:{gtrid}"


def enter(branch: RedisBranch, ns: str, gtrid: str) -> None:
    """c's ledger entry and its second key: two plain SETs, so c's commit takes steps."""
    branch.mset({ledger_key(ns, gtrid): "1", seen_key(ns, gtrid): "1"})


def veto_key(ns: str) -> str:
    return f"{ns}:veto"


def redis_client(url: str) -> redis.Redis:
    """A client that fails fast on a dead server and retries briefly (redis-py's default
    backoff sleeps up to seconds, longer than these tests let Redis stay down)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=5,
        socket_connect_timeout=2,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 3),
    )


# -- the manager -------------------------------------------------------------------------------


def open_resources(args: argparse.Namespace) -> list[Resource]:
    # a lock held by a crashed run's prepared branch must fail a statement, never hang it
    engine = create_engine(
        args.pg, pool_size=args.threads + 2, connect_args={"options": "-c lock_timeout=5000"}
    )
    client = redis_client(args.redis)
    options: dict[str, Any] = {"namespace": args.namespace, "lock_wait": args.lock_wait}
    resources: list[Resource] = [
        PostgresResource(engine, "a", last_resource=args.last == "a"),
        RedisResource(client, "b", blind_writes=args.blind, **options),
    ]
    if args.ledger:
        resources.append(RedisResource(client, "c", commit_chunk=1, **options))
    return resources


def open_manager(args: argparse.Namespace, *, recover_on_start: bool) -> TransactionManager:
    return TransactionManager(
        args.node,
        open_log(args.log, args.node, args),
        open_resources(args),
        recovery_interval=args.recovery_interval,
        reaper_interval=None,
        recover_on_start=recover_on_start,
        async_phase_two=args.async_phase_two,
    )


# -- the work ----------------------------------------------------------------------------------


def credit(branch: RedisBranch, ns: str, gtrid: str, account: int | None, amount: int) -> None:
    """``amount`` into the Redis ``account`` (none: the record only), and b's transfer record."""
    if account is not None:
        branch.incrby(balance_key(ns, account), amount)
    record = {"account": NONE if account is None else account, "amount": amount}
    branch.hset(xfer_key(ns, gtrid), mapping=record)


def work(tm: TransactionManager, tx: Transaction, args: argparse.Namespace, kind: str) -> list[str]:
    """Do ``kind``'s writes in ``tx``; returns who wrote."""
    ns, gtrid = args.namespace, tx.gtrid
    b = tx.join(tm.resource("b"))
    if kind == "1pc":
        credit(b, ns, gtrid, None, 0)
        return ["b"]
    if kind == "rob":  # b only reads: a ledger row in a, a ledger entry in c
        move(tx.join(tm.resource("a")), gtrid, None, 0)
        b.get(balance_key(ns, args.account))
        enter(tx.join(tm.resource("c")), ns, gtrid)
        return ["a", "c"]
    move(tx.join(tm.resource("a")), gtrid, args.account, -1)
    credit(b, ns, gtrid, args.account, 1)
    if not args.ledger:
        return ["a", "b"]
    c = tx.join(tm.resource("c"))
    if kind == "ro":
        c.get(veto_key(ns))
        return ["a", "b"]
    if kind == "veto":
        c.watch(veto_key(ns))
    enter(c, ns, gtrid)
    if kind == "veto":  # a writer outside twopc changes the watched key: c must vote no
        outsider = redis_client(args.redis)
        outsider.set(veto_key(ns), gtrid)
        outsider.close()
    return ["a", "b", "c"]


def run(args: argparse.Namespace, plan: list[str]) -> int:
    tm = open_manager(args, recover_on_start=True)
    for kind in plan:
        tx = tm.begin()
        wrote = work(tm, tx, args, kind)
        say("BEGIN", tx.gtrid, kind, ",".join(wrote))
        finish(tx)
        if args.async_phase_two:
            # the next transaction's incrby reads b's balance: read before this one's commit
            # landed, its watch would vote no (asynchronous phase two gives up read-your-writes),
            # and the scenario's transaction would roll back instead of reaching its point
            tm.await_settled(tx, 30.0)
    say("DONE")
    tm.close()
    return 0


def recover(args: argparse.Namespace) -> int:
    tm = open_manager(args, recover_on_start=False)
    started = time.perf_counter()
    report = tm.recover(force=True)
    elapsed_ms = (time.perf_counter() - started) * 1000
    result = {
        "committed": report.committed,
        "rolled_back": report.rolled_back,
        "heuristics": report.heuristics,
        "failures": report.failures,
        "left_alone": report.left_alone,
        "pending_after": [d.gtrid for d in tm.log.pending()],
        "heuristic_records": [f"{h.gtrid}/{h.branch}" for h in tm.log.heuristics()],
        "recovery_ms": round(elapsed_ms, 2),
    }
    tm.close()
    say("RECOVERED", json.dumps(result))
    return 0


# -- the bank ----------------------------------------------------------------------------------


def transfer(tm: TransactionManager, rng: random.Random, args: argparse.Namespace) -> None:
    """One random transfer between an account in a (PostgreSQL) and one in b (Redis)."""
    source = rng.choice("ab")
    amount = rng.randint(1, 20)
    tx = tm.begin()
    try:
        sign = -1 if source == "a" else 1
        move(tx.join(tm.resource("a")), tx.gtrid, rng.randrange(args.accounts), sign * amount)
        b = tx.join(tm.resource("b"))
        credit(b, args.namespace, tx.gtrid, rng.randrange(args.accounts), -sign * amount)
    except Exception as exc:  # a lock timeout, Redis down at join: the transfer never happened
        tx.rollback()
        say("ABORTED", tx.gtrid, type(exc).__name__)
        return
    say("BEGIN", tx.gtrid, "2pc", "a,b")
    finish(tx)


def bank(args: argparse.Namespace) -> int:
    tm = open_manager(args, recover_on_start=True)
    return run_clients(tm, args, lambda rng: transfer(tm, rng, args))


# -- the command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("run", "recover", "bank", "serve"))
    parser.add_argument("--pg", default="", help="database a's SQLAlchemy URL")
    parser.add_argument("--redis", default="", help="the Redis URL of b (and c)")
    parser.add_argument("--namespace", default="rcm")
    parser.add_argument("--ledger", action="store_true", help="a third branch, c, on Redis")
    parser.add_argument("--blind", action="store_true", help="b buffers blind writes")
    parser.add_argument("--last", choices=("a",), default=None, help="a is a last resource")
    parser.add_argument(
        "--async-phase-two", action="store_true", help="phase two on a background worker"
    )
    parser.add_argument("--lock-wait", type=float, default=2.0)
    parser.add_argument("--log", default="", help="file:DIR or sql:URL")
    parser.add_argument("--node", default=NODE_ID)
    parser.add_argument("--plan", default="2pc,2pc,2pc")
    parser.add_argument("--account", type=int, default=1)
    parser.add_argument("--segment-bytes", type=int, default=None)
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    parser.add_argument("--acquire-timeout", type=float, default=0.0)
    parser.add_argument("--recovery-interval", type=float, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accounts", type=int, default=8)
    parser.add_argument("--seed", default="0")
    parser.add_argument("--duration", type=float, default=3600.0)
    args = parser.parse_args(argv)
    if args.mode == "serve":
        return serve(main)
    if not args.pg or not args.redis or not args.log:
        parser.error("--pg, --redis and --log are required")
    if args.mode == "recover":
        return recover(args)
    if args.mode == "bank":
        return bank(args)
    plan = args.plan.split(",")
    unknown = set(plan) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; expected some of {KINDS}")
    return run(args, plan)


if __name__ == "__main__":
    sys.exit(main())
