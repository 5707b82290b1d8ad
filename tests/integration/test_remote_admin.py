"""A cursor's administration through `RemoteCursor`, against real ``twopc serve log|cursor``
processes.

Seed 003 (durable subscriptions): subscriptions are created, listed and removed remotely; a
remote subscriber is connected exactly while the connection that attached it lives, so a
subscriber process killed with ``kill -9`` is detached by the server, and its non-durable
subscription disappears with it. Seed 004 (dead-letter queues and negative acknowledgment): dead
letters of both kinds (too many deliveries; a transactional message rejected by a queue marked
non-transactional, with its NACK in the admin queue) are listed with their reasons, replayed and
purged remotely. Requests of the wrong shape are refused as bad requests, and a detach only
counts from the connection that attached.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import IllegalStateError, Xid
from messaging.connection import Connection, connect
from messaging.frames import FrameType, Value, XaReply, XaRequest
from messaging.remote import CONSUMER_ROLE, PRODUCER_ROLE, RemoteCursor
from resource_managers.cursor import NACK_HEADER, Delivery, Subscription
from resource_managers.message_log import InvalidMessageError
from tests.integration.cursor_stack import (
    MAX_DELIVERIES,
    REPO,
    SECRET,
    Stack,
    poison,
    running_stack,
    wait_for,
)

NEWS = "topic:news"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with running_stack(tmp_path) as running:
        yield running


@pytest.fixture
def remote(stack: Stack) -> Iterator[RemoteCursor]:
    with stack.cursor() as cursor:
        yield cursor


def by_name(subs: list[Subscription]) -> dict[str, Subscription]:
    return {s.name: s for s in subs}


# -- subscriptions (seed 003) ------------------------------------------------------------------


def test_subscriptions_are_created_listed_and_removed_remotely(remote: RemoteCursor) -> None:
    made = remote.subscribe(NEWS, "billing")
    assert (made.topic, made.name, made.durable, made.queue) == (NEWS, "billing", True,
                                                                 "topic:news/billing")  # fmt: skip
    assert not made.connected  # durable: kept for a subscriber who is not there yet
    assert remote.subscribe(NEWS, "billing") == made  # idempotent
    remote.subscribe("topic:sport", "audit")
    assert sorted(s.queue for s in remote.subscriptions()) == [
        "topic:news/billing", "topic:sport/audit"]  # fmt: skip
    assert [s.name for s in remote.subscriptions(NEWS)] == ["billing"]

    with pytest.raises(IllegalStateError):  # the other kind exists
        remote.subscribe(NEWS, "billing", durable=False)
    with pytest.raises(InvalidMessageError):
        remote.subscribe(NEWS, "no spaces")
    with pytest.raises(InvalidMessageError):
        remote.subscribe("news", "billing")  # not a topic
    with pytest.raises(IllegalStateError):
        remote.unsubscribe(NEWS, "unknown")
    with pytest.raises(IllegalStateError):
        remote.attach(NEWS, "unknown")

    assert remote.unsubscribe(NEWS, "billing") == 0
    assert [s.queue for s in remote.subscriptions()] == ["topic:sport/audit"]


def test_attachments_are_counted_and_belong_to_their_client(stack: Stack) -> None:
    with stack.cursor() as first, stack.cursor() as second:
        first.subscribe(NEWS, "billing")
        assert first.attach(NEWS, "billing").connected
        assert second.attach(NEWS, "billing").connected
        assert first.attached() == {(NEWS, "billing"): 1}
        with pytest.raises(IllegalStateError):  # only the client that attached detaches
            second.detach(NEWS, "other")
        first.detach(NEWS, "billing")
        assert by_name(first.subscriptions(NEWS))["billing"].connected  # second still is
        second.close()  # closing the client ends its attachments
        wait_for(lambda: not by_name(first.subscriptions(NEWS))["billing"].connected)

        live = first.subscribe(NEWS, "live", durable=False)
        assert live.connected and not live.durable
        assert first.subscribe(NEWS, "live", durable=False) == live  # shared: held twice
        first.detach(NEWS, "live")
        assert "live" in by_name(first.subscriptions(NEWS))
        first.detach(NEWS, "live")  # the last holder: it goes
        assert "live" not in by_name(first.subscriptions(NEWS))
        assert first.attached() == {}


SUBSCRIBER = """
import sys, time
from messaging.auth import SharedSecret
from messaging.remote import RemoteCursor
remote = RemoteCursor(("127.0.0.1", int(sys.argv[1])), SharedSecret(sys.argv[2].encode()))
remote.attach("topic:news", "billing")
remote.subscribe("topic:news", "live", durable=False)
print("attached", flush=True)
time.sleep(600)
"""


def test_a_killed_subscriber_is_detached_by_the_server(stack: Stack, remote: RemoteCursor) -> None:
    """Seed 003: "connected durable subscriber" means, for a remote one, that its connection is
    open; a subscriber killed with ``kill -9`` says nothing, and is detached all the same."""
    remote.subscribe(NEWS, "billing")
    client = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, str(stack.cursor_port), SECRET],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    try:
        assert client.stdout is not None and client.stdout.readline() == "attached\n"
        subs = by_name(remote.subscriptions(NEWS))
        assert subs["billing"].connected and subs["live"].connected and not subs["live"].durable
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        wait_for(lambda: "live" not in by_name(remote.subscriptions(NEWS)))
        billing = by_name(remote.subscriptions(NEWS))["billing"]
        assert billing.durable and not billing.connected  # kept, waiting for its subscriber
    finally:
        if client.poll() is None:
            client.kill()
        client.wait()


# -- dead letters (seed 004) -------------------------------------------------------------------


def test_dead_letters_are_listed_replayed_and_purged_remotely(
    stack: Stack, remote: RemoteCursor
) -> None:
    remote.set_transactional("refunds", False)
    assert not remote.is_transactional("refunds") and remote.is_transactional("orders")
    poisoned = [*stack.send("orders", b"poison-1", b"poison-2")]
    rejected = stack.send("refunds", b"refund", admin_queue="admin")[0]
    assert {poison(remote, "orders"), poison(remote, "orders")} == set(poisoned)
    wait_for(lambda: len(remote.dead_letters()) == 3)

    orders = remote.dead_letters("orders")
    assert [d.message_id for d in orders] == poisoned
    assert remote.dead_letters("orders.DLQ") == orders
    for d in orders:
        assert d.queue == "orders.DLQ" and d.delivery_count == MAX_DELIVERIES
        assert d.reason is not None and d.reason.startswith("max-deliveries:")
        assert d.message.destination == "orders"
    [refund] = remote.dead_letters("refunds")
    assert refund.message_id == rejected and refund.queue == "refunds.DLQ"
    assert refund.reason is not None and refund.reason.startswith("rejected:")
    assert refund.delivery_count == 0  # never handed out
    nack = _receive(remote, "admin")
    assert nack.message_id == f"{rejected}.nack" and NACK_HEADER in nack.headers

    assert remote.replay_dead_letters("orders.DLQ", [poisoned[0], "no-such-id"]) == 1
    back = _receive(remote, "orders")
    assert back.message_id == poisoned[0] and back.delivery_count == 1  # count reset
    assert remote.purge_dead_letters("orders", None) == 1
    assert remote.purge_dead_letters("refunds.DLQ", [rejected]) == 1
    assert remote.dead_letters() == []


def _receive(remote: RemoteCursor, queue: str) -> Delivery:
    """Receive one message of ``queue`` and commit (one phase)."""
    xid = Xid.branch_of(f"admin-test:take-{queue}", remote.name)
    got = remote.start(xid).receive(queue, timeout=10)
    assert got is not None
    remote.commit(xid, one_phase=True)
    return got


# -- the wire ----------------------------------------------------------------------------------


def ask(conn: Connection, request_id: int, args: dict[str, Value]) -> XaReply:
    conn.send(XaRequest(FrameType.XA_RECOVER, request_id, None, {"rm": "cursor", **args}))
    reply = conn.recv(timeout=10)
    assert isinstance(reply, XaReply) and reply.request_id == request_id
    return reply


def test_admin_requests_of_the_wrong_shape_are_refused(stack: Stack, remote: RemoteCursor) -> None:
    remote.subscribe(NEWS, "billing")
    address = ("127.0.0.1", stack.cursor_port)
    bad: list[dict[str, Value]] = [
        {"op": "drop-everything"},
        {"op": 7},
        {"op": "subscribe", "topic": 5, "name": "x"},
        {"op": "subscribe", "topic": NEWS, "name": "x", "durable": "yes"},
        {"op": "dead_letters", "queue": ["orders"]},
        {"op": "purge_dead_letters", "dlq": "orders.DLQ", "ids": "all"},
        {"op": "purge_dead_letters", "dlq": "orders.DLQ", "ids": [1, 2]},
        {"op": "set_transactional", "queue": "orders"},
        {"op": "subscribe", "topic": NEWS, "name": "x", "durable": True, "shared": True},
        {"op": "subscriptions", "topic": None, "queue": "orders"},
    ]
    with connect(address, stack.secret, "raw", CONSUMER_ROLE) as conn:
        for n, args in enumerate(bad, 1):
            reply = ask(conn, n, args)
            assert reply.status == "bad-request", (args, reply)
        # a detach only counts on the connection that attached
        attach: dict[str, Value] = {"op": "attach", "topic": NEWS, "name": "billing"}
        assert ask(conn, 20, attach).status == "ok"
        with connect(address, stack.secret, "other", CONSUMER_ROLE) as other:
            detach: dict[str, Value] = {"op": "detach", "topic": NEWS, "name": "billing"}
            assert ask(other, 21, detach).status == "illegal-state"
            assert by_name(remote.subscriptions(NEWS))["billing"].connected
        assert ask(conn, 22, {"op": "subscriptions", "topic": None}).status == "ok"
    wait_for(lambda: not by_name(remote.subscriptions(NEWS))["billing"].connected)
    with connect(("127.0.0.1", stack.log_port), stack.secret, "raw", PRODUCER_ROLE) as conn:
        conn.send(XaRequest(FrameType.XA_RECOVER, 1, None, {"rm": "mlog", "op": "subscriptions"}))
        refused = conn.recv(timeout=10)
        assert isinstance(refused, XaReply) and refused.status == "bad-request"
