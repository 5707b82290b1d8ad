"""Throughput of seed 002's per-publisher FIFO `Dispatcher` against the `GlobalLockDispatcher`.

Each run fills a `queue.Queue` with ``--messages`` publications spread over N publishers (the
publisher of each one drawn at random from a fixed seed, seq numbers in order per publisher),
starts the dispatcher with W workers, and measures publications/s from ``start()`` to the end of
the last delivery (shutdown latency is not counted). ``deliver`` simulates I/O with
``time.sleep(--io)``: sleeping releases the GIL, as writing to a subscriber's socket would.
Every run checks the delivered stream: each publisher's seqs must arrive as 0, 1, 2, ... with
none missing or repeated, otherwise it counts an order violation.

Target (from the issue, seed 002): the FIFO design scales where the global lock does not, with
zero order violations. Fixed before measuring:

- FIFO scales: with 10 and with 100 publishers, 8 workers give >= 3x the 1-worker throughput;
- the global lock does not: 8 workers give <= 1.2x its 1-worker throughput (any publishers);
- zero order violations, nothing lost or duplicated, in every run of both dispatchers.

One publisher cannot scale under either design (its order forces one delivery at a time), so
that column is reported but not part of the target. One run per cell; numbers are noisy.

``--cursor`` adds rows that dispatch through a real `Cursor` on disk with the
`messaging.topics.TopicDispatcher` (3 durable subscriptions, 10 publishers): publications/s from
start until the topic input and the in-doubt list are empty, and the order violations found in
the subscription queues. Persistent publications write lazy copy records (no fsync, so the GIL
bounds the gain); non-persistent ones for disconnected durable subscribers force every copy, and
there the workers overlap their fsyncs. Informational: not part of the target.

    .venv/bin/python bench/dispatch.py [--messages 2000] [--io 0.0005] [--cursor]
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from messaging.dispatch import Dispatcher, GlobalLockDispatcher, Publication

WORKERS = (1, 2, 4, 8)
PUBLISHERS = (1, 10, 100)


class Checker:
    """The subscriber: sleeps as I/O, counts order violations, notes the last delivery's end."""

    def __init__(self, io: float, total: int) -> None:
        self.io, self.total = io, total
        self.lock = threading.Lock()
        self.next_seq: dict[str, int] = {}
        self.count = self.violations = 0
        self.done = threading.Event()
        self.finished = 0.0

    def __call__(self, p: Publication) -> None:
        time.sleep(self.io)
        with self.lock:
            if p.seq != self.next_seq.get(p.publisher_id, 0):
                self.violations += 1
            self.next_seq[p.publisher_id] = p.seq + 1
            self.count += 1
            if self.count == self.total:
                self.finished = time.perf_counter()
                self.done.set()


def run(
    cls: type[Dispatcher], workers: int, publishers: int, messages: int, io: float
) -> dict[str, float]:
    rng, seqs = random.Random(publishers * 1000 + workers), [0] * publishers
    q: queue.Queue[Publication] = queue.Queue()
    for _ in range(messages):
        i = rng.randrange(publishers)
        q.put(Publication(f"pub-{i}", seqs[i]))
        seqs[i] += 1
    check = Checker(io, messages)
    d = cls(q, check, workers=workers, poll_interval=0.002)
    started = time.perf_counter()
    d.start()
    if not check.done.wait(120):
        check.finished = time.perf_counter()
    stats = d.stop(drain=True)
    # a violation is any seq out of place (a duplicate or a gap), or a count that does not match
    missing = abs(messages - check.count) + abs(stats.delivered - check.count)
    return {
        "rate": check.count / (check.finished - started),
        "violations": check.violations + missing,
        "depth": stats.max_fifo_depth,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--io", type=float, default=0.0005, help="seconds each deliver sleeps")
    ap.add_argument("--cursor", action="store_true", help="add rows through a real cursor")
    args = ap.parse_args()
    print(
        f"# {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {args.messages} publications/run, deliver = sleep({args.io})"
    )
    results: dict[tuple[str, int, int], dict[str, float]] = {}
    for cls in (Dispatcher, GlobalLockDispatcher):
        for pubs in PUBLISHERS:
            for w in WORKERS:
                results[(cls.__name__, pubs, w)] = run(cls, w, pubs, args.messages, args.io)
    header = (
        f"{'publishers':>10} {'workers':>7} {'FIFO pub/s':>11} {'global pub/s':>12} "
        f"{'FIFO/global':>11} {'FIFO depth':>10} {'violations F/G':>14}"
    )
    print(header)
    print("-" * len(header))
    for pubs in PUBLISHERS:
        for w in WORKERS:
            f, g = results[("Dispatcher", pubs, w)], results[("GlobalLockDispatcher", pubs, w)]
            print(
                f"{pubs:>10} {w:>7} {f['rate']:>11.0f} {g['rate']:>12.0f} "
                f"{f['rate'] / g['rate']:>10.2f}x {f['depth']:>10.0f} "
                f"{f['violations']:>7.0f}/{g['violations']:.0f}"
            )
    status = verdict(results)
    if args.cursor:
        cursor_rows(min(args.messages, 1000))
    return status


def verdict(results: dict[tuple[str, int, int], dict[str, float]]) -> int:
    def scale(name: str, pubs: int) -> float:
        return results[(name, pubs, 8)]["rate"] / results[(name, pubs, 1)]["rate"]

    fifo = {p: scale("Dispatcher", p) for p in (10, 100)}
    glob = {p: scale("GlobalLockDispatcher", p) for p in PUBLISHERS}
    violations = sum(r["violations"] for r in results.values())
    checks = [
        ("FIFO 8w/1w >= 3x at 10 and 100 publishers", all(v >= 3 for v in fifo.values()), fifo),
        ("global 8w/1w <= 1.2x", all(v <= 1.2 for v in glob.values()), glob),
        ("zero order violations, none lost or duplicated", violations == 0, violations),
    ]
    met = True
    for name, ok, value in checks:
        shown = {k: round(v, 2) for k, v in value.items()} if isinstance(value, dict) else value
        print(f"{'MET   ' if ok else 'MISSED'} {name}: {shown}")
        met = met and ok
    print(f"target {'MET' if met else 'MISSED'}")
    return 0 if met else 1


def run_cursor(workers: int, messages: int, persistent: bool) -> dict[str, float]:
    """Fan ``messages`` publications out through a real cursor; rate and order violations."""
    import tempfile

    from messaging.topics import TopicDispatcher
    from resource_managers.cursor import Cursor, subscription_queue
    from resource_managers.message_log import PUBLISHER_HEADER, Message
    from resource_managers.sequencing import Frame

    rng, seqs = random.Random(workers), [0] * 10
    with tempfile.TemporaryDirectory() as tmp, Cursor(tmp) as cursor:
        for name in ("a", "b", "c"):
            cursor.subscribe("topic:bench", name)
        items = []
        for n in range(messages):
            i = rng.randrange(10)
            m = Message(f"pub-{i}-{seqs[i]}", "topic:bench", b"x" * 100,
                        {PUBLISHER_HEADER: f"pub-{i}"}, persistent=persistent)  # fmt: skip
            items.append((Frame(m.stream, 1, n + 1, n, m.message_id), m))
            seqs[i] += 1
        cursor.deliver_many(items)
        started = time.perf_counter()
        with TopicDispatcher(cursor, workers, poll_interval=0.01):
            while cursor.topic_backlog() or cursor.in_doubt():
                time.sleep(0.001)
            elapsed = time.perf_counter() - started
        violations = 0
        for name in ("a", "b", "c"):
            last: dict[str, int] = {}
            ids = [d.message_id for d in cursor.available(subscription_queue("topic:bench", name))]
            violations += abs(messages - len(ids))
            for mid in ids:
                pub, _, seq = mid.rpartition("-")
                violations += last.get(pub, -1) + 1 != int(seq)
                last[pub] = int(seq)
    return {"rate": messages / elapsed, "violations": violations}


def cursor_rows(messages: int) -> None:
    print(f"\n# through a real cursor: {messages} publications, 10 publishers, 3 subscriptions")
    print(f"{'persistent':>10} {'workers':>7} {'pub/s':>9} {'violations':>10}")
    for persistent in (True, False):
        for w in (1, 4, 8):
            r = run_cursor(w, messages, persistent)
            print(f"{persistent!s:>10} {w:>7} {r['rate']:>9.0f} {r['violations']:>10.0f}")


if __name__ == "__main__":
    raise SystemExit(main())
