"""The consuming process of the acknowledgment-mode crash tests (killed with SIGKILL).

    python tests/crash/session_worker.py --mode MODE --cursor DIR --state DIR --queue Q
        [--ledger FILE] [--pg URL] [--every K] [--batch B]

Opens the cursor in ``--cursor`` (embedded: the process owns its journal, so a kill -9 leaves
exactly what the journal says), a `TransactionManager` with a file decision log in ``--state``
that recovers on start (a transaction decided but not finished before a crash is finished now),
and a `messaging.session.Session` in ``MODE`` that consumes ``Q`` until it is empty:

- ``auto``, ``client``, ``dups-ok``: the handler appends ``<body> <delivery_count>
  <redelivered>`` to ``--ledger`` (flushed, so a kill -9 keeps it: the ledger is what the
  application did, acknowledged or not). ``client`` acknowledges after every K-th message.
- ``transacted``: the handler inserts the same into PostgreSQL table ``handled`` through
  ``session.transaction.join(pg)``, and commits the session after every K-th message: the insert
  and the deletion of the messages are one two-phase transaction.

At the end whatever is left is acknowledged (committed), and ``DONE <handled>`` is printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find the repo

from sqlalchemy import create_engine, text

from coordinator import FileDecisionLog, TransactionManager
from messaging.session import AckMode, Received, Session
from resource_managers.cursor import Cursor, CursorResource
from resource_managers.postgres import PostgresResource

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS handled (id bigserial PRIMARY KEY, body text NOT NULL, "
    "delivery_count int NOT NULL, redelivered boolean NOT NULL)"
)
INSERT = text("INSERT INTO handled (body, delivery_count, redelivered) VALUES (:b, :n, :r)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=[m.value for m in AckMode])
    parser.add_argument("--cursor", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--queue", default="orders")
    parser.add_argument("--ledger")
    parser.add_argument("--pg")
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    mode = AckMode(args.mode)

    cursor = Cursor(args.cursor)  # a branch the last process left handed out is rolled back
    resource = CursorResource(cursor, "cursor")
    resources: list[Any] = [resource]
    pg: PostgresResource | None = None
    if mode is AckMode.TRANSACTED:
        pg = PostgresResource(create_engine(args.pg, pool_size=2), "pg")
        resources.append(pg)
    Path(args.state).mkdir(parents=True, exist_ok=True)
    tm = TransactionManager(
        "session-worker", FileDecisionLog(Path(args.state) / "tmlog"), resources,
        recovery_interval=None, reaper_interval=None, recover_on_start=False,
    )  # fmt: skip
    while not tm.recover(force=True).clean:  # what a crash left decided is finished first
        time.sleep(0.1)
    session = Session(tm, cursor=resource, mode=mode, dups_ok_batch=args.batch)
    ledger = open(args.ledger, "a") if args.ledger else None  # noqa: SIM115 - closed below
    handled = 0

    def handle(m: Received) -> None:
        nonlocal handled
        handled += 1
        row = {"b": m.body.decode(), "n": m.delivery_count, "r": m.redelivered}
        if pg is not None:
            session.transaction.join(pg).execute(INSERT, row)
            if handled % args.every == 0:
                session.commit()
            return
        assert ledger is not None
        ledger.write(f"{row['b']} {row['n']} {int(row['r'])}\n")
        ledger.flush()
        if mode is AckMode.CLIENT and handled % args.every == 0:
            m.acknowledge()

    session.consume(args.queue, handle)
    if mode is AckMode.TRANSACTED:
        session.commit()
    else:
        session.acknowledge()
    session.close()
    tm.close()
    cursor.close()
    if ledger is not None:
        ledger.close()
    print("DONE", handled, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
