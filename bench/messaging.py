"""End-to-end exactly-once messages/s: twopc against a PostgreSQL outbox, NATS JetStream and
RabbitMQ, side by side.

The pipeline is the one `bench/messaging_baselines.py` describes for the brokers (read it): a
producer inserts ``per_tx`` rows into ``produced`` and sends the same ``per_tx`` messages of 256
bytes; a consumer receives up to ``per_tx`` messages, inserts their ids into ``consumed`` and
acknowledges; messages/s from the first produce to the last consume, latency p50/p99 from the
send time in a header to the consumer's commit. The producer and the consumer have a database
each (two databases on one throwaway cluster; the broker rows keep both tables in the producer's).
twopc rows, each in two processes (the producing application with its embedded message log and
transfer thread; the consuming application with its embedded cursor, which the transfer reaches
over TCP on loopback, authenticated):

- ``twopc-eo``, exactly-once with PostgreSQL as the logging last resource at both ends: the
  producer's PostgreSQL insert commits in one phase with the decision row inside it (the commit
  point), the message-log branch riding in that row as a payload (`coordinator.carried`), then
  the log applies it; the consumer's cursor branch likewise rides its PostgreSQL insert's commit.
  No decision-log force, no PREPARE TRANSACTION, no forced record of either store.
  ``twopc-eo-prepared`` is the same with both stores' branches prepared (a forced record each)
  before the database's commit: the path before carried branches.
  Both sides run their SQL through the branch's Core connection (`PostgresResource.connection`,
  the lean handle for hot paths) and write their stores' commit records lazily (the defaults).
- ``twopc-eo-file``, the same with the file decision log and PostgreSQL prepared as an ordinary
  branch (the path before the last resource), so before and after show in one run. In both, nothing
  can be lost or duplicated by a crash anywhere, which is more than either broker row promises
  (JetStream does not fsync each message; RabbitMQ's "exactly once" is the consumer's primary key).
- ``twopc-alo``, at-least-once: the same stores with no two-phase commit: the producer commits
  PostgreSQL, then sends in a one-phase log transaction; the consumer receives, commits its
  PostgreSQL insert on its own, then commits the cursor transaction (acknowledge after commit, as
  the RabbitMQ row does). The gap between this row and ``twopc-eo`` is what exactly-once costs.
- ``twopc-core``, log+cursor only: no database work at all: the messaging system alone.
- ``twopc-eo-aio``, ``twopc-eo-file`` through the asyncio API: one event loop per application,
  the log and the cursor reached through `messaging.remote.aio` clients over loopback, PostgreSQL
  through `AsyncPostgresResource` (`bench/messaging_aio.py` says how).
- ``outbox``: the same pipeline inside PostgreSQL (producer, relay and consumer processes; outbox,
  inbox and processed-ids tables): `bench/messaging_outbox.py` says how.

Then one row per JMS acknowledgment mode (`messaging.session`), so the cost of each
guarantee is visible: a `Session` consumes messages of the same size from an embedded cursor
(filled beforehand, no database, no transfer) with a file decision log; ``auto`` acknowledges each
message, ``client`` every 10th, ``dups-ok`` each batch of 64, and ``transacted`` receives one
message, sends one on through an embedded message log and commits both (two-phase). ``fsync/msg``
counts the cursor's, the log's and the decision log's fsyncs; ``at risk`` is how many handled
messages a crash can bring back (redelivered) at most.

Targets (issue 14; printed with a verdict, as ratios of msg/s in the same run): ``twopc-eo`` >=
1.0x ``outbox`` at 1 and 10 msgs/txn and >= 0.6x at 100; >= 1.5x ``jetstream`` at 1, 10 and 100;
within 10% of ``twopc-alo`` at 100; ``twopc-core`` >= 2x ``jetstream`` at 1. ``--json PATH``
writes one object per row: ``{"system", "per_tx", "msg_s", "p50_ms", "p99_ms"}`` with the ids
above (``jetstream``, ``rabbitmq`` for the brokers).

    python bench/messaging.py [--messages 2000] [--quick] [--per-tx 1,10,100]
        [--systems twopc,outbox,jetstream,rabbitmq] [--ack-modes auto,client,dups-ok,transacted]
        [--ack-messages 1000] [--pg-dsn DSN [--pg-consumer-dsn DSN]] [--json PATH]

With ``--logs`` or ``--cursors`` it measures scale instead (`messaging_scale`: aggregate
exactly-once msgs/s with N log servers and M cursor servers, a destination partitioned by key over
the M cursors, every server a process; ``--logs 1,2,3 --cursors 1,2`` runs each combination):

    python bench/messaging.py --logs 1,2,3 --cursors 1,2 [--messages 6000] [--per-tx 10]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import messaging_aio  # type: ignore[import-not-found]
import messaging_baselines as base  # type: ignore[import-not-found]
import messaging_outbox as outbox  # type: ignore[import-not-found]
import messaging_scale  # type: ignore[import-not-found]
from sqlalchemy import create_engine, text

from coordinator import FileDecisionLog, TransactionManager
from messaging.auth import SharedSecret
from messaging.connection import Listener, connect
from messaging.session import AckMode, Received, Session
from messaging.transfer import TRANSFER_ROLE, LogTransfer, TransferReceiver
from resource_managers.cursor import Cursor, CursorResource
from resource_managers.message_log import Message, MessageLog, MessageLogResource
from resource_managers.postgres import PostgresResource
from resource_managers.sequencing import Frame
from resource_managers.throwaway import PostgresServer

EXACTLY_ONCE = "twopc exactly-once (PostgreSQL last resource)"
EXACTLY_ONCE_FILE = "twopc exactly-once (file log, PG prepared)"
EXACTLY_ONCE_PREPARED = "twopc exactly-once (PG last resource, stores prepared)"
AT_LEAST_ONCE = "twopc at-least-once (ack after commit, no 2PC)"
MESSAGING_ONLY = "twopc log+cursor only (no database)"
MODES = {
    "exactly-once": EXACTLY_ONCE,
    "exactly-once-file": EXACTLY_ONCE_FILE,
    "exactly-once-prepared": EXACTLY_ONCE_PREPARED,
    "at-least-once": AT_LEAST_ONCE,
    "log-only": MESSAGING_ONLY,
    "exactly-once-aio": messaging_aio.EXACTLY_ONCE_AIO,
}
#: the ids ``--json`` writes, one per row (issue 14 names them)
SYSTEM_IDS = {
    EXACTLY_ONCE: "twopc-eo",
    EXACTLY_ONCE_FILE: "twopc-eo-file",
    EXACTLY_ONCE_PREPARED: "twopc-eo-prepared",
    AT_LEAST_ONCE: "twopc-alo",
    MESSAGING_ONLY: "twopc-core",
    messaging_aio.EXACTLY_ONCE_AIO: "twopc-eo-aio",
    outbox.OUTBOX: "outbox",
    base.JETSTREAM: "jetstream",
    base.RABBITMQ: "rabbitmq",
}
SYSTEMS = ("twopc", "outbox", "jetstream", "rabbitmq")
DESTINATION = "bench"
SENT = base.SENT_HEADER

INSERT_PRODUCED = text(
    "INSERT INTO produced (id, body) SELECT * FROM unnest(CAST(:ids AS text[]), "
    "CAST(:bodies AS bytea[]))"
)
INSERT_CONSUMED = text(
    "INSERT INTO consumed (id) SELECT unnest(CAST(:ids AS text[])) ON CONFLICT (id) DO NOTHING"
)


def _engine(dsn: str) -> Any:
    """An engine on a libpq DSN or URL, whichever the baselines were given."""
    from psycopg2.extensions import parse_dsn
    from sqlalchemy.engine import URL

    p = parse_dsn(base._libpq(dsn))
    url = URL.create("postgresql+psycopg2", p.get("user"), p.get("password"), p.get("host"),
                     int(p["port"]) if "port" in p else None, p.get("dbname"))  # fmt: skip
    return create_engine(url, pool_size=2)


#: the modes whose database work and messages commit in one two-phase transaction
TWO_PHASE = ("exactly-once", "exactly-once-file", "exactly-once-prepared")
#: the modes whose database is the logging last resource
LAST_RESOURCE = ("exactly-once", "exactly-once-prepared")


def _pg(mode: str, engine: Any) -> PostgresResource:
    """The side's database: the logging last resource (its commit carries the decision and the
    log's branch; no prepare, no decision-log force) for ``exactly-once``; the same with the
    log's branch prepared before it for ``exactly-once-prepared``; an ordinary prepared branch
    under the file decision log for ``exactly-once-file``."""
    return PostgresResource(engine, "pg", last_resource=mode in LAST_RESOURCE)


def _log_resource(mode: str, mlog: MessageLog) -> MessageLogResource:
    """The producer's log branch: carried by the last resource's commit (`coordinator.carried`)
    unless the mode says it prepares."""
    return MessageLogResource(mlog, "mlog", rides_last_resource=mode != "exactly-once-prepared")


def _cursor_resource(mode: str, cursor: Cursor) -> CursorResource:
    """The consumer's cursor branch: carried likewise unless the mode says it prepares."""
    return CursorResource(cursor, "cursor", rides_last_resource=mode != "exactly-once-prepared")


def _manager(role: str, workdir: Path, resources: list[Any]) -> TransactionManager:
    """A manager whose node id is ``role`` and the row's own suffix: each row's stores are new,
    so a row must not inherit an earlier row's decision rows (recovery would hand their payloads
    to the new stores, or keep them as naming stores it cannot find)."""
    node = f"{role}-{workdir.name[-8:]}"
    return TransactionManager(
        node,
        FileDecisionLog(workdir / f"{node}-txlog"),
        resources,
        recovery_interval=None,
        reaper_interval=None,
        inline_completion=True,
    )


# -- the consuming application (a process) -------------------------------------------------------


def consumer_main(  # noqa: PLR0917 - a Process target takes positional arguments
    mode: str, dsn: str, workdir: Path, key: bytes, per_tx: int, total: int, pipe: Pipe
) -> None:
    cursor = Cursor(workdir / "cursor")
    listener = Listener(
        ("127.0.0.1", 0), SharedSecret(key), "bench-cursor",
        {TRANSFER_ROLE: TransferReceiver(cursor)},
    ).start()  # fmt: skip
    engine = _engine(dsn)
    cur_res = _cursor_resource(mode, cursor)
    pg = _pg(mode, engine)
    resources: list[Any] = [cur_res, pg] if mode in TWO_PHASE else [cur_res]
    tm = _manager("bench-consumer", workdir, resources)
    pipe.send(listener.address)
    latencies: list[float] = []
    rounds = 0
    try:
        while len(latencies) < total:
            with tm.transaction() as tx:
                got = tx.join(cur_res).receive_many(DESTINATION, per_tx, timeout=5.0)
                if not got:
                    continue
                ids = [d.headers["id"] for d in got]
                if mode in TWO_PHASE:
                    pg.connection(tx).execute(INSERT_CONSUMED, {"ids": ids})
                elif mode == "at-least-once":
                    with engine.begin() as conn:  # its own commit, before the acknowledgment
                        conn.execute(INSERT_CONSUMED, {"ids": ids})
            done = time.time_ns()
            latencies += [(done - int(d.headers[SENT])) / 1e6 for d in got]
            rounds += 1
        pipe.send((time.perf_counter(), latencies, rounds))
    finally:
        tm.close()
        listener.close()
        cursor.close()
        engine.dispose()


# -- the producing application (a process) -------------------------------------------------------


def producer_main(  # noqa: PLR0917 - a Process target takes positional arguments
    mode: str,
    dsn: str,
    workdir: Path,
    key: bytes,
    per_tx: int,
    total: int,
    cursor_address: tuple[str, int],
    pipe: Pipe,
) -> None:
    mlog = MessageLog(workdir / "log")
    secret = SharedSecret(key)
    transfer = LogTransfer(
        mlog, lambda: connect(cursor_address, secret, "bench-log", TRANSFER_ROLE)
    ).start()
    engine = _engine(dsn)
    log_res = _log_resource(mode, mlog)
    pg = _pg(mode, engine)
    resources: list[Any] = [log_res, pg] if mode in TWO_PHASE else [log_res]
    tm = _manager("bench-producer", workdir, resources)
    batches = list(base._Run(per_tx, total).batches())  # the baselines' ids and bodies
    pipe.send("ready")
    pipe.recv()  # go
    try:
        for ids, bodies in batches:
            if mode == "at-least-once":
                with engine.begin() as conn:
                    conn.execute(INSERT_PRODUCED, {"ids": ids, "bodies": bodies})
            with tm.transaction() as tx:
                if mode in TWO_PHASE:
                    pg.connection(tx).execute(INSERT_PRODUCED, {"ids": ids, "bodies": bodies})
                branch = tx.join(log_res)
                sent = str(time.time_ns())
                for mid, body in zip(ids, bodies, strict=True):
                    branch.send(DESTINATION, body, headers={"id": mid, SENT: sent})
        pipe.send(time.perf_counter())
        transfer.wait_idle(120)
    finally:
        transfer.close()
        tm.close()
        mlog.close()
        engine.dispose()


# -- one row ---------------------------------------------------------------------------------------


def run_twopc(mode: str, dsns: tuple[str, str], per_tx: int, messages: int) -> base.PipelineResult:
    """One twopc row; ``dsns`` are the producer's and the consumer's databases."""
    producer_dsn, consumer_dsn = dsns
    for dsn in dsns:
        base.prepare_tables(dsn)
    workdir = Path(tempfile.mkdtemp(prefix="twopc-bench-msg-"))
    key = secrets.token_bytes(32)
    ctx = mp.get_context("fork")
    c_parent, c_child = ctx.Pipe()
    p_parent, p_child = ctx.Pipe()
    aio = mode == "exactly-once-aio"
    sql = (DESTINATION, INSERT_PRODUCED, INSERT_CONSUMED)
    consumer = ctx.Process(
        target=messaging_aio.consumer_main if aio else consumer_main,
        args=(_async_url(consumer_dsn), workdir, key, per_tx, messages, c_child, sql) if aio
        else (mode, consumer_dsn, workdir, key, per_tx, messages, c_child),
    )  # fmt: skip
    consumer.start()
    try:
        address = _recv(c_parent, consumer)
        producer = ctx.Process(
            target=messaging_aio.producer_main if aio else producer_main,
            args=(_async_url(producer_dsn), workdir, key, per_tx, messages, address, p_child, sql)
            if aio else (mode, producer_dsn, workdir, key, per_tx, messages, address, p_child),
        )  # fmt: skip
        producer.start()
        try:
            _recv(p_parent, producer)  # ready
            started = time.perf_counter()
            p_parent.send("go")
            produced = _recv(p_parent, producer)
            finished, latencies, rounds = _recv(c_parent, consumer)
            producer.join(60)
        finally:
            if producer.is_alive():
                producer.kill()
        consumer.join(60)
    finally:
        if consumer.is_alive():
            consumer.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    if mode != "log-only":
        outbox.verify(producer_dsn, consumer_dsn, messages)
    return base.measured(
        MODES[mode],
        per_tx=per_tx,
        messages=messages,
        times=(started, produced, finished),
        latencies_ms=latencies,
        duplicates=len(latencies) - messages,
        batches=rounds,
    )


def _async_url(dsn: str) -> str:
    """The database of ``dsn`` as a psycopg 3 URL, for the async row's engines."""
    engine = _engine(dsn)
    url = engine.url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    engine.dispose()
    return str(url)


def _recv(pipe: Pipe, proc: Any, timeout: float = base.STALL_TIMEOUT_S * 3) -> Any:
    deadline = time.monotonic() + timeout
    while not pipe.poll(0.2):
        if not proc.is_alive():
            raise base.BenchError(f"{proc.name} died with exit code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise base.BenchError(f"{proc.name}: no answer in {timeout:.0f} s")
    return pipe.recv()


# -- acknowledgment modes ---------------------------------------------------------------

ACK_MODES = "auto,client,dups-ok,transacted"
CLIENT_ACK_EVERY = 10
DUPS_OK_BATCH = 64
ACK_ROWS = {
    "auto": "session auto (ack per message)",
    "client": f"session client (ack every {CLIENT_ACK_EVERY})",
    "dups-ok": f"session dups-ok (batch {DUPS_OK_BATCH})",
    "transacted": "session transacted (recv+send, 2PC)",
}
#: handled messages a crash can bring back, at most: the guarantee each row pays for
AT_RISK = {"auto": 1, "client": CLIENT_ACK_EVERY, "dups-ok": DUPS_OK_BATCH, "transacted": 0}


@dataclass
class AckModeResult:
    mode: str
    messages: int
    seconds: float
    fsyncs: int

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.seconds


def run_ack_mode(mode: str, messages: int) -> AckModeResult:
    """Consume ``messages`` prefilled messages through a `Session` in ``mode``, in this process."""
    workdir = Path(tempfile.mkdtemp(prefix="twopc-bench-ack-"))
    try:
        with Cursor(workdir / "cursor") as cursor, MessageLog(workdir / "log") as mlog:
            items = []
            for seq in range(1, messages + 1):
                m = Message(uuid.uuid4().hex, DESTINATION, os.urandom(base.BODY_BYTES))
                items.append((Frame(DESTINATION, 1, seq, seq - 1, m.message_id), m))
            cursor.deliver_many(items)
            cur_res, log_res = CursorResource(cursor, "cursor"), MessageLogResource(mlog, "mlog")
            tm = _manager("bench-session", workdir, [cur_res, log_res])
            session = Session(tm, cursor=cur_res, log=log_res, mode=AckMode(mode),
                              dups_ok_batch=DUPS_OK_BATCH)  # fmt: skip
            handled = 0

            def handle(m: Received) -> None:
                nonlocal handled
                handled += 1
                if mode == "client" and handled % CLIENT_ACK_EVERY == 0:
                    m.acknowledge()
                elif mode == "transacted":
                    session.send(DESTINATION + "-out", m.body)
                    session.commit()

            fsyncs = [cursor.stats().fsyncs, mlog.stats().fsyncs, tm.log.stats().fsyncs]
            started = time.perf_counter()
            session.consume(DESTINATION, handle)
            session.close()  # acknowledges (client: the last partial group; commits nothing else)
            seconds = time.perf_counter() - started
            after = [cursor.stats().fsyncs, mlog.stats().fsyncs, tm.log.stats().fsyncs]
            tm.close()
            if handled != messages or cursor.stats().available or cursor.stats().in_flight:
                raise base.BenchError(f"{mode}: handled {handled} of {messages}")
        return AckModeResult(mode, messages, seconds, sum(after) - sum(fsyncs))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def ack_mode_list(value: str) -> list[str]:
    """``--ack-modes``: a comma-separated subset of `ACK_MODES`, possibly empty."""
    modes = [m.strip() for m in value.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(ACK_ROWS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; known: {ACK_MODES}")
    return modes


def run_ack_modes(modes: list[str], messages: int) -> list[AckModeResult]:
    """One row per mode, printed as a table after the last (nothing for no modes)."""
    if not modes:
        return []
    print(f"\nJMS acknowledgment modes, {messages} messages of {base.BODY_BYTES} "
          "bytes per row")  # fmt: skip
    results = []
    for mode in modes:
        print(f"  running session {mode} ...", flush=True)
        results.append(run_ack_mode(mode, messages))
    print_ack_table(results)
    return results


def print_ack_table(results: list[AckModeResult]) -> None:
    print(f"{'mode':<10}  {'system':<42} {'msgs':>6} {'seconds':>8} {'msg/s':>8} "
          f"{'fsync/msg':>9} {'at risk':>7}")  # fmt: skip
    for r in results:
        print(f"{r.mode:<10}  {ACK_ROWS[r.mode]:<42} {r.messages:>6} {r.seconds:>8.2f} "
              f"{r.msgs_per_s:>8,.0f} {r.fsyncs / r.messages:>9.2f} "
              f"{AT_RISK[r.mode]:>7}")  # fmt: skip
    print(
        "msg/s: receive and acknowledge only, one session over an embedded cursor (no database, "
        "no transfer);\nfsync/msg: the cursor's, the log's and the decision log's fsyncs per "
        "message; at risk: handled messages a crash can redeliver."
    )


# -- the table ---------------------------------------------------------------------------------

#: issue 14's targets: (numerator, denominator, msgs per txn, lowest ratio that meets it)
TARGETS = (
    *(("twopc-eo", "outbox", n, 1.0) for n in (1, 10)),
    ("twopc-eo", "outbox", 100, 0.6),
    *(("twopc-eo", "jetstream", n, 1.5) for n in (1, 10, 100)),
    ("twopc-eo", "twopc-alo", 100, 0.9),  # exactly-once within 10% of at-least-once
    ("twopc-core", "jetstream", 1, 2.0),
)


def verdicts(results: list[base.PipelineResult]) -> list[str]:
    """One line per target of issue 14 whose two rows ran: the ratio and MET or MISSED."""
    rates = {(SYSTEM_IDS[r.system], r.per_tx): r.msgs_per_s for r in results if r.skipped is None}
    out = []
    for num, den, per_tx, least in TARGETS:
        a, b = rates.get((num, per_tx)), rates.get((den, per_tx))
        if a is None or b is None:
            continue
        ok = a / b >= least
        out.append(f"{'MET' if ok else 'MISSED':<6} {num} / {den} at {per_tx}/tx: "
                   f"{a / b:.2f}x (target >= {least}x)")  # fmt: skip
    return out


def as_json(results: list[base.PipelineResult]) -> list[dict[str, Any]]:
    """One object per row, in ``--json``'s format (a skipped row carries ``skipped``)."""
    out = []
    for r in results:
        row: dict[str, Any] = {"system": SYSTEM_IDS[r.system], "per_tx": r.per_tx}
        if r.skipped is not None:
            row["skipped"] = r.skipped
        else:
            row |= {"msg_s": round(r.msgs_per_s, 1), "p50_ms": round(r.p50_ms, 3),
                    "p99_ms": round(r.p99_ms, 3)}  # fmt: skip
        out.append(row)
    return out


@contextlib.contextmanager
def databases(producer_dsn: str | None, consumer_dsn: str | None) -> Iterator[tuple[str, str]]:
    """The producer's and the consumer's databases: the given DSNs (the consumer's defaults to
    the producer's), or two databases on a throwaway cluster (removed at the end)."""
    if producer_dsn:
        yield producer_dsn, consumer_dsn or producer_dsn
        return
    server = PostgresServer()
    try:
        server.start()
        producer, consumer = (server.dsn(server.create_database(n)) for n in DATABASES)
        yield producer, consumer
    finally:
        server.remove()


DATABASES = ("bench_producer", "bench_consumer")


def system_list(value: str) -> list[str]:
    """``--systems``: a comma-separated subset of `SYSTEMS`."""
    systems = [s.strip() for s in value.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; known: {','.join(SYSTEMS)}")
    return systems


def run_scale(args: argparse.Namespace) -> None:
    """``--logs``/``--cursors``: the scale rows (`messaging_scale`); 6000 messages, 10 per
    transaction, unless ``--messages``/``--per-tx``/``--quick`` say otherwise."""
    per_tx = int(args.per_tx) if args.per_tx.isdigit() else 10
    messages = 1000 if args.quick else args.messages or 6000
    messaging_scale.main([int(n) for n in (args.logs or "1").split(",")],
                         [int(n) for n in (args.cursors or "1").split(",")],
                         messages, per_tx, args.json)  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=None, help="messages per row (2000)")
    parser.add_argument("--quick", action="store_true", help="300 messages per row")
    parser.add_argument("--per-tx", default="1,10,100", help="batch sizes (1,10,100)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), type=system_list,
                        help=f"rows to run ({','.join(SYSTEMS)})")  # fmt: skip
    parser.add_argument("--pg-dsn", help="the producer's PostgreSQL (default: a throwaway cluster)")
    parser.add_argument("--pg-consumer-dsn", help="the consumer's PostgreSQL (default: --pg-dsn)")
    parser.add_argument("--nats-url", help="JetStream server (default the local one, else private)")
    parser.add_argument("--rabbitmq-url", default=base.RABBITMQ_URL)
    parser.add_argument(
        "--ack-modes",
        default=ack_mode_list(ACK_MODES),
        type=ack_mode_list,
        help=f"session acknowledgment-mode rows ({ACK_MODES}; '' for none)",
    )
    parser.add_argument("--ack-messages", type=int, default=1000,
                        help="messages per acknowledgment-mode row (1000)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write one object per pipeline row here")
    parser.add_argument("--logs", help="scale rows: log servers, e.g. 1,2,3 (messaging_scale)")
    parser.add_argument("--cursors", help="scale rows: cursor servers, e.g. 1,2")
    return parser


def _pipeline_defaults(args: argparse.Namespace) -> None:
    args.messages = args.messages or 2000
    if args.quick:
        args.messages = 300
        args.ack_messages = min(args.ack_messages, 300)


def main() -> None:
    args = _parser().parse_args()
    if args.logs or args.cursors:
        run_scale(args)
        return
    _pipeline_defaults(args)
    base.exit_on_sigterm()  # so a killed run still removes its throwaway PostgreSQL
    batch_sizes = [int(n) for n in args.per_tx.split(",")]
    systems = args.systems
    results: list[base.PipelineResult] = []
    with databases(args.pg_dsn, args.pg_consumer_dsn) as dsns, contextlib.ExitStack() as stack:
        dsn = dsns[0]  # the brokers' rows keep both tables in the producer's database
        print(f"python {sys.version.split()[0]}, {platform.platform()}, {os.cpu_count()} CPUs")
        print(base.pg_context(dsn))
        nats_url = None
        if "jetstream" in systems:
            with contextlib.suppress(base.BrokerUnavailable):
                nats_url = stack.enter_context(base.jetstream_server(args.nats_url))
                print(base.jetstream_context(nats_url))
        if "rabbitmq" in systems:
            print(base.rabbitmq_context(args.rabbitmq_url))
        print(f"{args.messages} messages of {base.BODY_BYTES} bytes per row\n")
        runners: list[tuple[str, Callable[[int], base.PipelineResult]]] = []
        if "twopc" in systems:
            for mode in MODES:
                runners.append((mode, lambda n, m=mode: run_twopc(m, dsns, n, args.messages)))
        if "outbox" in systems:
            runners.append(("outbox", lambda n: outbox.run_outbox(*dsns, n, args.messages, _recv)))
        if "jetstream" in systems:
            runners.append(("jetstream", lambda n: (
                base.run_jetstream(dsn, n, args.messages, nats_url=nats_url) if nats_url
                else base._skipped(base.JETSTREAM, n, args.messages, "no server"))))  # fmt: skip
        if "rabbitmq" in systems:
            runners.append(("rabbitmq", lambda n: base.run_rabbitmq(
                dsn, n, args.messages, url=args.rabbitmq_url)))  # fmt: skip
        for per_tx in batch_sizes:
            for name, runner in runners:
                print(f"  running {name} at {per_tx}/tx ...", flush=True)
                results.append(runner(per_tx))
    base.print_table(results)
    print("targets (issue 14), ratios of msg/s in this run:")
    for line in verdicts(results):
        print("  " + line)
    if args.json:
        args.json.write_text(json.dumps(as_json(results), indent=1) + "\n")
        print(f"wrote {args.json}")
    run_ack_modes(args.ack_modes, args.ack_messages)


if __name__ == "__main__":
    main()
