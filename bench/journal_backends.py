"""The cost of one forced record: the file journal's write+fsync against a PostgreSQL-backed append
(one ``INSERT`` and ``COMMIT`` with ``synchronous_commit=on``), the number `docs/scale.md` rests
its high-availability choice on.

Both run on the same filesystem (the file journal in a temporary directory beside the throwaway
PostgreSQL cluster's data directory, both under ``--dir``), with 1 and 8 concurrent writers: the
file journal group-commits (one fsync for every record that arrived during the previous one),
PostgreSQL flushes its WAL for every commit waiting at that moment. A record is 200 bytes, the
size of a message log's commit record. Prints a table (``--json``: one object) and never asserts:
the figures depend on the disk. This measures a single PostgreSQL server; synchronous streaming
replication adds a network round trip to a standby and its WAL flush to every commit.

    python bench/journal_backends.py [--records 2000] [--writers 1 8] [--dir PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg2

from coordinator.journal import Journal
from resource_managers.throwaway import PostgresServer

PAYLOAD = b"x" * 200


def run_threads(writers: int, records: int, append: Callable[[int], None]) -> float:
    """Seconds for ``writers`` threads to append ``records`` records between them."""
    per = records // writers
    barrier = threading.Barrier(writers + 1)

    def work(index: int) -> None:
        barrier.wait()
        for _ in range(per):
            append(index)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def file_journal(directory: Path, writers: int, records: int) -> dict[str, Any]:
    path = Path(tempfile.mkdtemp(prefix="journal-", dir=directory))
    journal = Journal(path)
    try:
        seconds = run_threads(writers, records, lambda _i: journal.append(PAYLOAD, True))
        fsyncs = journal.stats().fsyncs
    finally:
        journal.close()
        shutil.rmtree(path)
    return _row("file journal (write+fsync, group commit)", writers, records, seconds, fsyncs)


def postgres(dsn: str, writers: int, records: int) -> dict[str, Any]:
    conns = [psycopg2.connect(dsn) for _ in range(writers)]
    try:
        with conns[0].cursor() as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS journal (id bigserial PRIMARY KEY, r bytea)")
        conns[0].commit()
        for conn in conns:
            with conn.cursor() as cur:
                cur.execute("SET synchronous_commit = on")
            conn.commit()

        def append(index: int) -> None:
            conn = conns[index]
            with conn.cursor() as cur:
                cur.execute("INSERT INTO journal (r) VALUES (%s)", (PAYLOAD,))
            conn.commit()

        seconds = run_threads(writers, records, append)
    finally:
        for conn in conns:
            conn.close()
    return _row("PostgreSQL INSERT+COMMIT (synchronous_commit=on)", writers, records, seconds, None)


def _row(
    what: str, writers: int, records: int, seconds: float, fsyncs: int | None
) -> dict[str, Any]:
    done = records // writers * writers
    return {
        "backend": what,
        "writers": writers,
        "records": done,
        "seconds": round(seconds, 3),
        "records_per_s": round(done / seconds),
        "us_per_record": round(seconds / done * 1e6, 1),
        "fsyncs": fsyncs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dir", type=Path, default=None, help="where both live (default: /tmp)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="twopc-journal-bench-", dir=args.dir))
    os.chmod(base, 0o755)  # the cluster may run as another user (PostgreSQL refuses root)
    server = PostgresServer(base / "pg").start()
    rows: list[dict[str, Any]] = []
    try:
        for writers in args.writers:
            rows.append(file_journal(base, writers, args.records))
            rows.append(postgres(server.dsn(), writers, args.records))
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    ratios = {
        str(w): round(
            next(r for r in rows if r["writers"] == w and r["fsyncs"] is None)["us_per_record"]
            / next(r for r in rows if r["writers"] == w and r["fsyncs"] is not None)[
                "us_per_record"
            ],
            2,
        )
        for w in args.writers
    }
    if args.json:
        print(json.dumps({"filesystem": str(base.parent), "rows": rows, "pg_over_file": ratios}))
        return 0
    print(f"filesystem of {base.parent}; {len(PAYLOAD)}-byte records")
    for r in rows:
        print(f"{r['backend']:<52} writers={r['writers']:<3} {r['records_per_s']:>7} rec/s "
              f"{r['us_per_record']:>8} us/rec fsyncs={r['fsyncs']}")  # fmt: skip
    for w, ratio in ratios.items():
        print(f"PostgreSQL / file journal, time per record, {w} writer(s): {ratio}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
