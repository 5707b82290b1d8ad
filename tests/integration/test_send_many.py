"""``send_many``: a batch send to one destination, local or remote, is the same as a ``send`` per
body (order, headers, options, fresh ids, every rule of a message), and all or nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import (
    TransactionManager,
    TransactionRolledBack,
    TransientError,
)
from messaging.auth import SharedSecret
from messaging.connection import Listener
from messaging.remote import PRODUCER_ROLE, ProducerService, RemoteMessageLog
from resource_managers.message_log import (
    DestinationFullError,
    InvalidMessageError,
    MessageLog,
    MessageLogResource,
)
from tests.support.managers import make_manager

SECRET = SharedSecret(b"send-many-test-secret-0123456789")


@pytest.fixture(params=["local", "remote"])
def producer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[MessageLog, object]]:
    """The log, and a resource producing into it: the log itself, or a served one."""
    with MessageLog(tmp_path / "log", max_destination_messages=5) as mlog:
        if request.param == "local":
            yield mlog, MessageLogResource(mlog, "mlog")
            return
        service = {PRODUCER_ROLE: ProducerService(mlog)}
        with (
            Listener(("127.0.0.1", 0), SECRET, "log", service).start() as listener,
            RemoteMessageLog(listener.address, SECRET, timeout=5.0) as remote,
        ):
            yield mlog, remote


def test_a_batch_is_a_send_per_body(
    producer: tuple[MessageLog, object], managers: list[TransactionManager]
) -> None:
    mlog, resource = producer
    tm = make_manager(managers, [resource])
    with tm.transaction() as tx:
        branch = tx.join(resource)
        ids = branch.send_many("orders", [b"a", bytearray(b"b"), b"c"], {"h": "1"}, priority=7)
        assert branch.send_many("orders", []) == []
    tm.close()  # and with it the lazy commits: their messages are visible
    got = [m for _, m in mlog.pending("orders")]
    assert [m.message_id for m in got] == ids and len(set(ids)) == 3
    assert [m.body for m in got] == [b"a", b"b", b"c"]
    assert all(m.headers == {"h": "1", "twopc-priority": "7"} for m in got)


def test_one_refused_body_stages_none_of_the_batch(
    producer: tuple[MessageLog, object], managers: list[TransactionManager]
) -> None:
    mlog, resource = producer
    tm = make_manager(managers, [resource])
    with tm.transaction() as tx:
        branch = tx.join(resource)
        branch.send("orders", b"kept")
        with pytest.raises(InvalidMessageError):
            branch.send_many("orders", [b"fine", "not bytes"])  # type: ignore[list-item]
        with pytest.raises(InvalidMessageError):
            branch.send_many("orders", [b"fine", b"x" * (mlog.max_message_bytes + 1)])
        with pytest.raises(InvalidMessageError):
            branch.send_many("orders.DLQ", [b"fine"])
    tm.close()  # and with it the lazy commits: their messages are visible
    assert [m.body for _, m in mlog.pending("orders")] == [b"kept"]


def test_a_batch_over_the_destination_limit_is_refused_whole(
    producer: tuple[MessageLog, object], managers: list[TransactionManager]
) -> None:
    """Five messages fit: a local branch refuses a batch of six at the send, a remote one at
    the prepare (where a remote log checks the room); nothing of it is written either way."""
    mlog, resource = producer
    tm = make_manager(managers, [resource])
    # a remote one-phase commit refused for room: the transaction rolled back, saying why
    refused = pytest.raises((TransientError, TransactionRolledBack), match="limit is 5")
    with refused, tm.transaction() as tx:
        tx.join(resource).send_many("orders", [b"%d" % n for n in range(6)])
    with tm.transaction() as tx:
        tx.join(resource).send_many("orders", [b"%d" % n for n in range(5)])
    tm.close()  # and with it the lazy commits: their messages are visible
    assert len(list(mlog.pending("orders"))) == 5 and mlog.prepared_gids() == []


def test_a_local_branch_refuses_an_oversized_batch_at_the_send(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    with MessageLog(tmp_path / "log", max_destination_messages=5) as mlog:
        resource = MessageLogResource(mlog, "mlog")
        tm = make_manager(managers, [resource])
        with tm.transaction() as tx:
            branch = tx.join(resource)
            with pytest.raises(DestinationFullError):
                branch.send_many("orders", [b"%d" % n for n in range(6)])
            branch.send_many("orders", [b"%d" % n for n in range(5)])
        tm.close()
        assert len(list(mlog.pending("orders"))) == 5
