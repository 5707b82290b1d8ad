"""Run a test script (a worker that crash tests kill) in a fresh interpreter, with the crash point
``crash_at`` armed (`coordinator.crashpoints`) or none at all, whatever this process's
environment says."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def run_script(
    script: Path, argv: Sequence[str], *, crash_at: str = "", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    if crash_at:
        env["TWOPC_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, str(script), *argv],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
