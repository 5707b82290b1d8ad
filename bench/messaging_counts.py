"""Forced records and round trips per message at 1 msg/txn, by side and by store (issue 14).

The pipeline of ``bench/messaging.py``'s exactly-once rows (the same stores, managers and SQL),
driven one message at a time in three steps so that every counter read between two steps belongs
to one of them:

1. **producer**: one transaction inserts a ``produced`` row and sends its message (message log +
   the producer's PostgreSQL). The transfer's connection is held shut meanwhile (`CountingProxy`
   pauses it), so nothing reaches the cursor yet.
2. **transfer**: the connection opens; the transfer sends the message, the cursor persists it
   and acknowledges, the log records the acknowledgment; the step ends when the log holds nothing
   unacknowledged (``LogTransfer.wait_idle``).
3. **consumer**: one transaction receives the message, inserts its ``consumed`` row and deletes
   it from the cursor (cursor + the consumer's PostgreSQL).

Counted, per message (totals over ``--messages`` divided by it, after ``--warmup`` messages that
open every connection and create every table):

- **Stores**: the ``forced_records``, ``fsyncs`` and ``lazy_records`` of ``MessageLog.stats()``,
  ``Cursor.stats()`` and each manager's decision log (``tm.log.stats()``): public stats only, so the
  script keeps working while the stores change underneath.
- **PostgreSQL**: the COMMIT, PREPARE TRANSACTION and COMMIT PREPARED statements each side sent
  (each forces the server's WAL under ``synchronous_commit=on``), read off the wire by a counting
  proxy that parses the frontend protocol, and the WAL fsyncs the server did
  (``pg_stat_wal.wal_sync``, the whole cluster over the measured steps, after the backends have
  flushed their statistics). Each side has its own throwaway cluster (autovacuum off), so a
  cluster's WAL fsyncs are that side's.
- **Round trips**: request bursts (client bytes after the server last spoke) through a
  `CountingProxy` on loopback in front of each PostgreSQL and in front of the cursor's listener
  (the log-to-cursor transfer). A proxy and not a driver-level counter because it counts what the
  wire carries, whichever layer sent it, and counts statements sent together as one.

Two configurations, each on fresh stores: ``twopc-eo`` (PostgreSQL the logging last resource at
both ends) and ``twopc-eo-file`` (file decision log, PostgreSQL prepared as an ordinary branch).

    python bench/messaging_counts.py [--messages 200] [--warmup 20] [--modes twopc-eo,twopc-eo-file]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import messaging_baselines as base  # type: ignore[import-not-found]
import psycopg2
from counting_proxy import CountingProxy  # type: ignore[import-not-found]
from sqlalchemy.engine import make_url

from messaging.auth import SharedSecret
from messaging.connection import Listener, connect
from messaging.transfer import TRANSFER_ROLE, LogTransfer, TransferReceiver
from resource_managers.cursor import Cursor
from resource_managers.message_log import MessageLog
from resource_managers.throwaway import PostgresServer


def _bench_messaging() -> Any:
    """``bench/messaging.py`` as a module (its name would shadow the ``messaging`` package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_messaging", Path(__file__).resolve().parent / "messaging.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bm = _bench_messaging()
MODES = {
    "twopc-eo": "exactly-once",
    "twopc-eo-prepared": "exactly-once-prepared",
    "twopc-eo-file": "exactly-once-file",
}
SIDES = ("producer", "transfer", "consumer")
STORE_FIELDS = ("forced_records", "fsyncs", "lazy_records")
PG_FIELDS = ("commit", "prepare", "commit_prepared", "round_trips")
#: which step a store's crash points belong to, for the table's "crash points" column
CRASH_POINTS = {
    ("producer", "message log"): "carried: tm.carried.after_stage, mlog.mlog.after_carried_commit, "
    "mlog.mlog.carried_durable, tm.carried.before_forget; prepared: mlog.mlog.after_prepare, "
    "mlog.mlog.after_lazy_commit, mlog.mlog.commit_durable (forced commit: "
    "mlog.mlog.after_append, mlog.mlog.after_commit)",
    ("producer", "decision log"): "tm.before_decision_write, tm.after_decision_fsync, "
    "tm.before_end_record, tm.end_deferred, tm.before_deferred_end",
    ("producer", "PostgreSQL"): "tm.after_prepare.N, tm.llr.before_commit, tm.llr.after_commit, "
    "tm.after_commit.N",
    ("transfer", "wire"): "xfer.log.after_send, xfer.cursor.after_ack",
    ("transfer", "cursor"): "xfer.cursor.after_persist",
    ("transfer", "message log"): "xfer.log.before_compact",
    ("consumer", "cursor"): "cursor.cursor.after_receive, cursor.after_credited_take; carried: "
    "cursor.after_carriers (once), tm.carried.after_stage, cursor.cursor.after_carried_commit, "
    "cursor.cursor.carried_durable, tm.carried.before_forget; prepared: "
    "cursor.cursor.after_prepare, cursor.cursor.after_lazy_commit, cursor.cursor.commit_durable",
    ("consumer", "decision log"): "tm.before_decision_write, tm.after_decision_fsync, "
    "tm.before_end_record, tm.end_deferred, tm.before_deferred_end",
    ("consumer", "PostgreSQL"): "tm.after_prepare.N, tm.llr.before_commit, tm.llr.after_commit, "
    "tm.after_commit.N",
}


@dataclass
class Clusters:
    """The producer's and the consumer's PostgreSQL: one throwaway cluster each."""

    producer: PostgresServer
    consumer: PostgresServer
    producer_dsn: str
    consumer_dsn: str


@contextlib.contextmanager
def clusters() -> Iterator[Clusters]:
    servers = [PostgresServer(settings={"autovacuum": "off"}) for _ in range(2)]
    try:
        for server in servers:
            server.start()
        yield Clusters(
            servers[0],
            servers[1],
            servers[0].dsn(servers[0].create_database("bench_producer")),
            servers[1].dsn(servers[1].create_database("bench_consumer")),
        )
    finally:
        for server in servers:
            server.remove()


def _through(dsn: str, proxy: CountingProxy) -> str:
    """``dsn`` (a libpq key=value DSN or URL) pointed at ``proxy``, as a URL."""
    from psycopg2.extensions import parse_dsn

    p = parse_dsn(base._libpq(dsn))
    host, port = proxy.address
    url = make_url("postgresql://").set(
        username=p.get("user"), password=p.get("password"), host=host, port=port,
        database=p.get("dbname"),
    )  # fmt: skip
    return url.render_as_string(hide_password=False)


def _upstream(dsn: str) -> tuple[str, int]:
    from psycopg2.extensions import parse_dsn

    p = parse_dsn(base._libpq(dsn))
    return p.get("host", "127.0.0.1"), int(p.get("port", 5432))


def wal_syncs(dsn: str) -> int:
    """The cluster's WAL fsyncs so far (``pg_stat_wal.wal_sync``, PostgreSQL 14 and later)."""
    with contextlib.closing(psycopg2.connect(base._libpq(dsn))) as conn, conn.cursor() as cur:
        cur.execute("SELECT wal_sync FROM pg_stat_wal")
        row = cur.fetchone()
        conn.rollback()
    assert row is not None
    return int(row[0])


#: an idle backend flushes its statistics within PGSTAT_IDLE_INTERVAL (10 s, PostgreSQL 15)
STATS_SETTLE_S = 11.0


class Pipeline:
    """One configuration's producer, transfer and consumer, in this process, step by step."""

    def __init__(self, mode: str, cl: Clusters, workdir: Path, stack: contextlib.ExitStack) -> None:
        key = SharedSecret(secrets.token_bytes(32))
        self.pg_proxy = {
            "producer": stack.enter_context(
                CountingProxy(_upstream(cl.producer_dsn), postgres=True)
            ),
            "consumer": stack.enter_context(
                CountingProxy(_upstream(cl.consumer_dsn), postgres=True)
            ),
        }
        self.cursor = Cursor(workdir / "cursor")
        stack.callback(self.cursor.close)
        listener = Listener(
            ("127.0.0.1", 0), key, "bench-cursor", {TRANSFER_ROLE: TransferReceiver(self.cursor)}
        ).start()
        stack.callback(listener.close)
        self.wire = stack.enter_context(CountingProxy(listener.address))
        self.mlog = MessageLog(workdir / "log")
        stack.callback(self.mlog.close)
        wire = self.wire.address
        self.transfer = LogTransfer(
            self.mlog, lambda: connect(wire, key, "bench-log", TRANSFER_ROLE)
        ).start()
        stack.callback(self.transfer.close)
        p_engine = bm._engine(_through(cl.producer_dsn, self.pg_proxy["producer"]))
        c_engine = bm._engine(_through(cl.consumer_dsn, self.pg_proxy["consumer"]))
        stack.callback(p_engine.dispose)
        stack.callback(c_engine.dispose)
        self.log_res = bm._log_resource(mode, self.mlog)
        self.cur_res = bm._cursor_resource(mode, self.cursor)
        self.p_pg, self.c_pg = bm._pg(mode, p_engine), bm._pg(mode, c_engine)
        self.tm_p = bm._manager("bench-producer", workdir, [self.log_res, self.p_pg])
        stack.callback(self.tm_p.close)
        self.tm_c = bm._manager("bench-consumer", workdir, [self.cur_res, self.c_pg])
        stack.callback(self.tm_c.close)
        self.prefix = uuid.uuid4().hex[:12]
        self.sent = 0

    def produce(self) -> None:
        mid, body = f"{self.prefix}-{self.sent:09d}", os.urandom(base.BODY_BYTES)
        self.sent += 1
        self.wire.pause()
        with self.tm_p.transaction() as tx:
            tx.join(self.p_pg).execute(bm.INSERT_PRODUCED, {"ids": [mid], "bodies": [body]})
            tx.join(self.log_res).send(bm.DESTINATION, body, headers={"id": mid})

    def move(self) -> None:
        self.wire.resume()
        if not self.transfer.wait_idle(30):
            raise base.BenchError("the transfer did not deliver within 30 s")

    def consume(self) -> None:
        with self.tm_c.transaction() as tx:
            got = tx.join(self.cur_res).receive_many(bm.DESTINATION, 1, timeout=5.0)
            if len(got) != 1:
                raise base.BenchError(f"the consumer received {len(got)} messages, not 1")
            tx.join(self.c_pg).execute(bm.INSERT_CONSUMED, {"ids": [got[0].headers["id"]]})

    def sample(self) -> Counter[str]:
        """Every counter, keyed ``side/store/field`` for stores and ``side/PostgreSQL/kind``."""
        out: Counter[str] = Counter()
        stores = {
            "message log": self.mlog.stats(),
            "cursor": self.cursor.stats(),
            "producer decision log": self.tm_p.log.stats(),
            "consumer decision log": self.tm_c.log.stats(),
        }
        for store, stats in stores.items():
            for name in STORE_FIELDS:
                out[f"{store}/{name}"] = int(getattr(stats, name, 0))
        for side, proxy in self.pg_proxy.items():
            counts = proxy.snapshot()
            for name in (*PG_FIELDS, "connections"):
                out[f"{side} PostgreSQL/{name}"] = counts[name]
        wire = self.wire.snapshot()
        out["transfer wire/round_trips"] = wire["round_trips"]
        out["transfer wire/connections"] = wire["connections"]
        return out


def _delta(after: Counter[str], before: Counter[str]) -> Counter[str]:
    return Counter({k: after[k] - before[k] for k in after})


def count_mode(mode: str, cl: Clusters, messages: int, warmup: int) -> dict[str, Any]:
    """Per-message counts of one configuration: {side: {store: {field: per message}}}."""
    for dsn in (cl.producer_dsn, cl.consumer_dsn):
        base.prepare_tables(dsn)
    workdir = Path(tempfile.mkdtemp(prefix="twopc-bench-counts-"))
    try:
        with contextlib.ExitStack() as stack:
            pipe = Pipeline(MODES[mode], cl, workdir, stack)
            steps: list[tuple[str, Callable[[], None]]] = [
                ("producer", pipe.produce), ("transfer", pipe.move), ("consumer", pipe.consume)
            ]  # fmt: skip
            for _ in range(warmup):
                for _, step in steps:
                    step()
            time.sleep(STATS_SETTLE_S)
            wal_before = (wal_syncs(cl.producer_dsn), wal_syncs(cl.consumer_dsn))
            totals = {side: Counter[str]() for side in SIDES}
            for _ in range(messages):
                for side, step in steps:
                    before = pipe.sample()
                    step()
                    totals[side].update(_delta(pipe.sample(), before))  # keeps zeros
            time.sleep(STATS_SETTLE_S)
            wal_after = (wal_syncs(cl.producer_dsn), wal_syncs(cl.consumer_dsn))
        bm.outbox.verify(cl.producer_dsn, cl.consumer_dsn, warmup + messages)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _table(totals, messages, wal_after[0] - wal_before[0], wal_after[1] - wal_before[1])


def _table(
    totals: dict[str, Counter[str]], messages: int, p_wal: int, c_wal: int
) -> dict[str, Any]:
    """Keep, per side, the stores that step touches, divided by ``messages``."""
    stores_of = {
        "producer": ("message log", "producer decision log", "producer PostgreSQL"),
        "transfer": ("transfer wire", "message log", "cursor"),
        "consumer": ("cursor", "consumer decision log", "consumer PostgreSQL"),
    }
    out: dict[str, Any] = {}
    for side, stores in stores_of.items():
        out[side] = {}
        for store in stores:
            fields = {
                key.split("/", 1)[1]: value / messages
                for key, value in totals[side].items()
                if key.startswith(store + "/")
            }
            label = store.replace("producer ", "").replace("consumer ", "").replace(" wire", "")
            out[side][label if label != "transfer" else "wire"] = fields
    out["producer"]["PostgreSQL"]["wal_fsyncs"] = p_wal / messages
    out["consumer"]["PostgreSQL"]["wal_fsyncs"] = c_wal / messages
    return out


# -- the table ---------------------------------------------------------------------------------

ROWS = (
    ("producer", "message log", "forced_records"),
    ("producer", "message log", "fsyncs"),
    ("producer", "message log", "lazy_records"),
    ("producer", "decision log", "forced_records"),
    ("producer", "decision log", "fsyncs"),
    ("producer", "decision log", "lazy_records"),
    ("producer", "PostgreSQL", "prepare"),
    ("producer", "PostgreSQL", "commit_prepared"),
    ("producer", "PostgreSQL", "commit"),
    ("producer", "PostgreSQL", "wal_fsyncs"),
    ("producer", "PostgreSQL", "round_trips"),
    ("transfer", "cursor", "forced_records"),
    ("transfer", "cursor", "fsyncs"),
    ("transfer", "cursor", "lazy_records"),
    ("transfer", "message log", "forced_records"),
    ("transfer", "message log", "fsyncs"),
    ("transfer", "message log", "lazy_records"),
    ("transfer", "wire", "round_trips"),
    ("consumer", "cursor", "forced_records"),
    ("consumer", "cursor", "fsyncs"),
    ("consumer", "cursor", "lazy_records"),
    ("consumer", "decision log", "forced_records"),
    ("consumer", "decision log", "fsyncs"),
    ("consumer", "decision log", "lazy_records"),
    ("consumer", "PostgreSQL", "prepare"),
    ("consumer", "PostgreSQL", "commit_prepared"),
    ("consumer", "PostgreSQL", "commit"),
    ("consumer", "PostgreSQL", "wal_fsyncs"),
    ("consumer", "PostgreSQL", "round_trips"),
)
FORCED = {"forced_records", "prepare", "commit_prepared", "commit"}


def side_totals(result: dict[str, Any], side: str) -> tuple[float, float]:
    """(forced records, round trips) per message on ``side``: store records plus PostgreSQL's
    COMMIT / PREPARE / COMMIT PREPARED (each a forced WAL record)."""
    forced = trips = 0.0
    for fields in result[side].values():
        forced += sum(v for k, v in fields.items() if k in FORCED)
        trips += fields.get("round_trips", 0.0)
    return forced, trips


def side_fsyncs(result: dict[str, Any], side: str) -> float:
    """The stores' fsyncs per message on ``side`` plus PostgreSQL's forced statements: the disk
    cost once records are lazy (a lazy record's own fsync is not a forced record). An fsync
    counts in the step during which it happened: a lazy record nothing carried within its delay
    is flushed on its own during the next step."""
    total = 0.0
    for fields in result[side].values():
        total += fields.get("fsyncs", 0.0)
        total += sum(v for k, v in fields.items() if k in FORCED - {"forced_records"})
    return total


def print_table(results: dict[str, dict[str, Any]], messages: int) -> None:
    modes = list(results)
    print(f"per message, 1 msg/txn, {messages} messages after warm-up")
    print(f"{'side':<9} {'store':<13} {'counter':<16} " + " ".join(f"{m:>14}" for m in modes))
    for side, store, field in ROWS:
        cells = " ".join(f"{results[m][side].get(store, {}).get(field, 0.0):>14.2f}" for m in modes)
        print(f"{side:<9} {store:<13} {field:<16} {cells}")
    print()
    for side in SIDES:
        forced = " ".join(f"{side_totals(results[m], side)[0]:>14.2f}" for m in modes)
        trips = " ".join(f"{side_totals(results[m], side)[1]:>14.2f}" for m in modes)
        print(f"{side:<9} {'total':<13} {'forced records':<16} {forced}")
        syncs = " ".join(f"{side_fsyncs(results[m], side):>14.2f}" for m in modes)
        print(f"{side:<9} {'total':<13} {'fsyncs':<16} {syncs}")
        print(f"{side:<9} {'total':<13} {'round trips':<16} {trips}")
    print(
        "\ncrash points of each step (mlog, cursor: the resources' names; N: the branch's index):"
    )
    for (side, store), points in CRASH_POINTS.items():
        print(f"  {side:<9} {store:<13} {points}")
    print()
    for m in modes:
        forced = sum(side_totals(results[m], s)[0] for s in SIDES)
        trips = sum(side_totals(results[m], s)[1] for s in SIDES)
        syncs = sum(side_fsyncs(results[m], s) for s in SIDES)
        print(f"{m}: {forced:.2f} forced records, {syncs:.2f} fsyncs and {trips:.2f} round trips "
              "per message")  # fmt: skip
    print(
        "forced records: the stores' forced_records, plus PostgreSQL COMMIT / PREPARE "
        "TRANSACTION / COMMIT PREPARED statements\n(each a WAL flush; wal_fsyncs is the "
        "server's own count, whole cluster); fsyncs: the stores' fsyncs plus those statements\n"
        "(lazy records flushed on their own count here, in the step during which the flush "
        "happened: one message at a time,\nnothing else's forced record carries them); round "
        "trips: request bursts through a counting proxy (PostgreSQL wire;\nthe log-to-cursor "
        "transfer's connection)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=200, help="measured messages (200)")
    parser.add_argument("--warmup", type=int, default=20, help="messages before counting (20)")
    parser.add_argument("--modes", default=",".join(MODES), help=",".join(MODES))
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {','.join(MODES)}")
    base.exit_on_sigterm()
    results: dict[str, dict[str, Any]] = {}
    with clusters() as cl:
        print(base.pg_context(cl.producer_dsn) + " (two clusters, autovacuum off)")
        for mode in modes:
            print(f"  counting {mode} ...", flush=True)
            results[mode] = count_mode(mode, cl, args.messages, args.warmup)
    print_table(results, args.messages)
    if args.json:
        payload = {"messages": args.messages, "per_message": results}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
