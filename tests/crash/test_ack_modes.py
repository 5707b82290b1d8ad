"""Each acknowledgment mode's promise under ``kill -9`` (seed 003), in real processes.

A cursor directory is filled with N messages; `tests/crash/session_worker.py` consumes them in
one mode and is killed by a crash point in the middle of the stream, then started again (as a
supervisor would) and consumes the rest. The audit compares what the application did (its ledger
file, or its PostgreSQL table in ``transacted``) with what each mode promises:

- ``auto``: at most one message handled twice: the last one before the crash, and its second
  delivery carries ``redelivered`` and a count of 2 (seed 003: "only the most recent message
  received is subject to this ambiguity").
- ``client``: exactly the messages since the last acknowledge come back, redelivered.
- ``dups-ok``: at most one batch (``dups_ok_batch``) of duplicates.
- ``transacted``: the insert and the acknowledgment are one two-phase transaction: no duplicate,
  nothing lost, whether the crash comes before the commit or after the decision was logged.

The cursor pre-counts deliveries: the forced record that ends a transaction (its ``C`` or ``P``)
also raises the counts of the next messages, as many as that transaction took, so the next
receive forces nothing. A crash therefore also flags those (at most one batch, never handed out)
``redelivered`` with a count of 2: high by one, never low, and never a duplicate.

Every run must also leave the cursor empty: nothing available, handed out or prepared.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from coordinator.crashpoints import ENV_VAR
from resource_managers.cursor import Cursor
from resource_managers.message_log import Message
from resource_managers.sequencing import Frame
from tests.crash.session_worker import SCHEMA

pytestmark = pytest.mark.crash

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "crash" / "session_worker.py"
N = 24


@dataclass(frozen=True)
class Handled:
    """One handler call, as the application recorded it."""

    body: str
    delivery_count: int
    redelivered: bool


def fill(directory: Path, n: int = N, queue: str = "orders") -> list[str]:
    """Accept ``n`` messages ``001``..``n`` into the cursor at ``directory``, in order."""
    bodies = [f"{i:03d}" for i in range(1, n + 1)]
    with Cursor(directory) as cursor:
        for seq, body in enumerate(bodies, 1):
            m = Message(uuid.uuid4().hex, queue, body.encode())
            cursor.deliver(Frame(queue, 1, seq, seq - 1, m.message_id), m)
    return bodies


def run(tmp_path: Path, mode: str, *extra: str, crash_at: str | None = None) -> str:
    """One worker run; with ``crash_at`` it must die at that point, else finish."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(ENV_VAR, None)
    if crash_at:
        env[ENV_VAR] = crash_at
    argv = [sys.executable, str(WORKER), "--mode", mode, "--cursor", str(tmp_path / "cursor"),
            "--state", str(tmp_path / "state"), *extra]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, env=env, cwd=REPO, timeout=60)
    out = done.stdout.decode() + done.stderr.decode()
    if crash_at:
        point = crash_at.partition(":")[0]
        assert done.returncode == -signal.SIGKILL, f"{crash_at} did not fire:\n{out}"
        assert f"crash point {point} reached" in out, out
    else:
        assert done.returncode == 0 and "DONE" in out, out
    return out


def crash_and_restart(tmp_path: Path, mode: str, crash_at: str, *extra: str) -> list[str]:
    bodies = fill(tmp_path / "cursor")
    run(tmp_path, mode, *extra, crash_at=crash_at)
    run(tmp_path, mode, *extra)
    return bodies


def read_ledger(path: Path) -> list[Handled]:
    out = []
    for line in path.read_text().splitlines():
        body, count, redelivered = line.split()
        out.append(Handled(body, int(count), redelivered == "1"))
    return out


def duplicates(handled: list[Handled]) -> list[str]:
    return sorted(b for b, n in Counter(h.body for h in handled).items() if n > 1)


def assert_cursor_empty(directory: Path) -> None:
    with Cursor(directory) as cursor:
        stats = cursor.stats()
        assert (stats.available, stats.in_flight, stats.prepared) == (0, 0, 0), stats
        assert cursor.dead_letters() == []


def assert_all_handled(bodies: list[str], handled: list[Handled]) -> None:
    assert {h.body for h in handled} == set(bodies), "a message was lost"


@pytest.mark.parametrize("point", ["session.auto.after_handler:5", "session.auto.after_receive:5"])
def test_auto_at_most_the_last_message_comes_back(tmp_path: Path, crash_matrix, point) -> None:
    """Seed 003, AUTO_ACKNOWLEDGE under kill -9: only the most recent message is in doubt; it
    comes back with redelivered set and its count raised. Killed after its handler, it is handled
    twice; killed before, once, but still flagged (the provider cannot know which)."""
    ledger = tmp_path / "ledger"
    bodies = crash_and_restart(tmp_path, "auto", point, "--ledger", str(ledger))
    handled = read_ledger(ledger)
    assert_all_handled(bodies, handled)
    assert duplicates(handled) == (["005"] if "after_handler" in point else [])
    assert [h for h in handled if h.redelivered] == [Handled("005", 2, True)]
    assert_cursor_empty(tmp_path / "cursor")
    crash_matrix.add(point=point, expected="<= 1 redelivered (the last)",
                     outcome=f"duplicates {duplicates(handled)}", resolved="cursor open",
                     recovery_ms=None)  # fmt: skip


def test_client_exactly_the_unacknowledged_come_back(tmp_path: Path, crash_matrix) -> None:
    """Seed 003, CLIENT_ACKNOWLEDGE under kill -9: acknowledging after every 4th message and
    killed after handling the 10th, exactly the 9th and 10th (handled, never acknowledged)
    come back, redelivered; nothing acknowledged does. The acknowledging commit of 5-8 pre-counted
    9-12, so 11 and 12, never handed out, come back flagged too (count high by one)."""
    ledger = tmp_path / "ledger"
    point = "session.client.after_handler:10"
    bodies = crash_and_restart(tmp_path, "client", point, "--ledger", str(ledger), "--every", "4")
    handled = read_ledger(ledger)
    assert_all_handled(bodies, handled)
    assert duplicates(handled) == ["009", "010"]
    assert [h for h in handled if h.redelivered] == [Handled(f"{i:03d}", 2, True)
                                                     for i in range(9, 13)]  # fmt: skip
    assert_cursor_empty(tmp_path / "cursor")
    crash_matrix.add(point=point, expected="exactly the unacknowledged",
                     outcome=f"duplicates {duplicates(handled)}", resolved="cursor open",
                     recovery_ms=None)  # fmt: skip


def test_dups_ok_at_most_one_batch_of_duplicates(tmp_path: Path, crash_matrix) -> None:
    """Seed 003, DUPS_OK_ACKNOWLEDGE under kill -9: with batches of 8, killed after handling the
    12th message, the second batch (9-16) comes back whole: 4 duplicates, at most a batch, and
    the earlier batch, acknowledged, never."""
    ledger = tmp_path / "ledger"
    point = "session.dups-ok.after_handler:12"
    bodies = crash_and_restart(tmp_path, "dups-ok", point, "--ledger", str(ledger), "--batch", "8")
    handled = read_ledger(ledger)
    assert_all_handled(bodies, handled)
    dups = duplicates(handled)
    assert dups == ["009", "010", "011", "012"] and len(dups) <= 8
    assert sorted(h.body for h in handled if h.redelivered) == [f"{i:03d}" for i in range(9, 17)]
    assert_cursor_empty(tmp_path / "cursor")
    crash_matrix.add(point=point, expected="<= dups_ok_batch (8) duplicates",
                     outcome=f"{len(dups)} duplicates", resolved="cursor open",
                     recovery_ms=None)  # fmt: skip


RESOLVED = {"tm.after_prepare.2": "recovery: presumed abort",
            "tm.after_decision_fsync": "recovery: commit"}  # fmt: skip


@pytest.mark.parametrize(
    "point",
    ["session.transacted.before_ack:2", "tm.after_prepare.2:2", "tm.after_decision_fsync:2"],
)
def test_transacted_with_postgresql_exactly_once(
    tmp_path: Path, pg_url: str, crash_matrix, point: str
) -> None:
    """Seed 003, transacted session in a distributed transaction under kill -9: each insert
    commits with the acknowledgment of its message or not at all, so after the restart every
    message was handled exactly once, whether the crash hit before the commit, between the
    prepares, or after the decision was logged (recovery finishes it)."""
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text(SCHEMA))
    try:
        bodies = crash_and_restart(tmp_path, "transacted", point, "--pg", pg_url, "--every", "3")
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT body, delivery_count, redelivered FROM handled ORDER BY id")
            ).all()
            prepared = conn.execute(sa.text("SELECT count(*) FROM pg_prepared_xacts")).scalar_one()
    finally:
        engine.dispose()
    handled = [Handled(*row) for row in rows]
    assert_all_handled(bodies, handled)
    assert duplicates(handled) == [] and len(handled) == N and prepared == 0
    assert [h.body for h in handled] == bodies  # in order, one consumer
    redelivered = [h.body for h in handled if h.redelivered]
    # before the decision the transaction of messages 4-6 rolled back: they come back flagged;
    # after it, recovery committed them and nothing comes back; 7-9, pre-counted by the prepare
    # of 4-6 and never handed out, come back flagged if that prepare ran (high by one, never low)
    pre_counted = [] if "before_ack" in point else ["007", "008", "009"]
    rolled_back = [] if "decision" in point else ["004", "005", "006"]
    assert redelivered == rolled_back + pre_counted
    assert {h.delivery_count for h in handled if h.redelivered} == {2}
    assert_cursor_empty(tmp_path / "cursor")
    crash_matrix.add(point=point, expected="0 duplicates, 0 lost", outcome=f"{len(handled)} once",
                     resolved=RESOLVED.get(point.partition(":")[0], "cursor open"),
                     recovery_ms=None)  # fmt: skip
