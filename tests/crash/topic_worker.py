"""The process the topic-dispatch crash tests kill: a `Cursor` with a `TopicDispatcher` (seeds 001
and 002) and a feeder that publishes into the cursor's topic input while the workers fan out.

    python tests/crash/topic_worker.py run DIR [--publishers 3] [--per-publisher 30]
        [--subscriptions 3] [--workers 4] [--burst 6] [--non-persistent]

The plan is fixed, so a restarted process publishes exactly what its predecessor did not:
publication ``k`` (0-based) comes from publisher ``p<k % P>`` with sequence ``k // P`` and message
id ``p<i>-<seq>``, and the feeder resumes after the last number the cursor accepted on its stream
(the acknowledgment the transfer would get). It feeds in bursts of ``--burst`` (one
``deliver_many`` each, so several workers have work at once) with a short pause between, so
publications arrive while others are being dispatched, as they would from a log.

Durable subscriptions ``s0..`` are made (idempotently) and never attached, so they stay
disconnected: with ``--non-persistent`` every copy record is forced (seed 003 stores a
non-persistent publication for a disconnected durable subscriber as persistent), and a crash then
leaves publications in the in-doubt list with some copies in the monitor queue: the case seed
001's recovery exists for. Persistent publications' copies are lazy, made durable by the feeder's
forced records.

Printed, flushed: ``IN_DOUBT n`` at start (what the previous process left), ``STATS {json}``
and ``DONE`` once every publication has left the topic input and the in-doubt list.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from messaging.topics import TopicDispatcher
from resource_managers.cursor import Cursor
from resource_managers.message_log import PUBLISHER_HEADER, Message
from resource_managers.sequencing import Frame

TOPIC = "topic:news"
EPOCH = 1


def say(*words: object) -> None:
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def plan(publishers: int, per_publisher: int, persistent: bool) -> list[Message]:
    """Every publication of the run, in publishing order."""
    out = []
    for k in range(publishers * per_publisher):
        pub, seq = f"p{k % publishers}", k // publishers
        out.append(
            Message(f"{pub}-{seq:04d}", TOPIC, f"{pub}:{seq}".encode(),
                    {PUBLISHER_HEADER: pub}, persistent=persistent)
        )  # fmt: skip
    return out


def feed(cursor: Cursor, messages: list[Message], burst: int, pause: float) -> None:
    """Publish what the cursor has not accepted yet, in plan order, ``burst`` at a time."""
    stream = messages[0].stream
    ack = cursor.ack_for(stream)
    last = ack.seq if ack.epoch == EPOCH else 0
    for start in range(last, len(messages), burst):
        batch = messages[start : start + burst]
        items = [
            (Frame(stream, EPOCH, start + i + 1, start + i, m.message_id), m)
            for i, m in enumerate(batch)
        ]
        cursor.deliver_many(items)
        time.sleep(pause)


def run(args: argparse.Namespace) -> int:
    cursor = Cursor(args.dir)
    for i in range(args.subscriptions):
        cursor.subscribe(TOPIC, f"s{i}", durable=True)
    say("IN_DOUBT", len(cursor.in_doubt()))
    topics = TopicDispatcher(cursor, args.workers, poll_interval=0.02).start()
    feed(cursor, plan(args.publishers, args.per_publisher, not args.non_persistent),
         args.burst, args.pause)  # fmt: skip
    while cursor.topic_backlog() or cursor.in_doubt():
        time.sleep(0.01)
    stats = topics.stop()
    cursor.close()
    say("STATS", json.dumps(dataclasses.asdict(stats)))
    say("DONE")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--publishers", type=int, default=3)
    r.add_argument("--per-publisher", type=int, default=30)
    r.add_argument("--subscriptions", type=int, default=3)
    r.add_argument("--workers", type=int, default=4)
    r.add_argument("--burst", type=int, default=6)
    r.add_argument("--pause", type=float, default=0.005)
    r.add_argument("--non-persistent", action="store_true")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
