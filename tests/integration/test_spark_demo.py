"""`twopc demo --spark`: a streaming job's driver killed after batch 1's decision, restarted on its
checkpoint; the demo must pass its own audit from a clean start, well within two minutes."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from resource_managers.throwaway import find_postgres_bin, find_redis_server
from tests.support.servers import missing

pytestmark = [pytest.mark.spark, pytest.mark.slow]

AUDIT_ROWS = (
    "every id once in PostgreSQL",
    "every id once in Redis",
    "the replayed batch 1 wrote nothing",
    "one committed ledger row per batch",
    "nothing prepared",
    "no pending decision",
    "Spark recorded every batch",
)


def step(out: str, number: int) -> str:
    return out.partition(f"\n{number}. ")[2].partition(f"\n{number + 1}. ")[0]


def test_the_spark_demo_kills_the_driver_after_a_decision_and_passes_its_audit() -> None:
    if importlib.util.find_spec("pyspark") is None:
        missing("pyspark (pip install -e '.[spark]')")
    if not (os.environ.get("JAVA_HOME") or shutil.which("java")):
        missing("Java runtime for Spark")
    if find_postgres_bin() is None:
        missing("PostgreSQL binaries (the demo starts its own cluster)")
    if find_redis_server() is None:
        missing("redis-server (the demo starts its own)")
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", "--spark"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-4000:]

    crash = step(out, 1)
    assert "twopc: crash point spark.driver_after_commit reached" in crash
    assert "batch 0: decided: 3 branch(es) committed" in crash
    assert "batch 1: decided" not in crash  # killed between the decision and phase two

    left = step(out, 2)
    assert re.search(r"decision log\s+COMMIT, phase two not run\s+spark:demo:1 ", left)
    assert len(re.findall(r"\sprepared\s+spark:demo:1 ", left)) == 3  # pg, redis, ledger
    assert re.search(r"spark commits/\s+recorded done\s+batches \[0\]", left)
    assert re.search(r"postgres shop\.items\s+committed\s+100 rows", left)

    restarted = step(out, 3)
    assert "batch 1: 0 task" not in restarted  # no task of the replay wrote
    assert "found it committed and wrote nothing" in restarted
    assert "batch 1: a replay, finished the recorded decision" in restarted
    assert "0 rolled back" in restarted

    audit = step(out, 4)
    for row in AUDIT_ROWS:
        assert re.search(rf"{re.escape(row)}\s+yes\s", audit), audit
    assert "NO" not in audit
    assert "300 rows, 300 distinct ids of 300" in audit
    assert "PASS" in out
