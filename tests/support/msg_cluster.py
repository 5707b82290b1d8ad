"""A whole messaging deployment in real processes, for the end-to-end tests.

``twopc serve log`` and ``twopc serve cursor`` run as servers on fixed ports, producers and
consumers as `tests/crash/msg_worker.py` processes; optionally a `FaultProxy` sits between the log
and the cursor. A supervisor thread restarts every process that dies before its work is done, as
an init system would, so a test can arm a crash point in one process (``TWOPC_CRASH_AT`` on its
first start only) and watch the system recover. `audit` then checks the one thing that matters:
every committed message consumed exactly once, none of a rolled-back transaction, per-producer
order kept, nothing left in flight anywhere.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from coordinator.decision_log import inspect_log
from resource_managers.cursor import Cursor
from resource_managers.message_log import MessageLog
from resource_managers.message_log._records import decode
from resource_managers.message_log._state import LogState

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "crash" / "msg_worker.py"
SECRET = "end-to-end-test-secret-0123456789"
SERVE = "import sys; from coordinator.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """One supervised process: restarted while ``keep`` says so; ``crash_at`` only at first."""

    name: str
    argv: list[str]
    workdir: Path
    crash_at: str | None = None
    done_word: str | None = None  # printed when its work is done: no restart after that
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    finished: bool = False
    outputs: list[Path] = field(default_factory=list)

    def start(self) -> None:
        env = {**os.environ, "TWOPC_SECRET": SECRET, "PYTHONPATH": str(REPO)}
        env.pop("TWOPC_CRASH_AT", None)
        if self.crash_at and self.starts == 0:
            env["TWOPC_CRASH_AT"] = self.crash_at
        out = self.workdir / f"{self.name}.{self.starts}.out"
        self.outputs.append(out)
        with open(out, "wb") as f:
            self.popen = subprocess.Popen(
                self.argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        self.starts += 1

    def text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.outputs if p.exists())

    def check(self) -> None:
        """Restart if it died before its work was done."""
        if self.popen is None or self.finished or self.popen.poll() is None:
            return
        if self.popen.returncode == -signal.SIGKILL:
            self.kills += 1
        if self.done_word and self.done_word in self.text():
            self.finished = True
            return
        self.start()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        self.finished = True
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class Cluster:
    """Log server, cursor server, optional fault proxy, producers and consumers."""

    def __init__(
        self, workdir: Path, pg_url: str, *, proxy: Any = None, consumer_proxy: Any = None,
        consumer_tx_timeout: float = 30.0, llr: bool = False, logs: int = 1, cursors: int = 1,
        routes: tuple[tuple[str, int | tuple[int, ...]], ...] = (),
    ) -> None:  # fmt: skip
        """``proxy``: a `FaultProxy` between the log and the cursor; ``consumer_proxy``: one
        between the consumers and the cursor (both forward to ``cursor_port``); ``llr``: the
        producers' and consumers' PostgreSQL is their logging last resource; ``logs``: how many
        log servers (``log``, ``log1``, ``log2``...: each its own directory and port) send to the
        cursor; ``cursors``: how many cursor servers (``cursor``, ``cursor1``...), the first the
        logs' default route; ``routes``: (destination glob, cursor number) of every log's
        ``--route``; a tuple of cursor numbers partitions the destinations it matches over
        them, in that order."""
        self.llr = ["--llr"] if llr else []
        self.workdir = workdir
        self.pg_url = pg_url
        self.log_names = ["log", *(f"log{i}" for i in range(1, logs))]
        self.log_ports = [free_port() for _ in self.log_names]
        self.cursor_names = ["cursor", *(f"cursor{i}" for i in range(1, cursors))]
        self.cursor_ports = [free_port() for _ in self.cursor_names]
        self.log_port, self.cursor_port = self.log_ports[0], self.cursor_ports[0]
        self.routes = routes
        self.proxy = proxy
        self.consumer_proxy = consumer_proxy
        self.consumer_tx_timeout = consumer_tx_timeout
        self.procs: dict[str, Proc] = {}
        #: producer id -> how many partition keys it spreads its messages over (0: keyless)
        self.keyed: dict[str, int] = {}
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self.stop_file = workdir / "stop"
        engine = sa.create_engine(pg_url)
        with engine.begin() as conn:
            from tests.crash.msg_worker import SCHEMA

            for ddl in SCHEMA:
                conn.execute(sa.text(ddl))
        engine.dispose()

    @property
    def cursor_address_for_log(self) -> str:
        if self.proxy is not None:
            host, port = self.proxy.address
            return f"{host}:{port}"
        return f"127.0.0.1:{self.cursor_port}"

    def add(self, name: str, argv: list[str], crash_at: str | None = None, done: str | None = None
            ) -> Proc:  # fmt: skip
        proc = Proc(name, argv, self.workdir, crash_at, done)
        self.procs[name] = proc
        proc.start()
        return proc

    def start_servers(
        self, crash_log: str | None = None, crash_cursor: str | None = None,
        crash_servers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """``crash_log`` arms the first log server, ``crash_cursor`` the first cursor server,
        ``crash_servers`` any server by name (``log1``, ``cursor1``...)."""
        py = sys.executable
        crash_servers = dict(crash_servers or {})
        if crash_log:
            crash_servers["log"] = crash_log
        for name, port in zip(self.cursor_names, self.cursor_ports, strict=True):
            self.add(name, [py, "-c", SERVE, "serve", "cursor",
                            "--dir", str(self.workdir / name),
                            "--listen", f"127.0.0.1:{port}"],
                     crash_cursor if name == "cursor" else crash_servers.get(name))  # fmt: skip
        routes = [a for glob, i in self.routes for a in ("--route", f"{glob}={self._at(i)}")]
        for name, port in zip(self.log_names, self.log_ports, strict=True):
            self.add(name, [py, "-c", SERVE, "serve", "log", "--dir", str(self.workdir / name),
                            "--listen", f"127.0.0.1:{port}",
                            "--cursor", self.cursor_address_for_log, *routes],
                     crash_servers.get(name))  # fmt: skip
        self._supervisor.start()  # before waiting: a server killed while it starts is restarted
        for name in (*self.cursor_names, *self.log_names):
            self.wait_for(name, "listening on", 30)

    def _at(self, cursors: int | tuple[int, ...]) -> str:
        """A route's ``HOST:PORT[,HOST:PORT...]`` of cursor number(s) ``cursors``."""
        numbers = (cursors,) if isinstance(cursors, int) else cursors
        return ",".join(f"127.0.0.1:{self.cursor_ports[i]}" for i in numbers)

    def add_producer(self, pid: str, *, txs: int, per_tx: int, rollback_every: int,
                     crash_at: str | None = None, destination: str = "orders",
                     log: int = 0, keys: int = 0) -> Proc:  # fmt: skip
        """A producer sending through log server number ``log``; with ``keys``, each message
        carries one of that many partition keys (`msg_worker.partition_key`)."""
        port = self.log_ports[log]
        self.keyed[pid] = keys
        argv = [sys.executable, str(WORKER), "produce", "--log", f"127.0.0.1:{port}",
                "--pg", self.pg_url, "--id", pid, "--state", str(self.workdir / f"p-{pid}"),
                "--txs", str(txs), "--per-tx", str(per_tx),
                "--rollback-every", str(rollback_every), "--destination", destination,
                "--keys", str(keys), *self.llr]  # fmt: skip
        return self.add(f"producer-{pid}", argv, crash_at, done="DONE")

    def add_consumer(self, cid: str, *, batch: int = 1, crash_at: str | None = None,
                     destination: str = "orders", cursor: int = 0) -> Proc:  # fmt: skip
        """A consumer receiving from cursor server number ``cursor``."""
        host, port = ("127.0.0.1", self.cursor_ports[cursor])
        if self.consumer_proxy is not None:
            host, port = self.consumer_proxy.address
        argv = [sys.executable, str(WORKER), "consume", "--cursor", f"{host}:{port}",
                "--tx-timeout", str(self.consumer_tx_timeout),
                "--rpc-timeout", str(3.0 if self.consumer_proxy is not None else 30.0),
                "--pg", self.pg_url, "--id", cid,
                "--state", str(self.workdir / f"c-{cid}"), "--batch", str(batch),
                "--stop-file", str(self.stop_file), "--destination", destination,
                *self.llr]  # fmt: skip
        return self.add(f"consumer-{cid}", argv, crash_at, done="HANDLED")

    def wait_for(self, name: str, word: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while word not in self.procs[name].text():
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} did not print {word!r}:\n{self.procs[name].text()}")
            time.sleep(0.05)

    def _supervise(self) -> None:
        while not self._stop.is_set():
            for proc in list(self.procs.values()):
                proc.check()
            time.sleep(0.05)

    def run_to_completion(self, timeout: float = 120.0) -> None:
        """Wait for the producers, then until every committed message was consumed, then let
        the consumers finish."""
        deadline = time.monotonic() + timeout
        producers = [p for n, p in self.procs.items() if n.startswith("producer-")]
        consumers = [p for n, p in self.procs.items() if n.startswith("consumer-")]
        while not all(p.finished for p in producers):
            self._deadline(deadline, "producers to finish")
        engine = sa.create_engine(self.pg_url)
        try:
            while True:
                with engine.connect() as conn:
                    produced = conn.execute(sa.text("SELECT count(*) FROM produced")).scalar_one()
                    consumed = conn.execute(
                        sa.text("SELECT count(DISTINCT key) FROM consumed")
                    ).scalar_one()
                if consumed >= produced:
                    break
                self._deadline(deadline, f"consumers ({consumed} of {produced} consumed)")
        finally:
            engine.dispose()
        self.stop_file.touch()
        while not all(p.finished for p in consumers):
            self._deadline(deadline, "consumers to finish")
        self._await_acknowledged(min(deadline, time.monotonic() + 30))

    def _await_acknowledged(self, until: float) -> None:
        """Give the logs time to hear the cursors' last acknowledgments: a transfer killed
        late may be in its reconnect back-off when the consumers finish, and the audit counts
        what a log still holds. Not drained by ``until``: the audit reports it."""
        while time.monotonic() < until:
            if all(live_pending(self.workdir / name) == 0 for name in self.log_names):
                return
            time.sleep(0.2)

    def run_killing_at_random(
        self, names: Sequence[str], seed_variable: str, *, kills: int = 8, timeout: float = 200.0
    ) -> None:
        """`run_to_completion` while a thread SIGKILLs one of the processes ``names`` every
        0.3-1.5 s, ``kills`` times (the supervisor restarts them). The choices are seeded: the
        seed is printed, and the environment variable ``seed_variable`` replays it."""
        seed = int(os.environ.get(seed_variable, random.randrange(2**32)))
        print(f"seed: {seed} ({seed_variable} replays it)")
        rng = random.Random(seed)
        stop = threading.Event()

        def killer() -> None:
            for _ in range(kills):
                if stop.wait(rng.uniform(0.3, 1.5)):
                    return
                popen = self.procs[rng.choice(list(names))].popen
                if popen is not None and popen.poll() is None:
                    popen.kill()

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        try:
            self.run_to_completion(timeout=timeout)
        finally:
            stop.set()
            thread.join()

    def _deadline(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            dump = "\n".join(f"--- {n} ---\n{p.text()[-3000:]}" for n, p in self.procs.items())
            raise AssertionError(f"timed out waiting for {what}\n{dump}")
        time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        if self._supervisor.is_alive():
            self._supervisor.join(5)
        for proc in self.procs.values():
            proc.stop()

    # -- the audit ------------------------------------------------------------------------------

    def _disorder(self, consumed: list[str], produced: dict[str, tuple[str, int, int]]) -> int:
        """Messages consumed after one their producer committed later: per producer (so per
        log and destination), or, for a producer of keyed messages to a partitioned
        destination, per producer and partition key (the order a partition keeps)."""
        from tests.crash.msg_worker import partition_key  # a script: imported only when needed

        last: dict[tuple[str, str], tuple[int, int]] = {}
        disorder = 0
        for key in consumed:
            producer, tx, j = produced.get(key, ("?", 0, 0))
            keys = self.keyed.get(producer, 0)
            group = (producer, partition_key(tx, j, keys) if keys else "")
            if last.get(group, (0, -1)) >= (tx, j):
                disorder += 1
            last[group] = (tx, j)
        return disorder

    def audit(self, *, ordered: bool) -> dict[str, Any]:
        """Stop everything, then check the database and both journals."""
        self.close()
        engine = sa.create_engine(self.pg_url)
        with engine.connect() as conn:
            produced = {
                r.key: (r.producer, r.tx, r.j)
                for r in conn.execute(sa.text("SELECT key, producer, tx, j FROM produced"))
            }
            consumed = [
                r.key for r in conn.execute(sa.text("SELECT key FROM consumed ORDER BY id"))
            ]
            prepared = conn.execute(sa.text("SELECT count(*) FROM pg_prepared_xacts")).scalar_one()
        engine.dispose()
        counts = Counter(consumed)
        report: dict[str, Any] = {
            "committed": len(produced),
            "consumed": len(consumed),
            "duplicates": sum(n - 1 for n in counts.values() if n > 1),
            "lost": len(set(produced) - set(counts)),
            "phantom": len(set(counts) - set(produced)),
            "pg_prepared": prepared,
            "kills": {n: p.kills for n, p in self.procs.items() if p.kills},
            "by_producer": dict(Counter(producer for producer, _, _ in produced.values())),
        }
        if ordered:
            report["out_of_order"] = self._disorder(consumed, produced)
        report["log_pending"] = report["log_prepared"] = 0
        for name in self.log_names:
            with MessageLog(self.workdir / name, allow_repartition=True) as mlog:  # counts only
                stats = mlog.stats()
                report["log_pending"] += stats.pending
                report["log_prepared"] += stats.prepared
        report["cursor_available"] = report["cursor_in_flight"] = report["cursor_prepared"] = 0
        for name in self.cursor_names:
            with Cursor(self.workdir / name) as cursor:
                cstats = cursor.stats()
                report["cursor_available"] += cstats.available
                report["cursor_in_flight"] += cstats.in_flight
                report["cursor_prepared"] += cstats.prepared
        return report


def assert_exactly_once(report: dict[str, Any], *, ordered: bool) -> None:
    zero = ["duplicates", "lost", "phantom", "pg_prepared", "log_pending", "log_prepared",
            "cursor_available", "cursor_in_flight", "cursor_prepared"]  # fmt: skip
    if ordered:
        zero.append("out_of_order")
    bad = {k: report[k] for k in zero if report[k]}
    assert not bad, f"audit failed: {bad}; full report {report}"
    assert report["committed"] > 0 and report["consumed"] == report["committed"], report


def live_pending(directory: Path) -> int:
    """Committed messages a message log holds unacknowledged, read from its journal while its
    server runs (read-only, as ``twopc log inspect`` reads; -1 if a segment went away mid-read,
    which a compaction does)."""
    rows = inspect_log(directory, {"message-log": lambda payload: {"raw": decode(payload)}})
    if any(row.get("kind") == "NOTE" and "cannot read" in str(row.get("note")) for row in rows):
        return -1
    state = LogState()
    for row in rows:
        if "raw" in row:
            state.apply(row["raw"])
    return sum(len(s.messages) for s in state.streams.values())
