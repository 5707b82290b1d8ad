"""Real ``twopc serve log`` and ``twopc serve cursor`` processes for the administration tests
(`test_remote_admin`, `test_admin_cli`), the ``twopc`` command line run as a process, and the
two ways a message ends up dead (seed 004): too many deliveries, and rejected by a
non-transactional queue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from coordinator import MemoryDecisionLog, TransactionManager, Xid
from messaging.auth import SharedSecret, TlsConfig
from messaging.remote import RemoteCursor, RemoteMessageLog

REPO = Path(__file__).resolve().parents[2]
TWOPC = "import sys; from coordinator.cli import main; sys.exit(main())"
SECRET = "admin test secret, at least 16 bytes"
MAX_DELIVERIES = 2


def twopc(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``twopc ARGS`` as a process, with the test secret in its environment."""
    return subprocess.run(
        [sys.executable, "-c", TWOPC, *args], capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "TWOPC_SECRET": SECRET, **(env or {})}, timeout=60,
    )  # fmt: skip


@dataclass
class Served:
    """A ``twopc serve`` process and the ports it printed: the kernel's choice for a port 0, so
    no test picks a free port that a parallel test then takes before the server binds it."""

    proc: subprocess.Popen[str]
    port: int
    metrics_port: int = 0


def _port(line: str) -> int:
    return int(line.strip().removesuffix("/metrics").rsplit(":", 1)[1])


def _serve(*args: str) -> Served:
    proc = subprocess.Popen(
        [sys.executable, "-c", TWOPC, "serve", *args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "TWOPC_SECRET": SECRET},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on"):
        proc.kill()
        raise AssertionError(line + proc.stdout.read())
    served = Served(proc, _port(line))
    while "--metrics" in args and not served.metrics_port:
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError(f"no metrics endpoint: {proc.stdout.read()}")
        if line.startswith("metrics on"):
            served.metrics_port = _port(line)
    return served


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "stopped" in out, out


@dataclass
class Stack:
    """A log server transferring to a cursor server (``--max-deliveries 2``)."""

    root: Path
    tls: TlsConfig | None
    #: 0 until the first `start` (the kernel picks); a restart keeps the port
    cursor_port: int = 0
    log_port: int = 0
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def cursor_dir(self) -> Path:
        return self.root / "cursor"

    @property
    def secret(self) -> SharedSecret:
        return SharedSecret(SECRET.encode())

    @property
    def connect(self) -> list[str]:
        """The ``twopc`` flags that reach the cursor server."""
        flags = ["--connect", f"127.0.0.1:{self.cursor_port}"]
        if self.tls is not None:
            flags += ["--tls-ca", str(self.tls.cafile)]
        return flags

    def tls_flags(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--tls-cert", str(self.tls.certfile), "--tls-key", str(self.tls.keyfile),
                "--tls-ca", str(self.tls.cafile)]  # fmt: skip

    def start(self) -> None:
        self.start_cursor("--max-deliveries", str(MAX_DELIVERIES), *self.tls_flags())
        self.start_log(*self.tls_flags())

    def start_cursor(self, *flags: str) -> Served:
        cursor = _serve("cursor", "--dir", str(self.cursor_dir),
                        "--listen", f"127.0.0.1:{self.cursor_port}", *flags)  # fmt: skip
        self.procs.append(cursor.proc)
        self.cursor_port = cursor.port
        return cursor

    def start_log(self, *flags: str) -> Served:
        log = _serve("log", "--dir", str(self.root / "log"), "--listen",
                     f"127.0.0.1:{self.log_port}", "--cursor", f"127.0.0.1:{self.cursor_port}",
                     *flags)  # fmt: skip
        self.procs.append(log.proc)
        self.log_port = log.port
        return log

    def stop(self) -> None:
        """SIGTERM both; each must stop cleanly. The cursor directory is free afterwards."""
        procs, self.procs = self.procs[::-1], []
        for proc in procs:
            _stop(proc)

    def cursor(self) -> RemoteCursor:
        context = self.tls.client_context() if self.tls is not None else None
        return RemoteCursor(("127.0.0.1", self.cursor_port), self.secret, tls=context, timeout=10)

    def send(
        self,
        destination: str,
        *bodies: bytes,
        admin_queue: str | None = None,
        ttl: float | None = None,
    ) -> list[str]:
        """Commit ``bodies`` to ``destination`` through the log server; their message ids."""
        context = self.tls.client_context() if self.tls is not None else None
        log = RemoteMessageLog(("127.0.0.1", self.log_port), self.secret, tls=context)
        tm = TransactionManager("admin-test", MemoryDecisionLog(), [log],
                                recovery_interval=None, reaper_interval=None)  # fmt: skip
        try:
            with tm.transaction() as tx:
                branch = tx.join(log)
                return [branch.send(destination, b, ttl=ttl, admin_queue=admin_queue)
                        for b in bodies]  # fmt: skip
        finally:
            tm.close()
            log.close()


@contextmanager
def running_stack(root: Path, tls: TlsConfig | None = None) -> Iterator[Stack]:
    stack = Stack(root, tls)
    try:
        stack.start()  # a server that started before another failed to is stopped too
        yield stack
    finally:
        stack.stop()


def poison(cursor: RemoteCursor, queue: str, wait: float = 20.0) -> str:
    """Receive the next message of ``queue`` and roll back, until it is dead-lettered for too
    many deliveries (``MAX_DELIVERIES``); its id."""
    message_id = None
    for attempt in range(MAX_DELIVERIES):
        xid = Xid.branch_of(f"admin-test:poison-{time.monotonic_ns()}-{attempt}", cursor.name)
        got = cursor.start(xid).receive(queue, timeout=wait)
        assert got is not None, f"nothing arrived in {queue}"
        assert message_id in (None, got.message_id)
        message_id = got.message_id
        cursor.rollback(xid)
    assert message_id is not None
    return message_id


def wait_for(check: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll ``check()`` until it is true."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)
