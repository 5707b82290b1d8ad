"""The process the cursor crash tests kill: consumers that receive inside PostgreSQL transactions.

    python tests/crash/cursor_worker.py run     --db URL --log DIR --cursor DIR --count N
        [--llr [--no-carry]] [--durable-commit]
    python tests/crash/cursor_worker.py recover --db URL --log DIR --cursor DIR [--llr]

``run``: N transactions, each receiving one message of queue ``orders`` from the cursor (resource
``cursor``, crash points ``cursor.cursor.*``) and inserting its body as ``transfers`` row (resource
``db``); the coordinator's decision log is a `FileDecisionLog`. ``--llr``: the database is the
logging last resource, and the cursor's branch rides its commit (`coordinator.carried`) unless
``--no-carry`` (then it prepares first); ``--durable-commit``: the cursor forces its commit
record instead of writing it lazily. Printed, flushed (a SIGKILL loses nothing printed): ``ACK
<body> <delivery count>`` once commit returned, ``DONE``. ``recover``: a new manager recovers on
start, and once more, then prints ``STATE <json>``: the queue's ``available`` bodies and their
``counts``, the ``prepared`` gids left in the cursor, the database's ``rows``, the carried gids
the cursor still ``remembered``, the commit ``decision_rows`` left and the nodes the cursor is
``awaiting`` before it hands anything out. Crashes come from ``TWOPC_CRASH_AT``
(`coordinator.crashpoints`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from sqlalchemy import create_engine, text

from coordinator import FileDecisionLog, TransactionManager
from resource_managers.cursor import Cursor, CursorResource
from resource_managers.postgres import PostgresResource


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("run", "recover"))
    parser.add_argument("--db", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--cursor", required=True)
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--llr", action="store_true", help="the database is the last resource")
    parser.add_argument("--no-carry", action="store_true", help="the cursor prepares (with --llr)")
    parser.add_argument("--durable-commit", action="store_true", help="force the commit record")
    args = parser.parse_args(argv)
    engine = create_engine(args.db)
    # no fsync of its own for a lazy commit record: the next transaction's forced records carry
    # it (or close), so each crash point is reached once per transaction, in order
    cursor = Cursor(args.cursor, lazy_delay=60.0)
    db = PostgresResource(engine, "db", last_resource=args.llr)
    cr = CursorResource(
        cursor, lazy_commit=not args.durable_commit, rides_last_resource=not args.no_carry
    )
    tm = TransactionManager(
        "node-1", FileDecisionLog(args.log), [db, cr], recovery_interval=None, reaper_interval=None
    )
    try:
        if args.mode == "run":
            for _ in range(args.count):
                with tm.transaction() as tx:
                    got = tx.join(cr).receive("orders")
                    assert got is not None
                    body = got.body.decode()
                    tx.join(db).execute(
                        text("INSERT INTO transfers (id, amount) VALUES (:t, 1)"), {"t": body}
                    )
                print(f"ACK {body} {got.delivery_count}", flush=True)
                if args.llr and not args.no_carry:
                    # a carried branch writes no prepare to carry the last one's lazy record:
                    # flush it here, as its LazyWatch would a moment later
                    cr.flush_commits()
            print("DONE", flush=True)
        else:
            tm.recover(force=True)  # a second pass: the first one's restores are settled
            with engine.connect() as conn:
                rows = sorted(conn.execute(text("SELECT id FROM transfers")).scalars())
                decisions = 0
                if conn.execute(text("SELECT to_regclass('twopc_decision_row')")).scalar():
                    decisions = conn.execute(
                        text("SELECT count(*) FROM twopc_decision_row WHERE outcome = 'c'")
                    ).scalar_one()
            waiting = cursor.available("orders")
            state = {
                "available": [d.body.decode() for d in waiting],
                "counts": [d.delivery_count for d in waiting],
                "prepared": cursor.prepared_gids(),
                "rows": rows,
                "remembered": sorted(cr.carried_gids()),
                "decision_rows": decisions,
                "awaiting": sorted(cursor.awaiting_recovery()),
            }
            print("STATE " + json.dumps(state), flush=True)
    finally:
        tm.close()
        cursor.close()
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
