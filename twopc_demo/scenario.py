"""The demo's parent process: start the stores and the cursor, run the service until it is killed,
show what it left in doubt, recover, deliver, audit."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator import (
    FileDecisionLog,
    RecoveryReport,
    Transaction,
    TransactionManager,
    Xid,
)
from coordinator.cli import summarize, table
from coordinator.decision_log import inspect_log
from coordinator.xid import FORMAT_ID

from .audit import audit, indent, ledger_gtrids, total
from .bank import (
    ACCOUNTS,
    CONSUMER_ID,
    CURSOR,
    CURSOR_ID,
    DESTINATION,
    MLOG,
    NODE_ID,
    OPENING,
    PG,
    REDIS,
)
from .service import dialer, start_transfer
from .stores import Cluster, RedisStore, Run, check_redis, create_bank

if TYPE_CHECKING:
    from resource_managers.cursor import Delivery
    from resource_managers.message_log import MessageLog


@contextlib.contextmanager
def setup(cluster: Cluster, store: RedisStore, keep: bool) -> Iterator[Run]:
    import redis  # noqa: PLC0415
    from sqlalchemy import create_engine  # noqa: PLC0415

    state = Run(cluster, store, Path(tempfile.mkdtemp(prefix="twopc-demo-")))
    try:
        state.client = redis.Redis.from_url(store.url)
        check_redis(state)
        state.client.mset({f"{store.keys}balance:{a}": OPENING for a in ACCOUNTS[REDIS]})
        database = "bank" if cluster.ours else f"bank_{uuid.uuid4().hex[:6]}"
        create_bank(cluster, database)
        state.database = database
        state.engine = create_engine(cluster.url(database))
        _start_cursor(state)
        yield state
    finally:
        try:
            _close_messaging(state)
        finally:
            if state.engine is not None:
                state.engine.dispose()
            if keep:
                _print_kept(state)
            else:
                _remove(state)


def _start_cursor(state: Run) -> None:
    """The embedded cursor, served on a free local port to transfers that know a fresh secret."""
    import secrets  # noqa: PLC0415

    from messaging.auth import SharedSecret  # noqa: PLC0415
    from messaging.connection import Listener  # noqa: PLC0415
    from messaging.transfer import TRANSFER_ROLE, TransferReceiver  # noqa: PLC0415
    from resource_managers.cursor import Cursor  # noqa: PLC0415

    state.secret = secrets.token_bytes(32)
    state.cursor = Cursor(state.cursor_dir)
    state.receiver = TransferReceiver(state.cursor)
    handlers = {TRANSFER_ROLE: state.receiver}
    key = SharedSecret(state.secret)
    state.listener = Listener(("127.0.0.1", 0), key, CURSOR_ID, handlers).start()


def _close_messaging(state: Run) -> None:
    """Transfer, listener, cursor, log: each closed even if an earlier one fails."""
    with contextlib.ExitStack() as stack:
        # an ExitStack runs its callbacks last pushed first
        for part in (state.mlog, state.cursor, state.listener, state.transfer):
            if part is not None:
                stack.callback(part.close)


def _remove(state: Run) -> None:
    from resource_managers.throwaway import drop_database  # noqa: PLC0415

    cluster, store = state.cluster, state.store
    if state.database:
        with contextlib.suppress(Exception):
            drop_database(cluster.dsn(), cluster.dsn(state.database), state.database)
    if not store.ours and state.client is not None:
        with contextlib.suppress(Exception):
            for pattern in (f"{store.keys}*", f"{store.namespace}:*"):
                for key in list(state.client.scan_iter(match=pattern, count=1000)):
                    state.client.delete(key)
    if state.client is not None:
        state.client.close()
    cluster.release()
    store.release()
    shutil.rmtree(state.workdir, ignore_errors=True)


def _print_kept(state: Run) -> None:
    cluster, store = state.cluster, state.store
    print("\nkept (--keep):")
    print(f"  PostgreSQL: {cluster.url(state.database).render_as_string()}")
    where = store.url if store.ours else store.origin  # only a throwaway URL is password-free
    print(f"  Redis: {where}, keys {store.keys}* and {store.namespace}:*")
    print(f"  decision log: {state.log}")
    print(f"  message log: {state.mlog_dir}")
    print(f"  cursor: {state.cursor_dir}")
    print(f"  consumer's decision log: {state.consumer_log}")
    drop = cluster.kept or f'DROP DATABASE "{state.database}"'
    unkey = store.kept or f"delete the keys {store.keys}* and {store.namespace}:*"
    print(f"  remove with: {drop}; {unkey}; rm -rf {state.workdir}")


def demo(state: Run, args: argparse.Namespace) -> int:
    pg_version = state.query("SHOW server_version")[0][0].split()[0]
    redis_version = state.client.info("server")["redis_version"]
    print(f"twopc demo: PostgreSQL {pg_version}, {state.cluster.origin}")
    print(f"   and Redis {redis_version}, {state.store.origin}")
    if not state.cluster.ours or not state.store.ours:
        print(f"   database {state.database}; Redis keys {state.store.keys}*")
    print(
        f"\n1. a service moves money between PostgreSQL ({', '.join(ACCOUNTS[PG])}) and Redis "
        f"({', '.join(ACCOUNTS[REDIS])}),\n   sending a message about each transfer to "
        f'"{DESTINATION}" (its log\'s transfer feeds a cursor\n   on {_where(state)}), branches '
        f"in name order (mlog, postgres, redis),\n   until SIGKILL at {args.crash_at}:"
    )
    before = total(state)
    acked, attempted = _run_crashing_child(state, args)
    assert state.cursor is not None
    early = len(state.cursor.available(DESTINATION))  # what the service's transfer delivered
    state.mlog = _reopen_log(state)
    print(
        "\n2. left in doubt, as pg_prepared_xacts, Redis, the message log and `twopc status` "
        "show it:"
    )
    rows = _in_doubt(state)
    print(indent(table(["where", "state", "what"], rows)))
    if rows:
        print(
            f'   (a gid is <format id>_<base64 gtrid>_<base64 branch>; ours is {FORMAT_ID}, "tpc0")'
        )
    report = _recover(state)
    print("\n3. a new TransactionManager on the same log runs recovery, as a restart would:")
    print(
        f"   committed again: {len(report.committed)} decision(s); "
        f"presumed abort: {len(report.rolled_back)} branch(es); failures: {len(report.failures)}"
    )
    print(
        "\n4. the log transfers the messages to the cursor; a consumer takes each one in a "
        "transaction\n   with a PostgreSQL insert:"
    )
    _deliver(state, early)
    return audit(state, before, acked, attempted)


def _where(state: Run) -> str:
    assert state.listener is not None
    host, port = state.listener.address
    return f"{host}:{port}"


def _reopen_log(state: Run) -> MessageLog:
    """The dead service's message log, as its restart would open it (the lock died with it)."""
    from resource_managers.message_log import MessageLog  # noqa: PLC0415

    return MessageLog(state.mlog_dir)


def _run_crashing_child(state: Run, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Run the service; print what it did; return the gtrids it acknowledged and attempted."""
    assert state.listener is not None
    spec = {
        "pg_url": state.cluster.url(state.database).render_as_string(False),
        "redis_url": state.store.url,
        "namespace": state.store.namespace,
        "keys": state.store.keys,
        "log": str(state.log),
        "transfers": args.transfers,
        "mlog": str(state.mlog_dir),
        "cursor": list(state.listener.address),
        "secret": state.secret.hex(),
    }
    # the URLs (which may hold a password) and the cursor's secret go through stdin, never argv
    # or the environment
    proc = subprocess.run(
        [sys.executable, "-m", "twopc_demo.service"],
        input=json.dumps(spec),
        env=dict(os.environ, TWOPC_CRASH_AT=args.crash_at),
        capture_output=True,
        text=True,
        timeout=120,
    )
    killed = proc.returncode == -signal.SIGKILL
    transfers: dict[int, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            transfers.setdefault(event["n"], {}).update(event)
    for n, t in transfers.items():
        answer = t.get("answer", "no answer: killed by SIGKILL" if killed else "no answer")
        print(f"   transfer {n:>2}: {t['amount']:>2} from {t['src']:<5} to {t['dst']:<5}  {answer}")
    if not killed:
        print(f"   the service exited with {proc.returncode} before reaching the crash point")
    if proc.returncode not in (0, -signal.SIGKILL):
        print(proc.stderr, file=sys.stderr)
    acked = [t["gtrid"] for t in transfers.values() if t.get("answer") == "committed"]
    return acked, [t["gtrid"] for t in transfers.values()]


def _in_doubt(state: Run) -> list[tuple[str, str, str]]:
    """What a crash left: pending decisions, and each store's side of them, from the sources."""
    assert state.mlog is not None
    pending, _, _ = summarize(inspect_log(state.log))
    mlog_done = {g for g in pending if state.mlog.is_committed(Xid(FORMAT_ID, g, MLOG).to_gid())}
    pg_done = {g for g in pending if state.query("SELECT 1 FROM transfers WHERE gtrid = %s", g)}
    redis_done = {g for g in pending if g in ledger_gtrids(state)}
    done = {MLOG: mlog_done, PG: pg_done, REDIS: redis_done}
    rows = [(MLOG, "committed", f"transfer {g}, its message numbered") for g in sorted(mlog_done)]
    rows += [(MLOG, "prepared, message held", f"gid {gid}") for gid in state.mlog.prepared_gids()]
    rows += [(PG, "committed", f"transfer {g}") for g in sorted(pg_done)]
    prepared = state.query(
        "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY prepared"
    )
    rows += [(PG, "prepared, locks held", f"gid {gid}") for (gid,) in prepared]
    rows += [(REDIS, "committed", f"transfer {g}") for g in sorted(redis_done)]
    rows += _redis_prepared(state)
    for gtrid, record in pending.items():
        # END is written lazily, with the next forced write: a crash can lose it harmlessly
        finished = all(gtrid in done.get(branch, ()) for branch in record["branches"])
        state_ = "COMMIT, END lost (lazy)" if finished else "COMMIT, no END"
        rows.append(("decision log", state_, f"{gtrid} [{', '.join(record['branches'])}]"))
    return rows


def _redis_prepared(state: Run) -> list[tuple[str, str, str]]:
    """Each prepared Redis branch: its entry in the prepared set, its locks, its staged set."""
    prefix, client = state.twopc_keys, state.client
    rows: list[tuple[str, str, str]] = []
    for gid in client.zrange(prefix + b"prepared", 0, -1):
        locked = [
            key[len(prefix) + 5 :].decode(errors="replace")
            for key in client.scan_iter(match=prefix + b"lock:*", count=1000)
            if client.get(key) == gid
        ]
        staged = _staged_commands(client.lrange(prefix + b"ws:" + gid, 0, -1))
        rows += [
            (REDIS, "prepared", f"gid {gid.decode()}"),
            (REDIS, "locked by it", ", ".join(sorted(locked))),
            (REDIS, "staged, not applied", "; ".join(staged)),
        ]
    return rows


def _staged_commands(ws: list[bytes]) -> list[str]:
    """A staged write set, read: [magic, n, n keys, then (command, key, nargs, args) ...]."""
    if len(ws) < 2:
        return ["(none)"]
    i, out = 2 + int(ws[1]), []
    while i + 2 < len(ws):
        command, key, nargs = ws[i].decode(), ws[i + 1].decode(errors="replace"), int(ws[i + 2])
        shown = f" {ws[i + 3].decode()}" if command == "INCRBY" else ""
        out.append(f"{command} {key}{shown}")
        i += 3 + nargs
    return out


def _recover(state: Run) -> RecoveryReport:
    from resource_managers.message_log import MessageLogResource  # noqa: PLC0415
    from resource_managers.postgres import PostgresResource  # noqa: PLC0415

    assert state.engine is not None and state.mlog is not None
    resources: list[Any] = [
        MessageLogResource(state.mlog, MLOG),
        PostgresResource(state.engine, name=PG),
        state.cache(),
    ]
    with TransactionManager(
        NODE_ID,
        FileDecisionLog(state.log),
        resources,
        recover_on_start=False,
        recovery_interval=None,
    ) as tm:
        return tm.recover(force=True)


def _deliver(state: Run, early: int) -> None:
    """Restart the log's transfer, wait until the cursor holds everything, consume it all:
    one transaction per message, its deletion from the cursor and a notifications row together."""
    from sqlalchemy import text  # noqa: PLC0415

    from messaging.consumer import consume_once  # noqa: PLC0415
    from resource_managers.cursor import CursorResource  # noqa: PLC0415
    from resource_managers.postgres import PostgresResource  # noqa: PLC0415

    assert state.mlog is not None and state.cursor is not None and state.listener is not None
    assert state.receiver is not None and state.engine is not None
    state.transfer = start_transfer(
        state.mlog, dialer(state.listener.address, state.secret)
    ).start()
    idle = state.transfer.wait_idle(30)
    held = len(state.cursor.available(DESTINATION))
    dropped = state.receiver.stats["messages"] - held  # copies the cursor's filter refused
    print(
        f"   transferred: {held} message(s) in the cursor, {early} while the service ran and "
        f"{held - early} after the restart;\n   resent copies the cursor's stream filter dropped "
        f"as duplicates: {dropped}"
    )
    if not idle:
        print("   the transfer did not finish within 30 s: the audit shows what is missing")

    pg = PostgresResource(state.engine, name=PG)
    inbox = CursorResource(state.cursor, CURSOR)

    def notify(tx: Transaction, delivery: Delivery) -> None:
        event = json.loads(delivery.body)
        tx.join(pg).execute(
            text("INSERT INTO notifications (gtrid, message_id) VALUES (:gtrid, :message_id)"),
            {"gtrid": event["gtrid"], "message_id": delivery.message_id},
        )

    consumed = 0
    log = FileDecisionLog(state.consumer_log)
    with TransactionManager(CONSUMER_ID, log, [inbox, pg], recovery_interval=None) as tm:
        while got := consume_once(tm, inbox, DESTINATION, notify, batch=1, timeout=0.2):
            consumed += got
    c = state.cursor.stats()
    print(
        f"   consumed: {consumed} message(s), one transaction (cursor, postgres) and one "
        "notifications row each"
    )
    print(
        f"   the cursor now: available {c.available}, in flight {c.in_flight}, prepared "
        f"{c.prepared}; {c.forced_records} forced records, {c.fsyncs} fsyncs"
    )
