"""The service the demo kills: one transaction per transfer, each with a message (child process,
``python -m twopc_demo.service``, its spec on stdin)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coordinator import (
    FileDecisionLog,
    TransactionManager,
    TransactionRolledBack,
)

from .bank import ACCOUNTS, CURSOR_ID, DESTINATION, LOG_ID, MLOG, NODE_ID, PG, REDIS

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from messaging.connection import Connection
    from messaging.transfer import LogTransfer
    from resource_managers.message_log import MessageLog, ProducerBranch
    from resource_managers.redis import RedisBranch

# -- the service that crashes (child process) --------------------------------------------------


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _pg_move(db: Session, gtrid: str, account: str, delta: int) -> None:
    from sqlalchemy import text  # noqa: PLC0415

    db.execute(
        text("UPDATE accounts SET balance = balance + :delta WHERE id = :account"),
        {"delta": delta, "account": account},
    )
    db.execute(
        text("INSERT INTO transfers (gtrid, account, delta) VALUES (:gtrid, :account, :delta)"),
        {"gtrid": gtrid, "account": account, "delta": delta},
    )


def _redis_move(r: RedisBranch, keys: str, gtrid: str, account: str, delta: int) -> None:
    # buffered until commit; the ledger entry's id is assigned when the commit script runs
    r.incrby(f"{keys}balance:{account}", delta)
    r.xadd(f"{keys}ledger", {"gtrid": gtrid, "account": account, "delta": delta})


def _send_notice(outbox: ProducerBranch, event: dict[str, Any]) -> None:
    # staged until prepare; numbered at commit, and only then visible to the log's transfer
    body = json.dumps({k: event[k] for k in ("gtrid", "n", "amount", "src", "dst")}).encode()
    outbox.send(DESTINATION, body, headers={"content-type": "application/json"})


def dialer(address: tuple[str, int], secret: bytes) -> Callable[[], Connection]:
    """How a log's transfer reaches the demo's cursor (called again after every failure)."""
    from messaging.auth import SharedSecret  # noqa: PLC0415
    from messaging.connection import connect  # noqa: PLC0415
    from messaging.transfer import TRANSFER_ROLE  # noqa: PLC0415

    key = SharedSecret(secret)
    return lambda: connect(address, key, LOG_ID, TRANSFER_ROLE, server_id=CURSOR_ID, timeout=5.0)


def start_transfer(mlog: MessageLog, dial: Callable[[], Connection]) -> LogTransfer:
    from messaging.transfer import LogTransfer  # noqa: PLC0415
    from resource_managers.sequencing import DoublingBackoff  # noqa: PLC0415

    # resend soon: a frame lost with a connection matters only until the next one, but a demo
    # should not sit out the default back-off
    return LogTransfer(mlog, dial, resend=DoublingBackoff(base=0.2, cap=2.0), name="demo-transfer")


def run_child(spec: dict[str, Any]) -> int:
    """One transfer per transaction; an event line before each commit and after its answer."""
    import redis  # noqa: PLC0415
    from sqlalchemy import create_engine  # noqa: PLC0415

    from resource_managers.message_log import MessageLog, MessageLogResource  # noqa: PLC0415
    from resource_managers.postgres import PostgresResource  # noqa: PLC0415
    from resource_managers.redis import RedisResource  # noqa: PLC0415

    pg = PostgresResource(create_engine(spec["pg_url"]), name=PG)
    client = redis.Redis.from_url(spec["redis_url"])
    cache = RedisResource(client, name=REDIS, namespace=spec["namespace"])
    host, port = spec["cursor"]
    dial = dialer((host, int(port)), bytes.fromhex(spec["secret"]))
    rng = random.Random(7)
    with MessageLog(spec["mlog"]) as mlog, start_transfer(mlog, dial) as transfer:
        # the transfer runs while we work: committed messages reach the cursor at once
        outbox = MessageLogResource(mlog, MLOG)
        resources: list[Any] = [outbox, pg, cache]
        with TransactionManager(NODE_ID, FileDecisionLog(spec["log"]), resources) as tm:
            for n in range(1, spec["transfers"] + 1):
                amount = rng.randint(1, 50)
                pg_account, redis_account = rng.choice(ACCOUNTS[PG]), rng.choice(ACCOUNTS[REDIS])
                sign = -1 if n % 2 else 1  # odd: PostgreSQL -> Redis; even: Redis -> PostgreSQL
                src, dst = (pg_account, redis_account) if n % 2 else (redis_account, pg_account)
                try:
                    with tm.transaction() as tx:
                        event = {"n": n, "amount": amount, "src": src, "dst": dst}
                        _say(**event, gtrid=tx.gtrid)
                        _pg_move(tx.join(pg), tx.gtrid, pg_account, sign * amount)
                        _redis_move(
                            tx.join(cache), spec["keys"], tx.gtrid, redis_account, -sign * amount
                        )
                        _send_notice(tx.join(outbox), {**event, "gtrid": tx.gtrid})
                except TransactionRolledBack as exc:
                    _say(n=n, answer=f"rolled back ({exc.reason})")
                    continue
                _say(n=n, answer="committed")
        transfer.wait_idle(10)  # not killed: hand everything over before closing the log
    return 0


def main() -> int:
    return run_child(json.load(sys.stdin))


if __name__ == "__main__":
    raise SystemExit(main())
