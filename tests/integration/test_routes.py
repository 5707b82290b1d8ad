"""Routes: one log, many cursors (issue 15, point 2).

Invariants named here: ``one_cursor_per_stream`` (a destination's messages, persistent or not, go
to the cursor its first matching route names, else to the default cursor, and nowhere else), and
``independent_transfers`` (one transfer per cursor, each with its own window, acknowledgments and
reconnects: a cursor killed with SIGKILL holds back only the destinations routed to it; once it
is back they arrive exactly once and in order, while the other cursor's kept flowing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import MemoryDecisionLog, TransactionManager
from messaging.auth import SharedSecret
from messaging.remote import RemoteCursor, RemoteMessageLog
from messaging.routes import Route
from messaging.server import CursorServer, LogServer
from resource_managers.sequencing import DoublingBackoff
from tests.support.msg_cluster import free_port

REPO = Path(__file__).resolve().parents[2]
SERVE = "import sys; from coordinator.cli import main; sys.exit(main())"
KEY = "routes test secret, at least 16 bytes"
SECRET = SharedSecret(KEY.encode())


def bodies(server: CursorServer, queue: str) -> list[bytes]:
    return [d.body for d in server.cursor.available(queue)]


def test_each_destination_goes_to_the_cursor_its_route_names(tmp_path: Path) -> None:
    """``one_cursor_per_stream``, embedded: ``orders.*`` to cursor B (first match wins, so
    ``orders.audit`` to C), everything else to the default A; non-persistent messages follow
    their destination; one transfer per cursor."""
    with (
        CursorServer(tmp_path / "a", SECRET, listen=("127.0.0.1", 0)) as a,
        CursorServer(tmp_path / "b", SECRET, listen=("127.0.0.1", 0)) as b,
        CursorServer(tmp_path / "c", SECRET, listen=("127.0.0.1", 0)) as c,
    ):
        routes = [Route("orders.audit", c.address), Route("orders.*", b.address)]
        with (
            LogServer(
                tmp_path / "log",
                SECRET,
                cursor=a.address,
                routes=routes,
                resend=DoublingBackoff(0.1, 0.5),
            ) as log,  # fmt: skip
            TransactionManager("app", MemoryDecisionLog(), [log.resource]) as tm,
        ):
            assert list(log.transfers) == [a.address, c.address, b.address]
            assert log.transfer is log.transfers[a.address]
            for n in range(5):
                with tm.transaction() as tx:
                    branch = tx.join(log.resource)
                    for destination in ("orders.created", "orders.audit", "invoices"):
                        branch.send(destination, f"{destination}-{n}".encode())
                    branch.send("orders.paid", f"np-{n}".encode(), persistent=False)
            assert log.wait_idle(15)
        expected = {
            (b, "orders.created"), (b, "orders.paid"), (c, "orders.audit"), (a, "invoices"),
        }  # fmt: skip
        for server in (a, b, c):
            for queue in ("orders.created", "orders.paid", "orders.audit", "invoices"):
                got = bodies(server, queue)
                if (server, queue) not in expected:
                    assert got == [], (server.address, queue)
                    continue
                prefix = "np" if queue == "orders.paid" else queue
                assert got == [f"{prefix}-{n}".encode() for n in range(5)]


def serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"},
             "TWOPC_SECRET": KEY},
    )  # fmt: skip


def listening(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("listening on"), line + proc.stdout.read()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in reversed(started):
        stop(proc)


def receive_all(cursor: RemoteCursor, queue: str, n: int, timeout: float = 30) -> list[bytes]:
    """Receive and commit until ``n`` messages came (or the time is up)."""
    tm = TransactionManager("consumer", MemoryDecisionLog(), [cursor],
                            recovery_interval=None, reaper_interval=None)  # fmt: skip
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n and time.monotonic() < deadline:
            with tm.transaction() as tx:
                got += [d.body for d in tx.join(cursor).receive_many(queue, 50, timeout=0.5)]
    finally:
        tm.close()
    return got


def test_a_killed_cursor_holds_back_only_its_own_destinations(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    """``independent_transfers``, in real processes: ``twopc serve log --route 'orders.*=B'``
    with default cursor A. B is killed with SIGKILL; ``invoices`` keep reaching A while
    ``orders.created`` waits in the log; B restarts on its directory and gets every order once,
    in order."""
    port_a, port_b, port_log = free_port(), free_port(), free_port()

    def cursor(name: str, port: int) -> subprocess.Popen[str]:
        proc = serve("cursor", "--dir", str(tmp_path / name), "--listen", f"127.0.0.1:{port}")
        procs.append(proc)
        listening(proc)
        return proc

    cursor("a", port_a)
    b = cursor("b", port_b)
    log = serve("log", "--dir", str(tmp_path / "log"), "--listen", f"127.0.0.1:{port_log}",
                "--cursor", f"127.0.0.1:{port_a}",
                "--route", f"orders.*=127.0.0.1:{port_b}")  # fmt: skip
    procs.append(log)
    listening(log)
    remote = RemoteMessageLog(("127.0.0.1", port_log), SECRET)
    at_a = RemoteCursor(("127.0.0.1", port_a), SECRET)
    at_b = RemoteCursor(("127.0.0.1", port_b), SECRET)
    tm = TransactionManager("producer", MemoryDecisionLog(), [remote],
                            recovery_interval=None, reaper_interval=None)  # fmt: skip

    def send(first: int, last: int) -> None:
        for n in range(first, last):
            with tm.transaction() as tx:
                tx.join(remote).send("orders.created", f"o-{n}".encode())
                tx.join(remote).send("invoices", f"i-{n}".encode())

    try:
        send(0, 5)
        assert receive_all(at_b, "orders.created", 5) == [f"o-{n}".encode() for n in range(5)]
        b.kill()  # SIGKILL
        b.wait()
        send(5, 10)
        invoices = receive_all(at_a, "invoices", 10)  # A unaffected by B's absence
        assert invoices == [f"i-{n}".encode() for n in range(10)]
        cursor("b", port_b)  # B again, on its directory
        orders = receive_all(at_b, "orders.created", 5)
        assert orders == [f"o-{n}".encode() for n in range(5, 10)]
        assert receive_all(at_b, "orders.created", 1, timeout=2) == []  # nothing twice
        assert receive_all(at_a, "orders.created", 1, timeout=1) == []  # nothing misrouted
    finally:
        tm.close()
        for client in (remote, at_a, at_b):
            client.close()
