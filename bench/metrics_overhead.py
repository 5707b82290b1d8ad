"""What issue 16's server metrics and expiry sweep cost, measured where they run.

Nothing is counted per message for the metrics: the families are read from counters the parts
keep anyway, at each scrape. Per message there is one addition: the transfer's resend count, a
comparison per stream per transfer step (`LogTransfer._step`). The expiry sweep runs beside the
message path: every ``--expiry-sweep`` seconds it scans the waiting messages under the cursor's
lock, which is what a receive waits for meanwhile. Printed:

- ``sweep``: one `Cursor.sweep_expired` over N waiting messages in Q queues, none of which
  expires (the usual case: a scan that moves nothing), in ms; and the lock hold for one queue,
  the longest a receive can wait behind the sweep (it takes the lock queue by queue);
- ``scrape``: one `CursorServer.families()` plus `render_text` with Q queues holding N messages;
- ``step``: the resend-count lines of a transfer step, in ns per stream and step, against the
  step without them (a `StreamSender.tick` that sends one frame).

    python bench/metrics_overhead.py [--messages 100000] [--queues 100]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import timeit
import uuid
from pathlib import Path

# run as a script: the repository first, before bench/ (whose messaging.py would shadow the package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from messaging.auth import SharedSecret
from messaging.metrics import render_text
from messaging.server import CursorServer
from resource_managers.message_log import Message
from resource_managers.sequencing import Frame, StreamSender


def fill(server: CursorServer, messages: int, queues: int) -> None:
    cursor = server.cursor
    per_queue = messages // queues
    for q in range(queues):
        stream = f"bench-{q}"
        for seq in range(1, per_queue + 1):
            m = Message(uuid.uuid4().hex, stream, b"x" * 64, {}, False, None)
            cursor.deliver(Frame(stream, 1, seq, seq - 1, m.message_id), m)


def best_ms(fn: object, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeat)) * 1000  # type: ignore[arg-type]


def step_ns() -> tuple[float, float]:
    """A sender with one frame due per step, with and without the resend-count lines."""
    sender = StreamSender("s")
    stats = {"resends": 0}

    def plain() -> None:
        sender.commit(uuid.uuid4().hex)
        sender.tick(time.monotonic(), 256, 1024)
        sender.on_ack(1, sender.next_seq - 1)

    def counted() -> None:
        sender.commit(uuid.uuid4().hex)
        sent_before = sender.highest_sent
        tick = sender.tick(time.monotonic(), 256, 1024)
        if tick.frames and tick.frames[0].seq <= sent_before:
            stats["resends"] += sum(f.seq <= sent_before for f in tick.frames)
        sender.on_ack(1, sender.next_seq - 1)

    n = 20000
    a = min(timeit.repeat(plain, number=n, repeat=5)) / n * 1e9
    b = min(timeit.repeat(counted, number=n, repeat=5)) / n * 1e9
    return a, b


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--queues", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = CursorServer(
            Path(tmp), SharedSecret(b"bench secret, 16+ bytes"), listen=("127.0.0.1", 0),
            dispatch_workers=0, sweep_interval=None,
        )  # fmt: skip
        with server:
            fill(server, args.messages, args.queues)
            sweep = best_ms(server.cursor.sweep_expired)
            hold = best_ms(lambda: server.cursor._sweep_queue("bench-0"))
            scrape = best_ms(lambda: render_text(server.families()))
    plain, counted = step_ns()
    print(
        f"sweep   {args.messages} waiting messages in {args.queues} queues, none expired: "
        f"{sweep:.1f} ms per sweep, the lock held {hold:.2f} ms at most (one queue)"
    )
    print(f"scrape  {args.queues} queues, {args.messages} messages: {scrape:.1f} ms per scrape")
    print(f"step    one frame per step: {plain:.0f} ns without the resend count, "
          f"{counted:.0f} ns with it ({counted - plain:+.0f} ns)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
