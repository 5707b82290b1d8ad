"""Instructions per producer transaction at 1 message per transaction, layer by layer (callgrind).

Issue 14 asks why `twopc-eo` is slower than the outbox at 1 message per transaction. Wall time on
a shared two-core machine cannot separate the layers; instruction counts can (repeatable to a
fraction of a per cent). Each row runs the producer side of `bench/messaging.py` (one ``produced``
row of 256 bytes and, where the row has a log, one message) twice under
``valgrind --tool=callgrind`` (100 and 400 transactions) against a throwaway PostgreSQL; the
difference divided by 300 cancels start-up. Only this Python process is counted: the server's
work and the waits (round trips, fsyncs) are not instructions of it.

- ``psycopg2``: the outbox's client: one ``INSERT`` and a ``COMMIT`` on a plain connection.
- ``sqlalchemy``: the same through SQLAlchemy Core (``engine.begin()``, ``conn.execute(text)``).
- ``twopc pg``: a transaction with the PostgreSQL branch alone (the last resource, one phase).
- ``twopc log``: a transaction with the message-log branch alone (one phase, one forced record).
- ``twopc eo``: both: PostgreSQL's commit carrying the decision and the log's branch (its
  staged messages in the decision row, `coordinator.carried`), the log's commit record lazy:
  `twopc-eo`'s producer.
- ``twopc eo prepared``: the same with the log's branch prepared (a forced record) before that
  commit (``rides_last_resource=False``): the path before carried branches.
- ``twopc eo dbapi``: the same, the row written through the branch's driver connection
  (``pg.dbapi_connection(tx)``, a lean handle) instead of SQLAlchemy Core.

    python bench/producer_instructions.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = (100, 400)
ROWS = (
    "psycopg2",
    "sqlalchemy",
    "twopc pg",
    "twopc log",
    "twopc eo",
    "twopc eo prepared",
    "twopc eo dbapi",
)

CHILD = """
import os, sys, tempfile, uuid
from pathlib import Path
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
import messaging_baselines as base
from sqlalchemy import create_engine, text
from coordinator import FileDecisionLog, TransactionManager
from resource_managers.message_log import MessageLog, MessageLogResource
from resource_managers.postgres import PostgresResource
row, n, dsn, url = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
INSERT = ("INSERT INTO produced (id, body) SELECT * FROM unnest(CAST(:ids AS text[]), "
          "CAST(:bodies AS bytea[]))")
prefix, body = uuid.uuid4().hex[:12], os.urandom(256)
if row == "psycopg2":
    conn = base._connect(dsn)
    with conn.cursor() as cur:
        for i in range(n):
            cur.execute(INSERT.replace(":ids", "%(ids)s").replace(":bodies", "%(bodies)s"),
                        {{"ids": [f"{{prefix}}-{{i}}"], "bodies": [body]}})
            conn.commit()
    conn.close()
    raise SystemExit(0)
engine = create_engine(url, pool_size=2)
statement = text(INSERT)
if row == "sqlalchemy":
    for i in range(n):
        with engine.begin() as conn:
            conn.execute(statement, {{"ids": [f"{{prefix}}-{{i}}"], "bodies": [body]}})
    raise SystemExit(0)
work = Path(tempfile.mkdtemp())
mlog = MessageLog(work / "log")
log_res = MessageLogResource(mlog, "mlog", rides_last_resource=row != "twopc eo prepared")
pg = PostgresResource(engine, "pg", last_resource=True)
resources = {{"twopc pg": [pg], "twopc log": [log_res], "twopc eo": [log_res, pg],
              "twopc eo prepared": [log_res, pg], "twopc eo dbapi": [log_res, pg]}}[row]
RAW = INSERT.replace(":ids", "%(ids)s").replace(":bodies", "%(bodies)s")
tm = TransactionManager("p", FileDecisionLog(work / "txlog"), resources,
                        recovery_interval=None, reaper_interval=None, inline_completion=True)
for i in range(n):
    with tm.transaction() as tx:
        if row == "twopc eo dbapi":
            with pg.dbapi_connection(tx).cursor() as cur:
                cur.execute(RAW, {{"ids": [f"{{prefix}}-{{i}}"], "bodies": [body]}})
        elif pg in resources:
            pg.connection(tx).execute(statement, {{"ids": [f"{{prefix}}-{{i}}"], "bodies": [body]}})
        if log_res in resources:
            tx.join(log_res).send("bench", body, headers={{"id": f"{{prefix}}-{{i}}"}})
tm.close()
mlog.close()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"a subset of {','.join(ROWS)}")
    args = parser.parse_args()
    chosen = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not chosen or set(chosen) - set(ROWS):
        parser.error(f"--rows: unknown rows {sorted(set(chosen) - set(ROWS))}")
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import messaging_baselines as base  # type: ignore[import-not-found]
    from coordinator_instructions import instructions  # type: ignore[import-not-found]

    from resource_managers.throwaway import PostgresServer

    rows = []
    server = PostgresServer()
    try:
        server.start()
        database = server.create_database("producer_instructions")
        dsn = server.dsn(database)
        base.prepare_tables(dsn)
        url = server.url(database)
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "child.py"
            script.write_text(CHILD.format(root=str(ROOT), bench=str(ROOT / "bench")))
            for row in chosen:
                low, high = (instructions(script, row, n, dsn, url) for n in RUNS)
                per_tx = (high - low) // (RUNS[1] - RUNS[0])
                rows.append({"row": row, "instructions_per_tx": per_tx})
                print(f"{row:<15} {per_tx:>10,} instructions per transaction", flush=True)
    finally:
        server.remove()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
