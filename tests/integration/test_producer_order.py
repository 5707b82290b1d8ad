"""A producer's order across a lost phase-two commit at a remote message log.

A producer whose transaction committed (its decision durable, the commit sent to the log lazily
or not) goes on to its next transaction. If the log lost the first commit — it crashed before
applying it, or the connection broke and the retry failed too — the first branch stays prepared
there until recovery re-drives it, and without more the second transaction's messages were
numbered first: one producer's messages out of order at the consumer (seen under `kill -9` of a
log server in the routed crash tests). The fix: each prepare names the branches whose commit
this client issued and has not seen confirmed, and the log commits any it still holds before it
takes the new branch's messages. These tests lose the commit on purpose, against a real log
behind a real listener, and also across a restart of the log on the same directory.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator import InvalidXidError, TransactionManager, TransientError, Xid
from messaging.auth import SharedSecret
from messaging.connection import Connection, Listener
from messaging.frames import FrameType, XaRequest
from messaging.remote import PRODUCER_ROLE, ProducerService, RemoteMessageLog
from resource_managers.message_log import MessageLog, MessageLogResource
from tests.support.managers import make_manager

SECRET = SharedSecret(b"producer-order-test-secret-012345")


def bodies(log: MessageLog, stream: str = "orders") -> list[bytes]:
    return [m.body for _, m in log.pending(stream)]


class LoseCommits:
    """A server-side connection that drops the next ``limit`` phase-two ``XA_COMMIT`` requests
    unread and closes: the commit never reached the log, as when it crashes first."""

    lost = 0
    limit = 0

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.version = conn.version

    def recv(self, timeout: float | None = None) -> object:
        frame = self.conn.recv(timeout)
        is_commit = isinstance(frame, XaRequest) and frame.verb == FrameType.XA_COMMIT
        if is_commit and not frame.args.get("one_phase") and LoseCommits.lost < LoseCommits.limit:
            LoseCommits.lost += 1
            self.conn.close()
            return None
        return frame

    def send(self, frame: object) -> None:
        self.conn.send(frame)  # type: ignore[arg-type]


def serve(mlog: MessageLog, port: int = 0, *, lose: bool = False) -> Listener:
    service = ProducerService(mlog)

    def handler(conn: Connection) -> None:
        service(LoseCommits(conn) if lose else conn)  # type: ignore[arg-type]

    return Listener(("127.0.0.1", port), SECRET, "test-log", {PRODUCER_ROLE: handler}).start()


def send(tm: TransactionManager, remote: RemoteMessageLog, body: bytes) -> None:
    with tm.transaction() as tx:
        tx.join(remote).send("orders", body)


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy commit", "forced commit"])
def test_a_lost_commit_is_applied_before_the_next_transaction(
    tmp_path: Path, managers: list[TransactionManager], lazy: bool
) -> None:
    mlog = MessageLog(tmp_path / "mlog")
    LoseCommits.lost, LoseCommits.limit = 0, 99  # every try, until the first is lost
    with serve(mlog, lose=True) as listener:
        remote = RemoteMessageLog(listener.address, SECRET, timeout=5.0, lazy_commit=lazy)
        # two resources, so the log's branch is prepared and committed in two phases
        local = MessageLogResource(MessageLog(tmp_path / "other"), "other")
        tm = make_manager(managers, [remote, local])
        with tm.transaction() as tx:
            tx.join(remote).send("orders", b"first")
            tx.join(local).send("elsewhere", b"x")
        remote.flush_commits()
        assert LoseCommits.lost >= 2 and bodies(mlog) == []  # the first commit never arrived
        LoseCommits.limit = LoseCommits.lost  # from here on the log hears every commit
        assert len(mlog.prepared_gids()) == 1
        send(tm, remote, b"second")  # one phase: the only branch with work
        with tm.transaction() as tx:
            tx.join(remote).send("orders", b"third")
            tx.join(local).send("elsewhere", b"y")
        remote.flush_commits()
        assert bodies(mlog) == [b"first", b"second", b"third"]
        assert mlog.prepared_gids() == []
        assert tm.recover(force=True).clean and tm.log.pending() == []
        remote.close()
        local.log.close()
    mlog.close()


def test_a_commit_lost_with_a_log_restart_keeps_its_place(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """The log stops with the first branch prepared and its commit unsent; it starts again on
    the same directory and port; the producer's next transaction must come after the first."""
    mlog = MessageLog(tmp_path / "mlog")
    listener = serve(mlog)
    port = listener.address[1]
    remote = RemoteMessageLog(listener.address, SECRET, timeout=2.0)
    local = MessageLogResource(MessageLog(tmp_path / "other"), "other")
    tm = make_manager(managers, [remote, local])
    xid = Xid.branch_of("node-1:manual-1", remote.name)
    remote.start(xid).send("orders", b"first")
    assert remote.prepare(xid).name == "COMMIT"
    listener.close()  # the log goes away with the branch prepared...
    mlog.close()
    with pytest.raises(TransientError):  # ...before phase two reaches it: left to recovery
        remote.commit(xid)
    mlog = MessageLog(tmp_path / "mlog")  # back on the same directory and port
    with _listen_again(lambda: serve(mlog, port)):
        assert mlog.prepared_gids() == [xid.to_gid()]
        with tm.transaction() as tx:
            tx.join(remote).send("orders", b"second")
            tx.join(local).send("elsewhere", b"x")
        remote.flush_commits()
        assert bodies(mlog) == [b"first", b"second"]
        assert mlog.prepared_gids() == []
    remote.close()
    local.log.close()
    mlog.close()


def _listen_again(start: Callable[[], Listener]) -> Listener:
    for _ in range(50):  # the old socket may linger a moment
        try:
            return start()
        except OSError:
            socket.socket().close()
    return start()


def test_a_prepare_may_name_only_its_own_nodes_branches(tmp_path: Path) -> None:
    with MessageLog(tmp_path / "mlog") as mlog:
        resource = MessageLogResource(mlog, "mlog")
        mine = Xid.branch_of("node-1:a-1", "mlog")
        theirs = Xid.branch_of("node-2:a-1", "mlog")
        resource.start(mine).send("orders", b"x")
        with pytest.raises(InvalidXidError, match="own coordinator node"):
            resource.prepare(mine, after=[theirs.to_gid()])
        with pytest.raises(InvalidXidError):
            resource.commit_earlier(mine, ["not a gid"])
