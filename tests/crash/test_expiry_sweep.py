"""The expiry sweep and an operator's removal of one message under ``kill -9``.

`tests/crash/sweep_worker.py` opens a cursor holding expired and live messages, sweeps the
expired ones to the dead-letter queue (lazy ``W`` records), then drops or dead-letters one live
message (a forced ``Z`` or ``W``), and is killed at each point on the way: the sweep's own
(``cursor.after_sweep``: records queued, not on disk), the journal's write and fsync, and after
the removal's forced record (``cursor.after_remove``). A restart (a fresh open and sweep) must
then show, whatever the point (``no_loss``, ``once``):

- every expired message exactly once in ``orders.DLQ``, its reason naming its own deadline;
- every live message exactly once, in its queue in arrival order, except the one removed:
  absent (or in the DLQ, dead-lettered) if the kill came after its forced record was durable,
  otherwise still waiting, and the removal can simply be run again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from coordinator.crashpoints import ENV_VAR
from resource_managers.cursor import Cursor
from resource_managers.message_log import Message
from resource_managers.sequencing import Frame

pytestmark = pytest.mark.crash

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "crash" / "sweep_worker.py"


def fill(directory: Path) -> tuple[dict[str, int], list[str]]:
    """Ten messages, every other one expired a minute ago; (expired id -> deadline, live ids)."""
    past = time.time_ns() // 1_000_000 - 60_000
    expired: dict[str, int] = {}
    live: list[str] = []
    with Cursor(directory) as cursor:
        for seq in range(1, 11):
            deadline = past + seq if seq % 2 else None
            m = Message(uuid.uuid4().hex, "orders", f"{seq:02d}".encode(), {}, True, deadline)
            cursor.deliver(Frame("orders", 1, seq, seq - 1, m.message_id), m)
            if deadline is None:
                live.append(m.message_id)
            else:
                expired[m.message_id] = deadline
    return expired, live


def run(directory: Path, crash_at: str, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), ENV_VAR: crash_at}
    argv = [sys.executable, str(WORKER), "--cursor", str(directory), *extra]
    done = subprocess.run(argv, capture_output=True, env=env, cwd=REPO, timeout=60)
    out = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == -signal.SIGKILL, f"{crash_at} did not fire:\n{out}"
    assert f"crash point {crash_at.partition(':')[0]} reached" in out, out
    return out


POINTS = [
    ("cursor.after_sweep", None),
    ("log.before_write:1", None),
    ("log.after_write:1", None),
    ("log.after_fsync:1", None),
    ("cursor.after_sweep", "drop"),
    ("log.before_write:1", "dead-letter"),
    ("log.after_fsync:1", "drop"),
    ("cursor.after_remove", "drop"),
    ("cursor.after_remove", "dead-letter"),
]


@pytest.mark.parametrize(("point", "action"), POINTS, ids=[f"{p}-{a}" for p, a in POINTS])
def test_sweep_and_removal_survive_kill_9(tmp_path: Path, point: str, action: str | None) -> None:
    directory = tmp_path / "cursor"
    expired, live = fill(directory)
    victim = live[0]
    extra = ["--remove", victim, "--action", action] if action else []
    out = run(directory, point, *extra)
    with Cursor(directory) as cursor:
        cursor.sweep_expired()  # the restarted server's first sweep
        waiting = [d.message_id for d in cursor.available("orders")]
        dead = {d.message_id: d.reason or "" for d in cursor.dead_letters("orders")}
    # expired: each exactly once in the DLQ, with its own deadline in the reason (no_loss, once)
    for mid, deadline in expired.items():
        assert mid in dead and f"({deadline} ms)" in dead[mid], (mid, dead.get(mid))
    # live: in arrival order, exactly once; the victim gone only if its forced record was durable
    gone = action is not None and victim not in waiting
    if point == "cursor.after_remove" or "REMOVED" in out:
        assert gone
    assert waiting == [mid for mid in live if not (gone and mid == victim)], waiting
    operator = {m for m, r in dead.items() if r.startswith("dead-lettered by an operator")}
    assert operator == ({victim} if gone and action == "dead-letter" else set())
    assert set(dead) == set(expired) | operator
