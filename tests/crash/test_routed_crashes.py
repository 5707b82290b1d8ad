"""One log server, two cursor servers, in real processes, with ``kill -9`` (issue 15, point 2:
routes). The log routes ``orders*`` to ``cursor1`` and everything else to its default ``cursor``:
one transfer per cursor. Producer ``p0`` sends "orders", ``p1`` "invoices"; consumer ``c1``
drains "orders" at ``cursor1``, ``c0`` "invoices" at ``cursor``. Kills hit the log and either
cursor at named crash points and at random moments; the supervisor restarts what died. The audit
(`tests.support.msg_cluster`): 0 lost, 0 duplicated, each producer's order kept, nothing left
prepared or unacknowledged anywhere, and no message at the cursor it was not routed to.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resource_managers.cursor import Cursor
from resource_managers.sequencing import split_key
from tests.support.msg_cluster import Cluster, assert_exactly_once

pytestmark = [pytest.mark.crash, pytest.mark.slow]

CRASHES: list[Any] = [
    None,
    ("cursor1", "xfer.cursor.after_persist:2"),
    ("cursor", "xfer.cursor.after_ack:3"),
    ("log", "xfer.log.after_send:4"),
    ("log", "xfer.log.before_compact:3"),
]


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str) -> Iterator[Cluster]:
    made = Cluster(tmp_path, pg_url, cursors=2, routes=(("orders*", 1),))
    yield made
    made.close()


def _start(cluster: Cluster, crash: dict[str, str], txs: int) -> None:
    cluster.start_servers(
        crash_cursor=crash.get("cursor"),
        crash_servers={n: p for n, p in crash.items() if n != "cursor"},
    )
    cluster.add_producer("p0", txs=txs, per_tx=3, rollback_every=5, destination="orders")
    cluster.add_producer("p1", txs=txs, per_tx=3, rollback_every=5, destination="invoices")
    cluster.add_consumer("c0", batch=2, destination="invoices", cursor=0)
    cluster.add_consumer("c1", batch=2, destination="orders", cursor=1)


def _audit(cluster: Cluster, tmp_path: Path) -> dict[str, Any]:
    report: dict[str, Any] = cluster.audit(ordered=True)
    assert_exactly_once(report, ordered=True)
    assert sorted(report["by_producer"]) == ["p0", "p1"]
    for name, wrong in (("cursor", "orders"), ("cursor1", "invoices")):
        with Cursor(tmp_path / name) as cursor:  # never sent there, not even once
            streams = cursor.filter_state()["streams"]
            assert not [k for k in streams if split_key(k)[1] == wrong], (name, streams)
    return report


@pytest.mark.parametrize(
    "crash",
    CRASHES,
    ids=["no kill" if c is None else "@".join(c) for c in CRASHES],
)
def test_routed_destinations_exactly_once_with_kill_9(
    cluster: Cluster, tmp_path: Path, crash: tuple[str, str] | None
) -> None:
    """``one_cursor_per_stream`` and ``independent_transfers`` under named kills."""
    _start(cluster, dict([crash]) if crash else {}, txs=12)
    cluster.run_to_completion(timeout=150)
    report = _audit(cluster, tmp_path)
    if crash is not None:
        process, point = crash
        assert report["kills"].get(process, 0) >= 1, f"{point} never fired in {process}: {report}"
    print("audit:", report)


def test_routed_destinations_with_random_kill_9(cluster: Cluster, tmp_path: Path) -> None:
    """The same under SIGKILL of the log or either cursor every 0.3-1.5 s (seeded:
    ``TWOPC_ROUTES_SEED`` replays a run)."""
    _start(cluster, {}, txs=25)
    cluster.run_killing_at_random(("log", "cursor", "cursor1"), "TWOPC_ROUTES_SEED")
    report = _audit(cluster, tmp_path)
    assert sum(report["kills"].values()) >= 1, report
    print("audit:", report)
