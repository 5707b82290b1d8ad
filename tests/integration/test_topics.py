"""Topic fan-out (`messaging.topics.TopicDispatcher`) over a real cursor on disk.

Invariants checked: ``fan_out`` (a publication reaches every subscription), ``publisher_order``
(seed 002, IPCOM000031305D: each publisher's publications keep their order in every subscription
queue with several workers), ``exactly_once`` (seed 001, US 7,480,918: recovery copies only what
the monitor queue lacks, also when the recovery pass itself fails and starts over),
``durable_subscription`` and ``last_consumer_removes`` (seed 003: copies wait for a disconnected
durable subscriber; the message leaves the store only when the last subscription's consumer
commits), ``non_persistent_for_durable`` (a non-persistent publication for a disconnected durable
subscriber survives ``kill -9``), and the same fan-out through a real log and cursor server pair.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator import MemoryDecisionLog, TransactionManager
from coordinator.backoff import NoBackoff
from coordinator.errors import ConfigurationError
from messaging.auth import SharedSecret
from messaging.server import CursorServer, LogServer
from messaging.topics import TopicDispatcher, TopicStats
from resource_managers.cursor import Cursor, CursorResource, TopicPublication, subscription_queue
from resource_managers.message_log import PUBLISHER_HEADER, Message
from resource_managers.sequencing import Frame
from tests.support.managers import make_manager

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
TOPIC = "topic:news"
SECRET = SharedSecret(b"topic test secret, 32 bytes long!")


def publish(c: Cursor, *messages: Message) -> None:
    """Accept ``messages`` into the topic input, as the transfer would, each on its stream."""
    for m in messages:
        ack = c.ack_for(m.stream)
        last = ack.seq if ack.epoch == 1 else 0
        c.deliver(Frame(m.stream, 1, last + 1, last, m.message_id), m)


def pub(mid: str, publisher: str | None = "p0", topic: str = TOPIC, **kw: bool) -> Message:
    headers = {} if publisher is None else {PUBLISHER_HEADER: publisher}
    return Message(mid, topic, mid.encode(), headers, **kw)


def queue_ids(c: Cursor, name: str, topic: str = TOPIC) -> list[str]:
    return [d.message_id for d in c.available(subscription_queue(topic, name))]


def settle(c: Cursor, timeout: float = 20.0) -> None:
    """Wait until every publication left the topic input and the in-doubt list."""
    deadline = time.monotonic() + timeout
    while c.topic_backlog() or c.in_doubt():
        assert time.monotonic() < deadline, (c.topic_backlog(), c.in_doubt())
        time.sleep(0.01)


def run(store: object, workers: int = 4, **options: object) -> TopicStats:
    """Dispatch everything there is, then stop; the stats."""
    inner = store if isinstance(store, Cursor) else store._cursor  # type: ignore[attr-defined]
    with TopicDispatcher(store, workers, poll_interval=0.02, **options) as topics:  # type: ignore[arg-type]
        assert topics.wait_ready(10)
        settle(inner)
    return topics.stats


class Wrapped:
    """A cursor whose dispatch hooks a test can slow down or break (``hook(method, args)`` runs
    before each call and may sleep or raise)."""

    def __init__(self, cursor: Cursor, hook: Callable[[str, tuple[str, ...]], None]) -> None:
        self._cursor, self._hook = cursor, hook

    def next_publication(self, worker: str, timeout: float | None = 0.0) -> TopicPublication | None:
        return self._cursor.next_publication(worker, timeout)

    def deliver_copy(self, message_id: str, queue: str, by: str) -> bool:
        self._hook("deliver_copy", (message_id, queue, by))
        return self._cursor.deliver_copy(message_id, queue, by)

    def finish_publication(self, message_id: str) -> None:
        self._hook("finish_publication", (message_id,))
        self._cursor.finish_publication(message_id)

    def in_doubt(self) -> list[TopicPublication]:
        self._hook("in_doubt", ())
        return self._cursor.in_doubt()

    def monitored(self, message_id: str, queue: str) -> bool:
        return self._cursor.monitored(message_id, queue)


def per_publisher(ids: list[str]) -> dict[str, list[int]]:
    """``pX-n`` ids grouped by publisher, in queue order."""
    out: dict[str, list[int]] = defaultdict(list)
    for mid in ids:
        publisher, _, n = mid.rpartition("-")
        out[publisher].append(int(n))
    return dict(out)


# -- fan-out and order (seed 002) ------------------------------------------------------------------


def test_a_publication_reaches_every_subscription(cursor: Cursor) -> None:
    """fan_out: one copy in each subscription queue, durable or not; a publication with no
    subscription when a worker takes it (the queues are fixed then) is finished and gone."""
    publish(cursor, pub("lonely-0"))
    assert run(cursor).finished == 1 and cursor.holders("lonely-0") == []
    cursor.subscribe(TOPIC, "a")
    cursor.subscribe(TOPIC, "b")
    cursor.subscribe(TOPIC, "live", durable=False)
    publish(cursor, pub("m-0"), pub("other-0", topic="topic:other"))
    stats = run(cursor)
    assert [queue_ids(cursor, n) for n in ("a", "b", "live")] == [["m-0"]] * 3
    assert cursor.holders("m-0") == sorted(subscription_queue(TOPIC, n) for n in ("a", "b", "live"))
    assert cursor.holders("other-0") == []
    assert (stats.read, stats.finished, stats.copies) == (2, 2, 3)


def test_each_publishers_order_holds_in_every_subscription_with_four_workers(
    cursor: Cursor,
) -> None:
    """publisher_order (seed 002): 6 publishers, 40 publications each in random interleaving,
    4 workers whose copies take random time; every subscription queue holds each publisher's
    publications exactly once and in publishing order, and different publishers overlapped."""
    for name in ("s0", "s1", "s2"):
        cursor.subscribe(TOPIC, name)
    rng = random.Random(2)
    seqs: dict[str, int] = defaultdict(int)
    messages = []
    for _ in range(240):
        p = f"p{rng.randrange(6)}"
        messages.append(pub(f"{p}-{seqs[p]}", p))
        seqs[p] += 1
    busy: set[str] = set()
    lock = threading.Lock()
    overlap = [0]

    def slow(method: str, args: tuple[str, ...]) -> None:
        if method != "deliver_copy":
            return
        with lock:
            busy.add(args[2])
            overlap[0] = max(overlap[0], len(busy))
        time.sleep(rng.uniform(0, 0.002))
        with lock:
            busy.discard(args[2])

    publish(cursor, *messages[:120])
    with TopicDispatcher(Wrapped(cursor, slow), 4, poll_interval=0.02) as topics:
        publish(cursor, *messages[120:])  # some arrive while the workers run
        settle(cursor)
    expected = {p: list(range(n)) for p, n in seqs.items()}
    for name in ("s0", "s1", "s2"):
        assert per_publisher(queue_ids(cursor, name)) == expected, name
    assert overlap[0] > 1, "the workers never delivered in parallel"
    assert topics.stats.finished == 240 and topics.stats.copies == 720


# -- recovery (seed 001) ---------------------------------------------------------------------------


def test_recovery_after_a_failed_delivery_skips_monitored_copies_and_sends_the_rest_once(
    cursor: Cursor,
) -> None:
    """exactly_once (seed 001): the second copy of ``p1-3`` fails on every attempt, so the
    dispatcher fails stop with the publication in doubt and its first copy in the monitor queue.
    The recovery pass skips that copy, sends the other two, finishes the publisher's later
    publications in order, and fresh workers carry on: every queue holds everything once."""
    for name in ("s0", "s1", "s2"):
        cursor.subscribe(TOPIC, name)
    publish(cursor, *(pub(f"p{i % 3}-{i // 3}", f"p{i % 3}") for i in range(60)))
    s1 = subscription_queue(TOPIC, "s1")
    broken = {"on": True}

    def fail(method: str, args: tuple[str, ...]) -> None:
        if method == "deliver_copy" and args[:2] == ("p1-3", s1) and broken["on"]:
            if args[2].startswith("recovery"):
                broken["on"] = False  # the fault is gone by the time recovery runs
                return
            raise OSError("subscription queue unavailable")

    stats = run(Wrapped(cursor, fail), max_attempts=3, backoff=NoBackoff(),
                recovery_backoff=NoBackoff())  # fmt: skip
    everything = {f"p{i}": list(range(20)) for i in range(3)}
    for name in ("s0", "s1", "s2"):
        assert per_publisher(queue_ids(cursor, name)) == everything
    assert stats.dispatch_failures == 1 and stats.recovery_runs == 2
    assert stats.recovery_skipped == 1  # p1-3's copy in s0: the duplicate seed 001 prevents
    assert stats.skipped == 2  # the dispatcher's two retries found that copy made, too
    # recovery sent p1-3's other two copies and all three of each later p1 publication it held
    assert stats.recovered == 2 + 3 * (stats.recovery_finished - 1)
    assert stats.finished + stats.recovery_finished == 60
    assert stats.copies + stats.recovered == 180


def test_a_recovery_pass_that_fails_starts_over_and_sends_nothing_twice(curdir: Path) -> None:
    """exactly_once (seed 001's last step): a crashed process left four publications in doubt,
    two copies made; the recovery pass fails after two more and starts over from the top of the
    in-doubt list. The monitor queue makes it skip all four copies made, send the rest once,
    and keep each publisher's order with what the workers deliver after it."""
    with Cursor(curdir) as c:
        for name in ("s0", "s1", "s2"):
            c.subscribe(TOPIC, name)
        publish(c, *(pub(f"p{i % 2}-{i // 2}", f"p{i % 2}") for i in range(10)))
        taken = [c.next_publication("Dispatcher-0") for _ in range(4)]  # p0-0 p1-0 p0-1 p1-1
        assert [t.message_id for t in taken if t] == ["p0-0", "p1-0", "p0-1", "p1-1"]
        c.deliver_copy("p0-0", subscription_queue(TOPIC, "s0"), by="Dispatcher-0")
        c.deliver_copy("p0-0", subscription_queue(TOPIC, "s1"), by="Dispatcher-0")
    calls = {"recovery copies": 0}

    def fail_once(method: str, args: tuple[str, ...]) -> None:
        if method == "deliver_copy" and args[2].startswith("recovery"):
            calls["recovery copies"] += 1
            if calls["recovery copies"] == 3:  # p0-0's s2 and p1-0's s0 went; p1-0's s1 fails
                raise OSError("journal hiccup")

    with Cursor(curdir) as c:
        assert [t.message_id for t in c.in_doubt()] == ["p0-0", "p1-0", "p0-1", "p1-1"]
        stats = run(Wrapped(c, fail_once), recovery_backoff=NoBackoff())
        for name in ("s0", "s1", "s2"):
            assert per_publisher(queue_ids(c, name)) == {"p0": list(range(5)),
                                                         "p1": list(range(5))}  # fmt: skip
    assert stats.recovery_restarts == 1
    # the crashed worker's two, then p1-0's copy in s0 that the failed pass had made (p0-0's
    # third copy went too, but p0-0 was finished before the failure, so nobody looks again)
    assert stats.recovery_skipped == 2 + 1
    assert stats.recovered == 12 - 2  # every in-doubt copy, less those the crash had made
    assert stats.recovery_finished == 4 and stats.finished == 6


# -- durable subscriptions (seed 003) --------------------------------------------------------------


def test_a_durable_subscription_keeps_copies_while_disconnected(curdir: Path) -> None:
    """durable_subscription: copies for a durable subscription nobody is attached to wait, and
    survive a restart; a non-durable subscription goes with its last subscriber."""
    with Cursor(curdir) as c:
        c.subscribe(TOPIC, "keeper")
        c.subscribe(TOPIC, "passer", durable=False)
        publish(c, pub("p0-0"), pub("p0-1"))
        run(c)
        c.detach(TOPIC, "passer")
        publish(c, pub("p0-2"))
        run(c)
        assert [s.name for s in c.subscriptions(TOPIC)] == ["keeper"]
    with Cursor(curdir) as c:
        [keeper] = c.subscriptions(TOPIC)
        assert not keeper.connected and keeper.available == 3
        assert queue_ids(c, "keeper") == ["p0-0", "p0-1", "p0-2"]


def test_a_message_leaves_the_store_only_when_the_last_subscribers_consumer_commits(
    cursor: Cursor, managers: list[TransactionManager]
) -> None:
    """last_consumer_removes: ``holders`` names every subscription queue until its consumer
    commits; a rollback keeps the copy; ``[]`` only after the last durable subscription's
    consumer committed."""
    cursor.subscribe(TOPIC, "billing")
    cursor.subscribe(TOPIC, "audit")
    publish(cursor, pub("p0-0"))
    run(cursor)
    billing, audit = (subscription_queue(TOPIC, n) for n in ("billing", "audit"))
    cr = CursorResource(cursor)
    tm = make_manager(managers, [cr])

    def consume(queue: str, fail: bool = False) -> None:
        try:
            with tm.transaction() as tx:
                got = tx.join(cr).receive(queue)
                assert got is not None and got.message_id == "p0-0"
                if fail:
                    raise RuntimeError("handler failed")
        except RuntimeError:
            pass

    assert cursor.holders("p0-0") == sorted([billing, audit])
    consume(billing, fail=True)
    assert cursor.holders("p0-0") == sorted([billing, audit])
    consume(billing)
    assert cursor.holders("p0-0") == [audit]
    consume(audit)
    assert cursor.holders("p0-0") == []


KILLED_DISPATCHER = textwrap.dedent(
    """
    import os, signal, sys, time
    from messaging.topics import TopicDispatcher
    from resource_managers.cursor import Cursor
    from resource_managers.message_log import Message
    from resource_managers.sequencing import Frame
    c = Cursor(sys.argv[1])
    c.subscribe("topic:away", "durable")        # durable, nobody attached
    c.subscribe("topic:here", "durable")
    c.attach("topic:here", "durable")           # durable, its subscriber connected
    topics = TopicDispatcher(c, 1).start()
    for topic in ("topic:away", "topic:here"):  # one after the other: the forced copy first
        m = Message(topic[6:], topic, b"volatile", persistent=False)
        c.deliver(Frame(m.stream, 1, 1, 0, m.message_id), m)
        while c.topic_backlog() or c.in_doubt():
            time.sleep(0.005)
    print("DISPATCHED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_non_persistent_publication_survives_kill_9_only_for_a_disconnected_durable_subscriber(
    curdir: Path,
) -> None:
    """non_persistent_for_durable (seed 003): dispatched to a disconnected durable subscription,
    a non-persistent publication is stored as if persistent (its copy record is forced) and
    survives ``kill -9``. For a connected subscriber nothing forces it: every record of it is
    lazy, so a kill right after loses it, as it may lose any non-persistent message."""
    done = subprocess.run([sys.executable, "-c", KILLED_DISPATCHER, str(curdir)], cwd=REPO,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == -9 and "DISPATCHED" in done.stdout, done.stderr
    away = subscription_queue("topic:away", "durable")
    with Cursor(curdir) as c:
        assert queue_ids(c, "durable", "topic:away") == ["away"]  # the forced copy survived
        # its lazy finish did not: the publication is still in doubt, the copy in the monitor
        # queue, so the start-up recovery finishes it without a second copy (seed 001)
        assert [t.message_id for t in c.in_doubt()] == ["away"] and c.monitored("away", away)
        assert c.holders("here") == []  # lost with the process: nothing forced it
        stats = run(c)
        assert (stats.recovery_skipped, stats.recovered, stats.recovery_finished) == (1, 0, 1)
        assert c.holders("away") == [away] and c.in_doubt() == [] and c.topic_backlog() == 0


# -- through the servers ---------------------------------------------------------------------------


def test_fan_out_through_a_log_server_and_a_cursor_server_keeps_publisher_order(
    tmp_path: Path,
) -> None:
    """fan_out and publisher_order end to end: producers ``send(..., publisher=)`` to a topic in
    transactions on an embedded `LogServer`; its transfer carries them to an embedded
    `CursorServer`, whose topic dispatcher (4 workers) fans them out."""
    with CursorServer(tmp_path / "cursor", SECRET, listen=("127.0.0.1", 0)) as cursor_server:
        c = cursor_server.cursor
        for name in ("s0", "s1"):
            c.subscribe(TOPIC, name)
        with LogServer(tmp_path / "log", SECRET, cursor=cursor_server.address) as log_server:
            tm = TransactionManager("producer", MemoryDecisionLog(), [log_server.resource],
                                    recovery_interval=None, reaper_interval=None)  # fmt: skip
            try:
                for i in range(45):
                    with tm.transaction() as tx:
                        branch = tx.join(log_server.resource)
                        p = f"p{i % 3}"
                        branch.send(TOPIC, f"{p}-{i // 3}".encode(), publisher=p)
            finally:
                tm.close()
            deadline = time.monotonic() + 30
            while len(c.available(subscription_queue(TOPIC, "s1"))) < 45:
                assert time.monotonic() < deadline, c.available(subscription_queue(TOPIC, "s1"))
                time.sleep(0.02)
        assert cursor_server.topics is not None
        settle(c)
        for name in ("s0", "s1"):
            bodies = [d.body.decode() for d in c.available(subscription_queue(TOPIC, name))]
            assert per_publisher(bodies) == {f"p{i}": list(range(15)) for i in range(3)}
        assert cursor_server.topics.stats.finished == 45


def test_a_cursor_server_runs_its_dispatcher_unless_told_not_to(tmp_path: Path) -> None:
    """``dispatch_workers=0`` runs no dispatcher (publications wait in the topic input);
    a negative count is refused before anything listens."""
    with CursorServer(tmp_path / "c", SECRET, listen=("127.0.0.1", 0), dispatch_workers=0) as s:
        assert s.topics is None
        s.cursor.subscribe(TOPIC, "s0")
        publish(s.cursor, pub("p0-0"))
        time.sleep(0.1)
        assert s.cursor.topic_backlog() == 1
    with pytest.raises(ConfigurationError):
        CursorServer(tmp_path / "c", SECRET, listen=("127.0.0.1", 0), dispatch_workers=-1)
    with CursorServer(tmp_path / "c", SECRET, listen=("127.0.0.1", 0), dispatch_workers=2) as s:
        assert s.topics is not None and s.topics.wait_ready(10)
        settle(s.cursor)
        assert queue_ids(s.cursor, "s0") == ["p0-0"]
