"""``twopc serve log`` and ``twopc serve cursor`` as real processes over TLS: an application sends
through the remote log in a transaction, the log server transfers to the cursor server, another
application receives through the remote cursor; SIGTERM stops both cleanly with nothing lost;
a server without a secret refuses to start with a clear message."""

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
from messaging.auth import SharedSecret, TlsConfig
from messaging.remote import RemoteCursor, RemoteMessageLog
from resource_managers.cursor import Cursor
from resource_managers.message_log import MessageLog
from tests.support.tls import make_certificate

REPO = Path(__file__).resolve().parents[2]
SERVE = "import sys; from coordinator.cli import main; sys.exit(main())"
SECRET = "serve test secret, at least 16 bytes"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return make_certificate(tmp_path_factory.mktemp("tls"))


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "TWOPC_SECRET": SECRET, **(env or {})},
    )


def listening(proc: subprocess.Popen[str]) -> str:
    """The address of the ``listening on`` line. Log lines may come first (a log whose cursor
    is still starting warns ``cannot reach cursor`` before it prints it); reading on after a
    wrong first line would wait for a live server's EOF for ever."""
    assert proc.stdout is not None
    seen = []
    while not (line := proc.stdout.readline()).startswith("listening on"):
        seen.append(line)
        assert line, "".join(seen)  # EOF: the server exited; what it said is the reason
    return line.split()[-1]


def port_of(proc: subprocess.Popen[str]) -> int:
    """The port a server started with ``--listen HOST:0`` says it listens on: the kernel's
    choice, so no test picks a free port that a parallel one takes before the server binds."""
    return int(listening(proc).rsplit(":", 1)[1])


@pytest.fixture
def servers(tmp_path: Path, tls: TlsConfig) -> Iterator[tuple[int, int, Path]]:
    flags = ["--tls-cert", str(tls.certfile), "--tls-key", str(tls.keyfile),
             "--tls-ca", str(tls.cafile)]  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(serve("cursor", "--dir", str(tmp_path / "cursor"),
                           "--listen", "127.0.0.1:0", *flags))  # fmt: skip
        cursor_port = port_of(procs[-1])
        procs.append(serve("log", "--dir", str(tmp_path / "log"), "--listen", "127.0.0.1:0",
                           "--cursor", f"127.0.0.1:{cursor_port}", *flags))  # fmt: skip
        yield port_of(procs[-1]), cursor_port, tmp_path
    finally:
        for proc in procs[::-1]:
            proc.send_signal(signal.SIGTERM)
        for proc in procs[::-1]:
            out, _ = proc.communicate(timeout=20)
            assert proc.returncode == 0, out
            assert "stopped" in out


def test_serve_over_tls_end_to_end_and_stop_cleanly(
    servers: tuple[int, int, Path], tls: TlsConfig
) -> None:
    log_port, cursor_port, _ = servers
    secret = SharedSecret(SECRET.encode())
    context = tls.client_context()
    log = RemoteMessageLog(("127.0.0.1", log_port), secret, tls=context,
                           server_hostname="localhost")  # fmt: skip
    cursor = RemoteCursor(("127.0.0.1", cursor_port), secret, tls=context,
                          server_hostname="localhost")  # fmt: skip
    tm = TransactionManager("serve-test", MemoryDecisionLog(), [log, cursor],
                            recovery_interval=None, reaper_interval=None)  # fmt: skip
    try:
        for i in range(5):
            with tm.transaction() as tx:
                tx.join(log).send("orders", f"m{i}".encode())
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(got) < 5 and time.monotonic() < deadline:
            with tm.transaction() as tx:
                got += [d.body for d in tx.join(cursor).receive_many("orders", 10, timeout=1.0)]
        assert got == [f"m{i}".encode() for i in range(5)]
    finally:
        tm.close()
        log.close()
        cursor.close()


def test_a_server_without_a_secret_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_SECRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, "serve", "cursor", "--dir", str(tmp_path / "c"),
         "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "no shared secret" in proc.stderr
    with Cursor(tmp_path / "c2"), MessageLog(tmp_path / "l2"):
        pass  # the stores themselves need no secret
