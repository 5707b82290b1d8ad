"""Durable subscribers end to end, in real processes (seed 003): producers publish to a topic
through ``twopc serve log`` in transactions with PostgreSQL; ``twopc serve cursor`` fans every
publication out to two durable subscriptions with its topic dispatcher; one subscriber is killed
mid-stream and restarted by the supervisor, the other connects only after every publication was
made (it missed them all while disconnected). Each subscriber must get every committed
publication exactly once, in each publisher's order, and the store must be empty afterwards: a
publication is removed only once both durable subscribers have acknowledged it.

    pytest -m crash tests/crash/test_durable_subscribers.py -s    # prints the audit per case
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from resource_managers.cursor import Cursor, subscription_queue
from tests.support.msg_cluster import Cluster

pytestmark = pytest.mark.crash

TOPIC = "topic:orders"
SUBSCRIBERS = ("billing", "audit")


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str) -> Iterator[Cluster]:
    with Cursor(tmp_path / "cursor") as cursor:  # durable subscriptions exist before any publish
        for name in SUBSCRIBERS:
            cursor.subscribe(TOPIC, name)
    c = Cluster(tmp_path, pg_url)
    try:
        yield c
    finally:
        c.close()


def consumed_by(engine: sa.Engine) -> dict[str, list[str]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT consumer, key FROM consumed ORDER BY id")).all()
    out: dict[str, list[str]] = {name: [] for name in SUBSCRIBERS}
    for consumer, key in rows:
        out.setdefault(consumer, []).append(key)
    return out


def wait_until(cluster: Cluster, engine: sa.Engine, done: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        cluster._deadline(deadline, what)


def audit(cluster: Cluster, engine: sa.Engine) -> dict[str, Any]:
    cluster.close()
    with engine.connect() as conn:
        produced = {r.key: (r.producer, r.tx, r.j) for r in conn.execute(
            sa.text("SELECT key, producer, tx, j FROM produced"))}  # fmt: skip
    report: dict[str, Any] = {"committed": len(produced), "kills": {
        n: p.kills for n, p in cluster.procs.items() if p.kills}}  # fmt: skip
    for name, keys in consumed_by(engine).items():
        counts = Counter(keys)
        last: dict[str, tuple[int, int]] = {}
        disorder = 0
        for key in keys:
            producer, tx, j = produced.get(key, ("?", 0, 0))
            disorder += last.get(producer, (0, -1)) >= (tx, j)
            last[producer] = (tx, j)
        report[name] = {
            "consumed": len(keys),
            "duplicates": sum(n - 1 for n in counts.values() if n > 1),
            "lost": len(set(produced) - set(counts)),
            "phantom": len(set(counts) - set(produced)),
            "out_of_order": disorder,
        }
    with Cursor(cluster.workdir / "cursor") as cursor:
        report["store"] = {
            "in_doubt": len(cursor.in_doubt()),
            "topic_backlog": cursor.topic_backlog(),
            "held": sum(len(cursor.available(subscription_queue(TOPIC, n))) for n in SUBSCRIBERS),
            "in_flight": cursor.stats().in_flight,
            "prepared": cursor.stats().prepared,
        }
    return report


CASES = {
    "clean": (None, None),
    "subscriber-killed-after-prepare": ("tm.after_prepare.1", None),
    "subscriber-killed-after-decision": ("tm.after_decision_fsync", None),
    "cursor-killed-mid-fan-out": (None, "dispatch.after_copy.1:7"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_durable_subscribers_disconnect_miss_crash_and_reconnect(
    cluster: Cluster, pg_url: str, case: str
) -> None:
    """Seed 003: durable subscriptions keep publications for a disconnected subscriber, a
    subscriber that crashes gets its unacknowledged publication again, and every durable
    subscriber gets every publication once, in each publisher's order."""
    crash_subscriber, crash_cursor = CASES[case]
    cluster.start_servers(crash_cursor=crash_cursor)
    for pid in ("p1", "p2"):
        cluster.add_producer(pid, txs=12, per_tx=3, rollback_every=4, destination=TOPIC)
    queue = subscription_queue(TOPIC, "billing")
    cluster.add_consumer("billing", batch=2, crash_at=crash_subscriber, destination=queue)
    engine = sa.create_engine(pg_url)
    try:
        producers = [p for n, p in cluster.procs.items() if n.startswith("producer-")]
        wait_until(cluster, engine, lambda: all(p.finished for p in producers),
                   "producers", 120)  # fmt: skip
        cluster.add_consumer("audit", destination=subscription_queue(TOPIC, "audit"))

        def everyone_has_everything() -> bool:
            with engine.connect() as conn:
                produced = conn.execute(sa.text("SELECT count(*) FROM produced")).scalar_one()
            return all(len(set(k)) >= produced for k in consumed_by(engine).values())

        wait_until(cluster, engine, everyone_has_everything, "subscribers", 120)
        cluster.stop_file.touch()
        consumers = [p for n, p in cluster.procs.items() if n.startswith("consumer-")]
        wait_until(cluster, engine, lambda: all(p.finished for p in consumers),
                   "subscribers to stop", 60)  # fmt: skip
        report = audit(cluster, engine)
    finally:
        engine.dispose()
    print(case, report)
    assert report["committed"] > 0
    for name in SUBSCRIBERS:
        assert report[name]["consumed"] == report["committed"], report
        assert not any(report[name][k] for k in ("duplicates", "lost", "phantom",
                                                 "out_of_order")), report  # fmt: skip
    assert not any(report["store"].values()), report
    if crash_subscriber or crash_cursor:
        assert report["kills"], report
