"""Server metrics and the queue commands an operator fixes queues with, against real
``twopc serve log`` and ``twopc serve cursor`` processes.

- ``--metrics HOST:PORT``: both servers' ``/metrics`` scraped with an HTTP client and parsed
  with `prometheus_client`'s own parser; every family has its help and type; the numbers say
  what happened (messages transferred, acknowledged, waiting, in the DLQ).
- ``twopc stats --connect``: the same families online over the authenticated protocol, for a
  log and a cursor, found out or named with ``--server``.
- The cursor's expiry sweep moves an expired message from behind a live one to the DLQ with its
  deadline; ``twopc queue list`` shows depths online; ``twopc queue drop|dead-letter`` takes a
  message out of its queue so the next one is received; what cannot be done is one line.
- The stdlib endpoint (no `prometheus_client`) serves the same names.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coordinator import Xid
from messaging.auth import SharedSecret
from messaging.metrics import MetricsEndpoint, render_text
from messaging.server import CursorServer
from tests.integration.cursor_stack import SECRET, Stack, twopc, wait_for
from tests.support.msg_cluster import free_port


@dataclass
class Servers(Stack):
    """A cursor (expiry sweep every 0.2 s) and a log transferring to it, both with --metrics."""

    cursor_metrics: int = 0  # the kernel's choice at the first start, as the servers' ports
    log_metrics: int = 0

    def start(self) -> None:
        cursor = self.start_cursor(
            "--metrics", f"127.0.0.1:{self.cursor_metrics}", "--expiry-sweep", "0.2"
        )
        self.cursor_metrics = cursor.metrics_port
        self.log_metrics = self.start_log("--metrics", f"127.0.0.1:{self.log_metrics}").metrics_port


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    running = Servers(tmp_path, None)
    try:
        running.start()  # a server that started before another failed to is stopped too
        yield running
    finally:
        running.stop()


def scrape(port: int) -> dict[str, Any]:
    """``/metrics`` parsed by prometheus_client: family name -> family (the test is skipped
    without the ``metrics`` extra; the other tests here need none)."""
    parser = pytest.importorskip("prometheus_client.parser")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for f in families.values():
        assert f.documentation, f"{f.name} has no HELP"
        assert f.type in ("counter", "gauge"), (f.name, f.type)
    return families


def sample(families: dict[str, Any], name: str, **labels: str) -> float:
    """The value of ``name`` (a counter's ``_total`` sample) with exactly ``labels``."""
    family = families[name.removesuffix("_total")]
    found = [s.value for s in family.samples
             if s.labels == labels and not s.name.endswith("_created")]  # fmt: skip
    assert len(found) == 1, (name, labels, family.samples)
    return float(found[0])


def ok(*args: str) -> str:
    done = twopc(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_both_servers_serve_metrics_that_prometheus_parses(servers: Servers) -> None:
    servers.send("orders", b"a", b"b", b"c")
    cursor_at = f"127.0.0.1:{servers.cursor_port}"
    wait_for(lambda: sample(scrape(servers.log_metrics), "twopc_transfer_acked_total",
                            cursor=cursor_at) == 3)  # fmt: skip
    log = scrape(servers.log_metrics)
    assert sample(log, "twopc_transfer_sent_total", cursor=cursor_at) >= 3
    assert sample(log, "twopc_transfer_window", cursor=cursor_at) == 0
    assert sample(log, "twopc_transfer_connected", cursor=cursor_at) == 1
    assert sample(log, "twopc_journal_records_total", durability="forced") >= 1
    assert sample(log, "twopc_journal_bytes_written_total") > 0
    assert sample(log, "twopc_listener_authenticated_total") >= 1
    assert sample(log, "twopc_internal_errors_total") == 0
    assert sample(log, "twopc_log_prepared") == 0
    assert sample(log, "twopc_log_refusing_writes") == 0

    cur = scrape(servers.cursor_metrics)
    assert sample(cur, "twopc_queue_available", queue="orders") == 3
    assert sample(cur, "twopc_queue_dead_letters", queue="orders") == 0
    assert sample(cur, "twopc_receiver_messages_total") >= 3
    assert sample(cur, "twopc_journal_fsyncs_total") >= 1
    assert sample(cur, "twopc_listener_open_connections") >= 1  # the log's transfer
    assert sample(cur, "twopc_dispatch_backlog") == 0
    assert sample(cur, "twopc_cursor_refusing_writes") == 0

    with servers.cursor() as remote:  # a durable subscription shows up with its gauges
        remote.subscribe("topic:news", "audit")
    cur = scrape(servers.cursor_metrics)
    news = {"topic": "topic:news", "subscription": "audit"}
    assert sample(cur, "twopc_subscription_connected", **news) == 0


def test_stats_online_from_a_log_and_a_cursor(servers: Servers) -> None:
    servers.send("orders", b"x")
    cursor_at = f"127.0.0.1:{servers.cursor_port}"
    log_at = f"127.0.0.1:{servers.log_port}"
    wait_for(lambda: "twopc_queue_available" in ok("stats", "--connect", cursor_at))
    out = ok("stats", "--connect", cursor_at)
    assert "metric" in out.splitlines()[0]
    assert any(line.split()[:3] == ["twopc_queue_available", "queue=orders", "1"]
               for line in out.splitlines()), out  # fmt: skip
    found = json.loads(ok("stats", "--connect", log_at, "--json"))  # found out: a log
    names = {f["name"] for f in found}
    assert {"twopc_transfer_acked_total", "twopc_log_pending"} <= names
    named = json.loads(ok("stats", "--connect", log_at, "--server", "log", "--json"))
    assert {f["name"] for f in named} == names
    done = twopc("stats", "--connect", f"127.0.0.1:{free_port()}")
    assert done.returncode == 5 and done.stderr.startswith("twopc: "), done.stderr
    assert "Traceback" not in done.stderr


def test_the_sweep_dead_letters_an_expired_message_behind_a_live_one(servers: Servers) -> None:
    """The live head is never received, so only the sweep can find the expired one."""
    servers.send("orders", b"live")
    [late] = servers.send("orders", b"late", ttl=1.5)
    with servers.cursor() as remote:
        wait_for(lambda: [d.message_id for d in remote.dead_letters("orders")] == [late])
        [dead] = remote.dead_letters("orders")
    assert (dead.reason or "").startswith("expired: its time to live ran out at ")
    assert f"({dead.message.expires_at} ms)" in (dead.reason or "")
    stats = json.loads(ok("stats", "--connect", f"127.0.0.1:{servers.cursor_port}", "--json"))
    value = {(f["name"], json.dumps(s["labels"], sort_keys=True)): s["value"]
             for f in stats for s in f["samples"]}  # fmt: skip
    assert value["twopc_cursor_expired_swept_total", "{}"] == 1
    assert value["twopc_queue_dead_letters", '{"queue": "orders"}'] == 1
    rows = json.loads(ok("queue", "list", "--connect", f"127.0.0.1:{servers.cursor_port}",
                         "--json"))  # fmt: skip
    assert rows == [{"queue": "orders", "available": 1, "in_flight": 0, "dead_letters": 1,
                     "transactional": True}]  # fmt: skip


def test_drop_and_dead_letter_move_a_stuck_queue(servers: Servers) -> None:
    """A consumer that keeps rolling back the head message: the operator dead-letters it, and
    the consumer's next receive gets the message after it."""
    poison, second, third = servers.send("orders", b"poison", b"second", b"third")
    connect = ["--connect", f"127.0.0.1:{servers.cursor_port}"]
    with servers.cursor() as remote:
        xid = Xid.branch_of(f"metrics-test:{uuid.uuid4().hex}", remote.name)
        got = remote.start(xid).receive("orders", timeout=20)
        assert got is not None and got.message_id == poison
        done = twopc("queue", "dead-letter", "orders", poison, *connect)
        assert done.returncode == 1 and "handed out" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        remote.rollback(xid)  # the consumer gives up on it: it waits at the head again
        out = ok("queue", "dead-letter", "orders", poison, "--why", "bad schema", *connect)
        assert out.strip() == f"dead-lettered to orders.DLQ: {poison} of orders"
        ok("queue", "drop", "orders", second, *connect)
        xid2 = Xid.branch_of(f"metrics-test:{uuid.uuid4().hex}", remote.name)
        got = remote.start(xid2).receive("orders", timeout=20)
        assert got is not None and got.message_id == third  # the stream moved
        remote.rollback(xid2)
        [dead] = remote.dead_letters("orders")
        assert dead.message_id == poison
        assert dead.reason == "dead-lettered by an operator: bad schema"
    done = twopc("queue", "drop", "orders", "no-such-id", *connect)
    assert done.returncode == 1 and "no message no-such-id waits in orders" in done.stderr


def test_the_stdlib_endpoint_serves_the_same_names(tmp_path: Path) -> None:
    """Without `prometheus_client` (forced here): the text format 0.0.4, every family typed and
    documented, the same families as the server's own rendering."""
    secret = SharedSecret(SECRET.encode())
    with CursorServer(tmp_path / "c", secret, listen=("127.0.0.1", 0)) as server:
        endpoint = MetricsEndpoint(("127.0.0.1", 0), server.families, use_client=False).start()
        try:
            url = f"http://127.0.0.1:{endpoint.address[1]}/metrics"
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = reply.read().decode()
        finally:
            endpoint.close()
        ours = render_text(server.families())

    def declared(text: str, kind: str) -> list[str]:
        return [line.split()[2] for line in text.splitlines() if line.startswith(kind)]

    assert declared(text, "# TYPE") == declared(ours, "# TYPE") == declared(text, "# HELP")
    assert {"twopc_queue_available", "twopc_journal_records_total"} <= set(declared(text, "# TYPE"))
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    assert {f.name for f in text_string_to_metric_families(text)} == {
        f.name for f in text_string_to_metric_families(ours)
    }


def test_operator_mistakes_are_one_line(tmp_path: Path) -> None:
    """A metrics port in use, a wrong secret for stats, a negative sweep interval: exit 2, one
    line naming what to fix, no traceback, nothing left running."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = twopc("serve", "cursor", "--dir", str(tmp_path / "c"), "--listen", "127.0.0.1:0",
                     "--metrics", f"127.0.0.1:{port}")  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    prefix = f"twopc: [configuration] cannot serve metrics on 127.0.0.1:{port}"
    assert done.stderr.startswith(prefix), done.stderr
    assert "address already in use" in done.stderr and "Traceback" not in done.stderr
    done = twopc("serve", "cursor", "--dir", str(tmp_path / "c"), "--expiry-sweep", "-1")
    assert done.returncode == 2 and "--expiry-sweep must be >= 0" in done.stderr, done.stderr
    with CursorServer(tmp_path / "s", SharedSecret(SECRET.encode()),
                      listen=("127.0.0.1", 0)) as server:  # fmt: skip
        at = f"127.0.0.1:{server.address[1]}"
        done = twopc("stats", "--connect", at, env={"TWOPC_SECRET": "another secret, 16+ bytes"})
    assert done.returncode == 2 and "refused this client" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_queue_commands_offline_on_a_stopped_cursors_directory(tmp_path: Path) -> None:
    from resource_managers.cursor import Cursor
    from resource_managers.message_log import Message
    from resource_managers.sequencing import Frame

    with Cursor(tmp_path) as cursor:
        ids = []
        for seq, body in enumerate((b"stuck", b"next"), 1):
            m = Message(uuid.uuid4().hex, "orders", body)
            cursor.deliver(Frame("orders", 1, seq, seq - 1, m.message_id), m)
            ids.append(m.message_id)
    offline = ["--dir", str(tmp_path)]
    ok("queue", "dead-letter", "orders", ids[0], *offline)
    rows = json.loads(ok("queue", "list", "--json", *offline))
    assert rows == [{"queue": "orders", "available": 1, "in_flight": 0, "dead_letters": 1,
                     "transactional": True}]  # fmt: skip
    out = ok("queue", "list", *offline)
    assert out.splitlines()[0].split() == ["queue", "available", "in_flight", "dead_letters",
                                           "transactional"]  # fmt: skip
