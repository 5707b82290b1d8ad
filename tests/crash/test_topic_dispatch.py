"""Topic dispatch under ``kill -9`` (seeds 001 and 002), in real processes.

`tests/crash/topic_worker.py` holds a `Cursor` and a `TopicDispatcher` with 4 workers and
publishes 3 publishers x 30 publications, in bursts, to a topic with 3 durable subscriptions
while the workers fan them out. Each scenario kills it with ``TWOPC_CRASH_AT`` at a
``dispatch.*`` point, with an ``:nth`` that lands while several workers have publications in
flight, and starts it again until it finishes. For a ``recovery.dispatch.*`` point both points
are armed (``first,point``): the first start dies at the dispatch point, which leaves
publications in doubt; the second start's recovery dies at the recovery point; the third
finishes, so recovery itself recovers from a half-done recovery.

Non-persistent runs (``np``) make every copy record forced (disconnected durable subscribers), so
a crash leaves publications in the in-doubt list with copies in the monitor queue: recovery then
has to skip those (seed 001's duplicate elimination) and send the rest. Persistent runs (``p``)
have lazy copy records, made durable only by the feeder's forced records.

The audit opens the cursor after the last process stopped: every publication exactly once in
every subscription queue (no duplicates, none lost), each publisher's order kept in every queue
(seed 002), the topic input and the in-doubt list empty. ``pytest -s`` prints the table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from resource_managers.cursor import Cursor, subscription_queue
from tests.crash.topic_worker import TOPIC, plan

pytestmark = [pytest.mark.crash, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "crash" / "topic_worker.py"
PUBLISHERS, PER_PUBLISHER, SUBSCRIPTIONS, WORKERS, BURST = 3, 30, 3, 4, 12


@dataclass(frozen=True)
class Scenario:
    point: str | None  # None: no crash, the baseline
    mode: str  # "np": non-persistent publications (forced copies); "p": persistent
    first: str | None = None  # for recovery points: the dispatch point that makes work for it

    @property
    def id(self) -> str:
        return f"{self.point or 'no-crash'}[{self.mode}]"

    def starts(self) -> list[tuple[str | None, str | None]]:
        """(TWOPC_CRASH_AT, the point expected to fire) per start; the last start finishes."""
        if self.point is None:
            return [(None, None)]
        if self.first is None:
            return [(self.point, self.point), (None, None)]
        both = f"{self.first},{self.point}"
        return [(both, self.first), (both, self.point), (None, None)]


SCENARIOS = [
    Scenario(None, "np"),
    Scenario("dispatch.before_copy.1:20", "np"),
    Scenario("dispatch.before_copy.2:20", "p"),
    Scenario("dispatch.before_copy.3:45", "np"),
    Scenario("dispatch.after_copy.1:25", "np"),
    Scenario("dispatch.after_copy.2:30", "p"),
    Scenario("dispatch.after_copy.3:60", "np"),
    Scenario("dispatch.after_finish:30", "np"),
    Scenario("dispatch.after_finish:50", "p"),
    # after a crash at after_copy.1 the copy's forced record carries the publication's take
    # record with it: at least one publication is in doubt with two copies to send, three checks
    Scenario("recovery.dispatch.before_check:2", "np", first="dispatch.after_copy.1:25"),
    Scenario("recovery.dispatch.before_check:3", "np", first="dispatch.after_copy.2:40"),
    Scenario("recovery.dispatch.after_redeliver:2", "np", first="dispatch.after_copy.1:40"),
]

ROWS: list[dict[str, Any]] = []
COLUMNS = (
    "point", "mode", "kills", "in doubt at restarts", "publications", "copies", "duplicates",
    "lost", "order violations", "recovered", "skipped (monitored)",
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def crash_table() -> Iterator[None]:
    """Print every scenario's row once the module is done (shown with ``pytest -s``)."""
    yield
    if ROWS:
        print("\n" + "\n".join(render(ROWS)))


def render(rows: list[dict[str, Any]]) -> list[str]:
    cells = [tuple(str(row[c]) for c in COLUMNS) for row in rows]
    widths = [max(len(v) for v in column) for column in zip(COLUMNS, *cells, strict=True)]

    def line(values: tuple[str, ...]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    return [line(COLUMNS), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
            *(line(c) for c in cells)]  # fmt: skip


def start(directory: Path, crash_at: str | None, mode: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    env["PYTHONPATH"] = str(REPO)
    if crash_at:
        env["TWOPC_CRASH_AT"] = crash_at
    argv = [sys.executable, str(WORKER), "run", str(directory), "--publishers", str(PUBLISHERS),
            "--per-publisher", str(PER_PUBLISHER), "--subscriptions", str(SUBSCRIPTIONS),
            "--workers", str(WORKERS), "--burst", str(BURST)]  # fmt: skip
    if mode == "np":
        argv.append("--non-persistent")
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def audit(directory: Path, key: Callable[[str], str] | None = None) -> dict[str, int]:
    """Open the cursor the processes left and check every subscription queue against the plan;
    a copy is known by its message id, or by ``key(body)`` (the server test's ids are uuids)."""
    expected = [m.message_id for m in plan(PUBLISHERS, PER_PUBLISHER, True)]
    report = Counter(publications=len(expected))
    with Cursor(directory) as c:
        for i in range(SUBSCRIPTIONS):
            copies = c.available(subscription_queue(TOPIC, f"s{i}"))
            ids = [d.message_id if key is None else key(d.body.decode()) for d in copies]
            report["copies"] += len(ids)
            report["duplicates"] += len(ids) - len(set(ids))
            report["lost"] += len(set(expected) - set(ids))
            report["phantom"] += len(set(ids) - set(expected))
            last: dict[str, int] = {}
            for mid in ids:
                publisher, _, seq = mid.partition("-")
                if last.get(publisher, -1) >= int(seq):
                    report["order violations"] += 1
                last[publisher] = int(seq)
        report["in doubt"] = len(c.in_doubt())
        report["backlog"] = c.topic_backlog()
    return dict(report)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.id for s in SCENARIOS])
def test_kill_9_during_topic_dispatch_delivers_every_copy_once_in_order(
    scenario: Scenario, tmp_path: Path
) -> None:
    """exactly_once (seed 001) and publisher_order (seed 002) across kill -9 at each point."""
    directory = tmp_path / "cursor"
    kills, in_doubt, done = 0, [], None
    for crash_at, expected in scenario.starts():
        done = start(directory, crash_at, scenario.mode)
        found = re.search(r"IN_DOUBT (\d+)", done.stdout)
        in_doubt.append(found.group(1) if found else "?")
        if expected is None:
            assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-3000:]
            continue
        name = expected.partition(":")[0]
        assert done.returncode == -9, f"{name} never fired:\n{done.stdout}\n{done.stderr[-3000:]}"
        assert f"crash point {name} reached" in done.stderr, done.stderr[-3000:]
        kills += 1
    assert done is not None
    stats = json.loads(done.stdout.split("STATS ", 1)[1].splitlines()[0])
    report = audit(directory)
    ROWS.append({
        "point": scenario.point or "(none)", "mode": scenario.mode, "kills": kills,
        "in doubt at restarts": " -> ".join(in_doubt[1:]) or "-",
        "publications": report["publications"], "copies": report["copies"],
        "duplicates": report.get("duplicates", 0), "lost": report.get("lost", 0),
        "order violations": report.get("order violations", 0),
        "recovered": stats["recovered"], "skipped (monitored)": stats["recovery_skipped"],
    })  # fmt: skip
    bad = {k: report.get(k, 0) for k in ("duplicates", "lost", "phantom", "order violations",
                                           "in doubt", "backlog") if report.get(k, 0)}  # fmt: skip
    assert not bad, f"audit failed: {bad}; {report}"
    assert report["copies"] == PUBLISHERS * PER_PUBLISHER * SUBSCRIPTIONS
    if scenario.first is not None:  # the last start's recovery met the half-done one's work
        assert stats["recovery_finished"] >= 1 and stats["recovery_skipped"] >= 1, stats


def test_every_dispatch_crash_point_has_a_scenario() -> None:
    """A crash point added to `messaging.topics` without a scenario here fails this test."""
    source = (REPO / "messaging" / "topics.py").read_text()
    points = {re.sub(r"\{i\}", "<i>", p) for p in re.findall(r'crash_point\(f?"([^"]+)"\)', source)}
    covered = {
        re.sub(r"\.\d+$", ".<i>", s.point.partition(":")[0]) for s in SCENARIOS if s.point
    } | {re.sub(r"\.\d+$", ".<i>", s.first.partition(":")[0]) for s in SCENARIOS if s.first}
    assert points and points <= covered, points - covered


def test_kill_9_of_twopc_serve_cursor_during_topic_dispatch(tmp_path: Path) -> None:
    """The dispatcher inside a real ``twopc serve cursor`` (`CursorServer` starts it): producers
    send 3 x 30 non-persistent publications with ``publisher=`` in transactions on a log server,
    whose transfer carries them over TCP; the cursor server is killed at
    ``dispatch.after_copy.1:25`` and restarted by a supervisor, the log resends what was not
    acknowledged, the new process recovers its in-doubt publications. Same audit."""
    from coordinator import MemoryDecisionLog, TransactionManager
    from messaging.auth import SharedSecret
    from messaging.server import LogServer
    from resource_managers.sequencing import DoublingBackoff
    from tests.support.msg_cluster import SECRET, SERVE, Proc, free_port

    directory, port, point = tmp_path / "cursor", free_port(), "dispatch.after_copy.1:25"
    with Cursor(directory) as c:
        for i in range(SUBSCRIPTIONS):
            c.subscribe(TOPIC, f"s{i}")
    argv = [sys.executable, "-c", SERVE, "serve", "cursor", "--dir", str(directory),
            "--listen", f"127.0.0.1:{port}"]  # fmt: skip
    server = Proc("cursor", argv, tmp_path, crash_at=point)
    server.start()
    stop = threading.Event()

    def supervise() -> None:  # restart what died, as an init system would
        while not stop.wait(0.05):
            server.check()

    watcher = threading.Thread(target=supervise, daemon=True)
    watcher.start()
    log_server = LogServer(
        tmp_path / "log", SharedSecret(SECRET.encode()), cursor=("127.0.0.1", port),
        resend=DoublingBackoff(0.05, 0.3),
    ).start()  # fmt: skip
    tm = TransactionManager("producer", MemoryDecisionLog(), [log_server.resource],
                            recovery_interval=None, reaper_interval=None)  # fmt: skip
    try:
        for m in plan(PUBLISHERS, PER_PUBLISHER, False):
            with tm.transaction() as tx:
                tx.join(log_server.resource).send(TOPIC, m.message_id.encode(), persistent=False,
                                                  publisher=m.publisher)  # fmt: skip
        deadline = time.monotonic() + 60
        while log_server.mlog.stats().pending:  # the cursor has acknowledged everything
            assert time.monotonic() < deadline, server.text()[-3000:]
            time.sleep(0.05)
        time.sleep(1.0)  # let the workers fan the last acknowledged ones out
    finally:
        tm.close()
        log_server.close()
        stop.set()
        watcher.join(5)
        server.stop()
    for _ in range(3):  # a slow machine: what SIGTERM found unread, a clean restart finishes
        with Cursor(directory) as c:
            if not (c.topic_backlog() or c.in_doubt()):
                break
        server.start()
        time.sleep(1.5)
        server.stop()
    assert server.kills == 1 and f"crash point {point.partition(':')[0]} reached" in server.text()
    report = audit(directory, key=lambda body: body)
    ROWS.append({
        "point": f"{point} (serve cursor)", "mode": "np", "kills": server.kills,
        "in doubt at restarts": "-", "publications": report["publications"],
        "copies": report["copies"], "duplicates": report.get("duplicates", 0),
        "lost": report.get("lost", 0), "order violations": report.get("order violations", 0),
        "recovered": "-", "skipped (monitored)": "-",
    })  # fmt: skip
    bad = {k: report.get(k, 0) for k in ("duplicates", "lost", "phantom", "order violations",
                                           "in doubt", "backlog") if report.get(k, 0)}  # fmt: skip
    assert not bad, f"audit failed: {bad}; {report}\n{server.text()[-3000:]}"
