"""The async messaging path under ``kill -9``: a relay (`tests/crash/amsg_worker.py`) takes each
message from a real ``twopc serve cursor`` with `AsyncRemoteCursor`, writes a PostgreSQL row and
sends the body on through a real ``twopc serve log`` with `AsyncRemoteMessageLog`, one two-phase
transaction per message, and is killed with SIGKILL at a named point of its second one: after
the remote branches prepared (``tm.after_prepare.1``: the cursor's; ``.2``: the log's too, not
PostgreSQL), after the decision, after a remote branch's phase-two commit was sent
(``remote.<name>.commit_sent``), and after two branches committed. Restarted, it recovers (with
blocking connections: no loop yet) and finishes the queue. The audit, whatever the point: every
message consumed exactly once (rows), relayed exactly once (the output queue, drained), the
input queue empty, nothing prepared in PostgreSQL, the log server or the cursor server, nothing
pending in the decision log; and the interrupted transaction ended as its point implies (rolled
back before the decision, committed after it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text

from coordinator import Xid
from messaging.remote import RemoteMessageLog
from tests.crash.amsg_worker import SCHEMA
from tests.crash.test_crash_matrix import killed_at
from tests.integration.cursor_stack import Stack, running_stack

pytestmark = [pytest.mark.crash, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("amsg_worker.py")
BODIES = ["a", "b", "c"]

COMMITTED, ROLLED_BACK = "committed", "rolled-back"
SCENARIOS = [
    ("tm.after_prepare.1", ROLLED_BACK),  # the cursor's branch prepared on its server
    ("tm.after_prepare.2", ROLLED_BACK),  # the log's too, PostgreSQL not asked
    ("tm.after_decision_fsync", COMMITTED),  # decided, nobody told
    ("remote.cursor.commit_sent", COMMITTED),  # the cursor's commit sent, unanswered
    ("remote.mlog.commit_sent", COMMITTED),  # the log's too
    ("tm.after_commit.2", COMMITTED),  # both remote branches committed, PostgreSQL prepared
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("amsg-servers")) as s:
        yield s


def worker(
    *args: str, crash_at: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    if crash_at:
        env["TWOPC_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def drain(stack: Stack, queue: str, expect: int) -> list[str]:
    """Take ``expect`` messages of ``queue`` (waiting for the transfer), then check it is empty."""
    cursor = stack.cursor()
    try:
        xid = Xid.branch_of(f"amsg-audit-{queue}", cursor.name)
        branch = cursor.start(xid)
        got = [branch.receive(queue, timeout=15) for _ in range(expect)]
        extra = branch.receive(queue, timeout=0.5)
        cursor.commit(xid, one_phase=True)
    finally:
        cursor.close()
    assert extra is None, f"{queue}: one more than expected: {extra}"
    return sorted(d.body.decode() for d in got if d is not None)


@pytest.mark.parametrize(("point", "expect"), SCENARIOS, ids=[p for p, _ in SCENARIOS])
def test_async_messaging_crash_then_recovery(
    point: str, expect: str, stack: Stack, make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    sync_url = make_pg_database()
    engine = create_engine(sync_url)
    with engine.begin() as conn:
        for statement in SCHEMA:
            conn.execute(text(statement))
    url = make_url(sync_url).set(drivername="postgresql+psycopg").render_as_string(False)
    queue, out = f"in-{point}", f"out-{point}"
    stack.send(queue, *(b.encode() for b in BODIES))
    common = [
        "--pg", url, "--log", str(tmp_path / "decisions"), "--log-port", str(stack.log_port),
        "--cursor-port", str(stack.cursor_port),
    ]  # fmt: skip
    relay = [*common, "--queue", queue, "--out", out, "--count", str(len(BODIES))]

    killed = worker("relay", *relay, crash_at=f"{point}:2")
    killed_at(killed, f"{point}:2")
    assert killed.stdout.count("ACK") == 1, killed.stdout  # killed in the second transaction

    again = worker("relay", *relay)  # recovers first, then finishes the queue
    assert again.returncode == 0 and "DONE" in again.stdout, again.stderr
    recovery = worker("recover", *common)
    assert recovery.returncode == 0, recovery.stderr
    report = json.loads(recovery.stdout.split("RECOVERED ", 1)[1])

    with engine.connect() as conn:
        consumed = sorted(str(b) for (b,) in conn.execute(text("SELECT body FROM consumed")))
        prepared = conn.execute(text("SELECT gid FROM pg_prepared_xacts")).all()
    engine.dispose()
    relayed = drain(stack, out, len(BODIES))
    left = drain(stack, queue, 0)
    with RemoteMessageLog(("127.0.0.1", stack.log_port), stack.secret, name="mlog") as mlog:
        log_prepared = mlog.recover()
    cursor = stack.cursor()
    try:
        cursor_prepared = cursor.recover()
    finally:
        cursor.close()

    problems = []
    # the interrupted message ("b") ended as the point implies: handled again only if it rolled back
    ended = ROLLED_BACK if "BEGIN b" in again.stdout else COMMITTED
    if ended != expect:
        problems.append(f"outcome: the interrupted transaction {ended}, expected {expect}")
    if consumed != BODIES:
        problems.append(f"exactly_once: consumed rows {consumed}")
    if relayed != BODIES:
        problems.append(f"exactly_once: relayed {relayed}")
    if left:
        problems.append(f"lost_in_place: {left} still in {queue}")
    if prepared or log_prepared or cursor_prepared or report["pending_after"]:
        problems.append(
            f"no_residue: {prepared} {log_prepared} {cursor_prepared} {report['pending_after']}"
        )
    if report["failures"] or report["heuristics"]:
        problems.append(f"recovery: {report}")
    assert not problems, "\n".join(problems)
