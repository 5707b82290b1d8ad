"""``examples/async_transfer.py`` runs as a user would run it, in a fresh interpreter, and its
audit holds (exit status 0): concurrent asyncio transactions between PostgreSQL and Redis on
throwaway servers it starts itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.crashpoints import ENV_VAR
from resource_managers.throwaway import find_postgres_bin, find_redis_server
from tests.support.servers import missing

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "async_transfer.py"


def test_async_transfer_example_audits_clean(tmp_path: Path) -> None:
    if find_postgres_bin() is None or find_redis_server() is None:
        missing("PostgreSQL and redis-server binaries (the example starts its own servers)")
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop(ENV_VAR, None)  # an armed crash point would kill the example, not test it
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--transfers", "120", "--concurrency", "16"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "audit: ok" in done.stdout, done.stdout
    assert done.stdout.startswith("120 transfers, 16 at once"), done.stdout
