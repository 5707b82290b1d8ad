"""`messaging.dispatch`: seed 002's per-publisher FIFO dispatcher and its global-lock baseline.

Invariants checked: ``publisher_order`` (each publisher's publications are delivered in the order
they were read), ``exactly_once`` (nothing lost, nothing duplicated), ``parallelism`` (different
publishers are delivered at the same time), ``no_head_of_line`` (a slow publisher below the
worker count does not hold the others up), ``drain`` and ``fail_stop`` (the documented policy for
a ``deliver`` that keeps raising).
"""

from __future__ import annotations

import pickle
import queue
import random
import threading
import time
from collections import defaultdict

import pytest

from coordinator.backoff import NoBackoff
from coordinator.errors import ProgrammingError
from messaging.dispatch import (
    Dispatcher,
    DispatchFailed,
    GlobalLockDispatcher,
    Publication,
)

pytestmark = pytest.mark.timeout(30)

DISPATCHERS = [Dispatcher, GlobalLockDispatcher]


class Recorder:
    """A ``deliver`` that records each delivery, sleeps as I/O would, and measures overlap."""

    def __init__(
        self, delay: float | None = None, rng: random.Random | None = None, most: float = 0.003
    ) -> None:
        self.delay, self.rng, self.most = delay, rng or random.Random(0), most
        self.lock = threading.Lock()
        self.delivered: list[Publication] = []
        self.intervals: list[tuple[str, float, float]] = []
        self.busy: set[str] = set()
        self.overlap = 0  # most deliveries running at once
        self.same_publisher_overlap = False

    def sleep_for(self) -> float:
        if self.delay is not None:
            return self.delay
        with self.lock:
            return self.rng.uniform(0, self.most)

    def __call__(self, p: Publication) -> None:
        with self.lock:
            if p.publisher_id in self.busy:
                self.same_publisher_overlap = True
            self.busy.add(p.publisher_id)
            self.overlap = max(self.overlap, len(self.busy))
        start = time.monotonic()
        time.sleep(self.sleep_for())
        with self.lock:
            self.busy.discard(p.publisher_id)
            self.delivered.append(p)
            self.intervals.append((p.publisher_id, start, time.monotonic()))


def fill(q: queue.Queue[Publication], publishers: int, total: int, seed: int) -> list[Publication]:
    """``total`` publications over ``publishers``, publisher chosen at random, seq in order."""
    rng, seqs, made = random.Random(seed), defaultdict[str, int](int), []
    for _ in range(total):
        pid = f"p{rng.randrange(publishers)}"
        made.append(Publication(pid, seqs[pid], payload=len(made)))
        seqs[pid] += 1
        q.put(made[-1])
    return made


def by_publisher(pubs: list[Publication]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for p in pubs:
        out[p.publisher_id].append(p.seq)
    return dict(out)


def assert_prefix_in_order(delivered: list[Publication], published: list[Publication]) -> None:
    """publisher_order + no duplicates: per publisher, delivered seqs are 0, 1, 2, ... n-1."""
    assert len(set(delivered)) == len(delivered), "duplicate delivery"
    for pid, seqs in by_publisher(delivered).items():
        assert seqs == list(range(len(seqs))), f"order violated for {pid}: {seqs[:20]}"
    assert set(delivered) <= set(published)


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_publisher_order_and_exactly_once_8_workers_50_publishers(cls: type[Dispatcher]) -> None:
    q: queue.Queue[Publication] = queue.Queue()
    published = fill(q, publishers=50, total=600 if cls is Dispatcher else 150, seed=2)
    rec = Recorder(rng=random.Random(7))
    d = cls(q, rec, workers=8)
    d.start()
    stats = d.stop(drain=True)
    assert_prefix_in_order(rec.delivered, published)
    assert sorted(rec.delivered, key=lambda p: p.payload) == published  # nothing lost
    assert stats.delivered == stats.read == len(published)
    assert not rec.same_publisher_overlap


def test_parallelism_different_publishers_overlap() -> None:
    q: queue.Queue[Publication] = queue.Queue()
    fill(q, publishers=20, total=80, seed=3)
    rec = Recorder(delay=0.01)
    d = Dispatcher(q, rec, workers=8)
    started = time.monotonic()
    d.start()
    d.stop()
    elapsed = time.monotonic() - started
    assert rec.overlap >= 4, rec.overlap
    assert elapsed < 80 * 0.01 / 2  # serial would take 0.8 s


def test_global_lock_never_overlaps() -> None:
    q: queue.Queue[Publication] = queue.Queue()
    fill(q, publishers=20, total=40, seed=3)
    rec = Recorder(delay=0.002)
    d = GlobalLockDispatcher(q, rec, workers=8)
    d.start()
    assert d.stop().max_fifo_depth == 0
    assert rec.overlap == 1


def test_no_head_of_line_slow_publisher_below_worker_count() -> None:
    """A hot publisher stuck in ``deliver`` with 3 publications queued parks 3 of 8 workers;
    the other 5 deliver every other publisher meanwhile."""
    release = threading.Event()
    rec = Recorder(delay=0.0)

    def deliver(p: Publication) -> None:
        if p.publisher_id == "hot" and p.seq == 0:
            assert release.wait(10)
        rec(p)

    q: queue.Queue[Publication] = queue.Queue()
    for seq in range(3):
        q.put(Publication("hot", seq))
    cold = [Publication(f"c{i % 10}", i // 10) for i in range(100)]
    for p in cold:
        q.put(p)
    d = Dispatcher(q, deliver, workers=8)
    d.start()
    deadline = time.monotonic() + 5
    while len(rec.delivered) < len(cold) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sorted(rec.delivered, key=lambda p: (p.publisher_id, p.seq)) == sorted(
        cold, key=lambda p: (p.publisher_id, p.seq)
    )
    release.set()
    stats = d.stop()
    assert by_publisher(rec.delivered)["hot"] == [0, 1, 2]
    assert 2 <= stats.max_fifo_depth <= 7  # hot's two parked workers; cold ones may queue too


def test_head_of_line_documented_limit_backlog_at_worker_count() -> None:
    """The seed's price: a backlog of ``workers`` publications from one stuck publisher parks
    every worker, so a publication behind it waits until the hot one moves."""
    release = threading.Event()
    delivered: list[Publication] = []

    def deliver(p: Publication) -> None:
        if p.publisher_id == "hot" and p.seq == 0:
            assert release.wait(10)
        delivered.append(p)

    q: queue.Queue[Publication] = queue.Queue()
    for seq in range(4):
        q.put(Publication("hot", seq))
    q.put(Publication("cold", 0))
    d = Dispatcher(q, deliver, workers=4)
    d.start()
    time.sleep(0.1)
    assert delivered == [] and q.qsize() == 1
    release.set()
    stats = d.stop()
    assert [p.seq for p in delivered if p.publisher_id == "hot"] == [0, 1, 2, 3]
    assert stats.max_fifo_depth == 3 and stats.delivered == 5


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_stop_drain_delivers_everything(cls: type[Dispatcher]) -> None:
    q: queue.Queue[Publication] = queue.Queue()
    published = fill(q, publishers=5, total=200, seed=4)
    rec = Recorder(delay=0.0)
    d = cls(q, rec, workers=4)
    d.start()
    assert d.stop(drain=True).delivered == 200
    assert q.empty() and len(rec.delivered) == 200
    assert_prefix_in_order(rec.delivered, published)


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_stop_without_drain_delivers_what_was_read_and_leaves_the_rest(
    cls: type[Dispatcher],
) -> None:
    q: queue.Queue[Publication] = queue.Queue()
    published = fill(q, publishers=10, total=500, seed=5)
    rec = Recorder(delay=0.002)
    d = cls(q, rec, workers=4)
    d.start()
    time.sleep(0.03)
    stats = d.stop(drain=False)
    left: list[Publication] = []
    while not q.empty():
        left.append(q.get_nowait())
    assert stats.read == stats.delivered == len(rec.delivered) == 500 - len(left)
    assert 0 < len(left) < 500
    assert_prefix_in_order(rec.delivered, published)
    assert sorted(rec.delivered + left, key=lambda p: p.payload) == published


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_transient_failure_is_retried_in_order(cls: type[Dispatcher]) -> None:
    failures = {("p1", 3): 2}  # fails twice, then succeeds
    rec = Recorder(delay=0.0)

    def deliver(p: Publication) -> None:
        key = (p.publisher_id, p.seq)
        if failures.get(key, 0) > 0:
            failures[key] -= 1
            raise OSError("subscriber socket reset")
        rec(p)

    q: queue.Queue[Publication] = queue.Queue()
    published = fill(q, publishers=3, total=60, seed=6)
    d = cls(q, deliver, workers=4, max_attempts=3, backoff=NoBackoff())
    d.start()
    stats = d.stop()
    assert stats.retries == 2 and stats.delivered == 60
    assert_prefix_in_order(rec.delivered, published)


@pytest.mark.parametrize("cls", DISPATCHERS)
def test_fail_stop_keeps_the_failed_publication_and_everything_behind_it(
    cls: type[Dispatcher],
) -> None:
    rec = Recorder(delay=0.001)

    def deliver(p: Publication) -> None:
        if (p.publisher_id, p.seq) == ("p1", 5):
            raise OSError("subscriber gone")
        rec(p)

    q: queue.Queue[Publication] = queue.Queue()
    published = fill(q, publishers=3, total=300, seed=8)
    d = cls(q, deliver, workers=4, max_attempts=2, backoff=NoBackoff())
    d.start()
    with pytest.raises(DispatchFailed) as info:
        d.stop()
    err = info.value
    assert err.code == "dispatch-failed" and isinstance(err.__cause__, OSError)
    assert err.publication == Publication("p1", 5, err.publication.payload)  # type: ignore[union-attr]
    undelivered = list(err.undelivered)
    assert undelivered[0] == err.publication
    assert {p.publisher_id for p in undelivered} == {"p1"}
    left: list[Publication] = []
    while not q.empty():
        left.append(q.get_nowait())
    assert_prefix_in_order(rec.delivered, published)
    assert by_publisher(rec.delivered)["p1"] == [0, 1, 2, 3, 4]  # nothing after the failure
    # nothing lost: every publication is delivered, handed back, or still in the source
    assert sorted(rec.delivered + undelivered + left, key=lambda p: p.payload) == published
    # handed back in order, and before anything of p1 still in the source
    p1_rest = [p.seq for p in undelivered] + [p.seq for p in left if p.publisher_id == "p1"]
    assert p1_rest == list(range(5, len(p1_rest) + 5))
    copy = pickle.loads(pickle.dumps(err))
    assert copy.undelivered == err.undelivered and copy.code == err.code


def test_source_failure_stops_and_surfaces() -> None:
    class Broken:
        def get(self, block: bool = True, timeout: float | None = None) -> Publication:
            raise RuntimeError("queue manager unavailable")

    d = Dispatcher(Broken(), lambda p: None, workers=2)
    d.start()
    with pytest.raises(DispatchFailed) as info:
        d.stop()
    assert info.value.publication is None and info.value.undelivered == ()


def test_publication_validated_at_the_boundary() -> None:
    with pytest.raises(ProgrammingError, match="publisher_id"):
        Publication("", 0)


@pytest.mark.parametrize("seed", range(6))
def test_seeded_random_stress(seed: int) -> None:
    """publisher_order and exactly_once under random workers, publishers, delays and transient
    failures, with publications arriving while the dispatcher runs."""
    rng = random.Random(seed)
    workers, publishers, total = rng.choice([2, 3, 8, 16]), rng.choice([1, 4, 30]), 400
    flaky = {rng.randrange(total) for _ in range(10)}
    failed_once: set[int] = set()
    rec = Recorder(rng=random.Random(seed + 100), most=0.0005)

    def deliver(p: Publication) -> None:
        if p.payload in flaky and p.payload not in failed_once:
            failed_once.add(p.payload)
            raise OSError("flaky")
        rec(p)

    q: queue.Queue[Publication] = queue.Queue()
    d = Dispatcher(q, deliver, workers=workers, backoff=NoBackoff(), poll_interval=0.005)
    d.start()
    published = fill(q, publishers=publishers, total=total, seed=seed)  # while running
    stats = d.stop()
    assert_prefix_in_order(rec.delivered, published)
    assert sorted(rec.delivered, key=lambda p: p.payload) == published
    assert stats.delivered == total and stats.retries == len(flaky)
    assert stats.max_fifo_depth <= workers - 1
    assert not rec.same_publisher_overlap
