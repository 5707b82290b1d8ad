"""The crash matrix through the asyncio API: a worker moving money from PostgreSQL to Redis with
`coordinator.aio` is killed with a real SIGKILL at a named crash point in its second transfer,
then a recovery pass with no event loop (the async resources' synchronous twins) settles what
the crash left. Checked on both stores:

- the interrupted transfer ended as the point implies (rolled back before the decision, committed
  after it), and the same way in PostgreSQL and in Redis (``atomicity``);
- the first transfer, acknowledged before the crash, stayed committed (``durable_ack``);
- nothing is left prepared: ``pg_prepared_xacts`` is empty, Redis's prepared set is empty, no
  lock or staged write set remains, nothing is pending in the decision log (``no_residue``);
- the money is conserved across the two stores.

Branches prepare and commit in name order: ``cache`` (Redis) first, then ``pg``.

Then the bank: eight tasks on one loop move money both ways between PostgreSQL accounts and Redis
balances until a SIGKILL at a random moment, three times over (each restart recovers first), and
one last recovery; every transfer must be on both sides or neither, each balance must be its
opening plus exactly its transfers, and nothing may be left prepared, staged or pending.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, make_url, text

from tests.crash.async_worker import ACCOUNTS, SCHEMA
from tests.crash.test_crash_matrix import killed_at

pytestmark = [pytest.mark.crash, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("async_worker.py")
OPENING = 1000
COMMITTED, ROLLED_BACK = "committed", "rolled-back"

#: every point a transfer of the async path reaches, in the order it reaches them
#: (`test_the_matrix_names_every_point_of_the_async_path` keeps this list whole)
SCENARIOS = [
    ("tm.before_prepare", ROLLED_BACK),  # the work done, nothing prepared
    ("redis.cache.after_stage", ROLLED_BACK),  # Redis's write set staged, no marker yet
    ("redis.cache.after_prepare_marker", ROLLED_BACK),  # inside Redis's prepare
    ("tm.after_prepare.1", ROLLED_BACK),  # Redis prepared, PostgreSQL not asked yet
    ("postgres.pg.after_prepare", ROLLED_BACK),  # both prepared, on the completion thread
    ("tm.after_prepare.2", ROLLED_BACK),  # both votes heard
    ("tm.before_decision_write", ROLLED_BACK),  # both prepared, no decision
    ("log.before_write", ROLLED_BACK),  # the decision's record not written
    ("log.after_write", COMMITTED),  # written, not fsynced: a killed process leaves it on disk
    ("log.after_fsync", COMMITTED),
    ("tm.after_decision_fsync", COMMITTED),  # decided, nobody told
    ("redis.cache.after_apply", COMMITTED),  # Redis applied its write set, marker not cleared
    ("tm.after_commit.1", COMMITTED),  # Redis committed, PostgreSQL still prepared
    ("tm.after_commit.2", COMMITTED),  # both committed, no END record
    ("tm.before_end_record", COMMITTED),
]
#: the first point whose kill leaves the decision on disk: every later one commits
DECIDED_AT = "log.after_write"


def worker(*args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    if crash_at:
        env["TWOPC_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def pg_query(url: str, sql: str) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)).all())
    finally:
        engine.dispose()


def fresh_database(make: Callable[[], str], first: int, last: int) -> tuple[str, str]:
    """A new database with the worker's schema and accounts ``first``..``last`` holding
    `OPENING`: its URL for psycopg2 (checks) and for psycopg 3 (the worker's async engine)."""
    sync_url = make()
    engine = create_engine(sync_url)
    with engine.begin() as conn:
        for statement in SCHEMA:
            conn.execute(text(statement))
        conn.execute(
            text("INSERT INTO accounts SELECT g, :o FROM generate_series(:f, :l) g"),
            {"o": OPENING, "f": first, "l": last},
        )
    engine.dispose()
    return sync_url, make_url(sync_url).set(drivername="postgresql+psycopg").render_as_string(False)


@pytest.mark.parametrize(("point", "expect"), SCENARIOS, ids=[p for p, _ in SCENARIOS])
def test_async_crash_then_recovery(
    point: str,
    expect: str,
    *,
    make_pg_database: Callable[[], str],
    redis_url: str,
    tmp_path: Path,
    crash_matrix: Any,
) -> None:
    sync_url, url = fresh_database(make_pg_database, 1, 1)
    common = ["--pg", url, "--redis", redis_url, "--log", str(tmp_path / "log")]

    run = worker("run", *common, "--count", "2", crash_at=f"{point}:2")
    killed_at(run, f"{point}:2")
    lines = [line.split() for line in run.stdout.splitlines()]
    begun = [words[1] for words in lines if words[0] == "BEGIN"]
    acked = [words[1] for words in lines if words[0] == "ACK"]
    assert len(begun) == 2 and len(acked) == 1 and acked[0] == begun[0], run.stdout
    first, interrupted = begun

    recovery = worker("recover", *common)
    assert recovery.returncode == 0, recovery.stderr
    report = json.loads(recovery.stdout.split("RECOVERED ", 1)[1])
    assert not report["failures"] and not report["heuristics"], report

    rows = {str(r[0]) for r in pg_query(sync_url, "SELECT id FROM transfers")}
    balance = int(pg_query(sync_url, "SELECT balance FROM accounts WHERE id = 1")[0][0])
    prepared = pg_query(sync_url, "SELECT gid FROM pg_prepared_xacts")
    client = redis.Redis.from_url(redis_url)
    in_redis = int(client.get("balance") or 0)
    residue = [k for k in client.keys("twopc:*") if b":lock:" in k or b":ws:" in k]
    staged = client.zcard("twopc:{twopc}:prepared")

    problems = []
    in_pg, in_cache = interrupted in rows, client.exists(f"t:{interrupted}") == 1
    if in_pg != in_cache:
        problems.append(f"atomicity: {interrupted} in PostgreSQL {in_pg}, in Redis {in_cache}")
    ended = COMMITTED if in_pg and in_cache else ROLLED_BACK
    if ended != expect:
        problems.append(f"outcome: {interrupted} {ended}, expected {expect}")
    if first not in rows or not client.exists(f"t:{first}"):
        problems.append(f"durable_ack: acknowledged {first} is gone")
    if prepared or staged or residue or report["pending_after"]:
        problems.append(f"no_residue: {prepared} {staged} {residue} {report['pending_after']}")
    if balance + in_redis != OPENING:
        problems.append(f"conserved: {balance} + {in_redis} != {OPENING}")
    crash_matrix.add(
        point=f"async {point}",
        expected=expect,
        outcome=ended,
        resolved=f"{len(report['committed'])} commit, {len(report['rolled_back'])} abort",
        recovery_ms=None,
        verdict="ok" if not problems else "FAIL " + ",".join(p.split(":")[0] for p in problems),
    )
    assert not problems, "\n".join(problems)


def test_the_matrix_names_every_point_of_the_async_path(
    make_pg_database: Callable[[], str], redis_url: str, tmp_path: Path
) -> None:
    """The worker, traced (every crash point it reaches printed in order), reaches exactly the
    points of `SCENARIOS` in its second transfer, once each and in that order; the ones from the
    decision's write on are the ones expected to commit. A point added to the async path fails
    here until the matrix kills there too."""
    _, url = fresh_database(make_pg_database, 1, 1)
    common = ["--pg", url, "--redis", redis_url, "--log", str(tmp_path / "log")]
    run = worker("run", *common, "--count", "2", "--trace")
    assert run.returncode == 0, run.stderr
    lines = [line.split() for line in run.stdout.splitlines()]
    second_begin = [i for i, words in enumerate(lines) if words[0] == "BEGIN"][1]
    second_ack = [i for i, words in enumerate(lines) if words[0] == "ACK"][1]
    reached = [w[1] for w in lines[second_begin:second_ack] if w[0] == "POINT"]
    assert reached == [point for point, _ in SCENARIOS], reached
    decided = reached.index(DECIDED_AT)
    for at, (point, expect) in enumerate(SCENARIOS):
        assert expect == (COMMITTED if at >= decided else ROLLED_BACK), point


def test_async_bank_under_random_kills(
    make_pg_database: Callable[[], str], redis_url: str, tmp_path: Path
) -> None:
    sync_url, url = fresh_database(make_pg_database, 0, ACCOUNTS - 1)
    client = redis.Redis.from_url(redis_url)
    client.mset({f"balance:{i}": OPENING for i in range(ACCOUNTS)})
    common = ["--pg", url, "--redis", redis_url, "--log", str(tmp_path / "log")]
    rng = random.Random(18)
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    for round_ in range(3):
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "bank", *common, "--seed", f"r{round_}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "READY", proc.stderr
            time.sleep(rng.uniform(1.0, 3.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""

    recovery = worker("recover", *common)
    assert recovery.returncode == 0, recovery.stderr
    report = json.loads(recovery.stdout.split("RECOVERED ", 1)[1])
    assert not report["failures"] and not report["heuristics"], report

    rows = {str(g): (int(a), int(m)) for g, a, m in pg_query(sync_url, "SELECT * FROM transfers")}
    pg_balances = dict(pg_query(sync_url, "SELECT id, balance FROM accounts"))
    recorded = {
        key.decode()[2:]: tuple(int(x) for x in client.get(key).decode().split(":"))
        for key in client.scan_iter("t:*")
    }
    assert rows, "the bank moved no money before its first kill"
    problems = []
    if rows != recorded:
        torn = sorted(set(rows) ^ set(recorded))[:5]
        problems.append(f"atomicity: on one side only: {torn}")
    for i in range(ACCOUNTS):
        moved = sum(m for a, m in rows.values() if a == i)
        if pg_balances[i] != OPENING - moved:
            problems.append(f"exactly_once: PostgreSQL account {i} {pg_balances[i]}, moved {moved}")
        in_redis = int(client.get(f"balance:{i}"))
        if in_redis != OPENING + sum(m for a, m in recorded.values() if a == i):
            problems.append(f"exactly_once: Redis balance {i} is {in_redis}")
    prepared = pg_query(sync_url, "SELECT gid FROM pg_prepared_xacts")
    staged = [k for k in client.keys("twopc:*") if b":lock:" in k or b":ws:" in k]
    if prepared or staged or client.zcard("twopc:{twopc}:prepared") or report["pending_after"]:
        problems.append(f"no_residue: {prepared} {staged} {report['pending_after']}")
    assert not problems, "\n".join(problems)
