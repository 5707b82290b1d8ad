"""`twopc demo` is the README's first command: it must pass its own audit from a clean start."""

from __future__ import annotations

import re
import subprocess
import sys

from resource_managers.throwaway import find_postgres_bin, find_redis_server
from tests.support.servers import missing

NEW_AUDIT_ROWS = (
    "messages exactly once: every committed transfer notified once",
    "no message of a rolled-back transfer",
    "nothing in flight: log and cursor empty",
)


def demo(*args: str) -> str:
    """Run ``twopc demo`` with ``args``; its output, after checking that it passed its audit."""
    if find_postgres_bin() is None:
        missing("PostgreSQL binaries (the demo starts its own cluster)")
    if find_redis_server() is None:
        missing("redis-server (the demo starts its own)")
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "killed by SIGKILL" in done.stdout
    audit = done.stdout.split("5. audit")[-1]
    for row in NEW_AUDIT_ROWS:
        assert re.search(rf"{re.escape(row)}\s+yes\s", audit), audit
    assert "NO" not in audit
    assert "PASS" in done.stdout
    return done.stdout


def step(out: str, number: int) -> str:
    return out.partition(f"\n{number}. ")[2].partition(f"\n{number + 1}. ")[0]


def test_the_demo_crashes_recovers_delivers_once_and_passes_its_audit() -> None:
    out = demo()
    assert 'sending a message about each transfer to "transfers"' in out
    assert "branches in name order (mlog, postgres, redis)" in out
    # the default crash point leaves the message log and PostgreSQL committed, Redis prepared
    in_doubt = step(out, 2)
    # the log's commit record is lazy: the kill may leave its branch prepared (never both)
    assert ("mlog          committed" in in_doubt) != ("mlog          prepared" in in_doubt)
    assert "postgres      committed" in in_doubt
    assert "redis         staged, not applied" in in_doubt
    assert "[mlog, postgres, redis]" in in_doubt
    delivery = step(out, 4)
    assert "the log transfers the messages to the cursor" in delivery
    assert re.search(r"transferred: 7 message\(s\) in the cursor, \d+ while the service ran", out)
    assert "consumed: 7 message(s), one transaction (cursor, postgres)" in delivery
    assert "the cursor now: available 0, in flight 0, prepared 0" in delivery
    audit = step(out, 5)
    assert "7 notifications for 7 transfers" in audit
    assert "0 rolled back, none notified" in audit


def test_a_message_prepared_at_the_crash_is_rolled_back_and_never_delivered() -> None:
    """Killed after the message log prepared transfer 7 and before any decision: recovery
    presumes abort, and neither its money nor its message goes anywhere. (Redis's prepare is
    sent before the others and read after them, so by then it may have prepared too.)"""
    out = demo("--crash-at", "tm.after_prepare.1:7")
    assert "mlog          prepared, message held" in step(out, 2)
    assert re.search(r"presumed abort: [12] branch\(es\)", step(out, 3))
    assert "consumed: 6 message(s)" in step(out, 4)
    audit = step(out, 5)
    assert "6 notifications for 6 transfers" in audit
    assert "1 rolled back, none notified" in audit
