"""The executor side: write one partition into every target and prepare, never commit.

Why prepare and stop: Spark runs every attempt of a task (retries, speculative copies, attempts
whose executor is lost) before it decides which one counts, and tells only the driver. So each
attempt makes its work durable but invisible — a prepared branch per target — and returns the
branch ids in its commit message; the driver commits the chosen ones and rolls back the rest.

Steps, and why in this order:
1. A committed gtrid (a replayed micro-batch, a batch job re-run with its ``txnVersion``) writes
   nothing and says so (``skipped``): the rows are already there. Older attempts of the
   partition are retired; an attempt that finds a newer one prepared stops (a zombie).
2. Write every row into every target, in chunks (the row iterator is read once and never held
   whole), then prepare each branch.
3. Fence: read the decision again. If the gtrid got decided meanwhile (this attempt is a late
   speculative copy or a zombie) and this attempt is not among the winners, roll back our own
   branches now rather than leave them to recovery's grace period.
4. Any failure rolls back every branch this attempt started, prepared or not, and re-raises: the
   task fails and Spark retries it with a new attempt (and so new branch ids).
"""

from __future__ import annotations

import io
import json
import logging
import math
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any

import psycopg2.extras
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from coordinator import ConfigurationError, TransactionRolledBack, Vote, Xid

from .connect import Opened, open_targets, rollback_prepared, rollback_quietly
from .ids import branch_xid, make_gtrid, parse_branch
from .targets import (
    MessageLogTarget,
    PostgresTarget,
    RedisTarget,
    Target,
    WriteConfig,
    parse_options,
)

log = logging.getLogger("twopc.spark.writer")

CHUNK_ROWS = 1000


class StaleAttemptError(TransactionRolledBack):
    """A task attempt started writing after a newer attempt of its partition had prepared: Spark
    has already replaced it, so it writes nothing (and leaves the newer attempt's branches be)."""

    reason = "stale-attempt"


def new_run() -> str:
    """A token for one driver-side write (made once, on the driver, and given to every task):
    it tells this write's task attempts from those of an earlier run of the same gtrid."""
    return secrets.token_hex(2)


@dataclass(frozen=True)
class CommitMessage:
    """What one task attempt tells the driver (Spark pickles it there).

    ``branches`` are the gids this attempt prepared (read-only branches, which wrote nothing,
    are absent); ``counts`` are rows written per target; ``prepared_at`` (unix seconds) is when
    the first branch began, which bounds how late the driver may still decide.
    """

    gtrid: str
    partition: int
    attempt: int
    task_attempt_id: int
    branches: tuple[str, ...] = ()
    rows: int = 0
    counts: tuple[tuple[str, int], ...] = ()
    skipped: bool = False
    prepared_at: float = 0.0

    @property
    def xids(self) -> tuple[Xid, ...]:
        return tuple(Xid.from_gid(gid) for gid in self.branches)


def resolve_gtrid(
    options: Mapping[str, str], batch_id: int | None, gtrid: str | None
) -> tuple[str, WriteConfig]:
    """The write's gtrid (given, by batch id, or by ``txnVersion``) and the parsed config."""
    config = parse_options(options)
    if gtrid is None:
        if batch_id is None and config.txn_version is None:
            raise ConfigurationError(
                "no transaction id: pass option 'txnVersion', a streaming batch id, or a gtrid "
                "made once on the driver with spark_integration.ids.make_gtrid"
            )
        gtrid = make_gtrid(
            config.app_id, batch_id=batch_id, txn_version=config.txn_version, node=config.log.node
        )
    return gtrid, config


def write_partition(
    options: Mapping[str, str],
    rows: Iterable[Mapping[str, Any]],
    *,
    partition: int,
    attempt: int,
    task_attempt_id: int,
    batch_id: int | None = None,
    gtrid: str | None = None,
    run: str | None = None,
) -> CommitMessage:
    """Write ``rows`` into every target under prepared branches; see the module docstring.

    ``run`` names the driver-side write this task belongs to (`new_run`, made once per write on
    the driver): within one run Spark's task attempt ids grow with scheduling order, so an
    attempt can tell a newer attempt of its partition from an older one (see
    `_retire_other_attempts`). Without it every other attempt counts as older."""
    gtrid, config = resolve_gtrid(options, batch_id, gtrid)
    base = CommitMessage(gtrid, partition, attempt, task_attempt_id)
    with open_targets(config) as opened:
        if opened.committed(gtrid) is not None:
            for _ in rows:  # drain: Spark expects the iterator consumed
                pass
            log.info("%s already committed: partition %d writes nothing", gtrid, partition)
            return replace(base, skipped=True)
        _retire_other_attempts(opened, gtrid, partition, run, task_attempt_id)
        born = time.time()
        nonce = run or secrets.token_hex(2)
        xids = {
            name: branch_xid(
                gtrid,
                name,
                partition=partition,
                attempt=attempt,
                task_attempt_id=task_attempt_id,
                born=born,
                nonce=nonce,
            )
            for name in opened.resources
        }
        started: list[str] = []
        try:
            handles = {}
            for name, resource in opened.resources.items():
                handles[name] = resource.start(xids[name])
                started.append(name)
            counts = _write_all(opened, handles, rows)
            prepared = []
            for name, resource in sorted(opened.resources.items(), key=lambda kv: kv[1].sort_key):
                if resource.prepare(xids[name]) == Vote.COMMIT:
                    prepared.append(xids[name].to_gid())
            decided = opened.committed(gtrid)
            if decided is not None:
                mine = {Xid.from_gid(gid).bqual for gid in prepared}
                if not mine <= set(decided.branches):
                    log.warning("%s was decided without attempt %s: rolling back", gtrid, nonce)
                    _rollback(opened, xids, started)
                    return replace(base, skipped=True)
        except BaseException:
            _rollback(opened, xids, started)
            raise
        return CommitMessage(
            gtrid,
            partition,
            attempt,
            task_attempt_id,
            branches=tuple(prepared),
            rows=max(counts.values(), default=0),
            counts=tuple(counts.items()),
            prepared_at=born,
        )


def _retire_other_attempts(
    opened: Opened, gtrid: str, partition: int, run: str | None, task_attempt_id: int
) -> None:
    """Roll back what older attempts of this partition left prepared, before writing; refuse to
    write if a newer attempt of the same run has prepared already.

    An older attempt's branch is a failed attempt's (Spark retried the task) or a dead run's (the
    driver crashed before its decision and the restarted query replays the batch from attempt
    0). It cannot be a winner any more, but it still holds its locks (Redis keys, PostgreSQL rows
    under a unique key), and this attempt, writing the same keys, would wait on them until
    recovery's grace period ends.

    "Older" is decided by the run (the branch's nonce, `new_run`) and, within one run, by Spark's
    task attempt id, which grows with scheduling order within one SparkContext. A branch of
    another run (or of a write that named no run) is always older: runs of one gtrid follow one
    another. A branch of this run with a higher task attempt id is *newer*: this attempt is a
    zombie (Spark already failed it, its Python worker started late) and retiring the retry's
    branches would make the driver refuse the whole write, so it stops instead
    (`StaleAttemptError`, a task Spark has already written off). The one live branch this can
    still retire is an older speculative copy that has prepared; if Spark picks that copy anyway,
    the driver refuses to commit (`driver_commit` checks every winner is still prepared) and the
    job fails. Nothing is ever written twice."""
    newer: list[str] = []

    def older_attempt(xid: Xid) -> bool:
        info = parse_branch(xid.bqual)
        if info is None or info.partition != partition:
            return False
        if run is not None and info.nonce == run and info.task_attempt_id > task_attempt_id:
            newer.append(xid.to_gid())
            return False
        return True

    retired, _ = rollback_prepared(opened.resources.values(), gtrid, older_attempt)
    for gid in retired:
        log.info("retired %s, an older attempt of partition %d", gid, partition)
    if newer:
        raise StaleAttemptError(
            f"{gtrid}: task attempt {task_attempt_id} of partition {partition} started after a "
            f"newer attempt of the same write had prepared ({', '.join(sorted(newer))}); this "
            "attempt writes nothing (Spark has already replaced it)"
        )


def _rollback(opened: Opened, xids: Mapping[str, Xid], started: list[str]) -> None:
    for name in started:
        rollback_quietly(opened.resources[name], xids[name])


def _chunks(rows: Iterable[Mapping[str, Any]]) -> Iterator[list[Mapping[str, Any]]]:
    iterator = iter(rows)
    while chunk := list(islice(iterator, CHUNK_ROWS)):
        yield chunk


def _write_all(
    opened: Opened, handles: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]
) -> dict[str, int]:
    counts = dict.fromkeys(handles, 0)
    for chunk in _chunks(rows):
        for name, handle in handles.items():
            counts[name] += _write_chunk(opened.target(name), handle, chunk)
    return counts


def _write_chunk(target: Target, handle: Any, chunk: list[Mapping[str, Any]]) -> int:
    if isinstance(target, PostgresTarget):
        return _write_postgres(target, handle, chunk)
    if isinstance(target, RedisTarget):
        return _write_redis(target, handle, chunk)
    return _write_mlog(target, handle, chunk)


def _write_postgres(target: PostgresTarget, session: Any, chunk: list[Mapping[str, Any]]) -> int:
    """Insert mode: one ``COPY .. FROM STDIN`` per chunk when every value is a plain scalar (str,
    int, float, bool, None), else psycopg2's ``execute_values``; both on the branch's own
    connection, so inside its transaction. Upsert mode: one INSERT .. ON CONFLICT per chunk
    (SQLAlchemy's insertmanyvalues). Why not SQLAlchemy for inserts too: compiling and binding
    a multi-row INSERT cost twice execute_values and ten times COPY per row (bench/spark_sink.py);
    values are adapted by psycopg2 either way, as SQLAlchemy's untyped columns did."""
    columns = target.columns or tuple(chunk[0].keys())
    if target.mode == "insert":
        _insert_postgres(target, session, columns, chunk)
        return len(chunk)
    table = sa.table(target.table, *(sa.column(c) for c in columns), schema=target.schema)
    params = [{c: row.get(c) for c in columns} for row in chunk]
    if target.mode == "upsert":
        stmt = pg_insert(table)
        others = [c for c in columns if c not in target.key]
        if others:
            stmt = stmt.on_conflict_do_update(
                index_elements=list(target.key), set_={c: stmt.excluded[c] for c in others}
            )
        else:
            stmt = stmt.on_conflict_do_nothing(index_elements=list(target.key))
        session.execute(stmt, params)
    else:
        session.execute(sa.insert(table), params)
    return len(chunk)


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_text(rows: list[tuple[Any, ...]]) -> str | None:
    """The rows in COPY's text format, or None if a value is not a plain scalar (dates, decimals,
    bytes, containers, non-finite floats keep psycopg2's own adaptation)."""
    lines = []
    for row in rows:
        fields = []
        for value in row:
            kind = type(value)
            if kind is str:
                fields.append(value.translate(_COPY_ESCAPES))
            elif value is None:
                fields.append("\\N")
            elif kind is bool:
                fields.append("t" if value else "f")
            elif kind is int or (kind is float and math.isfinite(value)):
                fields.append(repr(value))
            else:
                return None
        lines.append("\t".join(fields))
    lines.append("")
    return "\n".join(lines)


def _insert_postgres(
    target: PostgresTarget, session: Any, columns: tuple[str, ...], chunk: list[Mapping[str, Any]]
) -> None:
    connection = session.connection()
    quote = connection.dialect.identifier_preparer.quote
    table = quote(target.table)
    if target.schema is not None:
        table = f"{quote(target.schema)}.{table}"
    names = ", ".join(quote(c) for c in columns)
    rows = [tuple(row.get(c) for c in columns) for row in chunk]
    text = _copy_text(rows)
    if text is not None:
        sql = f"COPY {table} ({names}) FROM STDIN"
    else:
        sql = f"INSERT INTO {table} ({names}) VALUES %s"
    dbapi = connection.connection.dbapi_connection
    cursor = dbapi.cursor()
    try:
        if text is not None:
            cursor.copy_expert(sql, io.StringIO(text))
        else:
            psycopg2.extras.execute_values(cursor, sql, rows, page_size=len(rows))
    except psycopg2.Error as exc:
        # raised as SQLAlchemy would have (IntegrityError, OperationalError, ...), and a lost
        # connection is invalidated as SQLAlchemy would have, so callers see no difference
        lost = connection.dialect.is_disconnect(exc, dbapi, cursor)
        if lost:
            connection.invalidate(exc)
        raise sa.exc.DBAPIError.instance(
            sql, None, exc, psycopg2.Error, connection_invalidated=lost, dialect=connection.dialect
        ) from exc
    finally:
        if not cursor.closed:
            cursor.close()


def _write_redis(target: RedisTarget, branch: Any, chunk: list[Mapping[str, Any]]) -> int:
    """Buffer the chunk in the branch. ``set``: one ``mset`` of the chunk (the same SETs, in
    order, a later row's value winning as it would one row at a time), which a blind branch
    buffers in one step: per-row calls were two thirds of a Redis partition's executor time."""
    if target.op == "set":
        assert target.value is not None
        render_key, render_value = target.key.render, target.value.render
        branch.mset({render_key(row): render_value(row) for row in chunk})
        return len(chunk)
    for row in chunk:
        key = target.key.render(row)
        if target.op == "hset":
            assert target.value is not None and target.field is not None
            branch.hset(key, target.field.render(row), target.value.render(row))
        else:
            amount = 1 if target.amount is None else int(row[target.amount])
            branch.incrby(key, amount)
    return len(chunk)


def _write_mlog(target: MessageLogTarget, branch: Any, chunk: list[Mapping[str, Any]]) -> int:
    """One batch send of the chunk's bodies (``send_many``: the destination and options checked
    once, not per row, which was a third of the executor's time per message)."""
    if target.value is not None:
        render = target.value.render
        bodies = [render(row).encode() for row in chunk]
    else:
        bodies = [json.dumps(dict(row), sort_keys=True, default=str).encode() for row in chunk]
    branch.send_many(target.destination, bodies)
    return len(chunk)
