"""Sequential against parallel prepare/commit, and asynchronous phase two, with each database a
few milliseconds away.

On one machine a round trip to PostgreSQL costs tens of microseconds, so overlapping the two
databases' prepares and commits (``parallel=True``) buys nothing and the pool hop it needs costs
CPU. With real distance between the coordinator and its databases the round trips dominate, and
overlapping them should pay. This script puts a `DelayProxy` (``delay_ms`` each way, on loopback)
in front of each of two databases on one throwaway cluster and runs the rows of
``postgres_2pc.py`` through them: ``bare`` (psycopg2 2PC, the baseline), ``file`` (sequential),
``file-par`` (parallel) and ``file-async`` (phase two behind the caller), at 1 and 8 threads, for
each delay. The numbers pick the defaults (see docs/concepts.md).

    python bench/postgres_delay.py [--delays 0,1,3] [--seconds 3] [--threads 1,8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from delay_proxy import DelayProxy  # type: ignore[import-not-found]
from postgres_2pc import ROW, Env, prepare_databases, run_row  # type: ignore[import-not-found]
from sqlalchemy.engine import make_url

from resource_managers.throwaway import PostgresServer

ROWS = ("bare", "file", "file-par", "file-async")


def through(url: str, proxy: DelayProxy) -> str:
    host, port = proxy.address
    return make_url(url).set(host=host, port=port).render_as_string(hide_password=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", default="0,1,3", help="one-way delays in ms (0,1,3)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--threads", default="1,8")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    server = PostgresServer().start()
    log_root = Path(tempfile.mkdtemp(prefix="twopc-bench-delay-"))
    out = []
    try:
        url_a, url_b = (server.url(server.create_database(n)) for n in ("bench_a", "bench_b"))
        prepare_databases(Env(url_a, url_b, None, False, 60.0, log_root))
        print(f"{'delay':>6} {'threads':>7} " + " ".join(f"{r:>11}" for r in ROWS) + "  (tx/s)")
        for delay in delays:
            upstream = make_url(url_a)
            target = (upstream.host or "127.0.0.1", upstream.port or 5432)
            with DelayProxy(target, delay) as pa, DelayProxy(target, delay) as pb:
                env = Env(through(url_a, pa), through(url_b, pb), None, False, 60.0, log_root)
                for n in threads:
                    tps = {row: run_row(env, ROW[row], n, args.seconds, args.warmup).tps
                           for row in ROWS}  # fmt: skip
                    cells = " ".join(f"{tps[r]:>11,.0f}" for r in ROWS)
                    ratios = ", ".join(f"{r} {tps[r] / tps['bare']:.2f}x" for r in ROWS[1:])
                    print(f"{delay:>5}ms {n:>7} {cells}  ({ratios} bare)")
                    out += [{"row": r, "delay_ms": delay, "threads": n, "tps": round(tps[r], 1)}
                            for r in ROWS]  # fmt: skip
    finally:
        server.remove()
        shutil.rmtree(log_root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
