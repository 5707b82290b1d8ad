"""`twopc demo` is the README's first command: it must pass its own audit from a clean start."""

from __future__ import annotations

import subprocess
import sys

from resource_managers.throwaway import find_postgres_bin, find_redis_server
from tests.support.servers import missing


def test_the_demo_crashes_recovers_and_passes_its_audit() -> None:
    if find_postgres_bin() is None:
        missing("PostgreSQL binaries (the demo starts its own cluster)")
    if find_redis_server() is None:
        missing("redis-server (the demo starts its own)")
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "killed by SIGKILL" in done.stdout
    # the default crash point leaves PostgreSQL committed and Redis prepared
    in_doubt = done.stdout.split("2. left in doubt")[-1].split("3. ")[0]
    assert "postgres      committed" in in_doubt
    assert "redis         staged, not applied" in in_doubt
    assert "PASS" in done.stdout
    assert "NO" not in done.stdout.split("4. audit")[-1]
