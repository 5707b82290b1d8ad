"""What one Redis branch costs per transaction: round trips, server commands and client CPU.

The tx/s rows of ``redis_2pc.py`` say how fast; this says why. For a few shapes of transaction
(each against a throwaway ``redis-server`` with ``appendfsync always``, one thread, no key
contention) it counts, per committed transaction:

- ``trips``: commands this process sent to Redis and waited for (a pipeline counts once);
- ``scripts``: ``FCALL``/``EVALSHA`` calls among them, from the server's ``INFO commandstats``;
- ``cpu us``: this process's CPU per transaction (``time.process_time``), the median of 5 runs.

Shapes: ``lua`` (the reference: one ``EVALSHA`` of a script making the three writes below),
``tx-only`` (a transaction that joins a Redis branch and writes nothing: the coordinator's share),
``1phase`` (blind ``incrby a``, ``incrby b``, ``set m``; the only participant, so one phase),
``1phase-rd`` (the same with reads: each ``incrby`` returns the new value), ``read``
(``get`` of an untouched key, ``incrby a`` then ``get a``), ``2pc-2r`` (two Redis resources, one
write each, so two phases and two branches to commit).

    python bench/redis_branch_cost.py [--count 2000] [--callgrind]

``--callgrind`` reruns each shape under ``valgrind --tool=callgrind`` (with ``--count 200``) and
prints instructions per transaction: a CPU figure that does not move with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
from redis.connection import Connection

from coordinator import FileDecisionLog, TransactionManager
from resource_managers.redis import RedisResource
from resource_managers.throwaway import RedisServer

#: the reference: Redis's own atomic way to make the three writes (as in ``redis_2pc.py``)
LUA_APPLY = """
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('INCRBY', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
return 1
"""
TRIPS = [0]
_send = Connection.send_packed_command


def _counting_send(self: Connection, command: Any, check_health: bool = True) -> None:
    TRIPS[0] += 1
    _send(self, command, check_health)


Connection.send_packed_command = _counting_send  # type: ignore[method-assign]


def manager(resources: list[Any], root: Path) -> TransactionManager:
    node = f"cost-{uuid.uuid4().hex[:8]}"
    return TransactionManager(
        node,
        FileDecisionLog(Path(tempfile.mkdtemp(dir=root)) / "log"),
        resources,
        recovery_interval=None,
        reaper_interval=None,
        default_timeout=None,
    )


def shapes(client: redis.Redis, root: Path) -> dict[str, Callable[[int], None]]:
    def resource(name: str, blind: bool) -> RedisResource:
        return RedisResource(
            client, name, namespace=f"cost-{uuid.uuid4().hex[:6]}", blind_writes=blind
        )

    blind, reading = resource("r", True), resource("r", False)
    tm_blind, tm_reading = manager([blind], root), manager([reading], root)
    first, second = resource("r1", True), resource("r2", True)
    tm_two = manager([first, second], root)
    base = f"cost:{uuid.uuid4().hex[:6]}:".encode()

    def three_writes(
        tm: TransactionManager, res: RedisResource, tag: bytes
    ) -> Callable[[int], None]:
        def one(n: int) -> None:
            with tm.transaction() as tx:
                branch = tx.join(res)
                branch.incrby(base + tag + b"a", 1)
                branch.incrby(base + tag + b"b", 1)
                branch.set(base + tag + b"m", n)

        return one

    def read(n: int) -> None:
        with tm_reading.transaction() as tx:
            branch = tx.join(reading)
            branch.get(base + b"x")
            branch.incrby(base + b"ga", 1)
            branch.get(base + b"ga")

    def two(n: int) -> None:
        with tm_two.transaction() as tx:
            tx.join(first).incrby(base + b"2a", 1)
            tx.join(second).incrby(base + b"2b", 1)

    sha = client.script_load(LUA_APPLY)

    def lua(n: int) -> None:
        client.execute_command("EVALSHA", sha, 3, base + b"la", base + b"lb", base + b"lm", 1, n)

    def empty(n: int) -> None:
        with tm_blind.transaction() as tx:
            tx.join(blind)

    return {
        "lua": lua,
        "tx-only": empty,
        "1phase": three_writes(tm_blind, blind, b"w"),
        "1phase-rd": three_writes(tm_reading, reading, b"r"),
        "read": read,
        "2pc-2r": two,
    }


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(
        int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_fcall", "cmdstat_evalsha")
    )


def measure(name: str, one: Callable[[int], None], client: redis.Redis, count: int) -> str:
    for n in range(200):  # warm up: scripts loaded, durability checked, caches filled
        one(n)
    client.config_resetstat()
    TRIPS[0] = 0
    cpu = []
    for _ in range(5):
        started = time.process_time()
        for n in range(count):
            one(n)
        cpu.append((time.process_time() - started) / count * 1e6)
    total = 5 * count
    trips = max(0, TRIPS[0] - 2) / total  # minus CONFIG RESETSTAT and INFO
    scripts = script_calls(client) / total
    return f"{name:<10} {trips:>6.2f} {scripts:>8.2f} {statistics.median(cpu):>8.0f}"


def callgrind(shape: str, count: int) -> int:
    """Instructions per transaction of ``shape`` (``count`` of them, minus a 0-count run)."""

    def instructions(n: int) -> int:
        out = tempfile.mktemp(prefix="callgrind-")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--only",
                shape,
                "--count",
                str(n),
            ],
            check=True,
            capture_output=True,
        )
        text = Path(out).read_text(errors="replace")
        os.unlink(out)
        match = re.search(r"^totals:\s*(\d+)", text, re.M) or re.search(
            r"^summary:\s*(\d+)", text, re.M
        )
        assert match is not None
        return int(match.group(1))

    return (instructions(count) - instructions(0)) // count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=2000, help="transactions per run (2000)")
    parser.add_argument("--callgrind", action="store_true", help="also count instructions")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # one shape, no report: for callgrind
    parser.add_argument("--redis-url", help="redis:// URL (default: a throwaway redis-server)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="twopc-cost-"))
    server = None
    try:
        url = args.redis_url
        if url is None:
            server = RedisServer().start()
            url = server.url()
        client = redis.Redis.from_url(url)
        table = shapes(client, root)
        if args.only:
            for n in range(50 + args.count):
                table[args.only](n)
            return
        print(f"{'shape':<10} {'trips':>6} {'scripts':>8} {'cpu us':>8}   (per transaction)")
        for name, one in table.items():
            print(measure(name, one, client, args.count))
        if args.callgrind:
            print("\ninstructions per transaction (callgrind, client process only):")
            for name in table:
                print(f"{name:<10} {callgrind(name, 200):>12,}")
    finally:
        if server is not None:
            server.remove()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
