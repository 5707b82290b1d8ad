"""The process the message log crash tests kill: producers that send inside PostgreSQL transactions.

    python tests/crash/mlog_worker.py run     --db URL --log DIR --mlog DIR --count N [--start S]
        [--llr [--no-carry]] [--durable-commit]
    python tests/crash/mlog_worker.py recover --db URL --log DIR --mlog DIR

``run``: N transactions (i from S), each inserting ``transfers`` row ``m<i>`` in the database
(resource ``db``) and sending body ``m<i>`` to destination ``orders`` of the message log (resource
``mlog``, crash points ``mlog.mlog.*``); the coordinator's decision log is a `FileDecisionLog`.
``--llr``: the database is the logging last resource (its commit carries the decision and the
log's branch: `coordinator.carried`); ``--no-carry``: the log's branch prepares instead;
``--durable-commit``: the log forces its commit record instead of writing it lazily.
Printed, flushed (a SIGKILL loses nothing printed): ``ACK m<i>`` once commit returned, ``DONE``.
``recover``: a new manager over the same logs recovers on start, then prints ``STATE <json>``:
the stream's ``pending`` ``[seq, body]`` pairs, ``prepared`` gids left in the log, the
database's ``rows``, the gids the log still ``remembered`` of carried commits and the commit
``decision_rows`` left (both 0 once a second recovery pass has cleaned up). Crashes come from
``TWOPC_CRASH_AT`` (`coordinator.crashpoints`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from sqlalchemy import create_engine, text

from coordinator import FileDecisionLog, TransactionManager
from resource_managers.message_log import MessageLog, MessageLogResource, ProducerBranch
from resource_managers.postgres import PostgresResource


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("run", "recover"))
    parser.add_argument("--db", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--mlog", required=True)
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--llr", action="store_true", help="the database is the last resource")
    parser.add_argument("--durable-commit", action="store_true", help="force the log's commit")
    parser.add_argument("--no-carry", action="store_true", help="the log's branch prepares")
    args = parser.parse_args(argv)
    engine = create_engine(args.db)
    # no fsync of its own for a lazy commit record: the next transaction's prepare carries it
    # (or close), so each crash point is reached once per transaction, in order
    mlog = MessageLog(args.mlog, lazy_delay=60.0)
    db = PostgresResource(engine, "db", last_resource=args.llr)
    mr = MessageLogResource(
        mlog, lazy_commit=not args.durable_commit, rides_last_resource=not args.no_carry
    )
    tm = TransactionManager(
        "node-1", FileDecisionLog(args.log), [db, mr], recovery_interval=None, reaper_interval=None
    )
    try:
        if args.mode == "run":
            for i in range(args.start, args.start + args.count):
                with tm.transaction() as tx:
                    tx.join(db).execute(
                        text("INSERT INTO transfers (id, amount) VALUES (:t, 1)"), {"t": f"m{i}"}
                    )
                    branch: ProducerBranch = tx.join(mr)
                    branch.send("orders", f"m{i}".encode())
                print(f"ACK m{i}", flush=True)
                if args.llr and not args.no_carry:
                    # a carried branch writes no prepare to carry the last one's lazy record:
                    # flush it here, as its LazyWatch would a moment later
                    mr.flush_commits()
            print("DONE", flush=True)
        else:
            tm.recover(force=True)  # a second pass: the first one's restores are settled
            with engine.connect() as conn:
                rows = sorted(conn.execute(text("SELECT id FROM transfers")).scalars())
                decisions = 0
                if args.llr:
                    decisions = conn.execute(
                        text("SELECT count(*) FROM twopc_decision_row WHERE outcome = 'c'")
                    ).scalar_one()
            state = {
                "pending": [[seq, m.body.decode()] for seq, m in mlog.pending("orders")],
                "prepared": mlog.prepared_gids(),
                "rows": rows,
                "remembered": sorted(mlog.carried_gids()),
                "decision_rows": decisions,
            }
            print("STATE " + json.dumps(state), flush=True)
    finally:
        tm.close()
        mlog.close()
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
