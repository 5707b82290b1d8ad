"""Forced cursor records per consumed message at one message per transaction.

    python bench/cursor_records.py [--messages N]

A consumer receives and commits one message per transaction from an embedded cursor, one-phase
(the cursor alone) and two-phase (a second cursor branch in the same transaction), with the
cursor's pre-counted deliveries off (``precount=0``: every receive forces its own ``H``) and on
(the default), and the phase-two commit record lazy or forced; then one-phase with 4 consumers
competing for the queue, whose receives a window of 1 pre-counts only in part (a window as large
as the number of consumers covers them all). Printed per row: the cursor's forced records, fsyncs
and lazy records per message (`Cursor.stats`), and msg/s (small runs on a shared machine: read
the record counts, not the speed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find the repo

from coordinator import FileDecisionLog, TransactionManager
from resource_managers.cursor import DEFAULT_PRECOUNT, Cursor, CursorResource
from resource_managers.message_log import Message
from resource_managers.sequencing import Frame


def fill(cursor: Cursor, n: int, queue: str) -> None:
    items = []
    for seq in range(1, n + 1):
        m = Message(uuid.uuid4().hex, queue, b"x" * 256)
        items.append((Frame(queue, 1, seq, seq - 1, m.message_id), m))
    cursor.deliver_many(items)


def row(n: int, two_phase: bool, precount: int, lazy_commit: bool, consumers: int = 1) -> str:
    work = Path(tempfile.mkdtemp(prefix="twopc-bench-cursor-"))
    cursor = Cursor(work / "c", precount=precount)
    fill(cursor, n, "orders")
    resources = [CursorResource(cursor, "cursor", lazy_commit=lazy_commit)]
    other = Cursor(work / "o") if two_phase else None
    if other is not None:
        fill(other, n, "other")
        resources.append(CursorResource(other, "other"))
    tm = TransactionManager("bench", FileDecisionLog(work / "log"), resources,
                            recovery_interval=None, reaper_interval=None)  # fmt: skip

    def consume() -> None:
        while True:
            with tm.transaction() as tx:
                if tx.join(resources[0]).receive("orders") is None:
                    return
                if other is not None:
                    tx.join(resources[1]).receive("other")

    before, started = cursor.stats(), time.perf_counter()
    threads = [threading.Thread(target=consume) for _ in range(consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tm.close()
    seconds = time.perf_counter() - started
    after = cursor.stats()
    cursor.close()
    if other is not None:
        other.close()
    kind = "two-phase" if two_phase else "one-phase" if consumers == 1 else f"1pc {consumers} cons."
    commit = "" if not two_phase else (" lazy C" if lazy_commit else " forced C")
    return (f"{kind + commit:<20} precount {precount:<3} "
            f"forced/msg {(after.forced_records - before.forced_records) / n:5.2f}  "
            f"fsyncs/msg {(after.fsyncs - before.fsyncs) / n:5.2f}  "
            f"lazy/msg {(after.lazy_records - before.lazy_records) / n:5.2f}  "
            f"{n / seconds:8,.0f} msg/s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=500)
    args = parser.parse_args(argv)
    for two_phase, lazy in ((False, True), (True, False), (True, True)):
        for precount in (0, DEFAULT_PRECOUNT):
            print(row(args.messages, two_phase, precount, lazy), flush=True)
    for precount in (0, DEFAULT_PRECOUNT, 4):
        print(row(args.messages, False, precount, True, consumers=4), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
