"""Bank transfers between PostgreSQL and Redis while the coordinator and Redis keep being killed.

A child coordinator (`tests/crash/redis_worker.py bank`) runs client threads that move random
amounts between an account in PostgreSQL and one in Redis: each transfer debits one side,
credits the other, and writes its transfer id (the gtrid) beside each half (a ``transfers`` row,
a ``<ns>:xfer:<gtrid>`` hash). Round after round this process SIGKILLs the child, at a crash
point the matrix knows (``TWOPC_CRASH_AT`` with a random ``nth``) or at a random moment, and
starts it again (recovery runs on start and every half second). Redis dies too: ``kill -9`` of
the private ``redis-server`` between rounds, or at a random moment mid-round, and a restart from
its AOF after a random pause. The schedule comes from one seed, printed; ``TWOPC_BANK_SEED``
replays it (thread timing is the operating system's). After a last recovery, by name:

- ``atomicity``: every transfer id is on both sides or on neither.
- ``exactly_once``: each balance is its opening balance plus its transfer records;
  ``conserved``: PostgreSQL and Redis together hold what was put in.
- ``durable_ack``: every transfer a client was told committed is on both sides;
  ``decision_stable``: none it was told rolled back is on either.
- ``no_in_doubt_residue``: nothing in ``pg_prepared_xacts``, in Redis's prepared set or pending
  in the log; ``no_redis_residue``: no lock keys or staged write sets left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.crash.pg_worker import SCHEMA
from tests.crash.redis_worker import balance_key, redis_client
from tests.crash.test_crash_matrix import (
    Transcript,
    durable_ack,
    no_in_doubt_residue,
    pending_decisions,
)
from tests.crash.test_pg_crash_matrix import (
    OPENING,
    ROOT,
    Lines,
    exactly_once,
    half_applied,
    names,
    query,
    read_pg_state,
    worker_env,
)
from tests.crash.test_redis_crash_matrix import (
    REDIS_SCENARIOS,
    no_redis_residue,
    read_redis_state,
    redis_worker_command,
)

SEED = int(os.environ.get("TWOPC_BANK_SEED", "20250612"))
ROUNDS = 8
THREADS = 4
ACCOUNTS = 8  # on each side
BRANCHES = ("a", "b")  # a: PostgreSQL, b: Redis
NODE = "rbank"
NAMESPACE = "rbank"

pytestmark = pytest.mark.crash


def kill_points() -> list[str]:
    """The matrix's points a transfer passes: two branches, a and b, every vote yes."""
    found: set[str] = set()
    for scenario in REDIS_SCENARIOS:
        if set(scenario.plan) != {"2pc"} or scenario.segment_bytes or scenario.last:
            continue  # (no last resource here)
        for name in names(scenario):
            index = re.search(r"\.(\d+)$", name)
            resource = re.match(r"(?:postgres|redis)\.([^.]+)\.", name)
            if (index and int(index[1]) > len(BRANCHES)) or (
                resource and resource[1] not in BRANCHES
            ):
                continue
            found.add(name)
    return sorted(found)


@dataclass(frozen=True)
class Round:
    """One life of the coordinator: ``crash_at`` and how long to wait for it (then it is killed
    anyway), or None and how long the clients run; and what happens to Redis: ``between`` (killed
    and restarted before the coordinator starts), ``mid`` (killed ``redis_at`` seconds after the
    clients start, back ``down`` seconds later, unless the coordinator died first) or ``-``."""

    crash_at: str | None
    seconds: float
    redis: str
    redis_at: float
    down: float


def schedule(rng: random.Random, points: list[str]) -> list[Round]:
    rounds = []
    for _ in range(ROUNDS):
        if rng.random() < 0.3:
            crash_at, seconds = None, rng.uniform(0.3, 1.2)
        else:
            point = rng.choice(points)
            # a few hundred transfers a second: up to about half a second before the point fires
            nth = 1 if point.startswith("recovery.") else rng.randint(1, 100)
            crash_at, seconds = f"{point}:{nth}", 2.0
        redis = rng.choice(["-", "between", "mid", "mid"])
        rounds.append(Round(crash_at, seconds, redis, rng.uniform(0.02, 0.35), rng.uniform(0, 0.3)))
    return rounds


def kill_redis(server: Any, down: float, done: list[str]) -> None:
    server.kill9()
    time.sleep(down)
    server.restart()
    done.append(f"killed for {down:.2f}s")


def ready(lines: Lines) -> bool:
    """Until the child says READY (its recovery on start is done); False if it died first (a
    crash point inside that recovery)."""
    try:
        lines.until("READY")
    except AssertionError:
        return False
    return True


def run_round(
    common: list[str], plan: Round, seed: str, server: Any, tmp_path: Path
) -> tuple[list[str], str]:
    """One life of the coordinator, with Redis killed as ``plan`` says; its stdout, and what
    happened to Redis."""
    redis: list[str] = []
    if plan.redis == "between":
        kill_redis(server, plan.down, redis)
        redis[-1] += " before the start"
    args = ["bank", *common, "--threads", str(THREADS), "--accounts", str(ACCOUNTS)]
    err = tmp_path / f"bank-{seed}.err"
    child = subprocess.Popen(
        redis_worker_command(*args, "--seed", seed),
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        env=worker_env(plan.crash_at),
        cwd=ROOT,
        text=True,
    )
    killer = threading.Timer(plan.redis_at, kill_redis, (server, plan.down, redis))
    lines = Lines(child)
    try:
        if ready(lines):
            if plan.redis == "mid":  # while the clients run: mid-prepare, mid-commit
                killer.start()
                redis.append(f"at {plan.redis_at:.2f}s ")
            if plan.crash_at is None:
                time.sleep(plan.seconds)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(plan.seconds)
        if child.poll() is None:  # the planned kill, or a point that was not reached in time
            os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        killer.cancel()
        if killer.is_alive():
            killer.join()  # Redis is up again before anything else happens
        if len(redis) == 1 and plan.redis == "mid":
            redis.append("not killed: the coordinator died first")
    seen = lines.rest()
    stderr = err.read_text()
    assert child.returncode == -signal.SIGKILL, f"the worker did not die by SIGKILL:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    return seen, "".join(redis) or "-"


def final_recovery(common: list[str]) -> dict[str, Any]:
    final = subprocess.run(
        redis_worker_command("recover", *common),
        env=worker_env(None),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert final.returncode == 0, final.stderr
    report: dict[str, Any] = json.loads(final.stdout.split("RECOVERED ", 1)[1])
    assert not report["failures"] and not report["heuristics"], report
    assert not report["heuristic_records"], report
    return report


def open_accounts(pg: str, redis_url: str) -> dict[str, dict[int, int]]:
    for statement in SCHEMA:
        query(pg, statement)
    client = redis_client(redis_url)
    try:
        for account in range(ACCOUNTS):
            query(pg, "INSERT INTO accounts VALUES (%s, %s)", (account, OPENING))
            client.set(balance_key(NAMESPACE, account), OPENING)
    finally:
        client.close()
    return {name: dict.fromkeys(range(ACCOUNTS), OPENING) for name in BRANCHES}


def test_bank_transfers_across_pg_and_redis_survive_random_kills(
    tmp_path: Path, make_pg_database: Callable[[], str], private_redis: Callable[..., Any]
) -> None:
    rng = random.Random(SEED)
    print(f"\nbank workload, PostgreSQL + Redis: seed {SEED} (TWOPC_BANK_SEED={SEED} replays it)")
    server = private_redis()
    pg, redis_url = make_pg_database(), server.url(0)
    opening = open_accounts(pg, redis_url)
    common = [
        *("--pg", pg, "--redis", redis_url, "--namespace", NAMESPACE, "--node", NODE),
        *("--log", f"file:{tmp_path / 'log'}", "--blind", "--lock-wait", "0.5"),
        *("--recovery-interval", "0.5"),
    ]

    transcript: list[str] = []
    for n, plan in enumerate(schedule(rng, kill_points()), 1):
        seen, redis = run_round(common, plan, f"{SEED}-{n}", server, tmp_path)
        transcript += seen
        acked = sum(line.startswith("ACK") for line in seen)
        pending = sum(line.startswith("ACK") and "pending" in line for line in seen)
        aborted = sum(line.startswith("ABORTED") for line in seen)
        print(
            f"round {n}: armed {plan.crash_at or '-'}, Redis {redis}: "
            f"{acked} acked ({pending} with Redis left to recovery), {aborted} aborted"
        )

    report = final_recovery(common)
    t = Transcript.parse("\n".join(transcript))
    unknown = [line for line in transcript if line.startswith("UNKNOWN")]
    assert not unknown, f"seed {SEED}: outcomes unknown or heuristic: {unknown}"
    assert len(t.acked) >= ROUNDS, f"too few transfers to prove anything: {len(t.acked)}"
    client = redis_client(redis_url)
    try:
        states = {"a": read_pg_state(pg)}
        states["b"] = read_redis_state(client, NAMESPACE, range(ACCOUNTS))["b"]
        problems = no_redis_residue(client, NAMESPACE)
    finally:
        client.close()
    problems += half_applied(states, BRANCHES)
    problems += exactly_once(states, opening)
    problems += durable_ack(states, t)
    problems += [
        f"decision_stable: {g} reported rolled back but applied"
        for g in t.aborted
        if any(g in states[name].rows for name in BRANCHES)
    ]
    pending = report["pending_after"] + pending_decisions(tmp_path / "log")
    problems += no_in_doubt_residue(states, pending)
    assert not problems, f"seed {SEED}:\n" + "\n".join(problems)
