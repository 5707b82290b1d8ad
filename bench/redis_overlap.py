"""What overlapping Redis round trips saves per transaction, measured so that a busy machine cannot
fake it: the same transaction through two managers, alternated one transaction at a time.

One manager's Redis resources overlap their round trips: the prepare script is sent before the
other branches prepare and read after them (`coordinator.early_prepare`), and the commit scripts
of branches on one client go out as one pipeline (`coordinator.batch_commit`). The other's are
`OneByOne` (``redis_2pc.py``): every call waited for in turn, as before those two. Both run on the
same servers, one client thread, and take turns transaction by transaction, so load that comes and
goes on a shared machine falls on both alike; the table gives each one's median and mean latency
(ms), their ratio, and this process's CPU per transaction (us). Shapes (every Redis write blind;
PostgreSQL one INSERT):

- ``2pc``: PostgreSQL + Redis, file decision log: Redis's prepare overlaps PREPARE TRANSACTION.
- ``2pc-2r``: PostgreSQL + two Redis resources on one client: both prepares overlap PostgreSQL's,
  both commits are one pipeline.
- ``llr-2r``: PostgreSQL as the last resource + two Redis resources on one client: the two
  prepares overlap each other, the two commits are one pipeline.
- ``llr``: PostgreSQL as the last resource + Redis: nothing to overlap (the last resource's commit
  must wait for Redis's vote), so the ratio shows the cost of the machinery alone.

    python bench/redis_overlap.py [--count 2000] [--shapes 2pc,llr]

Servers are throwaway (``TMPDIR`` places their data: on tmpfs the fsyncs cost nothing and only
round trips and CPU remain), unless ``--redis-url``/``--pg-url`` are given.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
from redis_2pc import CORE_INSERT, PAYLOAD, Bench, OneByOne, prepare_database, servers

from coordinator import TransactionManager
from resource_managers.postgres import PostgresResource
from resource_managers.redis import RedisResource

SHAPES = {"2pc": (False, 1), "2pc-2r": (False, 2), "llr-2r": (True, 2), "llr": (True, 1)}


def transaction(
    bench: Bench, r: redis.Redis, last: bool, redises: int, kind: type[RedisResource]
) -> tuple[TransactionManager, Callable[[int], None]]:
    """A manager over PostgreSQL and ``redises`` Redis resources of ``kind``, and one
    transaction's work through it."""
    namespace = f"overlap-{uuid.uuid4().hex[:8]}"
    db = PostgresResource(bench.engine(1), "pg", last_resource=last)
    caches = [kind(r, f"redis{n}", namespace=namespace, blind_writes=True) for n in range(redises)]
    tm = bench.manager([db, *caches])
    base = f"{namespace}:".encode()

    def one(n: int) -> None:
        with tm.transaction() as tx:
            tx.join(db).execute(CORE_INSERT, {"payload": PAYLOAD})
            for index, cache in enumerate(caches):
                branch = tx.join(cache)
                branch.incrby(base + b"%d" % index, 1)
                branch.set(base + b"m%d" % index, n)

    return tm, one


def measure(bench: Bench, shape: str, count: int) -> str:
    last, redises = SHAPES[shape]
    r = bench.redis()
    runs = {
        name: transaction(bench, r, last, redises, kind)
        for name, kind in (("overlapped", RedisResource), ("one-by-one", OneByOne))
    }
    took: dict[str, list[float]] = {name: [] for name in runs}
    cpu = dict.fromkeys(runs, 0.0)
    try:
        for n in range(count + 100):
            for name, (_, one) in runs.items() if n % 2 else reversed(runs.items()):
                started, used = time.perf_counter(), time.process_time()
                one(n)
                if n >= 100:  # the first 100 of each warm up
                    took[name].append((time.perf_counter() - started) * 1e3)
                    cpu[name] += time.process_time() - used
    finally:
        for tm, _ in runs.values():
            tm.close()
        r.close()
    p50 = {name: statistics.median(ms) for name, ms in took.items()}
    mean = {name: statistics.mean(ms) for name, ms in took.items()}
    return (
        f"{shape:<7} {p50['overlapped']:>8.3f} {p50['one-by-one']:>8.3f} "
        f"{p50['overlapped'] / p50['one-by-one']:>6.2f}x   {mean['overlapped']:>8.3f} "
        f"{mean['one-by-one']:>8.3f} {mean['overlapped'] / mean['one-by-one']:>6.2f}x   "
        f"{cpu['overlapped'] / count * 1e6:>7.0f} {cpu['one-by-one'] / count * 1e6:>7.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=2000, help="transactions per manager (2000)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--redis-url", help="redis:// URL (default: a throwaway redis-server)")
    parser.add_argument("--pg-url", help="SQLAlchemy URL of a database (default: throwaway)")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        raise SystemExit(f"unknown shapes {sorted(unknown)}; the shapes are {', '.join(SHAPES)}")
    with contextlib.ExitStack() as stack:
        log_root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="twopc-ovl-")))
        redis_url, pg_url = stack.enter_context(servers(args))
        bench = Bench(redis_url, pg_url, None, log_root)
        prepare_database(bench)
        print(f"{args.count} transactions per manager, alternated; latency in ms, 1 thread")
        print(f"{'shape':<7} {'p50 ovl':>8} {'p50 1by1':>8} {'ratio':>7}   {'mean ovl':>8} "
              f"{'mean 1by1':>8} {'ratio':>7}   {'cpu ovl':>7} {'cpu 1by1':>7}")  # fmt: skip
        for shape in shapes:
            print(measure(bench, shape, args.count), flush=True)


if __name__ == "__main__":
    main()
