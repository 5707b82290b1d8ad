"""The cursor's JMS/MSMQ semantics on its own journal: priorities and expiry to the dead-letter
queue (seed 003), non-transactional queues that reject transactional messages with a negative
acknowledgment (seed 004), dead-letter inspection, replay and purge, and topics with durable and
non-durable subscriptions, with the dispatch's in-doubt list and monitor queue (seeds 003, 001).
Every check that matters after a crash is made again on a reopened cursor, and after a rollover."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from coordinator import IllegalStateError, ProgrammingError
from resource_managers.cursor import (
    NACK_HEADER,
    Cursor,
    subscription_queue,
)
from resource_managers.message_log import (
    ADMIN_QUEUE_HEADER,
    PRIORITY_HEADER,
    PUBLISHER_HEADER,
    TRANSACTIONAL_HEADER,
    InvalidMessageError,
    Message,
)
from resource_managers.sequencing import Frame

TOPIC = "topic:prices"


def put(
    c: Cursor,
    body: bytes,
    destination: str = "orders",
    *,
    persistent: bool = True,
    expires_at: int | None = None,
    **headers: str,
) -> Message:
    """Accept one message as the next number of its destination's stream."""
    m = Message(uuid.uuid4().hex, destination, body, dict(headers), persistent, expires_at)
    stream = m.stream
    ack = c.ack_for(stream)
    last = ack.seq if ack.epoch == 1 else 0
    c.deliver(Frame(stream, 1, last + 1, last, m.message_id), m)
    return m


def take_all(c: Cursor, queue: str, gid: str = "g1") -> list[bytes]:
    got = c.take_many(gid, queue, 1000)
    return [d.body for d in got]


def consume(c: Cursor, queue: str, gid: str) -> list[bytes]:
    got = take_all(c, queue, gid)
    c.commit(gid)
    return got


# -- priority and expiry (seed 003) -----------------------------------------------------------


def test_higher_priority_first_fifo_within_a_priority_and_a_rollback_keeps_its_place(
    cursor: Cursor, curdir: Path
) -> None:
    """Seed 003 (JMS): priority orders delivery; within one priority, arrival order."""
    for body, prio in [(b"a4", "4"), (b"b9", "9"), (b"c0", "0"), (b"d9", "9"), (b"e4", "4")]:
        put(cursor, body, **{PRIORITY_HEADER: prio})
    assert [d.body for d in cursor.available("orders")] == [b"b9", b"d9", b"a4", b"e4", b"c0"]
    got = cursor.take_many("g1", "orders", 2)
    assert [d.body for d in got] == [b"b9", b"d9"]
    cursor.rollback("g1")
    assert [d.body for d in cursor.available("orders")] == [b"b9", b"d9", b"a4", b"e4", b"c0"]
    cursor.close()
    with Cursor(curdir) as again:
        assert [d.body for d in again.available("orders")][:2] == [b"b9", b"d9"]


def test_an_expired_message_goes_to_the_dead_letter_queue_with_its_reason(
    cursor: Cursor, curdir: Path
) -> None:
    """Seed 003: a message that expires is not delivered; it is kept as a dead letter."""
    put(cursor, b"old", expires_at=1)
    put(cursor, b"new")
    assert take_all(cursor, "orders") == [b"new"]
    (dead,) = cursor.dead_letters("orders")
    assert dead.body == b"old" and dead.reason is not None and dead.reason.startswith("expired:")
    assert dead.queue == "orders.DLQ"
    cursor.close()
    with Cursor(curdir) as again:  # the lazy move may be lost; it expires all the same
        again.take_many("g2", "orders", 10)
        assert [d.body for d in again.dead_letters("orders")] == [b"old"]


# -- non-transactional queues, NACK, dead-letter administration (seed 004) --------------------


def test_a_transactional_message_at_a_non_transactional_queue_is_rejected_with_a_nack(
    cursor: Cursor, curdir: Path
) -> None:
    """Seed 004: the copy goes to the transactional dead-letter queue on the receiving side and a
    negative acknowledgment to the administration queue the message named."""
    cursor.set_transactional("audit", False)
    m = put(cursor, b"copy", "audit", **{ADMIN_QUEUE_HEADER: "admin"})
    ok = put(cursor, b"plain", "audit", **{TRANSACTIONAL_HEADER: "0"})
    assert [d.message_id for d in cursor.available("audit")] == [ok.message_id]
    (dead,) = cursor.dead_letters("audit")
    assert dead.message_id == m.message_id and dead.reason is not None
    assert dead.reason.startswith("rejected:")
    (nack,) = cursor.available("admin")
    assert nack.headers[NACK_HEADER] == "non-transactional-queue"
    assert nack.headers["twopc-original-id"] == m.message_id
    assert nack.headers["twopc-original-destination"] == "audit"
    assert nack.body == b"copy"
    cursor.close()
    with Cursor(curdir) as again:  # the replay takes the same decision, once
        assert [d.message_id for d in again.available("admin")] == [nack.message_id]
        assert not again.is_transactional("audit")
        assert [d.message_id for d in again.dead_letters("audit")] == [m.message_id]
        assert again.replay_dead_letters("audit") == 0  # the queue would reject it again
        again.set_transactional("audit", True)
        assert again.replay_dead_letters("audit") == 1
        assert [d.message_id for d in again.available("audit")][-1] == m.message_id


def test_dead_letters_replay_and_purge_survive_a_reopen(cursor: Cursor, curdir: Path) -> None:
    """Seed 003: after max deliveries a message is a dead letter with its reason; an operator
    replays it (count reset, at the tail) or purges it."""
    a, b, c = (put(cursor, x) for x in (b"a", b"b", b"c"))
    for i in range(2):
        cursor.take_many(f"r{i}", "orders", 2)
        cursor.rollback(f"r{i}", max_deliveries=2)
    dead = cursor.dead_letters("orders.DLQ")
    assert [d.message_id for d in dead] == [a.message_id, b.message_id]
    assert all(d.reason and d.reason.startswith("max-deliveries:") for d in dead)
    assert cursor.replay_dead_letters("orders", [a.message_id]) == 1
    assert [d.message_id for d in cursor.available("orders")] == [c.message_id, a.message_id]
    assert cursor.available("orders")[1].delivery_count == 0
    assert cursor.purge_dead_letters("orders.DLQ") == 1
    assert cursor.dead_letters() == []
    cursor.close()
    with Cursor(curdir, segment_bytes=4096) as again:
        assert [d.message_id for d in again.available("orders")] == [c.message_id, a.message_id]
        assert again.dead_letters() == []


# -- topics (seeds 003, 001) ------------------------------------------------------------------


def dispatch_all(c: Cursor, worker: str = "w1") -> int:
    """Fan every waiting publication out, as one dispatcher thread would."""
    n = 0
    while (pub := c.next_publication(worker)) is not None:
        for queue in pub.queues:
            c.deliver_copy(pub.message_id, queue, worker)
        c.finish_publication(pub.message_id)
        n += 1
    return n


def test_a_publication_reaches_every_subscription_and_leaves_the_store_after_the_last_ack(
    cursor: Cursor, curdir: Path
) -> None:
    """Seed 003: a copy per subscriber; the message is removed from the store only when every
    durable subscriber has acknowledged it; a durable subscription keeps messages while its
    subscriber is disconnected."""
    cursor.subscribe(TOPIC, "a")
    cursor.subscribe(TOPIC, "b")
    m = put(cursor, b"p1", TOPIC)
    assert cursor.holders(m.message_id) == [TOPIC]
    assert dispatch_all(cursor) == 1
    qa, qb = subscription_queue(TOPIC, "a"), subscription_queue(TOPIC, "b")
    assert cursor.holders(m.message_id) == [qa, qb]
    assert consume(cursor, qa, "ga") == [b"p1"]
    assert cursor.holders(m.message_id) == [qb]
    cursor.close()
    with Cursor(curdir) as again:
        assert [s.name for s in again.subscriptions(TOPIC)] == ["a", "b"]
        assert not any(s.connected for s in again.subscriptions())
        assert again.holders(m.message_id) == [qb]
        delivery = again.take("gb", qb)
        assert delivery is not None and delivery.message_id == m.message_id
        again.commit("gb")
        assert again.holders(m.message_id) == []


def test_receiving_from_a_topic_is_refused_and_topic_names_are_checked(cursor: Cursor) -> None:
    with pytest.raises(ProgrammingError, match="subscription"):
        cursor.take("g", TOPIC)
    with pytest.raises(InvalidMessageError):
        subscription_queue(TOPIC, "a/b")
    with pytest.raises(InvalidMessageError):
        cursor.subscribe("prices", "a")


def test_a_non_durable_subscription_gets_only_what_arrives_while_it_is_connected(
    cursor: Cursor, curdir: Path
) -> None:
    """Seed 003: non-durable subscribers get what arrives while they are connected."""
    m1 = put(cursor, b"before", TOPIC)
    dispatch_all(cursor)
    assert cursor.holders(m1.message_id) == []  # no subscriber: discarded
    cursor.subscribe(TOPIC, "live", durable=False)
    put(cursor, b"during", TOPIC)
    dispatch_all(cursor)
    q = subscription_queue(TOPIC, "live")
    assert [d.body for d in cursor.available(q)] == [b"during"]
    cursor.detach(TOPIC, "live")
    assert cursor.subscriptions() == []
    put(cursor, b"after", TOPIC)
    dispatch_all(cursor)
    assert cursor.available(q) == []
    cursor.subscribe(TOPIC, "again", durable=False)
    put(cursor, b"kept?", TOPIC)
    dispatch_all(cursor)
    cursor.close()
    with Cursor(curdir) as again:  # a non-durable subscription does not outlive its process
        assert again.subscriptions() == []
        assert again.available(subscription_queue(TOPIC, "again")) == []


def test_unsubscribe_refuses_while_copies_are_in_flight_and_drops_the_rest(
    cursor: Cursor,
) -> None:
    cursor.subscribe(TOPIC, "a")
    put(cursor, b"1", TOPIC)
    put(cursor, b"2", TOPIC)
    dispatch_all(cursor)
    q = subscription_queue(TOPIC, "a")
    cursor.take("g", q)
    with pytest.raises(IllegalStateError, match="handed out"):
        cursor.unsubscribe(TOPIC, "a")
    cursor.rollback("g")
    assert cursor.unsubscribe(TOPIC, "a") == 2
    assert cursor.subscriptions() == []
    with pytest.raises(IllegalStateError):
        cursor.unsubscribe(TOPIC, "a")


def test_the_in_doubt_list_and_monitor_queue_survive_a_crash_and_a_rollover(
    curdir: Path,
) -> None:
    """Seed 001: a publication taken and partly delivered is in doubt after a failure; the
    monitor queue says which copies reached their queue, so recovery sends only the rest."""
    c = Cursor(curdir, segment_bytes=4096)
    for name in ("a", "b", "c"):
        c.subscribe(TOPIC, name)
    m = put(c, b"p", TOPIC, **{PUBLISHER_HEADER: "pub-1"})
    pub = c.next_publication("w7")
    assert pub is not None and pub.publisher == "pub-1"
    assert pub.queues == tuple(subscription_queue(TOPIC, n) for n in "abc")
    assert c.deliver_copy(m.message_id, pub.queues[0], "w7")
    assert not c.deliver_copy(m.message_id, pub.queues[0], "w7")  # the monitor has it
    for i in range(60):  # enough traffic for rollovers to carry the in-doubt state
        put(c, b"x" * 200, "filler")
        c.take(f"f{i}", "filler")
        c.commit(f"f{i}")
    assert c.stats().rollovers > 0
    c._journal.close()  # a crash: no finish, no clean close of the cursor
    with Cursor(curdir) as again:
        (doubt,) = again.in_doubt()
        assert doubt.message_id == m.message_id and doubt.worker == "w7"
        assert again.monitored(m.message_id, pub.queues[0])
        sent = [q for q in doubt.queues if again.deliver_copy(m.message_id, q, "recovery-1")]
        assert sent == list(pub.queues[1:])
        again.finish_publication(m.message_id)
        assert again.in_doubt() == []
        for q in pub.queues:
            assert [d.body for d in again.available(q)] == [b"p"]


def test_a_non_persistent_publication_is_forced_only_for_a_disconnected_durable_subscriber(
    cursor: Cursor,
) -> None:
    """Seed 003: a non-persistent message for a disconnected durable subscriber is stored as if
    it were persistent; for a connected one it may stay lazy."""
    cursor.subscribe(TOPIC, "away")
    cursor.subscribe(TOPIC, "here")
    cursor.attach(TOPIC, "here")
    m = put(cursor, b"np", TOPIC, persistent=False)
    pub = cursor.next_publication("w")
    assert pub is not None
    before = cursor.stats().forced_records
    cursor.deliver_copy(m.message_id, subscription_queue(TOPIC, "here"), "w")
    assert cursor.stats().forced_records == before
    cursor.deliver_copy(m.message_id, subscription_queue(TOPIC, "away"), "w")
    assert cursor.stats().forced_records == before + 1


# -- replay determinism: an apply never depends on what a concurrent writer did ---------------


def test_the_reject_verdict_travels_in_the_record_not_in_the_queue_kind_at_apply_time() -> None:
    """Seed 004's rejection is decided when the cursor writes the ``M`` record: a ``T`` that
    lands between the write and the apply (or before it in a replay) cannot change it."""
    from resource_managers.cursor._records import message_obj
    from resource_managers.cursor._state import CursorState

    m = Message(uuid.uuid4().hex, "audit", b"x", {ADMIN_QUEUE_HEADER: "admin"})
    record = {"k": "M", "q": "audit", "e": 1, "n": 1, "o": message_obj(m)}
    for verdict in (False, True):
        state = CursorState()
        state.apply({"k": "T", "u": "audit", "v": False})  # the queue kind changed meanwhile
        state.apply(record | ({"j": True} if verdict else {}))
        assert (m.message_id in state.queue("audit.DLQ")) is verdict
        assert (m.message_id in state.queue("audit")) is not verdict
        assert (len(state.queue("admin")) == 1) is verdict


def test_a_commit_or_rollback_leaves_nothing_in_limbo_that_a_racing_receive_took() -> None:
    """A receive that raced the end of its own branch (the branch's record names only what it
    held when the record was made): what the record does not name goes back to its queue."""
    from resource_managers.cursor._records import message_obj
    from resource_managers.cursor._state import CursorState

    for end in ({"k": "C", "g": "g", "i": ["a"]},
                {"k": "R", "g": "g", "t": 1, "i": ["a"], "x": []}):  # fmt: skip
        state = CursorState()
        for n, mid in enumerate(("a", "b"), 1):
            msg = Message(mid, "orders", b"", {})
            state.apply({"k": "M", "q": "orders", "e": 1, "n": n, "o": message_obj(msg)})
        state.apply({"k": "H", "g": "g", "i": ["a"], "c": 1})
        state.apply({"k": "H", "g": "g", "i": ["b"], "c": 1})  # taken after the end was made
        state.apply(end)
        assert "b" in state.queue("orders") and state.handed == {}


def test_a_shared_non_durable_subscription_lives_until_its_last_subscriber_detaches(
    cursor: Cursor,
) -> None:
    """Seed 003: non-durable subscribers get what arrives while they are connected; two local
    subscribers of one non-durable subscription keep it until both are gone."""
    cursor.subscribe(TOPIC, "shared", durable=False)
    cursor.subscribe(TOPIC, "shared", durable=False)
    cursor.detach(TOPIC, "shared")
    assert [s.connected for s in cursor.subscriptions()] == [True]
    cursor.detach(TOPIC, "shared")
    assert cursor.subscriptions() == []


def test_a_handler_changing_headers_changes_nothing_in_the_cursor(tmp_path: Path) -> None:
    """The cursor keeps the message it hands out: a consumer's changes to a delivery's headers
    reach neither a redelivery nor what a rollover writes."""
    from resource_managers.cursor import Cursor as _Cursor
    from resource_managers.message_log import Message as _Message
    from resource_managers.sequencing import Frame as _Frame

    with _Cursor(tmp_path / "c", segment_bytes=4096) as cursor:
        m = _Message("m-1", "orders", b"x", {"k": "v"})
        cursor.deliver(_Frame("orders", 7, 1, 0, m.message_id), m)
        got = cursor.take("g-1", "orders")
        assert got is not None
        got.headers["k"] = "changed"
        got.headers["extra"] = "1"
        cursor.rollback("g-1")
        again = cursor.take("g-2", "orders")
        assert again is not None and again.headers == {"k": "v"}
    with _Cursor(tmp_path / "c") as reopened:
        [left] = reopened.available("orders")
        assert left.headers == {"k": "v"}
