"""The producer and consumer processes of the end-to-end messaging tests (killed with SIGKILL).

    python tests/crash/msg_worker.py produce --log HOST:PORT --pg URL --id P --state DIR
        --txs N --per-tx K --rollback-every R --destination D
    python tests/crash/msg_worker.py consume --cursor HOST:PORT --pg URL --id C --state DIR
        --batch B --destination D --stop-file F [--tx-timeout S] [--rpc-timeout S]

Both use a `TransactionManager` with a file decision log in ``--state`` over PostgreSQL and a
remote store (`RemoteMessageLog` / `RemoteCursor`), and recover on start until clean, as a
restarted service would, before doing new work. The secret comes from ``TWOPC_SECRET``.
``--llr``: PostgreSQL is the logging last resource (its commit carries the decision).

``produce``: transaction ``t`` (1..N) of producer ``P`` inserts one ``produced`` row per message
(key ``P:t:j``) and sends the K messages; every R-th transaction raises instead, so it rolls
back. A restarted producer resumes after its last committed transaction. Printed: ``ACK t``,
``ABORTED t``, ``FAILED t <code>`` and ``DONE``. ``--keys N``: each message carries the partition
key `partition_key` (one of N) for a partitioned destination.

``consume``: a `Consumer` loop whose handler inserts one ``consumed`` row per message (no unique
key, so a duplicate shows up in the audit rather than as an error); it exits once ``--stop-file``
exists and a round found nothing. Printed: ``HANDLED n`` at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from sqlalchemy import create_engine, text

from coordinator import FileDecisionLog, TransactionError, TransactionManager, TransactionRolledBack
from coordinator.transaction import Transaction
from messaging.auth import SharedSecret
from messaging.connection import parse_address
from messaging.consumer import consume_once, settle
from messaging.remote import RemoteCursor, RemoteMessageLog
from resource_managers.cursor import Delivery
from resource_managers.postgres import PostgresResource

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS produced (key text PRIMARY KEY, producer text NOT NULL, "
    "tx int NOT NULL, j int NOT NULL)",
    "CREATE TABLE IF NOT EXISTS consumed (id bigserial PRIMARY KEY, key text NOT NULL, "
    "consumer text NOT NULL, message_id text NOT NULL, delivery_count int NOT NULL)",
)


def partition_key(t: int, j: int, keys: int) -> str:
    """The partition key of message ``j`` of transaction ``t`` for a producer with ``--keys``:
    consecutive messages take different keys, so one transaction spreads over the partitions."""
    return f"k{(t + j) % keys}"


class Rollback(Exception):
    """Raised inside a transaction the plan wants rolled back."""


def say(*words: object) -> None:
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def secret() -> SharedSecret:
    return SharedSecret(os.environ["TWOPC_SECRET"].encode())


def manager(
    node: str, state: str, resources: list[object], timeout: float = 30.0
) -> TransactionManager:
    Path(state).mkdir(parents=True, exist_ok=True)
    tm = TransactionManager(
        node,
        FileDecisionLog(Path(state) / "tmlog"),
        resources,  # type: ignore[arg-type]
        recovery_interval=0.5,
        reaper_interval=None,
        recover_on_start=False,
        default_timeout=timeout,
    )
    while not tm.recover(force=True).clean:  # the servers may still be restarting
        time.sleep(0.2)
    return tm


def finish(tm: TransactionManager) -> None:
    """Leave nothing in doubt behind: a transaction whose outcome was unknown is finished now."""
    while not tm.recover(force=True).clean:
        time.sleep(0.2)
    tm.close()


def produce(args: argparse.Namespace) -> int:
    engine = create_engine(args.pg, pool_size=2, connect_args={"options": "-c lock_timeout=10000"})
    pg = PostgresResource(engine, "pg", last_resource=args.llr)
    log = RemoteMessageLog(parse_address(args.log), secret(), client_id=f"producer-{args.id}")
    tm = manager(f"producer-{args.id}", args.state, [pg, log])
    with engine.connect() as conn:
        last = conn.execute(
            text("SELECT coalesce(max(tx), 0) FROM produced WHERE producer = :p"), {"p": args.id}
        ).scalar_one()
    for t in range(last + 1, args.txs + 1):
        give_up = time.monotonic() + 90.0
        while True:
            try:
                with tm.transaction() as tx:
                    _produce_one(tx, pg, log, args, t)
                say("ACK", t)
            except Rollback:
                say("ABORTED", t)
            except TransactionRolledBack as exc:  # rolled back for sure: an application retries
                if time.monotonic() < give_up:  # (a server restarting refuses for a while)
                    say("RETRY", t, exc.code)
                    time.sleep(0.2)
                    continue
                say("FAILED", t, exc.code)
            except TransactionError as exc:  # outcome unknown: recovery decides; do not redo it
                say("FAILED", t, exc.code)
            break
    finish(tm)
    say("DONE")
    return 0


def _produce_one(
    tx: Transaction, pg: PostgresResource, log: RemoteMessageLog, args: argparse.Namespace, t: int
) -> None:
    db = tx.join(pg)
    branch = tx.join(log)
    for j in range(args.per_tx):
        key = f"{args.id}:{t}:{j}"
        db.execute(
            text("INSERT INTO produced (key, producer, tx, j) VALUES (:k, :p, :t, :j)"),
            {"k": key, "p": args.id, "t": t, "j": j},
        )
        branch.send(
            args.destination,
            key.encode(),
            headers={"producer": args.id},
            publisher=args.id,
            key=partition_key(t, j, args.keys) if args.keys else None,
        )
    if args.rollback_every and t % args.rollback_every == 0:
        raise Rollback(t)


def consume(args: argparse.Namespace) -> int:
    engine = create_engine(args.pg, pool_size=2)
    pg = PostgresResource(engine, "pg", last_resource=args.llr)
    cursor = RemoteCursor(
        parse_address(args.cursor), secret(), client_id=f"consumer-{args.id}",
        timeout=args.rpc_timeout,
    )  # fmt: skip
    tm = manager(f"consumer-{args.id}", args.state, [pg, cursor], args.tx_timeout)

    def handle(tx: Transaction, delivery: Delivery) -> None:
        tx.join(pg).execute(
            text(
                "INSERT INTO consumed (key, consumer, message_id, delivery_count) "
                "VALUES (:k, :c, :m, :n)"
            ),
            {
                "k": delivery.body.decode(),
                "c": args.id,
                "m": delivery.message_id,
                "n": delivery.delivery_count,
            },
        )

    handled = 0
    while True:
        try:
            n = consume_once(tm, cursor, args.destination, handle, batch=args.batch, timeout=0.5)
        except TransactionError as exc:
            say("ROUND_FAILED", exc.code)
            settle(tm)  # what the failed round held comes back first: order kept
            continue
        handled += n
        if n == 0 and Path(args.stop_file).exists():
            break
    finish(tm)
    say("HANDLED", handled)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("produce")
    p.add_argument("--log", required=True)
    p.add_argument("--txs", type=int, default=20)
    p.add_argument("--per-tx", type=int, default=3)
    p.add_argument("--rollback-every", type=int, default=5)
    p.add_argument("--keys", type=int, default=0, help="partition keys (0: keyless messages)")
    c = sub.add_parser("consume")
    c.add_argument("--cursor", required=True)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--stop-file", required=True)
    c.add_argument("--tx-timeout", type=float, default=30.0)
    c.add_argument("--rpc-timeout", type=float, default=30.0)
    for q in (p, c):
        q.add_argument("--pg", required=True)
        q.add_argument("--id", required=True)
        q.add_argument("--state", required=True)
        q.add_argument("--destination", default="orders")
        q.add_argument("--llr", action="store_true", help="PostgreSQL is the last resource")
    args = parser.parse_args(argv)
    return produce(args) if args.cmd == "produce" else consume(args)


if __name__ == "__main__":
    sys.exit(main())
