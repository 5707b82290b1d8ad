"""Two log servers, one destination, one cursor, in real processes, with ``kill -9`` (issue 15,
point 1: a stream per log and destination).

Producers ``p0`` and ``p1`` send "orders" through log server ``log``, ``p2`` through ``log1``;
each log numbers "orders" in its own epoch and the cursor keeps one filter state per log, so both
feed the one queue that the single consumer drains. Before issue 15 the two logs fenced each other
by epoch on the shared stream. The audit (`tests.support.msg_cluster`): every committed message
consumed once (0 lost, 0 duplicated), none of a rolled-back transaction, each producer's commit
order kept (so each log's order: a producer commits through one log, in order), nothing left
prepared in PostgreSQL, either log or the cursor. Kills hit both logs and the cursor at named
crash points, the new one (``xfer.cursor.after_announce``: a log's ORIGIN recorded lazily, nothing
of it judged yet) included; the supervisor restarts what died.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.msg_cluster import Cluster, assert_exactly_once

pytestmark = [pytest.mark.crash, pytest.mark.slow]

#: (process, crash point); None: no kill
CRASHES: list[tuple[str, str] | None] = [
    None,
    ("cursor", "xfer.cursor.after_announce:2"),
    ("cursor", "xfer.cursor.after_persist:3"),
    ("cursor", "xfer.cursor.after_ack:4"),
    ("log", "xfer.log.after_send:3"),
    ("log1", "xfer.log.before_compact:2"),
    ("log1", "mlog.mlog.after_append:3"),
    ("log", "mlog.after_open:1"),  # the first open: its identity chosen and durable
]


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str) -> Iterator[Cluster]:
    made = Cluster(tmp_path, pg_url, logs=2)
    yield made
    made.close()


@pytest.mark.parametrize(
    "crash", CRASHES, ids=["no kill" if c is None else f"{c[0]}@{c[1]}" for c in CRASHES]
)
def test_two_logs_one_destination_one_cursor_exactly_once_per_log_order(
    cluster: Cluster, crash: tuple[str, str] | None
) -> None:
    """``exactly_once_per_log``: 0 lost, 0 duplicated, each producer's (so each log's) order."""
    kill = dict([crash]) if crash else {}
    cluster.start_servers(
        crash_cursor=kill.get("cursor"),
        crash_servers={n: p for n, p in kill.items() if n.startswith("log")},
    )
    for pid, log in (("p0", 0), ("p1", 0), ("p2", 1)):
        cluster.add_producer(pid, txs=12, per_tx=3, rollback_every=5, log=log)
    cluster.add_consumer("c0", batch=2)
    cluster.run_to_completion(timeout=150)
    report: dict[str, Any] = cluster.audit(ordered=True)
    assert_exactly_once(report, ordered=True)
    assert sorted(report["by_producer"]) == ["p0", "p1", "p2"]  # both logs carried messages
    if crash is None:
        assert report["committed"] == 3 * 10 * 3  # every fifth transaction rolled back
    else:  # a producer whose log server is down fails its transaction (and goes on)
        process, point = crash
        assert report["kills"].get(process, 0) >= 1, f"{point} never fired in {process}: {report}"
    print("audit:", report)


def test_random_kill_9_of_both_logs_and_the_cursor(cluster: Cluster) -> None:
    """``exactly_once_per_log`` under kills at random moments rather than named points: every
    0.3-1.5 s one of the three servers is killed with SIGKILL (the supervisor restarts it) while
    the producers send through both logs. Seeded (``TWOPC_MANY_LOGS_SEED`` replays a run)."""
    cluster.start_servers()
    for pid, log in (("p0", 0), ("p1", 1), ("p2", 1)):
        cluster.add_producer(pid, txs=25, per_tx=2, rollback_every=5, log=log)
    cluster.add_consumer("c0", batch=3)
    cluster.run_killing_at_random(("log", "log1", "cursor"), "TWOPC_MANY_LOGS_SEED")
    report: dict[str, Any] = cluster.audit(ordered=True)
    assert_exactly_once(report, ordered=True)
    assert sum(report["kills"].values()) >= 1, report
    print("audit:", report)
