"""The consuming process of the pre-counted delivery crash tests (killed with SIGKILL).

    python tests/crash/precount_worker.py --cursor DIR --state DIR --ledger FILE
        [--queue Q] [--batch B] [--two-phase] [--poison BODY] [--precount K]
        [--max-deliveries L] [--forced-commit]

Opens the cursor in ``--cursor`` embedded (the process owns its journal, so a kill -9 leaves
exactly what the journal says), a `TransactionManager` with a file decision log in ``--state``
that recovers on start, and consumes ``Q`` until it is empty: one transaction per receive of up
to ``B`` messages. The handler appends ``<body> <delivery_count>`` to ``--ledger`` (flushed: the
ledger is what the application did, committed or not). One-phase (the cursor alone) by default;
``--two-phase`` also adds 1 to key ``<body>`` of a `FileResource` (``<state>/ledger``) in the
same transaction, so the cursor prepares (``P``) and commits (``C``), and the file resource says
which handlings committed. ``--poison BODY``: the handler kills its own process (SIGKILL) when
it gets that message, every time, as a consumer crashing on a poison message does.
``--forced-commit``: the cursor's phase-two ``C`` is forced (``lazy_commit=False``).

Prints ``DONE <handled>`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find the repo

from coordinator import FileDecisionLog, TransactionManager
from resource_managers.cursor import Cursor, CursorResource
from tests.support.file_resource import FileResource


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cursor", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--queue", default="orders")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--two-phase", action="store_true")
    parser.add_argument("--poison")
    parser.add_argument("--precount", type=int, default=1)
    parser.add_argument("--max-deliveries", type=int, default=5)
    parser.add_argument("--forced-commit", action="store_true")
    args = parser.parse_args(argv)

    cursor = Cursor(args.cursor, precount=args.precount, max_deliveries=args.max_deliveries)
    resource = CursorResource(
        cursor, "cursor", args.max_deliveries, lazy_commit=not args.forced_commit
    )
    resources: list[Any] = [resource]
    state = Path(args.state)
    state.mkdir(parents=True, exist_ok=True)
    files = FileResource("files", state / "ledger") if args.two_phase else None
    if files is not None:
        resources.append(files)
    tm = TransactionManager(
        "precount-worker", FileDecisionLog(state / "tmlog"), resources,
        recovery_interval=None, reaper_interval=None, recover_on_start=False,
    )  # fmt: skip
    while not tm.recover(force=True).clean:  # what a crash left decided is finished first
        time.sleep(0.1)
    handled = 0
    with open(args.ledger, "a") as ledger:
        while True:
            with tm.transaction() as tx:
                got = tx.join(resource).receive_many(args.queue, args.batch)
                for d in got:
                    body = d.body.decode()
                    ledger.write(f"{body} {d.delivery_count}\n")
                    ledger.flush()
                    handled += 1
                    if body == args.poison:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if files is not None:
                        tx.join(files).add(body, 1)
            if not got:
                break
    tm.close()
    cursor.close()
    print("DONE", handled, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
