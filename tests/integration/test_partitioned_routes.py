"""Partitioned destinations (issue 15, point 3): a route naming several cursors splits each of its
destinations over them by message key.

Invariants named here: ``partition_by_key`` (every message of a key reaches the one cursor its
partition routes to, in the order its transactions committed; keyless messages go to partition
0's cursor), ``key_on_every_send_path`` (``key=`` works the same through a local branch, a remote
producer and a session), ``gapless_partition_streams`` (each cursor holds one filter state per
partition stream, at the count of messages it accepted), and ``partition_count_checked``
(``twopc serve log`` refuses, with one line, to start with another partition count while the
log holds unacknowledged messages numbered under the old one).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from coordinator import MemoryDecisionLog, TransactionManager
from messaging.auth import SharedSecret
from messaging.remote import RemoteMessageLog
from messaging.routes import Route
from messaging.server import CursorServer, LogServer
from messaging.session import Session
from resource_managers.message_log import Message, MessageLog, SendOptions, outgoing, partition_of
from resource_managers.sequencing import DoublingBackoff, split_key

REPO = Path(__file__).resolve().parents[2]
SERVE = "import sys; from coordinator.cli import main; sys.exit(main())"
KEY = "partition test secret, at least 16 bytes"
SECRET = SharedSecret(KEY.encode())
KEYS = ["alice", "bob", "carol", "dave", "erin", "frank"]


def test_partition_by_key_on_every_send_path(tmp_path: Path) -> None:
    """``partition_by_key``, ``key_on_every_send_path``, ``gapless_partition_streams``."""
    with (
        CursorServer(tmp_path / "c0", SECRET, listen=("127.0.0.1", 0)) as c0,
        CursorServer(tmp_path / "c1", SECRET, listen=("127.0.0.1", 0)) as c1,
        CursorServer(tmp_path / "main", SECRET, listen=("127.0.0.1", 0)) as main,
        LogServer(
            tmp_path / "log",
            SECRET,
            cursor=main.address,
            listen=("127.0.0.1", 0),
            routes=[Route("orders.*", c0.address, c1.address)],
            resend=DoublingBackoff(0.1, 0.5),
        ) as log,  # fmt: skip
    ):
        assert log.address is not None
        remote = RemoteMessageLog(log.address, SECRET, name="remote", client_id="app")
        with TransactionManager("app", MemoryDecisionLog(), [log.resource, remote]) as tm:
            sent: list[tuple[str | None, bytes]] = []
            for n in range(6):
                with tm.transaction() as tx:
                    for key in (KEYS[n], KEYS[(n + 1) % 6], None):
                        body = f"local {key} {n}".encode()
                        tx.join(log.resource).send("orders.created", body, key=key)
                        sent.append((key, body))
                with tm.transaction() as tx:
                    body = f"remote {KEYS[n]} {n}".encode()
                    tx.join(remote).send("orders.created", body, key=KEYS[n])
                    sent.append((KEYS[n], body))
                    tx.join(remote).send_to_list(["orders.paid", "invoices"], b"l", key=KEYS[n])
            session = Session(tm, log=log.resource, mode="auto", client_id="s")
            for key in KEYS:
                body = f"session {key}".encode()
                session.send("orders.created", body, key=key)
                sent.append((key, body))
            session.close()
            assert log.wait_idle(20)
        cursors = (c0, c1)
        for index, server in enumerate(cursors):
            got = [(d.headers.get("twopc-key"), d.body)
                   for d in server.cursor.available("orders.created")]  # fmt: skip
            want = [(k, b) for k, b in sent if partition_of(k, 2) == index]
            assert got == want, index  # every key at its partition's cursor, in commit order
            paid = server.cursor.available("orders.paid")
            assert [d.headers["twopc-key"] for d in paid] == [
                k for k in KEYS if partition_of(k, 2) == index
            ]
            state = server.cursor.filter_state()["streams"]
            streams = {split_key(k)[1]: s for k, s in state.items()}
            assert streams[f"orders.created#p{index}.2"]["last"] == len(want)  # gapless
        assert [d.body for d in main.cursor.available("invoices")] == [b"l"] * 6
        assert main.cursor.available("orders.created") == []


def test_serve_log_refuses_a_changed_partition_count(tmp_path: Path) -> None:
    """``partition_count_checked``: unacknowledged messages numbered under 2 partitions; a
    restart with a route of 3 cursors exits 2 with one line; ``--allow-repartition`` starts."""
    with MessageLog(tmp_path / "log", partitions=lambda _d: 2) as mlog:
        mlog.commit("g1", [_message("orders.x", "alice")])
    route = "orders.*=127.0.0.1:9,127.0.0.1:10,127.0.0.1:11"
    argv = [sys.executable, "-c", SERVE, "serve", "log", "--dir", str(tmp_path / "log"),
            "--listen", "127.0.0.1:0", "--cursor", "127.0.0.1:12", "--route", route]  # fmt: skip
    env = {"TWOPC_SECRET": KEY, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2, done
    assert "numbered in 2 partition(s), its route now has 3" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    proc = subprocess.Popen([*argv, "--allow-repartition"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        while "listening on" not in lines[-1]:  # unreachable-cursor warnings may come first
            lines.append(proc.stdout.readline())
            assert lines[-1], lines
        assert "WARNING" in lines[0] and "per-key order is not kept" in lines[0], lines
    finally:
        proc.terminate()
        proc.wait(15)


def _message(destination: str, key: str) -> Message:
    return outgoing(
        [destination], body=b"x", headers=None, now_ms=0, max_bytes=1 << 20,
        options=SendOptions(persistent=True, key=key),
    )[0]  # fmt: skip
