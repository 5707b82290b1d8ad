"""Aggregate exactly-once messages/s with N log servers and M cursor servers (issue 15):
``python bench/messaging.py --logs 1,2,3 --cursors 1,2`` runs this, one row per (N, M).

Every server is a real ``twopc serve`` process on loopback. N log servers each route the
destination ``bench.orders`` to the M cursors (``--route 'bench.*=C1,...,CM'``: with M >= 2 the
destination is partitioned by key over them; with M = 1 it goes to the one cursor). One producer
process per log sends ``--messages``/N messages of 256 bytes, ``--per-tx`` per transaction, each
keyed by a random customer id, through a `RemoteMessageLog` in a `TransactionManager` (a
transaction with one branch commits in one phase: the log's forced commit record is the commit
point). One consumer process per cursor receives in rounds of ``--per-tx`` through a
`RemoteCursor` in its own manager (the cursor's forced commit record deletes them). The whole path
is exactly-once: a crash anywhere loses nothing and duplicates nothing (`tests/crash`). No
database: this measures the messaging system and how it spreads over processes. Messages/s is
counted from the moment every producer is connected and starts to the last consume.

The ratio column compares each row with the 1-log, 1-cursor row of the same run; ``CPU s`` is
the CPU time every process of the row used while timed (from ``/proc``), so ``CPU s`` against
``seconds`` times the machine's cores says whether the row was CPU-bound, and ``CPU us/msg`` what
a message costs all processes together. Every process
shares the machine's cores: with 2 cores, 3 logs, 3 producers, a cursor and a consumer (8 busy
processes, each a Python interpreter doing framing, JSON records and checks) are CPU-bound long
before the disk is, so the ratio shows the CPU's limit, not the design's; the printed header
says how many CPUs there are.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordinator import FileDecisionLog, TransactionManager
from messaging.auth import SharedSecret
from messaging.connection import parse_address
from messaging.consumer import consume_once
from messaging.remote import RemoteCursor, RemoteMessageLog

DESTINATION = "bench.orders"
SECRET = b"bench: a shared secret of at least 32 bytes"
BODY = b"x" * 256
KEYS = 10_000
REPO = Path(__file__).resolve().parents[1]


@dataclass
class ScaleResult:
    logs: int
    cursors: int
    messages: int
    per_tx: int
    seconds: float
    msg_s: float
    by_cursor: list[int]
    #: CPU seconds of every process of the row (servers, producers, consumers) while timed
    cpu_s: float


def _manager(node: str, state: Path, resources: list[Any]) -> TransactionManager:
    return TransactionManager(
        node, FileDecisionLog(state), resources, recovery_interval=5.0,
        reaper_interval=None, recover_on_start=False,
    )  # fmt: skip


@dataclass
class _Shared:
    """What the processes of one row share: the start and stop signals, the count of messages
    consumed so far."""

    go: Any
    stop: Any
    total: Any


def _produce(log_at: str, count: int, per_tx: int, state: Path, shared: _Shared) -> None:
    rng = random.Random(state.name)
    mlog = RemoteMessageLog(parse_address(log_at), SharedSecret(SECRET), client_id="bench")
    with _manager(f"producer-{state.name}", state, [mlog]) as tm:
        shared.go.wait()
        sent = 0
        while sent < count:
            with tm.transaction() as tx:
                branch = tx.join(mlog)
                for _ in range(min(per_tx, count - sent)):
                    branch.send(DESTINATION, BODY, key=f"customer-{rng.randrange(KEYS)}")
                    sent += 1


def _consume(cursor_at: str, per_tx: int, state: Path, shared: _Shared, mine: Any) -> None:
    cursor = RemoteCursor(parse_address(cursor_at), SharedSecret(SECRET), client_id="bench")
    with _manager(f"consumer-{state.name}", state, [cursor]) as tm:
        while not shared.stop.is_set():
            n = consume_once(tm, cursor, DESTINATION, _ignore, batch=per_tx, timeout=0.2)
            if n:
                with shared.total.get_lock():
                    shared.total.value += n
                mine.value += n
    cursor.close()


def _ignore(tx: Any, delivery: Any) -> None:
    """The consumer's handler: the transaction deleting the message is the work measured."""


@contextlib.contextmanager
def _servers(
    work: Path, logs: int, cursors: int
) -> Iterator[tuple[list[str], list[str], list[int]]]:
    """M cursor servers, then N log servers routing the destination to all of them."""
    procs: list[subprocess.Popen[str]] = []
    env = {**os.environ, "TWOPC_SECRET": SECRET.decode(), "PYTHONPATH": str(REPO)}

    def serve(kind: str, name: str, *options: str) -> str:
        argv = [sys.executable, "-m", "coordinator.cli", "serve", kind, "--dir",
                str(work / name), "--listen", "127.0.0.1:0", *options]  # fmt: skip
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        while not (line := proc.stdout.readline()).startswith("listening on"):
            if not line:
                raise RuntimeError(f"{kind} {name} did not start")
        return line.split()[-1]

    try:
        cursor_at = [serve("cursor", f"cursor{i}") for i in range(cursors)]
        route = "bench.*=" + ",".join(cursor_at)
        log_at = [serve("log", f"log{i}", "--cursor", cursor_at[0], "--route", route)
                  for i in range(logs)]  # fmt: skip
        yield log_at, cursor_at, [p.pid for p in procs]
    finally:
        for proc in reversed(procs):  # the logs first: no warning about a stopped cursor
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_scale(logs: int, cursors: int, messages: int, per_tx: int) -> ScaleResult:
    # fork: a spawned child would import this directory's messaging.py as the package
    ctx = mp.get_context("fork")
    work = Path(tempfile.mkdtemp(prefix="twopc-scale-"))
    try:
        with _servers(work, logs, cursors) as (log_at, cursor_at, server_pids):
            shared = _Shared(ctx.Event(), ctx.Event(), ctx.Value("q", 0))
            mine = [ctx.Value("q", 0, lock=False) for _ in cursor_at]
            share = [messages // logs + (i < messages % logs) for i in range(logs)]
            consumers = [
                ctx.Process(target=_consume, args=(at, per_tx, work / f"ctx{i}", shared, mine[i]))
                for i, at in enumerate(cursor_at)
            ]
            producers = [
                ctx.Process(target=_produce, args=(at, share[i], per_tx, work / f"ptx{i}", shared))
                for i, at in enumerate(log_at)
            ]
            for proc in (*consumers, *producers):
                proc.start()
            time.sleep(1.0)  # the processes connect before the clock starts
            pids = [*server_pids, *(p.pid for p in (*consumers, *producers) if p.pid)]
            cpu_before = _cpu(pids)
            start = time.perf_counter()
            shared.go.set()
            seconds = _wait_consumed(shared, messages, consumers, start)
            cpu = round(_cpu(pids) - cpu_before, 2)
            shared.stop.set()
            for proc in (*producers, *consumers):
                proc.join(30)
        return ScaleResult(logs, cursors, messages, per_tx, round(seconds, 3),
                           round(messages / seconds), [m.value for m in mine], cpu)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cpu(pids: list[int]) -> float:
    """CPU seconds (user and system) the processes ``pids`` have used so far (Linux ``/proc``;
    a process gone counts 0)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return total / ticks


def _wait_consumed(shared: _Shared, messages: int, consumers: list[Any], start: float) -> float:
    deadline = time.monotonic() + 600
    while shared.total.value < messages:
        if time.monotonic() > deadline or not any(p.is_alive() for p in consumers):
            raise RuntimeError(f"stalled at {shared.total.value} of {messages} consumed")
        time.sleep(0.01)
    return time.perf_counter() - start


def main(logs: list[int], cursors: list[int], messages: int, per_tx: int,
         json_path: Path | None) -> None:  # fmt: skip
    print(
        f"{os.cpu_count()} CPUs; {messages} messages of {len(BODY)} bytes per row, "
        f"{per_tx} per transaction, keyed over {KEYS} customers; every server a process"
    )
    results: list[ScaleResult] = []
    for m in cursors:
        for n in logs:
            print(f"  running {n} log(s) -> {m} cursor(s) ...", flush=True)
            results.append(run_scale(n, m, messages, per_tx))
    baseline = next((r.msg_s for r in results if r.logs == 1 and r.cursors == 1), None)
    print(f"{'logs':>4} {'cursors':>7} {'msg/s':>8} {'x 1x1':>6} {'CPU s':>6} "
          f"{'CPU us/msg':>10}  consumed per cursor")  # fmt: skip
    for r in results:
        ratio = f"{r.msg_s / baseline:.2f}" if baseline else "-"
        per = r.cpu_s / r.messages * 1e6
        print(f"{r.logs:>4} {r.cursors:>7} {r.msg_s:>8} {ratio:>6} {r.cpu_s:>6} {per:>10.0f}  "
              f"{r.by_cursor}")  # fmt: skip
    if json_path is not None:
        json_path.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
        print(f"wrote {json_path}")
