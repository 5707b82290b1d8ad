"""The Spark demo's run: its servers and children, and what the stores hold."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator import Xid
from coordinator.cli import table

from .audit import indent
from .spark_job import APP_ID, LEASE_SECONDS, NODE, REPLAYED, TABLE

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from resource_managers.throwaway import PostgresServer, RedisServer

# -- the run ---------------------------------------------------------------------------------------


class Unusable(Exception):
    """Something the demo needs is missing; the message says what."""


@dataclass
class Child:
    """A driver process and the files holding its stdout and stderr."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        """What each micro-batch's commit told (`twopc_demo.spark_source`), in order."""
        from twopc_demo.spark_source import TAG  # noqa: PLC0415

        return [
            json.loads(line.partition(TAG)[2])
            for line in self.stderr().splitlines()
            if line.startswith(TAG)
        ]


@dataclass
class Run:
    workdir: Path
    pg: PostgresServer | None = None
    redis_server: RedisServer | None = None
    data: Engine | None = None
    log: Engine | None = None
    client: Any = None  # redis.Redis, bytes in and out
    children: list[Child] = field(default_factory=list)

    @property
    def source(self) -> Path:
        return self.workdir / "in"

    @property
    def checkpoint(self) -> Path:
        return self.workdir / "checkpoint"

    def options(self) -> dict[str, str]:
        assert self.pg is not None and self.redis_server is not None
        return {
            "appId": APP_ID,
            "log.url": self.pg.url("txlog"),
            "log.acquire_timeout": "60",
            "log.lease_seconds": str(LEASE_SECONDS),
            "pg.url": self.pg.url("shop"),
            "pg.table": TABLE,
            "pg.columns": "id,name",
            "redis.url": self.redis_server.url(),
            "redis.op": "set",
            "redis.key": "item:{id}",
            "redis.value": "{name}",
        }


# -- reading the stores ------------------------------------------------------------------------


def engine_of(state: Run, database: str) -> Engine:
    engine = state.data if database == "shop" else state.log
    assert engine is not None
    return engine


def query(state: Run, database: str, sql: str) -> list[Any]:
    with engine_of(state, database).connect() as conn:
        return list(conn.exec_driver_sql(sql).fetchall())


def scalar(state: Run, database: str, sql: str) -> Any:
    return query(state, database, sql)[0][0]


def pending_decisions(state: Run) -> list[tuple[str, tuple[str, ...]]]:
    """The node's pending decisions, read as ``twopc status`` does: no lease, no writes."""
    from resource_managers.postgres import SqlDecisionLog  # noqa: PLC0415

    log = SqlDecisionLog(engine_of(state, "txlog"), NODE, read_only=True)
    try:
        return [(d.gtrid, d.branches) for d in log.pending()]
    finally:
        log.close()


def prepared_branches(state: Run) -> list[tuple[str, Xid]]:
    """Every prepared branch: both databases, then Redis's prepared set."""
    from resource_managers.redis import RedisResource  # noqa: PLC0415

    found: list[tuple[str, Xid]] = []
    for database in ("shop", "txlog"):
        sql = "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY gid"
        found += [(f"postgres {database}", Xid.from_gid(g)) for (g,) in query(state, database, sql)]
    prepared_set = RedisResource(state.client, name="redis").prefix + b"prepared"
    for gid in state.client.zrange(prepared_set, 0, -1):
        found.append(("redis", Xid.from_gid(gid.decode())))
    return found


def ledger_rows(state: Run) -> dict[str, list[tuple[str, ...]]]:
    """The committed ledger rows (one per committed micro-batch), by gtrid."""
    rows: dict[str, list[tuple[str, ...]]] = {}
    exists = scalar(state, "txlog", "SELECT to_regclass('twopc_spark_ledger') IS NOT NULL")
    if exists:
        for gtrid, branches in query(
            state, "txlog", "SELECT gtrid, branches FROM twopc_spark_ledger"
        ):
            rows.setdefault(gtrid, []).append(tuple(json.loads(branches)))
    return rows


def item_rows(state: Run) -> list[tuple[int, str]]:
    sql = f"SELECT id, name FROM {TABLE} ORDER BY id, name"
    return [(int(i), str(n)) for i, n in query(state, "shop", sql)]


def redis_items(state: Run) -> dict[str, str]:
    keys = list(state.client.scan_iter(match=b"item:*", count=1000))
    values = state.client.mget(keys) if keys else []
    return {k.decode(): v.decode() for k, v in zip(keys, values, strict=True)}


def listed(state: Run, name: str) -> list[int]:
    folder = state.checkpoint / name
    return sorted(int(p) for p in os.listdir(folder) if p.isdigit()) if folder.exists() else []


def commits(state: Run) -> list[int]:
    return listed(state, "commits")


def short(bqual: str) -> str:
    """A sub-branch's owner, partition and attempt, without its task id, nonce and birth time."""
    return ".".join(bqual.split(".")[:2]) if "~p" in bqual else bqual.split(".", 1)[0]


def show_leftovers(state: Run) -> tuple[str, tuple[str, ...]] | None:
    pending = pending_decisions(state)
    rows = [
        ("decision log", "COMMIT, phase two not run", f"{g} [{', '.join(map(short, b))}]")
        for g, b in pending
    ]
    rows += [
        (where, "prepared", f"{x.gtrid} {short(x.bqual)}") for where, x in prepared_branches(state)
    ]
    rows += [
        (f"postgres shop.{TABLE}", "committed", f"{len(item_rows(state))} rows"),
        ("redis item:*", "committed", f"{len(redis_items(state))} keys"),
        ("spark offsets/", "planned", f"batches {listed(state, 'offsets')}"),
        ("spark commits/", "recorded done", f"batches {commits(state)}"),
    ]
    print(indent(table(["where", "state", "what"], rows)))
    print(
        f"   batch {REPLAYED} is decided but Spark never recorded it: the restarted query runs "
        "it again with the same id"
    )
    return pending[0] if len(pending) == 1 else None
