"""Bank transfers between two PostgreSQL databases while the coordinator keeps being killed.

A child coordinator (`tests/crash/pg_worker.py bank`) runs client threads that move random
amounts between random accounts: each transfer debits an account in one database, credits one in
the other, and writes its transfer id (the gtrid) beside each half. Round after round this
process kills the child with SIGKILL, at a crash point the matrix knows (``TWOPC_CRASH_AT`` with a
random ``nth``) or at a random moment, then starts it again; recovery runs on start, as in a
restarted service. The schedule comes from one seed, printed, and ``TWOPC_BANK_SEED`` replays it
(thread timing is the operating system's). After a last recovery, by name:

- ``atomicity``: every transfer id is in both databases or in neither.
- ``exactly_once``: each balance is its opening balance plus its transfer rows; ``conserved``:
  the two databases together hold what was put in.
- ``durable_ack``: every transfer a client was told committed is in both databases;
  ``decision_stable``: none it was told rolled back is in either.
- ``no_in_doubt_residue``: nothing in ``pg_prepared_xacts``, nothing pending in the log.

The ``llr`` variant makes b a logging last resource: a prepares, b commits with the decision row,
and the kills come from the matrix's last-resource scenarios too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.crash.test_crash_matrix import Transcript, durable_ack, no_in_doubt_residue
from tests.crash.test_pg_crash_matrix import (
    PG_SCENARIOS,
    ROOT,
    Databases,
    Lines,
    exactly_once,
    half_applied,
    journal_only,
    make_log,
    names,
    pg_worker_command,
    worker_env,
)

SEED = int(os.environ.get("TWOPC_BANK_SEED", "20250611"))
ROUNDS = 8
THREADS = 4
ACCOUNTS = 8  # in each database
BRANCHES = ("a", "b")
NODE = "bank"

pytestmark = pytest.mark.crash


def kill_points(log_kind: str, last: str | None = None) -> list[str]:
    """The matrix's points a transfer passes: two branches, a and b, every vote yes; with
    ``last``, the last-resource scenarios (whose last resource, c there, is ``last`` here)."""
    found: set[str] = {"postgres.a.after_prepare", "tm.after_prepare.1"} if last else set()
    two_phase = len(BRANCHES) - (last is not None)
    for scenario in PG_SCENARIOS:
        if set(scenario.plan) != {"2pc"} or scenario.segment_bytes:
            continue
        if (log_kind == "sql" and journal_only(scenario)) or bool(scenario.last) != bool(last):
            continue
        for named in names(scenario):
            name = named.replace(f"postgres.{scenario.last}.", f"postgres.{last}.")
            index = re.search(r"\.(\d+)$", name)
            resource = re.match(r"postgres\.([^.]+)\.", name)
            if (index and int(index[1]) > two_phase) or (resource and resource[1] not in BRANCHES):
                continue
            found.add(name)
    return sorted(found)


def schedule(rng: random.Random, points: list[str]) -> list[tuple[str | None, float]]:
    """Per round: a crash point spec and how long to wait for it (then it is killed anyway), or
    None and how long to let the clients run after recovery before the kill."""
    rounds: list[tuple[str | None, float]] = []
    for _ in range(ROUNDS):
        if rng.random() < 0.3:
            rounds.append((None, rng.uniform(0.1, 1.2)))
            continue
        point = rng.choice(points)
        # ~200 transfers a second: up to about half a second of work before the point fires
        in_recovery = point.startswith("recovery.") or point.endswith(".before_decision_lookup")
        nth = 1 if in_recovery else rng.randint(1, 100)
        rounds.append((f"{point}:{nth}", 3.0))
    return rounds


def run_round(
    common: list[str], crash_at: str | None, seconds: float, seed: str, tmp_path: Path
) -> tuple[list[str], str]:
    """One life of the coordinator; its stdout, and how it died."""
    args = ["bank", *common, "--threads", str(THREADS), "--accounts", str(ACCOUNTS)]
    err = tmp_path / f"bank-{seed}.err"
    child = subprocess.Popen(
        pg_worker_command(*args, "--seed", seed),
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        env=worker_env(crash_at),
        cwd=ROOT,
        text=True,
    )
    lines = Lines(child)
    try:
        if crash_at is None:
            lines.until("READY")  # recovery is done: the clients run from here
            time.sleep(seconds)
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(seconds)
        if child.poll() is None:  # the planned kill, or a point that was not reached in time
            os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    seen = lines.rest()
    stderr = err.read_text()
    assert child.returncode == -signal.SIGKILL, f"the worker did not die by SIGKILL:\n{stderr}"
    fired = re.search(r"crash point (\S+) reached", stderr)
    assert "Traceback" not in stderr, stderr
    how = f"at {fired[1]}" if fired else f"after {seconds:.2f}s"
    return seen, how


@pytest.mark.parametrize(
    ("log_kind", "last"),
    [("file", None), ("sql", None), pytest.param("file", "b", id="file-llr")],
)
def test_bank_transfers_survive_random_kills(
    log_kind: str, last: str | None, tmp_path: Path, make_pg_database: Callable[[], str]
) -> None:
    rng = random.Random(SEED)
    what = f"{log_kind} log" + (f", {last} the last resource" if last else "")
    print(f"\nbank workload, {what}: seed {SEED} (TWOPC_BANK_SEED={SEED} replays it)")
    dbs = Databases.create(make_pg_database, BRANCHES)
    opening = dbs.open_accounts(BRANCHES, range(ACCOUNTS))
    log = make_log(log_kind, tmp_path, make_pg_database)
    common = [*dbs.args(), "--node", NODE, *log.args(), *(["--last", last] if last else [])]

    transcript: list[str] = []
    for n, (crash_at, seconds) in enumerate(schedule(rng, kill_points(log_kind, last)), 1):
        seen, how = run_round(common, crash_at, seconds, f"{SEED}-{n}", tmp_path)
        transcript += seen
        acked = sum(line.startswith("ACK") for line in seen)
        aborted = sum(line.startswith("ABORTED") for line in seen)
        print(f"round {n}: armed {crash_at or '-'}, killed {how}: {acked} acked, {aborted} aborted")

    final = subprocess.run(
        pg_worker_command("recover", *common),
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

    t = Transcript.parse("\n".join(transcript))
    unknown = [line for line in transcript if line.startswith("UNKNOWN")]
    assert not unknown, (
        f"seed {SEED}: outcomes unknown or heuristic with no server failing: {unknown}"
    )
    assert len(t.acked) >= ROUNDS, f"too few transfers to prove anything: {len(t.acked)}"
    states = dbs.read()
    problems = half_applied(states, BRANCHES)
    problems += exactly_once(states, opening)
    problems += durable_ack(states, t)
    problems += [
        f"decision_stable: {g} reported rolled back but applied"
        for g in t.aborted
        if any(g in states[name].rows for name in BRANCHES)
    ]
    problems += no_in_doubt_residue(states, log.pending(report, NODE))
    assert not problems, f"seed {SEED}:\n" + "\n".join(problems)
