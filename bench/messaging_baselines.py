"""Broker baselines for ``bench/messaging.py``: the same database-to-database pipeline, run through
NATS JetStream and RabbitMQ at their strongest delivery settings.

The pipeline is the same for every system, so the numbers compare:

- **Produce** (one thread): per transaction, one PostgreSQL transaction INSERTs ``per_tx`` rows
  into ``produced(id text PRIMARY KEY, body bytea)`` (one ``unnest`` statement), the broker
  publishes the same ``per_tx`` messages (256 random bytes each, the id as the message id, and a
  header carrying the send time ``time.time_ns()``), the producer waits for every publish
  acknowledgement, and then the PostgreSQL transaction commits. A broker cannot join a PostgreSQL
  transaction, so "publish, await the broker's acks, then commit" is as close to one commit as it
  gets. A crash between the acks and the COMMIT leaves messages with no ``produced`` row. A retry
  re-publishes them under the same ids, and only JetStream's de-duplication drops those copies.
- **Consume** (one thread, running at the same time): receive up to ``per_tx`` messages (what
  the broker has ready, like a JetStream fetch), INSERT their ids into
  ``consumed(id text PRIMARY KEY)`` in one PostgreSQL transaction
  (``INSERT ... SELECT unnest(...) ON CONFLICT DO NOTHING``), COMMIT, then acknowledge. A
  redelivered message hits the primary key. It is counted as a duplicate and does not change the
  table, so the consumer is idempotent and the database effect is exactly once.
- **Measured**: messages/s from the first produce to the last acknowledgement (connections are
  opened before the clock starts), and end-to-end latency per message (the consumer's COMMIT time
  minus the send time in the header), reported as p50 and p99 in ms. Afterwards the run checks
  that ``produced`` and ``consumed`` hold the same ids, exactly ``messages`` of them. A mismatch
  raises `BenchError`. Duplicates are reported, not raised.

Why each broker configuration is its fairest exactly-once / at-least-once setting:

- **NATS JetStream, "exactly once"** as NATS documents it: a file-storage stream (fresh and
  uniquely named per run, WorkQueue retention so acknowledged messages are deleted as a queue
  deletes them, deleted after the run) with a 2-minute duplicate window. Publishers set
  ``Nats-Msg-Id`` (the server drops a re-publish inside the window) and await each PubAck. A
  batch is published concurrently and all its acks are awaited before the COMMIT. The consumer is
  a durable pull consumer with ``AckPolicy.EXPLICIT`` that fetches batches of ``per_tx`` and
  acknowledges each message with the "double ack" ``msg.ack_sync()``, which waits for the
  server's confirmation, after the PostgreSQL COMMIT. A lost ack then shows up as an error, not
  as a silent redelivery.

  **Durability caveat:** a PubAck does not mean the message is on disk. JetStream's file store
  writes through the OS page cache and fsyncs only in the background. The installed server
  (v2.9.10) has no setting for this: its file store hard-codes ``defaultSyncInterval = 60 s``
  (per nats-server's 2.9-era ``server/filestore.go``, not measured here). From v2.10 the interval
  is configurable as ``jetstream { sync_interval }`` with a default of 2 minutes, and
  ``sync_interval: always`` fsyncs every write. So in this default single-server setup, a machine
  crash (not a process crash) can lose acknowledged messages from the last minute. PostgreSQL
  fsyncs every COMMIT, and RabbitMQ fsyncs every message it confirms and has not already
  delivered, so this flatters JetStream's numbers. Replication (R3) is NATS's intended answer,
  and this single-node bench cannot show it.
- **RabbitMQ, at-least-once** (RabbitMQ has no exactly-once mode and no publish de-duplication,
  so the consumer-side primary key is the whole of its "exactly once"): a durable queue (classic
  by default, or ``--rabbitmq-queue-type quorum``, unique per run and deleted after), persistent
  messages (``delivery_mode=2``) with a ``message_id``, published ``mandatory`` on a channel in
  ``confirm_delivery()`` mode. RabbitMQ confirms a persistent message to a durable queue once it
  is written to disk (fsync, batched across publishers), or once every queue it went to has
  delivered it and had it acked, whichever comes first. So when the consumer keeps up, a classic
  queue may confirm a message it never wrote, which is safe because the consumer is already done
  with it. pika's BlockingConnection waits for each confirm before it returns from
  ``basic_publish``, so a batch costs ``per_tx`` round trips, not one. That is a limit of the
  blocking client, which is the usual Python choice. The consumer sets
  ``basic_qos(prefetch_count=per_tx)`` and sends one ``basic_ack(multiple=True)`` for the batch
  after the COMMIT. AMQP 0-9-1 acks are never confirmed by the server, so RabbitMQ has no
  equivalent of the double ack.

API (for ``bench/messaging.py``): `run_jetstream`, `run_rabbitmq` and `prepare_tables` return or
need only a psycopg2 DSN. Each run truncates both tables first. A broker that cannot be reached
gives a `PipelineResult` with ``skipped`` set, never an exception. JetStream is looked for at
``nats://127.0.0.1:4222`` (``$TWOPC_BENCH_NATS_URL``), and when it is not there a private
``nats-server -js`` is started on a free port and stopped afterwards. RabbitMQ is looked for at
``amqp://guest:guest@127.0.0.1:5672/`` (``$TWOPC_BENCH_RABBITMQ_URL``).

    python bench/messaging_baselines.py [--messages 2000] [--quick] [--per-tx 1,10,100]
        [--systems jetstream,rabbitmq] [--pg-dsn DSN] [--rabbitmq-queue-type classic|quorum]

Without ``--pg-dsn`` the script starts a throwaway PostgreSQL cluster (fsync=on,
synchronous_commit=on) and removes it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg2
import psycopg2.extensions

from resource_managers.throwaway import PostgresServer, free_port

JETSTREAM = "NATS JetStream (Nats-Msg-Id + double ack)"
RABBITMQ = "RabbitMQ (confirms + manual ack)"

NATS_URL = os.environ.get("TWOPC_BENCH_NATS_URL", "nats://127.0.0.1:4222")
RABBITMQ_URL = os.environ.get("TWOPC_BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_SERVER_BINARY = "/usr/sbin/nats-server"

BODY_BYTES = 256
SENT_HEADER = "Twopc-Sent-Ns"  # the send time, time.time_ns(), as a decimal string or an int
DUPLICATE_WINDOW_S = 120.0
STALL_TIMEOUT_S = 60.0  # a run with no progress for this long fails instead of hanging
PER_TX_DEFAULT = (1, 10, 100)


@dataclass
class PipelineResult:
    """One system at one batch size. ``skipped`` is the reason when the broker is unavailable."""

    system: str
    per_tx: int
    messages: int
    seconds: float
    msgs_per_s: float
    p50_ms: float
    p99_ms: float
    duplicates: int
    skipped: str | None = None
    # diagnostics, not part of the comparison: when the producer finished (seconds from the
    # start; far below ``seconds`` means a backlog built up, and the latencies are mostly queueing)
    # and the mean number of messages per consumer transaction
    produce_seconds: float = math.nan
    mean_consume_batch: float = math.nan


class BenchError(RuntimeError):
    """A run went wrong: a stalled pipeline, or a database that does not match what was sent."""


class BrokerUnavailable(BenchError):
    """The broker cannot be reached or started; the run is reported as skipped."""


def _skipped(system: str, per_tx: int, messages: int, reason: str) -> PipelineResult:
    nan = math.nan
    return PipelineResult(system, per_tx, messages, nan, nan, nan, nan, 0, skipped=reason)


# -- PostgreSQL ------------------------------------------------------------------------------------


def _libpq(pg_dsn: str) -> str:
    """psycopg2 takes ``key=value`` DSNs and ``postgresql://`` URLs, not SQLAlchemy's dialect."""
    for prefix in ("postgresql+psycopg2://", "postgres+psycopg2://"):
        if pg_dsn.startswith(prefix):
            return "postgresql://" + pg_dsn[len(prefix) :]
    return pg_dsn


def _connect(pg_dsn: str) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(_libpq(pg_dsn), connect_timeout=10)
    conn.autocommit = False
    return conn


def prepare_tables(pg_dsn: str) -> None:
    """Create ``produced`` and ``consumed`` if they are missing, and empty both."""
    with contextlib.closing(_connect(pg_dsn)) as conn:
        with conn.cursor() as cur:
            cur.execute(
                "CREATE TABLE IF NOT EXISTS produced (id text PRIMARY KEY, body bytea NOT NULL)"
            )
            cur.execute("CREATE TABLE IF NOT EXISTS consumed (id text PRIMARY KEY)")
            cur.execute("TRUNCATE produced, consumed")
        conn.commit()


def _insert_produced(
    conn: psycopg2.extensions.connection, ids: list[str], bodies: list[bytes]
) -> None:
    """The producer's rows, in the transaction the caller commits after the broker's acks."""
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO produced (id, body) SELECT * FROM unnest(%s::text[], %s::bytea[])",
            (ids, [psycopg2.Binary(b) for b in bodies]),
        )


def _record_consumed(conn: psycopg2.extensions.connection, ids: list[str]) -> int:
    """Insert a received batch and COMMIT; returns how many ids were already there (duplicates)."""
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO consumed (id) SELECT unnest(%s::text[]) ON CONFLICT (id) DO NOTHING",
            (ids,),
        )
        inserted = cur.rowcount
    conn.commit()
    return len(ids) - inserted


def _verify(pg_dsn: str, messages: int) -> None:
    """Every produced id consumed, nothing else, ``messages`` of each; raise `BenchError` if not."""
    with contextlib.closing(_connect(pg_dsn)) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT (SELECT count(*) FROM produced), (SELECT count(*) FROM consumed), "
            "(SELECT count(*) FROM produced p FULL JOIN consumed c USING (id) "
            " WHERE p.id IS NULL OR c.id IS NULL)"
        )
        row = cur.fetchone()
        conn.rollback()
    assert row is not None
    produced, consumed, unmatched = (int(v) for v in row)
    if produced != messages or consumed != messages or unmatched:
        raise BenchError(
            f"verification failed: {produced} produced, {consumed} consumed, {unmatched} ids in "
            f"only one of the tables (expected {messages} in both)"
        )


# -- measuring -------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What the producer and consumer threads of one run share."""

    per_tx: int
    messages: int
    prefix: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    ready: threading.Barrier = field(default_factory=lambda: threading.Barrier(2))
    stop: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0  # perf_counter at the first produce
    finished: float = 0.0  # perf_counter after the last acknowledgement
    latencies_ms: list[float] = field(default_factory=list)
    duplicates: int = 0
    publish_duplicates: int = 0  # PubAcks the server flagged as de-duplicated (should be 0)
    produced: float = 0.0  # perf_counter after the last producer COMMIT
    consume_batches: int = 0

    def batches(self) -> Iterator[tuple[list[str], list[bytes]]]:
        """(ids, bodies) per producer transaction; the last one may be short."""
        for first in range(0, self.messages, self.per_tx):
            ids = [
                f"{self.prefix}-{n:09d}"
                for n in range(first, min(first + self.per_tx, self.messages))
            ]
            yield ids, [os.urandom(BODY_BYTES) for _ in ids]

    def start_clock(self) -> None:
        """Both sides are connected: wait for the other, then the producer starts the clock."""
        self.ready.wait(STALL_TIMEOUT_S)
        self.started = time.perf_counter()

    def consumed(self, sent_ns: list[int], duplicates: int) -> None:
        done = time.time_ns()
        self.latencies_ms.extend((done - s) / 1e6 for s in sent_ns)
        self.duplicates += duplicates
        self.consume_batches += 1


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _run_pair(run: _Run, producer: Callable[[], None], consumer: Callable[[], None]) -> None:
    """Run both sides on their own threads; the first failure stops the other and is raised."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                target()
            except BaseException as exc:
                errors.append(exc)
                run.stop.set()
                run.ready.abort()

        return body

    threads = [
        threading.Thread(target=guarded(producer), name="bench-producer", daemon=True),
        threading.Thread(target=guarded(consumer), name="bench-consumer", daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def measured(
    system: str,
    *,
    per_tx: int,
    messages: int,
    times: tuple[float, float, float],
    latencies_ms: list[float],
    duplicates: int,
    batches: int,
) -> PipelineResult:
    """A row from what a run measured: ``times`` is (started, produced, finished), perf_counter
    seconds; ``batches`` the consumer's transactions (or fetches)."""
    started, produced, finished = times
    seconds = finished - started
    ordered = sorted(latencies_ms)
    return PipelineResult(
        system=system,
        per_tx=per_tx,
        messages=messages,
        seconds=seconds,
        msgs_per_s=messages / seconds,
        p50_ms=_percentile(ordered, 0.50),
        p99_ms=_percentile(ordered, 0.99),
        duplicates=duplicates,
        produce_seconds=produced - started,
        mean_consume_batch=len(latencies_ms) / max(1, batches),
    )


def _result(system: str, run: _Run) -> PipelineResult:
    return measured(
        system,
        per_tx=run.per_tx,
        messages=run.messages,
        times=(run.started, run.produced, run.finished),
        latencies_ms=run.latencies_ms,
        duplicates=run.duplicates + run.publish_duplicates,
        batches=run.consume_batches,
    )


class _Progress:
    """Raises `BenchError` when nothing has arrived for `STALL_TIMEOUT_S`."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.last = time.monotonic()

    def moved(self) -> None:
        self.last = time.monotonic()

    def check(self, done: int, total: int) -> None:
        if time.monotonic() - self.last > STALL_TIMEOUT_S:
            raise BenchError(
                f"{self.what}: no message for {STALL_TIMEOUT_S:.0f} s ({done}/{total})"
            )


# -- NATS JetStream --------------------------------------------------------------------------------


async def _ignore_error(_exc: Exception) -> None:
    """nats-py logs every connection error with a traceback; the caller reports it instead."""


async def _nats_connect(url: str) -> Any:
    import nats

    return await nats.connect(
        url,
        connect_timeout=3,
        allow_reconnect=False,
        max_reconnect_attempts=1,  # 0 would mean "retry the first connect forever" in nats-py
        reconnect_time_wait=0.2,
        name="twopc-bench",
        error_cb=_ignore_error,
    )


async def _jetstream_problem(url: str) -> str | None:
    """None when ``url`` answers with JetStream enabled, else what is wrong."""
    try:
        nc = await _nats_connect(url)
    except Exception as exc:
        return f"{url}: {type(exc).__name__}: {exc}"
    try:
        await nc.jetstream().account_info()
        return None
    except Exception as exc:
        return f"{url}: JetStream not available: {type(exc).__name__}: {exc}"
    finally:
        await nc.close()


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerUnavailable(
                f"nats-server exited with {proc.returncode}: {log.read_text()[-2000:]}"
            )
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise BrokerUnavailable(f"nats-server did not listen on {port} within 30 s")


@contextlib.contextmanager
def jetstream_server(url: str | None = None) -> Iterator[str]:
    """The URL of a JetStream server: ``url`` (or $TWOPC_BENCH_NATS_URL) when it answers, else a
    private ``nats-server -js`` on a free port with its own store directory, stopped and removed
    when the block ends. Raises `BrokerUnavailable` when neither is possible."""
    url = url or NATS_URL
    problem = asyncio.run(_jetstream_problem(url))
    if problem is None:
        yield url
        return
    binary = shutil.which("nats-server") or (
        NATS_SERVER_BINARY if os.path.exists(NATS_SERVER_BINARY) else None
    )
    if binary is None:
        raise BrokerUnavailable(f"{problem}; and no nats-server binary to start a private one")
    directory = Path(tempfile.mkdtemp(prefix="twopc-nats-"))
    port = free_port()
    log = directory / "server.log"
    argv = [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(directory / "js")]
    proc: subprocess.Popen[bytes] | None = None
    try:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _wait_listening(port, proc, log)
        yield f"nats://127.0.0.1:{port}"
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


async def _js_setup(url: str, stream: str, subject: str, durable: str) -> None:
    from nats.js import api

    nc = await _nats_connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            api.StreamConfig(
                name=stream,
                subjects=[subject],
                storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.WORK_QUEUE,
                duplicate_window=DUPLICATE_WINDOW_S,
                num_replicas=1,
            )
        )
        await js.add_consumer(
            stream,
            api.ConsumerConfig(
                durable_name=durable,
                name=durable,
                ack_policy=api.AckPolicy.EXPLICIT,
                deliver_policy=api.DeliverPolicy.ALL,
                ack_wait=30.0,
                filter_subject=subject,
            ),
        )
    finally:
        await nc.close()


async def _js_teardown(url: str, stream: str) -> None:
    nc = await _nats_connect(url)
    try:
        await nc.jetstream().delete_stream(stream)  # takes its consumer with it
    finally:
        await nc.close()


async def _js_produce(url: str, subject: str, pg_dsn: str, run: _Run) -> None:
    nc = await _nats_connect(url)
    conn = _connect(pg_dsn)
    try:
        js = nc.jetstream(timeout=10.0)
        run.start_clock()
        for ids, bodies in run.batches():
            if run.stop.is_set():
                return
            _insert_produced(conn, ids, bodies)
            acks = await asyncio.gather(
                *(
                    js.publish(
                        subject,
                        body,
                        headers={"Nats-Msg-Id": mid, SENT_HEADER: str(time.time_ns())},
                    )
                    for mid, body in zip(ids, bodies, strict=True)
                )
            )
            run.publish_duplicates += sum(1 for ack in acks if ack.duplicate)
            conn.commit()
        run.produced = time.perf_counter()
    finally:
        with contextlib.suppress(psycopg2.Error):
            conn.rollback()
        conn.close()
        await nc.close()


async def _js_consume(
    url: str, pg_dsn: str, run: _Run, *, stream: str, subject: str, durable: str
) -> None:
    import nats.errors

    nc = await _nats_connect(url)
    conn = _connect(pg_dsn)
    try:
        sub = await nc.jetstream(timeout=10.0).pull_subscribe(
            subject, durable=durable, stream=stream
        )
        run.ready.wait(STALL_TIMEOUT_S)
        progress, done = _Progress("JetStream consumer"), 0
        while done < run.messages and not run.stop.is_set():
            try:
                msgs = await sub.fetch(run.per_tx, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                progress.check(done, run.messages)
                continue
            progress.moved()
            duplicates = _record_consumed(conn, [m.headers["Nats-Msg-Id"] for m in msgs])
            run.consumed([int(m.headers[SENT_HEADER]) for m in msgs], duplicates)
            await asyncio.gather(*(m.ack_sync(timeout=10.0) for m in msgs))
            done += len(msgs) - duplicates
        run.finished = time.perf_counter()
    finally:
        with contextlib.suppress(psycopg2.Error):
            conn.rollback()
        conn.close()
        await nc.close()


def run_jetstream(
    pg_dsn: str, per_tx: int, messages: int, *, nats_url: str | None = None
) -> PipelineResult:
    """The pipeline through a fresh JetStream file stream (see the module docstring).

    ``nats_url`` is used as given. Without it, the server at $TWOPC_BENCH_NATS_URL or
    127.0.0.1:4222 is tried, and a private one is started if needed. An unreachable server gives
    a skipped result.
    """
    try:
        with contextlib.ExitStack() as stack:
            url = nats_url or stack.enter_context(jetstream_server())
            if nats_url is not None and (problem := asyncio.run(_jetstream_problem(url))):
                return _skipped(JETSTREAM, per_tx, messages, problem)
            return _run_jetstream(url, pg_dsn, per_tx, messages)
    except BrokerUnavailable as exc:
        return _skipped(JETSTREAM, per_tx, messages, str(exc))


def _run_jetstream(url: str, pg_dsn: str, per_tx: int, messages: int) -> PipelineResult:
    prepare_tables(pg_dsn)
    run = _Run(per_tx, messages)
    stream, durable = f"TWOPC_BENCH_{run.prefix}", f"twopc-bench-{run.prefix}"
    subject = f"twopc.bench.{run.prefix}"
    try:
        asyncio.run(_js_setup(url, stream, subject, durable))
        _run_pair(
            run,
            lambda: asyncio.run(_js_produce(url, subject, pg_dsn, run)),
            lambda: asyncio.run(
                _js_consume(url, pg_dsn, run, stream=stream, subject=subject, durable=durable)
            ),
        )
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(_js_teardown(url, stream))
    _verify(pg_dsn, messages)
    return _result(JETSTREAM, run)


def jetstream_context(url: str) -> str:
    """A line saying which server ran and how it syncs to disk."""

    async def probe() -> str:
        nc = await _nats_connect(url)
        try:
            version = nc._server_info.get("version", "?")
        finally:
            await nc.close()
        return (
            f"nats-server {version} at {url}; file store fsyncs in the background only "
            "(2.9: fixed 60 s; 2.10+: jetstream.sync_interval, default 2 min), not per PubAck"
        )

    return asyncio.run(probe())


# -- RabbitMQ --------------------------------------------------------------------------------------


def _rabbit_connect(url: str) -> Any:
    import pika

    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 5
    params.blocked_connection_timeout = STALL_TIMEOUT_S
    return pika.BlockingConnection(params)


def _rabbit_produce(url: str, queue: str, pg_dsn: str, run: _Run) -> None:
    import pika

    mq = _rabbit_connect(url)
    conn = _connect(pg_dsn)
    try:
        channel = mq.channel()
        channel.confirm_delivery()
        run.start_clock()
        for ids, bodies in run.batches():
            if run.stop.is_set():
                return
            _insert_produced(conn, ids, bodies)
            for mid, body in zip(ids, bodies, strict=True):
                # in confirm mode, basic_publish returns once the broker has confirmed (or raises)
                channel.basic_publish(
                    exchange="",
                    routing_key=queue,
                    body=body,
                    properties=pika.BasicProperties(
                        delivery_mode=pika.DeliveryMode.Persistent,
                        message_id=mid,
                        headers={SENT_HEADER: time.time_ns()},
                    ),
                    mandatory=True,
                )
            conn.commit()
        run.produced = time.perf_counter()
    finally:
        with contextlib.suppress(psycopg2.Error):
            conn.rollback()
        conn.close()
        with contextlib.suppress(Exception):
            mq.close()


def _rabbit_consume(url: str, queue: str, pg_dsn: str, run: _Run) -> None:
    mq = _rabbit_connect(url)
    conn = _connect(pg_dsn)
    try:
        channel = mq.channel()
        channel.basic_qos(prefetch_count=run.per_tx)
        pending: list[tuple[int, str, int]] = []  # (delivery tag, message id, sent ns)

        def on_message(_ch: Any, method: Any, props: Any, _body: bytes) -> None:
            pending.append((method.delivery_tag, props.message_id, int(props.headers[SENT_HEADER])))

        channel.basic_consume(queue, on_message, auto_ack=False)
        run.ready.wait(STALL_TIMEOUT_S)
        progress, done = _Progress("RabbitMQ consumer"), 0
        while done < run.messages and not run.stop.is_set():
            if not pending:
                mq.process_data_events(time_limit=1.0)  # wait for the first message
                if not pending:
                    progress.check(done, run.messages)
                    continue
            mq.process_data_events(time_limit=0)  # and take what else has already arrived
            progress.moved()
            batch, pending[:] = pending[: run.per_tx], pending[run.per_tx :]
            duplicates = _record_consumed(conn, [mid for _, mid, _ in batch])
            run.consumed([sent for _, _, sent in batch], duplicates)
            channel.basic_ack(delivery_tag=batch[-1][0], multiple=True)
            done += len(batch) - duplicates
        mq.process_data_events(time_limit=0)  # flush the last ack to the socket
        run.finished = time.perf_counter()
    finally:
        with contextlib.suppress(psycopg2.Error):
            conn.rollback()
        conn.close()
        with contextlib.suppress(Exception):
            mq.close()


def run_rabbitmq(
    pg_dsn: str,
    per_tx: int,
    messages: int,
    *,
    url: str | None = None,
    queue_type: str = "classic",
) -> PipelineResult:
    """The pipeline through a fresh durable RabbitMQ queue (see the module docstring).

    ``url`` defaults to $TWOPC_BENCH_RABBITMQ_URL or guest@127.0.0.1:5672. ``queue_type`` is
    ``classic`` or ``quorum``. An unreachable broker gives a skipped result.
    """
    import pika.exceptions

    url = url or RABBITMQ_URL
    try:
        admin = _rabbit_connect(url)
    except (pika.exceptions.AMQPError, OSError) as exc:
        where = url.rsplit("@", maxsplit=1)[-1]
        return _skipped(RABBITMQ, per_tx, messages, f"{where}: unreachable ({exc!r})")
    run = _Run(per_tx, messages)
    queue = f"twopc-bench-{run.prefix}"
    try:
        # declared, then the admin connection closes: left idle it would miss heartbeats
        admin.channel().queue_declare(queue, durable=True, arguments={"x-queue-type": queue_type})
    finally:
        with contextlib.suppress(Exception):
            admin.close()
    try:
        prepare_tables(pg_dsn)
        _run_pair(
            run,
            lambda: _rabbit_produce(url, queue, pg_dsn, run),
            lambda: _rabbit_consume(url, queue, pg_dsn, run),
        )
    finally:
        with contextlib.suppress(Exception):
            cleanup = _rabbit_connect(url)
            try:
                cleanup.channel().queue_delete(queue)
            finally:
                cleanup.close()
    _verify(pg_dsn, messages)
    return _result(RABBITMQ, run)


def rabbitmq_context(url: str) -> str:
    """A line saying which broker ran, or why it did not."""
    try:
        mq = _rabbit_connect(url)
    except Exception as exc:
        return f"RabbitMQ at {url}: unreachable ({type(exc).__name__})"
    try:
        props = mq._impl.server_properties
        version = props.get("version", b"?")
        version = version.decode() if isinstance(version, bytes) else str(version)
    finally:
        mq.close()
    safe = url.rsplit("@", maxsplit=1)[-1]
    return f"RabbitMQ {version} at {safe}; persistent messages confirmed once on disk or acked"


# -- the script ------------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[..., PipelineResult]] = {
    "jetstream": run_jetstream,
    "rabbitmq": run_rabbitmq,
}


def print_table(results: list[PipelineResult]) -> None:
    w = max([42, *(len(r.system) for r in results)])
    print(
        f"{'per_tx':>6}  {'system':<{w}} {'msgs':>6} {'seconds':>8} {'msg/s':>8} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'dups':>5} {'prod s':>7} {'batch':>6}"
    )
    for per_tx in sorted({r.per_tx for r in results}):
        for r in (r for r in results if r.per_tx == per_tx):
            if r.skipped:
                print(f"{per_tx:>6}  {r.system:<{w}} skipped: {r.skipped}")
                continue
            print(
                f"{per_tx:>6}  {r.system:<{w}} {r.messages:>6} {r.seconds:>8.2f} "
                f"{r.msgs_per_s:>8,.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.duplicates:>5} "
                f"{r.produce_seconds:>7.2f} {r.mean_consume_batch:>6.1f}"
            )
        rows = {r.system: r for r in results if r.per_tx == per_tx and not r.skipped}
        if JETSTREAM in rows and RABBITMQ in rows:
            print(
                f"{'':>6}  JetStream / RabbitMQ: "
                f"{rows[JETSTREAM].msgs_per_s / rows[RABBITMQ].msgs_per_s:.2f}x msg/s"
            )
        print()
    print(
        "msg/s: first produce to last ack, one producer and one consumer thread; latency: consumer "
        "COMMIT minus send time;\ndups: redeliveries caught by consumed's primary key (plus "
        "publishes JetStream de-duplicated); both tables verified equal after every row.\n"
        "prod s: when the producer finished (well below seconds: a backlog, so the latency is "
        "mostly queueing); batch: mean messages per consumer transaction."
    )


def pg_context(pg_dsn: str) -> str:
    with contextlib.closing(_connect(pg_dsn)) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT split_part(version(), ',', 1), current_setting('fsync'), "
            "current_setting('synchronous_commit')"
        )
        row = cur.fetchone()
        conn.rollback()
    assert row is not None
    return f"{row[0]}; fsync={row[1]}, synchronous_commit={row[2]}"


@contextlib.contextmanager
def database(pg_dsn: str | None) -> Iterator[str]:
    """The given DSN, or a throwaway cluster's (removed at the end)."""
    if pg_dsn:
        yield pg_dsn
        return
    server = PostgresServer()
    try:
        server.start()
        yield server.dsn(server.create_database("bench_messaging"))
    finally:
        server.remove()


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, ``kill``) into SystemExit, so the ``finally`` blocks still stop
    the throwaway PostgreSQL cluster, a private nats-server and the broker's stream or queue.
    Call it from the main thread."""
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(128 + signal.SIGTERM))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=2000, help="messages per row (2000)")
    parser.add_argument("--quick", action="store_true", help="300 messages per row")
    parser.add_argument("--per-tx", default="1,10,100", help="batch sizes (1,10,100)")
    parser.add_argument("--systems", default="jetstream,rabbitmq", help="jetstream,rabbitmq")
    parser.add_argument("--pg-dsn", help="PostgreSQL DSN (default: a throwaway cluster)")
    parser.add_argument("--nats-url", help=f"JetStream server (default {NATS_URL}, else private)")
    parser.add_argument("--rabbitmq-url", default=RABBITMQ_URL, help="AMQP URL")
    parser.add_argument(
        "--rabbitmq-queue-type",
        choices=("classic", "quorum"),
        default="classic",
        help="durable queue type (classic)",
    )
    args = parser.parse_args()
    if args.quick:
        args.messages = 300
    return args


def main() -> None:
    exit_on_sigterm()
    args = parse()
    batch_sizes = [int(n) for n in args.per_tx.split(",")]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(RUNNERS)
    if unknown:
        raise SystemExit(f"unknown system(s): {', '.join(sorted(unknown))}")
    results: list[PipelineResult] = []
    with database(args.pg_dsn) as pg_dsn, contextlib.ExitStack() as stack:
        print(f"python {sys.version.split()[0]}, {platform.platform()}, {os.cpu_count()} CPUs")
        print(pg_context(pg_dsn))
        nats_url: str | None = None
        if "jetstream" in systems:
            try:
                nats_url = stack.enter_context(jetstream_server(args.nats_url))
                print(jetstream_context(nats_url))
            except BrokerUnavailable as exc:
                print(f"JetStream: unavailable ({exc})")
        if "rabbitmq" in systems:
            print(rabbitmq_context(args.rabbitmq_url) + f"; {args.rabbitmq_queue_type} queue")
        print(f"{args.messages} messages of {BODY_BYTES} bytes per row\n")
        for per_tx in batch_sizes:
            for system in systems:
                if system == "jetstream":
                    if nats_url is None:
                        results.append(_skipped(JETSTREAM, per_tx, args.messages, "no server"))
                        continue
                    result = run_jetstream(pg_dsn, per_tx, args.messages, nats_url=nats_url)
                else:
                    result = run_rabbitmq(
                        pg_dsn,
                        per_tx,
                        args.messages,
                        url=args.rabbitmq_url,
                        queue_type=args.rabbitmq_queue_type,
                    )
                results.append(result)
    print_table(results)


if __name__ == "__main__":
    main()
