"""The PostgreSQL outbox row of ``bench/messaging.py``: the same pipeline done inside PostgreSQL.

What every team writes when it wants database work and messages in one transaction without a
transaction manager, so it is the bar twopc has to clear on its own ground (issue 14). Three
processes, like the twopc rows, and two databases on one cluster (the producer's and the
consumer's), like the twopc rows:

- **Producer**: per transaction, one local PostgreSQL transaction on the producer's database
  inserts ``per_tx`` rows into ``produced`` and the same ``per_tx`` messages (id, 256-byte body,
  send time) into ``outbox``, and NOTIFYs the relay (delivered at COMMIT). Both INSERTs and the
  NOTIFY go in one round trip, the COMMIT in a second: what a plain psycopg2 client sends.
- **Relay**: LISTENs on the producer's database; takes the committed outbox rows in ``seq``
  order, up to `RELAY_BATCH` at a time, inserts them into ``inbox`` on the consumer's database in
  ONE transaction (``ON CONFLICT (id) DO NOTHING``: a batch copied again after a relay crash is
  not doubled) that also NOTIFYs the consumer, and only after that COMMIT deletes them from the
  outbox. A crash between the two commits copies the batch again; nothing is lost.
- **Consumer**: LISTENs on the consumer's database; per transaction, one statement deletes up to
  ``per_tx`` inbox rows (``FOR UPDATE SKIP LOCKED``, oldest first) and inserts their ids into
  ``consumed`` (the processed ids, primary key, ``ON CONFLICT DO NOTHING``), then COMMIT. A
  message the relay copied twice after its inbox row was consumed is deleted again and counted as
  a duplicate, with no second effect: exactly once, PostgreSQL only.

Latency is the consumer's COMMIT time minus the send time the producer stored with the message.
`verify` checks that the producer's ``produced`` and the consumer's ``consumed`` hold the same
``messages`` ids, as every other row's check does.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import select
import time
import uuid
from multiprocessing.connection import Connection as Pipe
from typing import Any

import messaging_baselines as base  # type: ignore[import-not-found]
import psycopg2
import psycopg2.extensions

OUTBOX = "PostgreSQL outbox (relay, inbox, processed ids)"
#: outbox rows the relay moves per consumer-database transaction, at most
RELAY_BATCH = 1000
#: how long a LISTENer sleeps when no NOTIFY comes (a lost wake-up costs at most this)
IDLE_WAIT_S = 0.5

PRODUCER_DDL = (
    "CREATE TABLE IF NOT EXISTS produced (id text PRIMARY KEY, body bytea NOT NULL); "
    "CREATE TABLE IF NOT EXISTS outbox (seq bigserial PRIMARY KEY, id text NOT NULL, "
    "body bytea NOT NULL, sent_ns bigint NOT NULL); "
    "TRUNCATE produced, outbox"
)
CONSUMER_DDL = (
    "CREATE TABLE IF NOT EXISTS consumed (id text PRIMARY KEY); "
    "CREATE TABLE IF NOT EXISTS inbox (id text PRIMARY KEY, seq bigint NOT NULL, "
    "body bytea NOT NULL, sent_ns bigint NOT NULL); "
    "CREATE INDEX IF NOT EXISTS inbox_seq ON inbox (seq); "
    "TRUNCATE consumed, inbox"
)
PRODUCE = (
    "INSERT INTO produced (id, body) SELECT * FROM unnest(%(ids)s::text[], %(bodies)s::bytea[]); "
    "INSERT INTO outbox (id, body, sent_ns) SELECT i, b, %(sent)s "
    "FROM unnest(%(ids)s::text[], %(bodies)s::bytea[]) AS m(i, b); "
    "NOTIFY outbox"
)
RELAY_READ = "SELECT seq, id, body, sent_ns FROM outbox ORDER BY seq LIMIT %s"
RELAY_WRITE = (
    "INSERT INTO inbox (seq, id, body, sent_ns) "
    "SELECT * FROM unnest(%s::bigint[], %s::text[], %s::bytea[], %s::bigint[]) "
    "ON CONFLICT (id) DO NOTHING; NOTIFY inbox"
)
RELAY_DELETE = "DELETE FROM outbox WHERE seq = ANY(%s::bigint[])"
CONSUME = (
    "WITH d AS (DELETE FROM inbox WHERE id IN "
    "  (SELECT id FROM inbox ORDER BY seq LIMIT %s FOR UPDATE SKIP LOCKED) "
    "  RETURNING id, sent_ns), "
    "i AS (INSERT INTO consumed (id) SELECT id FROM d ON CONFLICT (id) DO NOTHING RETURNING id) "
    "SELECT d.sent_ns, i.id IS NOT NULL FROM d LEFT JOIN i USING (id)"
)


def prepare_tables(producer_dsn: str, consumer_dsn: str) -> None:
    """The producer's ``produced`` and ``outbox``, the consumer's ``consumed`` and ``inbox``:
    created if missing, emptied."""
    for dsn, ddl in ((producer_dsn, PRODUCER_DDL), (consumer_dsn, CONSUMER_DDL)):
        with contextlib.closing(base._connect(dsn)) as conn:
            with conn.cursor() as cur:
                cur.execute(ddl)
            conn.commit()


def verify(producer_dsn: str, consumer_dsn: str, messages: int) -> None:
    """The producer's ``produced`` ids equal the consumer's ``consumed`` ids, ``messages`` of
    each; `BenchError` if not (the two tables live in two databases, so compared here)."""

    def ids(dsn: str, table: str) -> set[str]:
        with contextlib.closing(base._connect(dsn)) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT id FROM {table}")  # a constant table name, not data
            found = {str(i) for (i,) in cur.fetchall()}
            conn.rollback()
        return found

    produced, consumed = ids(producer_dsn, "produced"), ids(consumer_dsn, "consumed")
    if len(produced) != messages or produced != consumed:
        raise base.BenchError(
            f"verification failed: {len(produced)} produced, {len(consumed)} consumed, "
            f"{len(produced ^ consumed)} ids in only one database (expected {messages} in both)"
        )


def _listen(dsn: str, channel: str) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(base._libpq(dsn), connect_timeout=10)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"LISTEN {channel}")  # a constant channel name
    return conn


def _wait_notify(conn: psycopg2.extensions.connection) -> None:
    """Sleep until a NOTIFY (or `IDLE_WAIT_S`); one already on the socket wakes at once."""
    if not conn.notifies:
        select.select([conn], [], [], IDLE_WAIT_S)
        conn.poll()
    conn.notifies.clear()


# -- the three processes ---------------------------------------------------------------------------


def producer_main(dsn: str, per_tx: int, total: int, pipe: Pipe) -> None:
    conn = base._connect(dsn)
    prefix = uuid.uuid4().hex[:12]
    batches = []
    for first in range(0, total, per_tx):
        ids = [f"{prefix}-{n:09d}" for n in range(first, min(first + per_tx, total))]
        batches.append((ids, [psycopg2.Binary(os.urandom(base.BODY_BYTES)) for _ in ids]))
    pipe.send("ready")
    pipe.recv()  # go
    try:
        with conn.cursor() as cur:
            for ids, bodies in batches:
                cur.execute(PRODUCE, {"ids": ids, "bodies": bodies, "sent": time.time_ns()})
                conn.commit()
        pipe.send(time.perf_counter())
    finally:
        conn.close()


def relay_main(producer_dsn: str, consumer_dsn: str, total: int, pipe: Pipe) -> None:
    """Move committed outbox rows to the inbox until ``total`` have gone, batch by batch."""
    source, target = _listen(producer_dsn, "outbox"), base._connect(consumer_dsn)
    pipe.send("ready")
    moved = 0
    try:
        while moved < total:
            with source.cursor() as cur:
                cur.execute(RELAY_READ, (RELAY_BATCH,))
                rows = cur.fetchall()
            if not rows:
                _wait_notify(source)
                continue
            seqs, ids, bodies, sent = (list(column) for column in zip(*rows, strict=True))
            with target.cursor() as cur:
                cur.execute(RELAY_WRITE, (seqs, ids, bodies, sent))
            target.commit()  # the inbox holds the batch: only now may the outbox forget it
            with source.cursor() as cur:
                cur.execute(RELAY_DELETE, (seqs,))
            moved += len(rows)
    finally:
        source.close()
        target.close()


def consumer_main(dsn: str, per_tx: int, total: int, pipe: Pipe) -> None:
    listener, conn = _listen(dsn, "inbox"), base._connect(dsn)
    pipe.send("ready")
    latencies: list[float] = []
    rounds = duplicates = 0
    try:
        while len(latencies) < total:
            with conn.cursor() as cur:
                cur.execute(CONSUME, (per_tx,))
                rows = cur.fetchall()
            conn.commit()
            if not rows:
                _wait_notify(listener)
                continue
            done = time.time_ns()
            latencies += [(done - int(sent)) / 1e6 for sent, new in rows if new]
            duplicates += sum(1 for _, new in rows if not new)
            rounds += 1
        pipe.send((time.perf_counter(), latencies, rounds, duplicates))
    finally:
        listener.close()
        conn.close()


# -- one row ---------------------------------------------------------------------------------------


def run_outbox(
    producer_dsn: str, consumer_dsn: str, per_tx: int, messages: int, recv: Any
) -> base.PipelineResult:
    """One row; ``recv(pipe, process)`` waits for a child's answer (``messaging._recv``)."""
    prepare_tables(producer_dsn, consumer_dsn)
    ctx = mp.get_context("fork")
    procs: list[Any] = []
    try:
        c_parent, c_child = ctx.Pipe()
        r_parent, r_child = ctx.Pipe()
        p_parent, p_child = ctx.Pipe()
        consumer = ctx.Process(target=consumer_main, args=(consumer_dsn, per_tx, messages, c_child))
        relay = ctx.Process(target=relay_main, args=(producer_dsn, consumer_dsn, messages, r_child))
        producer = ctx.Process(target=producer_main, args=(producer_dsn, per_tx, messages, p_child))
        procs = [consumer, relay, producer]
        for proc in procs:
            proc.start()
        recv(c_parent, consumer), recv(r_parent, relay), recv(p_parent, producer)  # ready
        started = time.perf_counter()
        p_parent.send("go")
        produced = recv(p_parent, producer)
        finished, latencies, rounds, duplicates = recv(c_parent, consumer)
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    verify(producer_dsn, consumer_dsn, messages)
    return base.measured(
        OUTBOX,
        per_tx=per_tx,
        messages=messages,
        times=(started, produced, finished),
        latencies_ms=latencies,
        duplicates=duplicates,
        batches=rounds,
    )
