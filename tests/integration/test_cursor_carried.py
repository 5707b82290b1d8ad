"""A consumer branch carried by the database's commit (`resource_managers.cursor._carried`):
what it forces, the gate an open keeps shut until recovery restored what a crash lost, its
pre-counts, its rollover records, and `kill -9` at every step, in real processes against a real
PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import text

from coordinator import FileDecisionLog, TransactionManager, TransactionRolledBack, Xid
from resource_managers.cursor import Cursor, CursorResource, Delivery
from resource_managers.cursor._records import decode, encode
from resource_managers.cursor._state import CursorState
from resource_managers.message_log import Message
from resource_managers.postgres import PostgresResource
from resource_managers.sequencing import Frame
from tests.support.pg import ledger_engine
from tests.support.scripts import run_script

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "crash" / "cursor_worker.py"
SLOW_WORKER = REPO / "tests" / "crash" / "slow_commit_worker.py"
LLR = ("--llr",)
FORCED = ("--durable-commit",)
BODIES = [f"m{i}" for i in range(8)]


def feed(cursor: Cursor, bodies: list[str], first: int = 1) -> None:
    """Accept ``bodies`` into queue ``orders`` as the next numbers of one stream."""
    items = []
    for seq, body in enumerate(bodies, first):
        m = Message(uuid.uuid4().hex, "orders", body.encode())
        items.append((Frame("orders", 7, seq, seq - 1, m.message_id), m))
    cursor.deliver_many(items)


class Consumer:
    """An embedded cursor holding ``BODIES`` and a manager whose PostgreSQL is the last resource
    (the cursor's branch rides its commit)."""

    def __init__(
        self,
        url: str,
        tmp: Path,
        *,
        ledger: bool = True,
        recover_on_start: bool = True,
        **cursor_options: Any,
    ) -> None:
        self.engine = ledger_engine(url, accounts=1) if ledger else sa.create_engine(url)
        self.cursor = Cursor(tmp / "cursor", **cursor_options)
        feed(self.cursor, BODIES)
        self.cr = CursorResource(self.cursor)
        self.db = PostgresResource(self.engine, "db", last_resource=True)
        self.tm = TransactionManager("node-1", FileDecisionLog(tmp / "dlog"), [self.db, self.cr],
                                     recovery_interval=None, reaper_interval=None,
                                     recover_on_start=recover_on_start)  # fmt: skip

    def consume(self, fail: bool = False) -> Delivery | None:
        return consume(self.tm, self.cr, self.db, fail)

    def close(self) -> None:
        self.tm.close()
        self.cursor.close()
        self.engine.dispose()


@pytest.fixture
def consumer(make_pg_database: Callable[[], str], tmp_path: Path) -> Iterator[Consumer]:
    made = Consumer(make_pg_database(), tmp_path)
    yield made
    made.close()


def consume(
    tm: TransactionManager, cr: CursorResource, db: PostgresResource, fail: bool = False
) -> Delivery | None:
    """One transaction: receive one message, insert its body as a row; roll back if ``fail``."""
    got = None
    try:
        with tm.transaction() as tx:
            got = tx.join(cr).receive("orders")
            assert got is not None
            tx.join(db).execute(
                text("INSERT INTO transfers (id, amount) VALUES (:t, 1)"), {"t": got.body.decode()}
            )
            if fail:
                raise RuntimeError("the handler failed")
    except RuntimeError:
        pass
    return got


def rows(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(text("SELECT id FROM transfers")).scalars())


def test_a_carried_consumer_forces_nothing_of_its_own(consumer: Consumer) -> None:
    """After its first branch (which forces the ``O`` naming the node), a consumer at one
    message per transaction forces no cursor record: the database's commit holds the branch,
    and each branch pre-counts the next message in it."""
    consumer.consume()
    consumer.cr.flush_commits()
    before = consumer.cursor.stats().forced_records
    got = [consumer.consume() for _ in range(5)]
    consumer.cr.flush_commits()
    assert consumer.cursor.stats().forced_records == before
    assert [g.delivery_count for g in got if g is not None] == [1] * 5
    assert rows(consumer.engine) == BODIES[:6]
    assert [d.body.decode() for d in consumer.cursor.available("orders")] == BODIES[6:]
    assert consumer.cursor.prepared_gids() == []


def test_a_rolled_back_carried_branch_gives_the_message_back_counted(consumer: Consumer) -> None:
    first = consumer.consume(fail=True)
    again = consumer.consume()
    assert first is not None and again is not None
    assert again.message_id == first.message_id and again.delivery_count == 2
    assert rows(consumer.engine) == ["m0"]
    nxt = consumer.consume()
    assert nxt is not None and nxt.body == b"m1" and nxt.delivery_count == 1


def test_a_pending_pre_count_is_not_handed_to_another_branch(tmp_path: Path) -> None:
    """A staged branch pre-counted m1; another branch passes m1 over until that commit (which
    raises m1's count) is done, then takes it on the credit: counted once, never twice."""
    with Cursor(tmp_path / "cursor") as cursor:
        feed(cursor, ["m0", "m1"])
        a, b = (Xid.branch_of(f"node-1:t{i}", "cursor").to_gid() for i in (1, 2))
        assert [d.body for d in cursor.take_many(a, "orders", 1)] == [b"m0"]
        assert cursor.stage(a, "node-1") is not None
        assert cursor.take_many(b, "orders", 1) == []  # m1 waits for a's commit
        forced = cursor.stats().forced_records
        cursor.commit_carried(a, lambda: None, force=False)
        [taken] = cursor.take_many(b, "orders", 1)
        assert taken.body == b"m1" and taken.delivery_count == 1
        assert cursor.stats().forced_records == forced  # on a's credit: no forced record


def test_a_rolled_back_staged_branch_withdraws_its_pre_count(tmp_path: Path) -> None:
    with Cursor(tmp_path / "cursor") as cursor:
        feed(cursor, ["m0", "m1"])
        a, b = (Xid.branch_of(f"node-1:t{i}", "cursor").to_gid() for i in (1, 2))
        cursor.take_many(a, "orders", 1)
        cursor.stage(a, "node-1")
        cursor.rollback(a)
        got = cursor.take_many(b, "orders", 2)
        assert [(d.body, d.delivery_count) for d in got] == [(b"m0", 2), (b"m1", 1)]


def test_an_open_after_a_crash_hands_nothing_out_until_recovery_restored(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """Killed right after the database committed m2's branch (the cursor's record never
    written): the next open finds m2 handed out and not prepared, rolls it back, and must not
    hand it out again; recovery restores the row's record, and only then does m3 go out."""
    url = make_pg_database()
    crashed_after_m2_committed(url, tmp_path)
    engine = sa.create_engine(url)
    cursor = Cursor(tmp_path / "cursor")
    try:
        assert cursor.awaiting_recovery() == {"node-1"}
        assert [d.body for d in cursor.available("orders")][:2] == [b"m2", b"m3"]
        cr = CursorResource(cursor)
        db = PostgresResource(engine, "db", last_resource=True)
        tm = TransactionManager("node-1", FileDecisionLog(tmp_path / "dlog"), [db, cr],
                                recover_on_start=False, recovery_interval=None,
                                reaper_interval=None)  # fmt: skip
        with tm.transaction() as tx:
            assert tx.join(cr).receive("orders", timeout=0.3) is None  # shut, not empty
        tm.recover()
        assert cursor.awaiting_recovery() == set()
        got = consume(tm, cr, db)
        assert got is not None and got.body == b"m3"
        assert got.delivery_count == 2  # pre-counted by m2's branch (restored), then counted
        tm.close()
        assert rows(engine) == ["m0", "m1", "m2", "m3"]
    finally:
        cursor.close()
        engine.dispose()


def test_remembered_gids_survive_rollovers_and_a_clean_close_opens_at_once(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    consumer = Consumer(make_pg_database(), tmp_path, segment_bytes=4096)
    try:
        for _ in range(3):
            consumer.consume()
        consumer.cr.flush_commits()
        remembered = consumer.cr.carried_gids()
        assert len(remembered) >= 1  # the last rows are deleted by later commits
        feed(consumer.cursor, [f"x{i}" for i in range(40)], first=len(BODIES) + 1)
        assert consumer.cursor.stats().rollovers > 0
        assert consumer.cr.carried_gids() == remembered
    finally:
        consumer.close()
    with Cursor(tmp_path / "cursor", segment_bytes=4096) as again:
        assert again.awaiting_recovery() == set()  # a clean close cleared the carriers
        assert CursorResource(again).carried_gids() == remembered
        assert [d.body.decode() for d in again.available("orders")][:5] == BODIES[3:]


def test_a_rollover_carries_the_carriers_and_the_remembered_gids() -> None:
    state = CursorState()
    state.apply({"k": "O", "d": ["node-1", "node-2"]})
    state.apply({"k": "C", "g": "g1", "i": [], "v": True})
    state.apply({"k": "C", "g": "g2", "i": [], "v": True, "f": ["g1"]})
    replayed = CursorState()
    for record in state.live_records(0, 0):
        replayed.apply(decode(encode(record)))
    assert replayed.carriers == {"node-1", "node-2"} and replayed.remembered == {"g2"}
    replayed.apply({"k": "D", "b": ["g2"]})
    replayed.apply({"k": "O", "d": []})
    assert replayed.carriers == set() and replayed.remembered == set()


# -- kill -9 at every step of a carried consumer ------------------------------------------------


def worker(
    mode: str, url: str, tmp: Path, flags: tuple[str, ...], crash_at: str = ""
) -> subprocess.CompletedProcess[str]:
    argv = ["--db", url, "--log", str(tmp / "dlog"), "--cursor", str(tmp / "cursor"), *flags]
    return run_script(WORKER, [mode, *argv, "--count", "5"], crash_at=crash_at)


#: (crash point, worker flags, how many of m0..m4 the database holds after recovery). The
#: third transaction's branch commits only once the database committed its decision row.
KILLS = [
    ("cursor.after_carriers:1", LLR, 0),
    ("tm.carried.after_stage:3", LLR, 2),
    ("tm.llr.before_commit:3", LLR, 2),
    ("tm.llr.after_commit:3", LLR, 3),
    ("cursor.cursor.after_carried_commit:3", LLR, 3),
    ("cursor.cursor.carried_durable:3", LLR, 3),
    ("cursor.cursor.carried_durable:3", (*LLR, *FORCED), 3),
    ("tm.end_deferred:3", LLR, 3),
    ("tm.before_deferred_end:3", LLR, 3),
    ("tm.carried.before_forget:1", LLR, 2),
    ("cursor.after_credited_take:2", LLR, 2),
]


@pytest.mark.parametrize(
    ("point", "flags", "consumed"),
    KILLS,
    ids=[f"{p}{' ' + ' '.join(f) if f else ''}" for p, f, _ in KILLS],
)
def test_consumed_exactly_once_after_kill_at_each_carried_step(
    point: str,
    flags: tuple[str, ...],
    consumed: int,
    make_pg_database: Callable[[], str],
    tmp_path: Path,
) -> None:
    url = make_pg_database()
    ledger_engine(url, accounts=1).dispose()
    with Cursor(tmp_path / "cursor") as c:
        feed(c, BODIES)
    crashed = worker("run", url, tmp_path, flags, crash_at=point)
    assert crashed.returncode == -9, crashed.stderr
    acked = [line.split()[1] for line in crashed.stdout.splitlines() if line.startswith("ACK")]
    state = recovered(url, tmp_path, flags)
    assert state["prepared"] == [] and state["awaiting"] == []
    assert state["rows"] == BODIES[:consumed]  # exactly once
    assert set(acked) <= set(state["rows"])  # every acknowledged one
    assert state["available"] == BODIES[consumed:]  # the rest, in order
    assert state["counts"][0] >= 1  # handed out before the kill, or pre-counted: never low
    assert state["remembered"] == [] and state["decision_rows"] == 0  # nothing left behind
    again = worker("run", url, tmp_path, flags)  # and it goes on from there
    assert again.returncode == 0, again.stderr
    state = recovered(url, tmp_path, flags)
    assert state["rows"] == BODIES[: consumed + 5]
    assert state["available"] == BODIES[consumed + 5 :]


def test_a_kill_in_recovery_after_a_restore_restores_nothing_twice(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    url = make_pg_database()
    crashed_after_m2_committed(url, tmp_path)
    killed = worker("recover", url, tmp_path, LLR, crash_at="recovery.carried.after_restore")
    assert killed.returncode == -9, killed.stderr
    state = recovered(url, tmp_path, LLR)
    assert state["rows"] == BODIES[:3] and state["available"] == BODIES[3:]
    assert state["remembered"] == [] and state["decision_rows"] == 0 and state["awaiting"] == []


@contextmanager
def restarted(
    url: str, tmp: Path, resources: list[Any] = (), name: str = "cursor", **options: Any
) -> Iterator[tuple[Cursor, CursorResource, PostgresResource, TransactionManager, sa.Engine]]:
    """The consumer's process again: its cursor, a last resource, ``resources`` more, and a
    manager that recovers on start; all closed at the end."""
    engine = sa.create_engine(url)
    cursor = Cursor(tmp / "cursor")
    cr = CursorResource(cursor, name, **options)
    db = PostgresResource(engine, "db", last_resource=True)
    tm = TransactionManager("node-1", FileDecisionLog(tmp / "dlog"), [db, cr, *resources],
                            recovery_interval=None, reaper_interval=None)  # fmt: skip
    try:
        yield cursor, cr, db, tm, engine
    finally:
        tm.close()
        cursor.close()
        engine.dispose()


def crashed_after_m2_committed(url: str, tmp: Path) -> None:
    """m0, m1 consumed; m2's row committed by the database, the cursor's record never written."""
    ledger_engine(url, accounts=1).dispose()
    with Cursor(tmp / "cursor") as c:
        feed(c, BODIES)
    crashed = worker("run", url, tmp, LLR, crash_at="tm.llr.after_commit:3")
    assert crashed.returncode == -9, crashed.stderr


def test_a_clean_close_before_recovery_keeps_the_next_open_shut(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """Opened after the crash and closed again before any recovery ran (a deploy rolled back,
    an operator's look): the node is still awaited at the next open, and a manager whose first
    pass cannot list every resource (one is down) does not open it either."""
    url = make_pg_database()
    crashed_after_m2_committed(url, tmp_path)
    with Cursor(tmp_path / "cursor") as c:
        assert c.awaiting_recovery() == {"node-1"}
    down = PostgresResource(sa.create_engine("postgresql+psycopg2://x@127.0.0.1:1/x"), "down")
    with restarted(url, tmp_path, [down]) as (cursor, cr, _, tm, _):
        assert cursor.awaiting_recovery() == {"node-1"}  # an incomplete pass restores nothing
        with tm.transaction() as tx:
            assert tx.join(cr).receive("orders", timeout=0.2) is None
    state = recovered(url, tmp_path, LLR)
    assert state["rows"] == BODIES[:3] and state["available"] == BODIES[3:]
    assert state["awaiting"] == []


def test_a_row_no_configured_store_can_restore_keeps_the_cursor_shut(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """The restart names the cursor's resource differently: the row of branch ``cursor``
    cannot be restored, so the cursor stays shut (it may be that store's) and the row stays."""
    url = make_pg_database()
    crashed_after_m2_committed(url, tmp_path)
    with restarted(url, tmp_path, name="consumer") as (cursor, _, _, tm, _):
        report = tm.recover(force=True)
        assert report.failures and cursor.awaiting_recovery() == {"node-1"}
    state = recovered(url, tmp_path, LLR)
    assert state["rows"] == BODIES[:3] and state["available"] == BODIES[3:]


def test_a_restart_that_does_not_ride_keeps_the_rows_it_cannot_restore(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """Carrying switched off after the crash: recovery must not delete m2's row as ended (its
    payload is the only record of the cursor's commit); carrying on again, it is restored."""
    url = make_pg_database()
    crashed_after_m2_committed(url, tmp_path)
    state = recovered(url, tmp_path, (*LLR, "--no-carry"))
    assert state["decision_rows"] >= 1 and state["awaiting"] == ["node-1"]
    state = recovered(url, tmp_path, LLR)
    assert state["rows"] == BODIES[:3] and state["available"] == BODIES[3:]
    assert state["decision_rows"] == 0 and state["awaiting"] == []


def test_a_commit_the_server_finishes_after_the_process_died_is_fenced_or_read(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """The consumer is killed while its COMMIT (a deferred trigger sleeps in it) still runs on
    the server. Its decision row is the only trace of the cursor's branch, and no prepared
    branch names it: the restarted manager's recovery must wait for that commit (the node's
    epoch, `fence_node`) before it reads the rows and lets the cursor hand anything out."""
    url = make_pg_database()
    engine = ledger_engine(url, accounts=1)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE slow (body text)"))
        conn.execute(text(
            "CREATE FUNCTION sleepy() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$"
        ))  # fmt: skip
        conn.execute(text(
            "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION sleepy()"
        ))  # fmt: skip
    engine.dispose()
    with Cursor(tmp_path / "cursor") as c:
        feed(c, BODIES)
    child = subprocess.Popen(
        [sys.executable, str(SLOW_WORKER), url, str(tmp_path / "dlog"), str(tmp_path / "cursor")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert child.stdout is not None
    assert child.stdout.readline().startswith("COMMITTING m0")
    time.sleep(1.0)  # the COMMIT is on the server now, in its trigger
    child.kill()
    child.wait()
    with restarted(url, tmp_path) as (cursor, cr, db, tm, engine):
        assert cursor.awaiting_recovery() == set()  # the start's pass waited, then restored
        got = consume(tm, cr, db)
        assert got is not None and got.body == b"m1"
        with engine.connect() as conn:
            assert list(conn.execute(text("SELECT body FROM slow")).scalars()) == ["m0"]


def test_a_commit_of_a_fenced_incarnation_fails(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """Two processes of one node (a takeover): the later one's fence makes the earlier one's
    next carried commit fail cleanly, its branch rolled back, nothing committed."""
    url = make_pg_database()
    old = Consumer(url, tmp_path / "old")
    try:
        assert old.consume() is not None
        new = Consumer(url, tmp_path / "new", ledger=False)  # its start's recovery fences
        new.close()
        with pytest.raises(TransactionRolledBack) as raised, old.tm.transaction() as tx:
            tx.join(old.cr).receive("orders")
            tx.join(old.db).execute(text("INSERT INTO transfers (id, amount) VALUES ('x', 1)"))
        assert "newer process" in str(raised.value)
        assert rows(old.engine) == ["m0"]
        assert [d.body.decode() for d in old.cursor.available("orders")] == BODIES[1:]
    finally:
        old.close()


def test_the_first_carried_commits_of_a_process_fence_once(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """Two threads make a process's first carried commits at once (no recovery pass fenced the
    node first): one fence, both commits through."""
    url = make_pg_database()
    consumer = Consumer(url, tmp_path, recover_on_start=False)
    barrier = threading.Barrier(2)
    failed: list[BaseException] = []

    def work() -> None:
        try:
            with consumer.tm.transaction() as tx:
                got = tx.join(consumer.cr).receive("orders", timeout=1)
                assert got is not None
                tx.join(consumer.db).execute(
                    text("INSERT INTO transfers (id, amount) VALUES (:t, 1)"),
                    {"t": got.body.decode()},
                )
                barrier.wait()
        except BaseException as exc:  # reported below
            failed.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert failed == []
        with consumer.engine.connect() as conn:
            epoch = conn.execute(text("SELECT epoch FROM twopc_decision_row_epoch")).scalar_one()
        assert epoch == 1 and rows(consumer.engine) == BODIES[:2]
    finally:
        consumer.close()


def test_rows_with_payloads_stay_until_the_node_can_be_fenced(
    make_pg_database: Callable[[], str], tmp_path: Path
) -> None:
    """An upgrade: the decision table holds a payload row, the epoch table is missing and the
    role may not create it. Recovery keeps the row and says what to run; once an administrator
    has, the next pass restores it."""
    url = make_pg_database()
    crashed_after_m2_committed(url, tmp_path)
    admin = sa.create_engine(url)
    role = f"app_{uuid.uuid4().hex[:8]}"
    with admin.begin() as conn:
        conn.execute(text("DROP TABLE twopc_decision_row_epoch"))
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'"))
        conn.execute(text("REVOKE CREATE ON SCHEMA public FROM PUBLIC"))
        conn.execute(text(f'GRANT CONNECT ON DATABASE "{database}" TO {role}'))
        conn.execute(text(f"GRANT USAGE ON SCHEMA public TO {role}"))
        conn.execute(
            text(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        )
    app = sa.make_url(url).set(username=role, password="pw").render_as_string(hide_password=False)
    try:
        done = worker("recover", app, tmp_path, LLR)
        assert done.returncode == 0, done.stderr
        assert "twopc_decision_row_epoch" in done.stderr  # what an administrator must run
        [line] = [x for x in done.stdout.splitlines() if x.startswith("STATE ")]
        state = json.loads(line[len("STATE ") :])
        assert state["decision_rows"] == 1 and state["awaiting"] == ["node-1"]
        with admin.begin() as conn:
            conn.execute(text(
                "CREATE TABLE twopc_decision_row_epoch (node_id text NOT NULL, resource text "
                "NOT NULL, epoch bigint NOT NULL, PRIMARY KEY (node_id, resource))"
            ))  # fmt: skip
            conn.execute(
                text(f"GRANT SELECT, INSERT, UPDATE ON twopc_decision_row_epoch TO {role}")
            )
        state = recovered(app, tmp_path, LLR)
        assert state["rows"] == BODIES[:3] and state["available"] == BODIES[3:]
        assert state["decision_rows"] == 0 and state["awaiting"] == []
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"REASSIGN OWNED BY {role} TO CURRENT_USER"))
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
        admin.dispose()


def recovered(url: str, tmp: Path, flags: tuple[str, ...]) -> dict[str, Any]:
    done = worker("recover", url, tmp, flags)
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("STATE ")]
    state: dict[str, Any] = json.loads(line[len("STATE ") :])
    return state
