"""Queues an operator can fix, on a cursor's own journal: the expiry sweep moves expired messages
from anywhere in a queue (not only its head) to the dead-letter queue with their deadline in the
reason; one waiting message can be dropped or dead-lettered so its stream moves again; queue
depths. Each effect is checked again on a reopened cursor (the records replay to the same state).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from coordinator import IllegalStateError
from resource_managers.cursor import DEAD_LETTER, DROP, Cursor, QueueDepth, subscription_queue
from resource_managers.message_log import Message
from resource_managers.sequencing import Frame

NOW = 1_800_000_000_000  # ms: the fake clock's reading


def put(c: Cursor, body: bytes, queue: str = "orders", expires_at: int | None = None) -> Message:
    m = Message(uuid.uuid4().hex, queue, body, {}, True, expires_at)
    ack = c.ack_for(m.stream)
    last = ack.seq if ack.epoch == 1 else 0
    c.deliver(Frame(m.stream, 1, last + 1, last, m.message_id), m)
    return m


def bodies(c: Cursor, queue: str = "orders") -> list[bytes]:
    return [d.body for d in c.available(queue)]


def open_cursor(path: Path) -> Cursor:
    return Cursor(path, clock_ms=lambda: NOW)


def test_the_sweep_moves_expired_messages_from_anywhere_with_their_deadline(tmp_path: Path) -> None:
    """An expired message behind an unexpired head, and one in a queue nobody reads, both reach
    their dead-letter queue; the reason records the deadline; a dead letter never expires."""
    with open_cursor(tmp_path) as c:
        put(c, b"head", expires_at=None)
        late = put(c, b"middle", expires_at=NOW - 5000)
        put(c, b"tail", expires_at=NOW + 60_000)
        idle = put(c, b"idle", queue="unread", expires_at=NOW - 1)
        assert c.sweep_expired() == 2
        assert bodies(c) == [b"head", b"tail"]
        assert bodies(c, "unread") == []
        dead = {d.message_id: d for d in c.dead_letters()}
        assert set(dead) == {late.message_id, idle.message_id}
        reason = dead[late.message_id].reason or ""
        assert reason.startswith("expired: its time to live ran out at ")
        assert f"({NOW - 5000} ms)" in reason and f"seen at {NOW} ms" in reason
        assert c.sweep_expired() == 0  # the dead letters stay where they are
    with open_cursor(tmp_path) as again:  # the lazy W records replayed, or swept once more
        again.sweep_expired()
        assert bodies(again) == [b"head", b"tail"]
        assert {d.message_id for d in again.dead_letters()} == {late.message_id, idle.message_id}


def test_a_receive_records_the_deadline_of_the_expired_head(tmp_path: Path) -> None:
    with open_cursor(tmp_path) as c:
        old = put(c, b"old", expires_at=NOW - 10)
        put(c, b"fresh")
        got = c.take("g1", "orders")
        assert got is not None and got.body == b"fresh"
        [dead] = c.dead_letters("orders")
        assert dead.message_id == old.message_id
        assert f"({NOW - 10} ms)" in (dead.reason or "")


def test_an_operator_drops_or_dead_letters_a_waiting_message(tmp_path: Path) -> None:
    """The stream moves again: the next receive gets the message after the one taken out."""
    with open_cursor(tmp_path) as c:
        poison, second, third = put(c, b"poison"), put(c, b"second"), put(c, b"third")
        moved = c.remove_message("orders", poison.message_id, DEAD_LETTER, "crashes parser")
        assert moved == "orders"
        [dead] = c.dead_letters("orders")
        assert dead.message_id == poison.message_id
        assert dead.reason == "dead-lettered by an operator: crashes parser"
        c.remove_message("orders", second.message_id, DROP)
        assert bodies(c) == [b"third"]
        c.remove_message("orders.DLQ", poison.message_id, DROP)  # a dead letter can go too
        assert c.dead_letters() == []
    with open_cursor(tmp_path) as again:  # forced records: both replay
        assert bodies(again) == [b"third"] and again.dead_letters() == []
        assert again.delivery_count(third.message_id) == 0


def test_a_handed_out_or_unknown_message_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    with open_cursor(tmp_path) as c:
        m = put(c, b"busy")
        assert c.take("g1", "orders") is not None
        with pytest.raises(IllegalStateError, match="handed out"):
            c.remove_message("orders", m.message_id, DROP)
        with pytest.raises(IllegalStateError, match="no message nope waits in orders"):
            c.remove_message("orders", "nope", DEAD_LETTER)
        with pytest.raises(IllegalStateError, match="no message"):
            c.remove_message("elsewhere", m.message_id, DROP)  # not in that queue
        c.rollback("g1")
        c.remove_message("orders", m.message_id, DROP)  # waiting again: now it can go
        assert bodies(c) == []


def test_a_subscription_copy_can_be_dead_lettered_by_its_message_id(tmp_path: Path) -> None:
    with open_cursor(tmp_path) as c:
        c.subscribe("topic:prices", "audit")
        queue = subscription_queue("topic:prices", "audit")
        m = put(c, b"tick", queue="topic:prices")
        pub = c.next_publication("w1")
        assert pub is not None
        c.deliver_copy(m.message_id, queue, "w1")
        c.finish_publication(m.message_id)
        c.remove_message(queue, m.message_id, DEAD_LETTER)
        assert [d.message_id for d in c.dead_letters(queue)] == [m.message_id]


def test_queue_depths_count_waiting_in_flight_and_dead_letters(tmp_path: Path) -> None:
    with open_cursor(tmp_path) as c:
        for body in (b"a", b"b", b"c"):
            put(c, body)
        put(c, b"x", queue="other", expires_at=NOW - 1)
        c.sweep_expired()
        c.take("g1", "orders")
        c.set_transactional("legacy", False)
        assert c.queues() == [
            QueueDepth("legacy", 0, 0, 0, False),
            QueueDepth("orders", 2, 1, 0, True),
            QueueDepth("other", 0, 0, 1, True),
        ]
