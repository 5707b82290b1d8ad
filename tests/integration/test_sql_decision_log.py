"""`SqlDecisionLog` on real PostgreSQL: the DecisionLog contract, the node lease and how it fences
an old owner, group commit, and what a crash of the server or a paused owner leaves behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event, text

from coordinator.decision_log import Decision, DecisionLog, HeuristicRecord
from coordinator.errors import ConfigurationError, FencedError, LogLockedError, LogWriteError
from resource_managers.postgres import SqlDecisionLog
from resource_managers.throwaway import free_port
from tests.support.servers import PgCluster
from tests.support.threads import run_threads

ROOT = Path(__file__).resolve().parents[2]
OpenLog = Callable[..., SqlDecisionLog]


def commit(gtrid: str, *branches: str, deadline: float | None = None) -> Decision:
    return Decision(gtrid, branches or ("pg", "redis"), deadline, 1000.0)


def heuristic(gtrid: str, branch: str, outcome: str = "heuristic-rollback") -> HeuristicRecord:
    return HeuristicRecord(gtrid, branch, outcome, "seen by test", 2000.0)


def rows(engine: sa.Engine, node_id: str) -> dict[str, str]:
    """What the decision table holds for a node, read behind the log's back: gtrid -> branches."""
    query = text("SELECT gtrid, branches FROM twopc_decision WHERE node_id = :n")
    with engine.connect() as conn:
        return {str(g): str(b) for g, b in conn.execute(query, {"n": node_id})}


@pytest.fixture(scope="module")
def database_url(pg_server: PgCluster) -> Iterator[str]:
    """One database for the module: nodes are the unit of isolation (as in production, where
    many coordinators share one database), and a database per test would double the run time."""
    name = pg_server.create_database()
    yield pg_server.url(name)
    pg_server.drop_database(name)


@pytest.fixture(scope="module")
def engine(database_url: str) -> Iterator[sa.Engine]:
    made = sa.create_engine(database_url)
    yield made
    made.dispose()


@pytest.fixture
def tag() -> str:
    """Prefixes the node ids of one test, so tests sharing the database never share a node."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
def open_log(engine: sa.Engine, tag: str) -> Iterator[OpenLog]:
    """Opens logs on nodes private to this test (``"orders"`` becomes ``"<tag>-orders"``, see
    ``log.node_id``), on the module's database unless ``bind`` says otherwise; closes them after."""
    opened: list[SqlDecisionLog] = []

    def make(node: str = "node", *, bind: sa.Engine | None = None, **kw: Any) -> SqlDecisionLog:
        log = SqlDecisionLog(bind or engine, f"{tag}-{node}", **kw)
        opened.append(log)
        return log

    yield make
    for log in reversed(opened):
        log.close()


@contextlib.contextmanager
def renewals_stalled(engine: sa.Engine, node_id: str) -> Iterator[None]:
    """Hold the lease thread of ``node_id`` before each of its statements: an owner that stopped
    renewing (GC pause, stuck host) while its other threads still run."""
    release = threading.Event()

    def hold(*_: Any) -> None:
        if threading.current_thread().name == f"twopc-lease-{node_id}":
            release.wait(30)

    event.listen(engine, "before_cursor_execute", hold)
    try:
        yield
    finally:
        release.set()
        event.remove(engine, "before_cursor_execute", hold)


# -- the DecisionLog contract ---------------------------------------------------------------------


def test_the_log_implements_the_protocol(open_log: OpenLog) -> None:
    assert isinstance(open_log(), DecisionLog)


def test_commit_is_pending_until_end_and_end_is_written_at_close(open_log: OpenLog) -> None:
    log = open_log()
    log.log_commit(commit("g1"))
    log.log_commit(commit("g2", "a"))
    assert log.pending() == [commit("g1"), commit("g2", "a")]
    log.log_end("g1")  # queued, not yet written, but no longer pending
    assert [d.gtrid for d in log.pending()] == ["g2"]
    log.close()
    assert [d.gtrid for d in open_log().pending()] == ["g2"]


def test_idempotence_repeated_commit_and_end_are_harmless(open_log: OpenLog) -> None:
    log = open_log()
    log.log_commit(commit("g1"))
    log.log_commit(commit("g1"))
    assert len(log.pending()) == 1
    log.log_end("g1")
    log.log_end("g1")
    log.log_end("never-committed")
    assert log.pending() == []
    log.log_commit(commit("g2"))  # the queued ENDs ride on this batch
    assert log.stats().extra["queued_ends"] == 0
    assert [d.gtrid for d in log.pending()] == ["g2"]


def test_heuristics_stay_until_forgotten(open_log: OpenLog) -> None:
    log = open_log()
    log.log_heuristic(heuristic("g1", "pg"))
    log.log_heuristic(heuristic("g1", "redis"))
    log.log_heuristic(heuristic("g1", "redis"))
    log.log_heuristic(heuristic("g2", "pg", "heuristic-mixed"))
    log.forget_heuristic("g1", "pg")
    assert [(h.gtrid, h.branch) for h in log.heuristics()] == [("g1", "redis"), ("g2", "pg")]
    log.forget_heuristic("g2")
    assert log.heuristics() == [heuristic("g1", "redis")]


def test_fencing_a_decision_past_its_deadline_is_not_written(open_log: OpenLog) -> None:
    log = open_log()
    with pytest.raises(FencedError, match="past its deadline"):
        log.log_commit(commit("late", deadline=time.time() - 1))
    log.log_commit(commit("in-time", deadline=time.time() + 60))
    assert [d.gtrid for d in log.pending()] == ["in-time"]
    assert log.stats().forced_records == 1


def test_written_at_is_stamped_by_the_log_clock(open_log: OpenLog) -> None:
    log = open_log(clock=lambda: 1234.5)
    log.log_commit(Decision("g1", ("a",)))
    assert log.pending()[0].written_at == 1234.5


def test_a_closed_log_refuses_writes_and_ownership(open_log: OpenLog) -> None:
    log = open_log()
    log.close()
    log.close()
    for write in (
        lambda: log.log_commit(commit("g1")),
        lambda: log.log_end("g1"),
        lambda: log.log_heuristic(heuristic("g1", "pg")),
    ):
        with pytest.raises(LogWriteError) as info:
            write()
        assert info.value.durable is False
    with pytest.raises(FencedError):
        log.check_owner()


def test_stats_and_a_lazy_end_written_by_the_renewal_tick(
    open_log: OpenLog, engine: sa.Engine
) -> None:
    log = open_log(lease_seconds=0.6)
    log.log_commit(commit("g1"))
    log.log_end("g1")
    stats = log.stats()
    assert (stats.forced_records, stats.lazy_records, stats.fsyncs) == (1, 1, 1)
    assert stats.extra["epoch"] == 1
    deadline = time.monotonic() + 5
    while rows(engine, log.node_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rows(engine, log.node_id) == {}
    assert (log.stats().fsyncs, log.stats().extra["batches"]) == (2, 2)


def test_bad_configuration_is_refused(engine: sa.Engine) -> None:
    for kwargs in (
        {"table_prefix": 'x"; drop table y; --'},
        {"schema": "a b"},
        {"lease_seconds": 1.0, "renew_interval": 1.0},
    ):
        with pytest.raises(ConfigurationError):
            SqlDecisionLog(engine, "n", **kwargs)


def test_tables_live_in_the_given_schema_under_the_given_prefix(
    open_log: OpenLog, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE SCHEMA IF NOT EXISTS audit"))
    log = open_log(schema="audit", table_prefix="tx_")
    log.log_commit(commit("g1"))
    query = text("SELECT gtrid FROM audit.tx_decision WHERE node_id = :n")
    with engine.connect() as conn:
        assert conn.execute(query, {"n": log.node_id}).scalar_one() == "g1"


def test_server_down_at_construction_names_the_url_not_the_password() -> None:
    port = free_port()
    engine = sa.create_engine(f"postgresql+psycopg2://twopc:s3cret@127.0.0.1:{port}/nowhere")
    with pytest.raises(LogWriteError) as info:
        SqlDecisionLog(engine, "n")
    assert info.value.durable is False
    assert f"twopc:***@127.0.0.1:{port}/nowhere" in str(info.value)
    assert "s3cret" not in str(info.value)


def open_at_once(engine: sa.Engine, prefix: str, count: int) -> list[BaseException]:
    """``count`` logs on fresh tables, opened by threads released together; their errors."""
    barrier = threading.Barrier(count)
    logs: list[SqlDecisionLog] = []
    errors: list[BaseException] = []

    def open_one(node: str) -> None:
        barrier.wait()
        try:
            logs.append(SqlDecisionLog(engine, node, table_prefix=prefix))
        except BaseException as exc:
            errors.append(exc)

    run_threads(threading.Thread(target=open_one, args=(f"n{i}",)) for i in range(count))
    for log in logs:
        log.close()
    return errors


def test_schema_is_created_concurrently_without_errors(engine: sa.Engine, tag: str) -> None:
    for round_ in range(3):  # without the re-check, nearly every round fails (unique_violation)
        assert open_at_once(engine, f"race{round_}_{tag}_", 4) == []


# -- the node lease -------------------------------------------------------------------------------


def test_records_of_an_earlier_owner_are_seen_by_the_next(open_log: OpenLog) -> None:
    first = open_log("orders")
    first.log_commit(commit("g1"))
    first.log_commit(commit("g2"))
    first.log_heuristic(heuristic("g0", "pg"))
    first.log_end("g1")
    first.close()  # releases the lease: the successor starts at once, with the next epoch
    second = open_log("orders", acquire_timeout=0)
    assert [d.gtrid for d in second.pending()] == ["g2"]
    assert second.heuristics() == [heuristic("g0", "pg")]
    assert second.stats().extra["epoch"] == 2


def test_a_live_owner_keeps_its_node(open_log: OpenLog) -> None:
    open_log("busy-node", lease_seconds=0.5)
    time.sleep(0.8)  # past the first lease: only renewals keep it
    started = time.monotonic()
    with pytest.raises(LogLockedError) as info:
        open_log("busy-node", acquire_timeout=0.2)
    assert time.monotonic() - started >= 0.2
    message = str(info.value)
    assert "busy-node" in message and "until" in message
    assert info.value.owner.startswith(f"{socket.gethostname()}:{os.getpid()}:")


def test_two_nodes_on_one_database_are_independent(open_log: OpenLog) -> None:
    a, b = open_log("node-a"), open_log("node-b")
    a.log_commit(commit("a1"))
    b.log_commit(commit("b1"))
    b.log_heuristic(heuristic("b1", "pg"))
    assert [d.gtrid for d in a.pending()] == ["a1"]
    assert [d.gtrid for d in b.pending()] == ["b1"]
    assert a.heuristics() == []
    a.close()
    b.log_commit(commit("b2"))
    b.check_owner()


def test_fencing_a_stalled_owner_loses_its_node_to_a_takeover(
    open_log: OpenLog, engine: sa.Engine
) -> None:
    old = open_log("stalled", lease_seconds=0.5)
    old.log_commit(commit("before"))
    with renewals_stalled(engine, old.node_id):
        started = time.monotonic()
        new = open_log("stalled", acquire_timeout=5)  # waits for the lease to run out
        assert time.monotonic() - started > 0.1
        assert new.stats().extra["epoch"] == 2
        with pytest.raises(FencedError, match="taken over"):
            old.log_commit(commit("after"))
        with pytest.raises(FencedError, match="taken over"):
            old.check_owner()
        with pytest.raises(FencedError):
            old.log_heuristic(heuristic("before", "pg"))
    new.log_commit(commit("new"))
    assert [d.gtrid for d in new.pending()] == ["before", "new"]
    old.close()  # must not release the new owner's lease
    with pytest.raises(LogLockedError):
        open_log("stalled")


def test_fencing_takeover_waits_for_an_uncommitted_commit_record(
    open_log: OpenLog, database_url: str
) -> None:
    """The race the FOR SHARE lock closes: the owner's COMMIT statement has passed its lease check
    but not committed, and its lease runs out. The takeover must wait, then see the record."""
    owner_engine, other_engine = sa.create_engine(database_url), sa.create_engine(database_url)
    try:
        old = open_log("race", bind=owner_engine, lease_seconds=0.5)
        in_commit, go_on = threading.Event(), threading.Event()

        def hold_commit(_: Any) -> None:
            if threading.current_thread().name == "writer":
                in_commit.set()
                go_on.wait(30)

        event.listen(owner_engine, "commit", hold_commit)
        errors: list[BaseException] = []

        def write() -> None:
            try:
                old.log_commit(commit("racing"))
            except BaseException as exc:
                errors.append(exc)

        taken: list[SqlDecisionLog] = []
        with renewals_stalled(owner_engine, old.node_id):
            writer = threading.Thread(target=write, name="writer")
            writer.start()
            assert in_commit.wait(10)
            taker = threading.Thread(
                target=lambda: taken.append(open_log("race", bind=other_engine, acquire_timeout=20))
            )
            taker.start()
            time.sleep(0.8)  # the old lease has expired by the database clock
            assert taker.is_alive()
            with other_engine.connect() as conn:
                waiting = conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND query LIKE '%ON CONFLICT (node_id)%'"
                    )
                ).scalar_one()
            assert waiting == 1, "the takeover should be blocked on the lease row lock"
            go_on.set()
            writer.join(10)
            taker.join(20)
        assert errors == []
        assert taken and taken[0].stats().extra["epoch"] == 2
        assert [d.gtrid for d in taken[0].pending()] == ["racing"]
        with pytest.raises(FencedError):
            old.log_commit(commit("too-late"))
    finally:
        owner_engine.dispose()
        other_engine.dispose()


CHILD = textwrap.dedent(
    """
    import sys
    import sqlalchemy
    from coordinator.decision_log import Decision
    from coordinator.errors import FencedError
    from resource_managers.postgres import SqlDecisionLog

    url, node = sys.argv[1:]
    log = SqlDecisionLog(sqlalchemy.create_engine(url), node, lease_seconds=0.5)
    log.log_commit(Decision("paused-1", ("pg",)))
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            log.log_commit(Decision(line.strip(), ("pg",)))
            print("committed", flush=True)
        except FencedError as exc:
            try:
                log.check_owner()
                owner = "still-owner"
            except FencedError:
                owner = "not-owner"
            print("fenced", owner, exc, flush=True)
    """
)


def test_fencing_a_paused_process_cannot_write_after_a_takeover(
    open_log: OpenLog, database_url: str, tag: str, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    node = f"{tag}-paused"
    with open(tmp_path / "child.err", "w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, database_url, node],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    assert child.stdin is not None and child.stdout is not None
    try:
        ready = child.stdout.readline()
        assert ready == "ready\n", (tmp_path / "child.err").read_text()
        os.kill(child.pid, signal.SIGSTOP)
        new = open_log("paused", acquire_timeout=10)  # waits out the stopped child's lease
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("paused-2\n")
        child.stdin.flush()
        answer = child.stdout.readline()
        assert answer.startswith("fenced not-owner"), (answer, (tmp_path / "child.err").read_text())
        assert "taken over" in answer
        assert [d.gtrid for d in new.pending()] == ["paused-1"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()


# -- group commit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "one-per-commit"])
def test_group_commit_batches_concurrent_callers(open_log: OpenLog, grouped: bool) -> None:
    log = open_log("busy", group_commit=grouped)
    threads, per_thread = 16, 8
    barrier = threading.Barrier(threads)

    def work(i: int) -> None:
        barrier.wait()
        for n in range(per_thread):
            log.log_commit(commit(f"busy-{i}-{n}"))

    run_threads(threading.Thread(target=work, args=(i,)) for i in range(threads))
    stats = log.stats()
    records = threads * per_thread
    assert stats.forced_records == records
    assert len(log.pending()) == records
    assert stats.fsyncs == stats.extra["batches"]
    if grouped:
        assert stats.fsyncs < records / 2, stats
    else:
        assert stats.fsyncs == records


# -- the server crashes ---------------------------------------------------------------------------


def test_server_killed_during_log_commit_leaves_whole_records_or_none(
    private_pg: Callable[..., Any], open_log: OpenLog
) -> None:
    server = private_pg()
    engine = sa.create_engine(server.url(server.create_database()))
    try:
        log = open_log("crash", bind=engine, lease_seconds=1.0)
        acknowledged: list[str] = []
        failed: list[tuple[str, LogWriteError]] = []

        def write(i: int) -> None:
            for n in range(100_000):
                gtrid = f"crash-{i}-{n}"
                try:
                    log.log_commit(commit(gtrid))
                except LogWriteError as exc:
                    failed.append((gtrid, exc))
                    return
                acknowledged.append(gtrid)

        writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
        for writer in writers:
            writer.start()
        time.sleep(0.3)
        server.kill9()
        for writer in writers:
            writer.join(30)
        assert len(failed) == 4 and acknowledged
        time.sleep(1.0)  # the last renewal is now older than the lease
        with pytest.raises(FencedError, match="cannot confirm"):
            log.check_owner()  # recovery must not presume abort on an unconfirmed lease
        server.restart()
        found = rows(engine, log.node_id)
        assert set(acknowledged) <= set(found)  # forced means forced
        assert set(found) <= set(acknowledged) | {g for g, _ in failed}  # nothing invented
        assert set(found.values()) == {'["pg", "redis"]'}  # never half a record
        for gtrid, error in failed:
            if error.durable is False:
                assert gtrid not in found, f"{gtrid} reported certainly unwritten: {error}"
        log.check_owner()  # lapsed, but nobody took it over: renewed under the same epoch
        log.log_commit(commit("after-restart"))
        assert "after-restart" in rows(engine, log.node_id)
    finally:
        engine.dispose()
