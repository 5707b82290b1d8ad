"""``twopc demo``: the command (thin); the scenario lives in `twopc_demo.scenario`."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from coordinator import ConfigurationError

from .bank import CRASH_AT
from .scenario import demo, setup
from .stores import Unusable, find_cluster, find_redis


def register(sub: Any) -> None:
    """Entry point of the ``twopc.commands`` group."""
    p = sub.add_parser(
        "demo",
        help="transfers between PostgreSQL and Redis with a message each, a crash, recovery, "
        "exactly-once delivery, an audit",
    )
    p.add_argument(
        "--transfers", type=int, default=10, metavar="N", help="transfers to attempt (default 10)"
    )
    p.add_argument(
        "--crash-at",
        default=CRASH_AT,
        metavar="NAME[:NTH]",
        help=f"crash point that kills the service (default {CRASH_AT})",
    )
    p.add_argument("--keep", action="store_true", help="keep the servers and the log; print them")
    p.add_argument(
        "--spark",
        action="store_true",
        help="instead: a Spark streaming job into PostgreSQL and Redis, its driver killed after a "
        "decision, restarted on its checkpoint, audited (needs the spark extra and Java)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.spark:
        if importlib.util.find_spec("pyspark") is None:
            raise ConfigurationError(
                "twopc demo --spark needs the spark extra (and Java 17+): "
                "pip install 'twopc[spark]'"
            )
        from . import spark  # noqa: PLC0415 - only --spark pays for the Spark demo's imports

        return spark.run(args)
    try:
        import psycopg2  # noqa: PLC0415, F401
        import redis  # noqa: PLC0415, F401
        import sqlalchemy  # noqa: PLC0415, F401
    except ImportError:
        raise ConfigurationError(
            "twopc demo needs the extras: pip install 'twopc[postgres,redis]'"
        ) from None
    try:
        store = find_redis()
        try:
            cluster = find_cluster()
        except BaseException:
            store.release()
            raise
        with setup(cluster, store, args.keep) as state:
            return demo(state, args)
    except Unusable as exc:  # one line with its code, as every command's failure
        raise ConfigurationError(f"twopc demo: {exc}") from exc
