"""Open what a parsed `WriteConfig` names: the resources, the ledger, the decision log.

Kept apart from parsing because the two run at different times and places: options are parsed
(and rejected) anywhere, cheaply; connections are opened where the work happens (an executor's
Python worker, the driver's commit process). Nothing of a call's state survives it but the options
and the commit messages; the connection pools do (`.pools`): Spark reuses a Python worker for task
after task, and opening two PostgreSQL connections per task was a third of a small partition's
fixed cost.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from coordinator import ConfigurationError, Resource, Xid
from messaging.auth import SharedSecret
from messaging.remote import RemoteMessageLog
from resource_managers.postgres import PostgresResource
from resource_managers.postgres.sql_log import SqlDecisionLog
from resource_managers.redis import RedisResource

from .ledger import Committed, Ledger, TablesMissing, committed, committed_at_once
from .pools import POOLS
from .targets import MessageLogTarget, PostgresTarget, RedisTarget, Target, WriteConfig

_log = logging.getLogger("twopc.spark")


@dataclass
class Opened:
    """Live resources of one call. ``resources`` maps a target's name to its resource, in the
    targets' order; ``ledger_resource`` is the driver's branch on the log database."""

    config: WriteConfig
    resources: dict[str, Resource[Any]]
    log_engine: Engine
    ledger: Ledger
    ledger_resource: PostgresResource[Any]
    _stack: ExitStack = field(default_factory=ExitStack)

    def all_resources(self) -> list[Resource[Any]]:
        return [*self.resources.values(), self.ledger_resource]

    def target(self, name: str) -> Target:
        return next(t for t in self.config.targets if t.name == name)

    def committed(self, gtrid: str) -> Committed | None:
        """Is ``gtrid`` committed? An executor's question (twice per task): one statement
        (`ledger.committed_at_once`), or, before a driver made the tables, `ledger.committed`."""
        log = self.config.log
        try:
            return committed_at_once(self.log_engine, log.table_prefix, log.node, gtrid)
        except TablesMissing:
            return committed(self.read_log(), self.ledger, gtrid)

    def read_log(self) -> SqlDecisionLog | None:
        """The decision log, read-only (no lease): what an executor may look at. None while its
        tables do not exist yet (no driver has opened it: nothing can be decided)."""
        table = f"{self.config.log.table_prefix}decision"
        with self.log_engine.connect() as conn:
            query = sa.text("SELECT to_regclass(:t) IS NOT NULL")
            if not conn.execute(query, {"t": table}).scalar_one():
                return None
        log = SqlDecisionLog(
            self.log_engine,
            self.config.log.node,
            table_prefix=self.config.log.table_prefix,
            read_only=True,
        )
        self._stack.callback(log.close)
        return log

    def write_log(self) -> SqlDecisionLog:
        """The decision log with the node's lease (the driver), waiting for a holder to leave."""
        log = SqlDecisionLog(
            self.log_engine,
            self.config.log.node,
            table_prefix=self.config.log.table_prefix,
            acquire_timeout=self.config.log.acquire_timeout,
            lease_seconds=self.config.log.lease_seconds,
        )
        self._stack.callback(log.close)
        return log


def secret_of(target: MessageLogTarget) -> SharedSecret:
    if target.secret_file:
        return SharedSecret.from_file(target.secret_file)
    env = os.environ.get("TWOPC_SECRET")
    if env:
        return SharedSecret(env.encode())
    raise ConfigurationError(
        f"target {target.name!r}: no shared secret: set option 'mlog.secret_file' or the "
        "environment variable TWOPC_SECRET where the write runs"
    )


#: plain SETs a Redis branch's commit applies per script call: a partition's branch holds all its
#: rows, and one call over 250,000 of them held the server for about a second; a step of this
#: many takes some tens of milliseconds, so other clients of that Redis wait no longer than that
REDIS_COMMIT_STEP = 20_000


def _open(target: Target, stack: ExitStack) -> Resource[Any]:
    if isinstance(target, PostgresTarget):
        # hold_prepared=0: phase two of a target branch never runs where it was prepared (an
        # executor prepares, the driver commits on a connection of its own), so the connection
        # goes back to the pool at once; a held one stays checked out until the garbage
        # collector finds the branch (64 partitions ran PostgreSQL out of connections)
        return PostgresResource(POOLS.engine(target.url), target.name, hold_prepared=0)
    if isinstance(target, RedisTarget):
        return RedisResource(
            POOLS.redis(target.url),
            target.name,
            namespace=target.namespace,
            durability=target.durability,
            blind_writes=True,
            commit_chunk=REDIS_COMMIT_STEP,
        )
    resource = RemoteMessageLog((target.host, target.port), secret_of(target), name=target.name)
    stack.callback(resource.close)
    return resource


@contextmanager
def open_targets(config: WriteConfig) -> Iterator[Opened]:
    """Every resource of ``config`` plus the log database; all closed on exit."""
    with ExitStack() as stack:
        resources = {t.name: _open(t, stack) for t in config.targets}
        log_engine = POOLS.engine(config.log.url)
        ledger = Ledger(log_engine, config.log.table_prefix)
        ledger_resource = PostgresResource(log_engine, config.log.ledger_name)
        opened = Opened(config, resources, log_engine, ledger, ledger_resource)
        stack.enter_context(opened._stack)
        yield opened


def rollback_quietly(resource: Resource[Any], xid: Xid) -> bool:
    """Roll a branch back; one that cannot be reached now is left to recovery (False)."""
    try:
        resource.rollback(xid)
    except Exception as exc:
        _log.warning("rollback of %s failed, recovery will retry: %r", xid, exc)
        return False
    return True


def prepared_of(resource: Resource[Any], gtrid: str) -> list[Xid]:
    """``resource``'s prepared branches of ``gtrid``: one narrowed statement where the resource
    has one (PostgreSQL: every task asks before it writes, and a wide write has a branch per
    partition prepared), else its ``recover()`` filtered here."""
    if isinstance(resource, PostgresResource):
        return resource.recover_gtrid(gtrid)
    return [xid for xid in resource.recover() if xid.gtrid == gtrid]


def rollback_prepared(
    resources: Iterable[Resource[Any]], gtrid: str, select: Callable[[Xid], bool]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Roll back every prepared branch of ``gtrid`` that ``select`` picks, on each resource: the
    driver's sweep of a gtrid and an executor's retirement of its partition's older attempts.
    Returns the gids rolled back and what failed (gids, and ``<resource>:recover`` for a resource
    that could not be listed)."""
    rolled: list[str] = []
    failed: list[str] = []
    for resource in resources:
        try:
            prepared = prepared_of(resource, gtrid)
        except Exception as exc:
            _log.warning("cannot list %s's prepared branches: %r", resource.name, exc)
            failed.append(f"{resource.name}:recover")
            continue
        for xid in prepared:
            if select(xid):
                (rolled if rollback_quietly(resource, xid) else failed).append(xid.to_gid())
    return tuple(rolled), tuple(failed)
