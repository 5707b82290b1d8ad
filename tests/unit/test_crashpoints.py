"""Crash points: parsing, counting, and a real SIGKILL in a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from coordinator import crashpoints


def test_parse_names_and_counts() -> None:
    assert crashpoints.parse("a, b:3") == {"a": 1, "b": 3}
    assert crashpoints.parse("") == {}
    for bad in ("a:0", "a:x", ":2"):
        with pytest.raises(ValueError, match="TWOPC_CRASH_AT"):
            crashpoints.parse(bad)


def test_unarmed_points_are_inert_and_observed() -> None:
    seen: list[str] = []
    crashpoints.observe(seen.append)
    try:
        crashpoints.crash_point("tm.test.inert")
    finally:
        crashpoints._observers.remove(seen.append)
    assert seen == ["tm.test.inert"]


def test_armed_point_kills_the_process_on_its_nth_hit() -> None:
    code = (
        "from coordinator.crashpoints import crash_point\n"
        "for i in range(5):\n"
        "    print(i, flush=True)\n"
        "    crash_point('x.loop')\n"
    )
    env = dict(os.environ, TWOPC_CRASH_AT="x.loop:3")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["0", "1", "2"]
    assert "crash point x.loop reached" in proc.stderr
