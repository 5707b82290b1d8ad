"""End-to-end exactly-once messages/s: twopc against NATS JetStream and RabbitMQ, side by side.

The pipeline is the one `bench/messaging_baselines.py` describes for the brokers (read it): a
producer inserts ``per_tx`` rows into ``produced`` and sends the same ``per_tx`` messages of 256
bytes; a consumer receives up to ``per_tx`` messages, inserts their ids into ``consumed`` and
acknowledges; messages/s from the first produce to the last consume, latency p50/p99 from the
send time in a header to the consumer's commit. twopc rows, each in two processes (the producing
application with its embedded message log and transfer thread; the consuming application with its
embedded cursor, which the transfer reaches over TCP on loopback, authenticated):

- ``twopc exactly-once``: the producer's PostgreSQL insert and its messages commit in ONE
  two-phase transaction (`PostgresResource` + `MessageLogResource`, file decision log); the
  consumer's insert and the deletion of its messages from the cursor likewise (`CursorResource`
  + `PostgresResource`). Nothing can be lost or duplicated by a crash anywhere, which is more than
  either broker row promises (see the baselines' docstring: JetStream does not fsync each message;
  RabbitMQ's "exactly once" is the consumer's primary key).
- ``twopc at-least-once``: the same stores with no two-phase commit: the producer commits
  PostgreSQL, then sends in a one-phase log transaction; the consumer receives, commits its
  PostgreSQL insert on its own, then commits the cursor transaction (acknowledge after commit, as
  the RabbitMQ row does). The gap between these two rows is what exactly-once costs.
- ``twopc log+cursor only``: no database work at all: the messaging system alone.

Then one row per JMS acknowledgment mode (seed 003; `messaging.session`), so the cost of each
guarantee is visible: a `Session` consumes messages of the same size from an embedded cursor
(filled beforehand, no database, no transfer) with a file decision log; ``auto`` acknowledges each
message, ``client`` every 10th, ``dups-ok`` each batch of 64, and ``transacted`` receives one
message, sends one on through an embedded message log and commits both (two-phase). ``fsync/msg``
counts the cursor's, the log's and the decision log's fsyncs; ``at risk`` is how many handled
messages a crash can bring back (redelivered) at most.

Targets (printed with a verdict): at 100 messages per transaction, twopc exactly-once >= 1.0x
JetStream's exactly-once pipeline, and exactly-once at most 10% slower than at-least-once.

    python bench/messaging.py [--messages 2000] [--quick] [--per-tx 1,10,100]
        [--systems twopc,jetstream,rabbitmq] [--ack-modes auto,client,dups-ok,transacted]
        [--ack-messages 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import messaging_baselines as base  # type: ignore[import-not-found]
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

EXACTLY_ONCE = "twopc exactly-once (2PC with PostgreSQL both ends)"
AT_LEAST_ONCE = "twopc at-least-once (ack after commit, no 2PC)"
MESSAGING_ONLY = "twopc log+cursor only (no database)"
MODES = {"exactly-once": EXACTLY_ONCE, "at-least-once": AT_LEAST_ONCE, "log-only": MESSAGING_ONLY}
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


def _manager(node: str, workdir: Path, resources: list[Any]) -> TransactionManager:
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
    cur_res = CursorResource(cursor, "cursor")
    pg = PostgresResource(engine, "pg")
    resources: list[Any] = [cur_res, pg] if mode == "exactly-once" else [cur_res]
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
                if mode == "exactly-once":
                    tx.join(pg).execute(INSERT_CONSUMED, {"ids": ids})
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
    log_res = MessageLogResource(mlog, "mlog")
    pg = PostgresResource(engine, "pg")
    resources: list[Any] = [log_res, pg] if mode == "exactly-once" else [log_res]
    tm = _manager("bench-producer", workdir, resources)
    prefix = uuid.uuid4().hex[:12]
    batches = []
    for first in range(0, total, per_tx):
        ids = [f"{prefix}-{n:09d}" for n in range(first, min(first + per_tx, total))]
        batches.append((ids, [os.urandom(base.BODY_BYTES) for _ in ids]))
    pipe.send("ready")
    pipe.recv()  # go
    try:
        for ids, bodies in batches:
            if mode == "at-least-once":
                with engine.begin() as conn:
                    conn.execute(INSERT_PRODUCED, {"ids": ids, "bodies": bodies})
            with tm.transaction() as tx:
                if mode == "exactly-once":
                    tx.join(pg).execute(INSERT_PRODUCED, {"ids": ids, "bodies": bodies})
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


def run_twopc(mode: str, dsn: str, per_tx: int, messages: int) -> base.PipelineResult:
    base.prepare_tables(dsn)
    workdir = Path(tempfile.mkdtemp(prefix="twopc-bench-msg-"))
    key = secrets.token_bytes(32)
    ctx = mp.get_context("fork")
    c_parent, c_child = ctx.Pipe()
    p_parent, p_child = ctx.Pipe()
    consumer = ctx.Process(
        target=consumer_main, args=(mode, dsn, workdir, key, per_tx, messages, c_child)
    )
    consumer.start()
    try:
        address = _recv(c_parent, consumer)
        producer = ctx.Process(
            target=producer_main,
            args=(mode, dsn, workdir, key, per_tx, messages, address, p_child),
        )
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
        base._verify(dsn, messages)
    ordered = sorted(latencies)
    seconds = finished - started
    return base.PipelineResult(
        system=MODES[mode],
        per_tx=per_tx,
        messages=messages,
        seconds=seconds,
        msgs_per_s=messages / seconds,
        p50_ms=base._percentile(ordered, 0.5),
        p99_ms=base._percentile(ordered, 0.99),
        duplicates=len(latencies) - messages,
        produce_seconds=produced - started,
        mean_consume_batch=len(latencies) / max(1, rounds),
    )


def _recv(pipe: Pipe, proc: Any, timeout: float = base.STALL_TIMEOUT_S * 3) -> Any:
    deadline = time.monotonic() + timeout
    while not pipe.poll(0.2):
        if not proc.is_alive():
            raise base.BenchError(f"{proc.name} died with exit code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise base.BenchError(f"{proc.name}: no answer in {timeout:.0f} s")
    return pipe.recv()


# -- acknowledgment modes (seed 003) ---------------------------------------------------------------

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
    print(f"\nJMS acknowledgment modes (seed 003), {messages} messages of {base.BODY_BYTES} "
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


def verdicts(results: list[base.PipelineResult]) -> list[str]:
    def rate(system: str, per_tx: int) -> float | None:
        for r in results:
            if r.system == system and r.per_tx == per_tx and r.skipped is None:
                return r.msgs_per_s
        return None

    out = []
    eo, js, alo = rate(EXACTLY_ONCE, 100), rate(base.JETSTREAM, 100), rate(AT_LEAST_ONCE, 100)
    if eo is not None and js is not None:
        ok = eo >= js
        out.append(f"{'MET' if ok else 'MISSED'}: exactly-once vs JetStream at 100/tx: "
                   f"{eo / js:.2f}x (target >= 1.0x)")  # fmt: skip
    if eo is not None and alo is not None:
        cost = 1 - eo / alo
        out.append(f"{'MET' if cost <= 0.10 else 'MISSED'}: exactly-once costs {cost:.0%} over "
                   "at-least-once at 100/tx (target <= 10%)")  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=2000, help="messages per row (2000)")
    parser.add_argument("--quick", action="store_true", help="300 messages per row")
    parser.add_argument("--per-tx", default="1,10,100", help="batch sizes (1,10,100)")
    parser.add_argument("--systems", default="twopc,jetstream,rabbitmq")
    parser.add_argument("--pg-dsn", help="PostgreSQL DSN (default: a throwaway cluster)")
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
    args = parser.parse_args()
    if args.quick:
        args.messages = 300
        args.ack_messages = min(args.ack_messages, 300)
    base.exit_on_sigterm()  # so a killed run still removes its throwaway PostgreSQL
    batch_sizes = [int(n) for n in args.per_tx.split(",")]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    results: list[base.PipelineResult] = []
    with base.database(args.pg_dsn) as dsn, contextlib.ExitStack() as stack:
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
                runners.append((mode, lambda n, m=mode: run_twopc(m, dsn, n, args.messages)))
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
    for line in verdicts(results):
        print(line)
    run_ack_modes(args.ack_modes, args.ack_messages)


if __name__ == "__main__":
    main()
