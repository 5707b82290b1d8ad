"""A consumer killed while the server still runs its commit (the carried cursor's fence test).

    python tests/crash/slow_commit_worker.py DB_URL DECISION_LOG_DIR CURSOR_DIR

One transaction: receive one message of queue ``orders`` from the embedded cursor (its branch
carried by the database's commit) and insert its body into table ``slow``, whose deferred
trigger makes the COMMIT take seconds. Prints ``COMMITTING <body>`` before the commit starts; the
test kills the process meanwhile, so the server finishes the commit of a process that is gone.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find the repo

from sqlalchemy import create_engine, text

from coordinator import FileDecisionLog, TransactionManager
from resource_managers.cursor import Cursor, CursorResource
from resource_managers.postgres import PostgresResource


def main(url: str, log: str, directory: str) -> int:
    engine = create_engine(url)
    cursor = Cursor(directory, lazy_delay=60.0)
    db = PostgresResource(engine, "db", last_resource=True)
    cr = CursorResource(cursor)
    tm = TransactionManager(
        "node-1", FileDecisionLog(log), [db, cr], recovery_interval=None, reaper_interval=None
    )
    with tm.transaction() as tx:
        got = tx.join(cr).receive("orders")
        assert got is not None
        tx.join(db).execute(text("INSERT INTO slow (body) VALUES (:b)"), {"b": got.body.decode()})
        print(f"COMMITTING {got.body.decode()}", flush=True)
    print("COMMITTED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
