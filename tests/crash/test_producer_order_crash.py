"""``kill -9`` of a log server at ``mlog.<name>.after_earlier_commits``: a prepare that names an
earlier branch whose commit was lost (`tests/integration/test_producer_order.py` explains the
mechanism) commits it lazily, then the server dies before anything is durable. After a restart
the earlier branch is prepared again, the new one never prepared; the client's next prepare
names the earlier one again, and the producer's messages come out in its commit order.
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

from coordinator import TransientError, Vote, Xid
from messaging.auth import SharedSecret
from messaging.remote import RemoteMessageLog
from resource_managers.message_log import MessageLog
from tests.support.msg_cluster import REPO, SECRET, SERVE, free_port

pytestmark = [pytest.mark.crash]

POINT = "mlog.mlog.after_earlier_commits"


class LogServer:
    """``twopc serve log`` in its own process, on a fixed directory and port."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory, self.port = directory, port
        self.popen: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self, crash_at: str | None = None) -> None:
        env = {**os.environ, "TWOPC_SECRET": SECRET, "PYTHONPATH": str(REPO)}
        env.pop("TWOPC_CRASH_AT", None)
        if crash_at:
            env["TWOPC_CRASH_AT"] = crash_at
        out = self.directory.parent / f"log.{self.runs}.out"
        self.runs += 1
        with open(out, "wb") as f:
            self.popen = subprocess.Popen(
                [sys.executable, "-c", SERVE, "serve", "log", "--dir", str(self.directory),
                 "--listen", f"127.0.0.1:{self.port}", "--cursor", f"127.0.0.1:{free_port()}"],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while "listening on" not in out.read_text(errors="replace"):
            assert self.popen.poll() is None, out.read_text(errors="replace")
            assert time.monotonic() < deadline, "the log server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.popen is not None
        self.popen.kill()
        self.popen.wait()

    def died_by_kill(self) -> bool:
        assert self.popen is not None
        return self.popen.wait(15) == -signal.SIGKILL


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LogServer]:
    made = LogServer(tmp_path / "mlog", free_port())
    yield made
    if made.popen is not None and made.popen.poll() is None:
        made.popen.terminate()
        made.popen.wait(15)


def prepared(remote: RemoteMessageLog, xid: Xid, body: bytes) -> Vote:
    remote.start(xid).send("orders", body)
    return remote.prepare(xid)


def test_a_kill_after_the_earlier_commits_keeps_the_producers_order(server: LogServer) -> None:
    server.start()
    remote = RemoteMessageLog(
        ("127.0.0.1", server.port), SharedSecret(SECRET.encode()), timeout=3.0
    )
    first, second, third = (Xid.branch_of(f"node-1:order-{n}", "mlog") for n in (1, 2, 3))
    assert prepared(remote, first, b"first") == Vote.COMMIT
    server.kill()  # the log goes away with "first" prepared...
    with pytest.raises(TransientError):  # ...and its commit is lost: the client keeps it
        remote.commit(first)
    server.start(crash_at=POINT)
    with pytest.raises(TransientError):  # "first" committed lazily, then kill -9: no answer
        prepared(remote, second, b"second")
    assert server.died_by_kill()
    server.start()
    remote.rollback(second)  # voted no: the coordinator rolls it back (nothing prepared there)
    assert prepared(remote, third, b"third") == Vote.COMMIT  # names "first" again
    remote.commit(third)
    remote.close()
    server.popen.terminate()  # type: ignore[union-attr]
    server.popen.wait(15)  # type: ignore[union-attr]
    with MessageLog(server.directory) as mlog:
        assert [m.body for _, m in mlog.pending("orders")] == [b"first", b"third"]
        assert mlog.prepared_gids() == []
