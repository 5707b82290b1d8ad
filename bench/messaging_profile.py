"""Where a message's Python time goes: the `log+cursor only` pipeline of `bench/messaging.py` in
ONE process, so a profiler (or ``valgrind --tool=callgrind``) sees every part of it.

The producer (this thread) commits ``--per-tx`` messages per transaction into an embedded
`MessageLog`; its `LogTransfer` moves them over authenticated loopback TCP to a `Listener` with a
`TransferReceiver` into an embedded `Cursor`; a consumer thread receives up to ``--per-tx`` per
transaction and commits. The same stores, the same file decision log and the same message shape
(256 random bytes, two headers) as the benchmark row; only the process boundary is gone.

    python bench/messaging_profile.py [--messages 5000] [--per-tx 100] [--profile]
        [--top 40] [--sort tottime] [--timers 0.5]

``--profile``: cProfile in every thread (the pump, the receiver, the consumer and the producer),
merged, printed by ``--sort``. Without it, the run is timed only (messages/s). For instruction
counts, run it twice under callgrind with different ``--messages`` and divide the difference by
the difference in messages (startup cancels out)::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python bench/messaging_profile.py --messages 2000 --timers 3600 2>&1 | grep refs
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import secrets
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator import FileDecisionLog, TransactionManager
from messaging.auth import SharedSecret
from messaging.connection import Listener, connect
from messaging.transfer import TRANSFER_ROLE, LogTransfer, TransferReceiver
from resource_managers.cursor import Cursor, CursorResource
from resource_managers.message_log import MessageLog, MessageLogResource
from resource_managers.sequencing import DoublingBackoff

DESTINATION = "bench"
BODY_BYTES = 256
SENT = "sent-ns"

_profiles: list[tuple[str, cProfile.Profile]] = []
_profiles_lock = threading.Lock()


def profile_every_thread() -> None:
    """Run every thread started from now on under its own cProfile (merged at the end)."""
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        profile = cProfile.Profile()
        profile.enable()
        try:
            original(self)
        finally:
            profile.disable()
            with _profiles_lock:
                _profiles.append((self.name, profile))

    threading.Thread.run = run  # type: ignore[method-assign]


def _manager(node: str, workdir: Path, resources: list[Any]) -> TransactionManager:
    return TransactionManager(
        node,
        FileDecisionLog(workdir / f"{node}-txlog"),
        resources,
        recovery_interval=None,
        reaper_interval=None,
        inline_completion=True,
    )


def consume(cursor: Cursor, workdir: Path, per_tx: int, total: int, done: list[float]) -> None:
    cur_res = CursorResource(cursor, "cursor")
    tm = _manager("prof-consumer", workdir, [cur_res])
    got_total = 0
    try:
        while got_total < total:
            with tm.transaction() as tx:
                got = tx.join(cur_res).receive_many(DESTINATION, per_tx, timeout=5.0)
            got_total += len(got)
        done.append(time.perf_counter())
    finally:
        tm.close()


def run(per_tx: int, total: int, timers: float) -> float:
    """Messages per second, first send to last consumer commit."""
    workdir = Path(tempfile.mkdtemp(prefix="twopc-prof-msg-"))
    secret = SharedSecret(secrets.token_bytes(32))
    try:
        cursor = Cursor(workdir / "cursor")
        listener = Listener(("127.0.0.1", 0), secret, "prof-cursor",
                            {TRANSFER_ROLE: TransferReceiver(cursor)}).start()  # fmt: skip
        mlog = MessageLog(workdir / "log")
        transfer = LogTransfer(
            mlog,
            lambda: connect(listener.address, secret, "prof-log", TRANSFER_ROLE),
            resend=DoublingBackoff(base=timers, cap=max(30.0, timers)),
            ping_interval=max(5.0, timers),
        ).start()
        log_res = MessageLogResource(mlog, "mlog")
        tm = _manager("prof-producer", workdir, [log_res])
        prefix = uuid.uuid4().hex[:12]
        bodies = [os.urandom(BODY_BYTES) for _ in range(total)]
        done: list[float] = []
        consumer = threading.Thread(
            target=consume, args=(cursor, workdir, per_tx, total, done), name="consumer"
        )
        started = time.perf_counter()
        consumer.start()
        for first in range(0, total, per_tx):
            with tm.transaction() as tx:
                branch = tx.join(log_res)
                sent = str(time.time_ns())
                for n in range(first, min(first + per_tx, total)):
                    branch.send(DESTINATION, bodies[n], headers={"id": f"{prefix}-{n:09d}",
                                                                 SENT: sent})  # fmt: skip
        consumer.join(120)
        if not done:
            raise SystemExit("the consumer did not get every message in time")
        transfer.wait_idle(30)
        transfer.close()
        listener.close()
        tm.close()
        mlog.close()
        cursor.close()
        return total / (done[0] - started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--per-tx", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="cProfile every thread")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--sort", default="tottime")
    parser.add_argument(
        "--side",
        choices=("all", "log", "cursor"),
        default="all",
        help="profile only the log's side (producer, transfer pump) or the "
        "cursor's (transfer receiver, consumer)",
    )
    parser.add_argument(
        "--timers",
        type=float,
        default=0.5,
        help="first resend after this many seconds (0.5, the default); under "
        "callgrind pass 3600, so that the slowdown causes no resends",
    )
    args = parser.parse_args()
    main_profile = None
    if args.profile:
        profile_every_thread()
        main_profile = cProfile.Profile()
        main_profile.enable()
    rate = run(args.per_tx, args.messages, args.timers)
    if main_profile is not None:
        main_profile.disable()
        cursor_side = ("twopc-conn-", "consumer")
        chosen = [p for name, p in _profiles if args.side == "all"
                  or (args.side == "cursor") == name.startswith(cursor_side)]  # fmt: skip
        if args.side != "cursor":
            chosen.append(main_profile)
        stats = pstats.Stats(chosen[0])
        for p in chosen[1:]:
            stats.add(p)
        stats.sort_stats(args.sort).print_stats(args.top)
    print(f"{args.messages} messages, {args.per_tx}/tx: {rate:,.0f} msg/s (one process)")


if __name__ == "__main__":
    main()
