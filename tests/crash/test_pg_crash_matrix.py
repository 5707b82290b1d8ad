"""The crash matrix on PostgreSQL: SIGKILL the coordinator at every crash point over real databases.

The scenarios are the file matrix's (`tests/crash/test_crash_matrix.py`), every one whose points
are declared in ``coordinator/``, plus the PostgreSQL resource's own point; each runs with the
file decision log and with the SQL one (``log.*`` points live in the journal, which only the file
log has). ``pg_worker.py run`` moves one unit from database a to database b per transaction and
writes a ledger row in database c (so that a transaction has the three branches the ``.3``
points need), each row keyed by the gtrid. A fresh ``pg_worker.py recover`` then resolves what
the crash left, and this process reads the databases and checks, by name:

- ``atomicity``: every transaction is all or nothing across the databases it wrote.
- ``decision_stable``, ``durable_ack``: as in the file matrix (the same checkers).
- ``no_in_doubt_residue``: ``pg_prepared_xacts`` is empty in every database; nothing is pending
  in the decision log.
- ``exactly_once``: each account's balance is its opening balance plus the transfer rows that
  name it, and the money in a and b together is the money put in (``conserved``).

Beyond the matrix: the postmaster killed with ``kill -9`` while branches are prepared, before
and after the decision (the prepared transactions survive its crash recovery, then ours finishes
them), and a coordinator SIGSTOPped past its SQL-log lease, before and after its decision, while
another process takes its node over.

Speed: the scenarios share one set of databases on the session's cluster, kept apart by node id
(recovery touches only its own node's branches; the SQL log keys everything by node) and by
account; their workers are forked by ``pg_worker.py serve``, so a scenario costs its work, not
three imports of SQLAlchemy. Only the server kills and the pauses get private clusters.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import psycopg2
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from coordinator import FileDecisionLog, TransactionManager, Xid
from coordinator.errors import InvalidXidError
from resource_managers.postgres import PostgresResource, SqlDecisionLog
from tests.crash.pg_worker import SCHEMA, move
from tests.crash.test_crash_matrix import (
    _CALL,
    SCENARIOS,
    Scenario,
    Transcript,
    decision_stable,
    durable_ack,
    fate,
    killed_at,
    no_in_doubt_residue,
    pending_decisions,
)
from tests.support.file_resource import COMMITTED, PREPARED, ROLLED_BACK
from tests.support.managers import make_manager

ROOT = Path(__file__).resolve().parents[2]
PG_WORKER = Path(__file__).with_name("pg_worker.py")
OPENING = 1000  # every account's opening balance

pytestmark = pytest.mark.crash


# -- the databases -------------------------------------------------------------------------------


class Prepared(NamedTuple):
    """A row of ``pg_prepared_xacts`` (``gtrid`` is the whole gid when it is not ours)."""

    gtrid: str
    gid: str


@dataclass(frozen=True)
class PgState:
    """What one database holds: its transfer rows, its balances, its prepared transactions."""

    rows: dict[str, tuple[int | None, int]]  # gtrid -> (account, signed amount)
    balances: dict[int, int]
    prepared: tuple[Prepared, ...]

    def outcome(self, gtrid: str) -> str:
        if gtrid in self.rows:
            return COMMITTED
        return PREPARED if any(p.gtrid == gtrid for p in self.prepared) else ROLLED_BACK


def dsn(url: str) -> str:
    """The libpq form of a SQLAlchemy URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def query(url: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(dsn(url), connect_timeout=10)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []
    finally:
        conn.close()


def prepared_in(url: str, node: str | None = None) -> tuple[Prepared, ...]:
    """The database's prepared transactions: ``node``'s and any that are not twopc's."""
    found = []
    for (gid,) in query(
        url, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
    ):
        try:
            xid = Xid.from_gid(gid)
        except InvalidXidError:
            found.append(Prepared(gid, gid))
            continue
        if node is None or xid.belongs_to(node):
            found.append(Prepared(xid.gtrid, gid))
    return tuple(sorted(found))


def read_pg_state(url: str, node: str | None = None, accounts: Sequence[int] = ()) -> PgState:
    """``node``'s transfer rows (every row if None), the balances of ``accounts`` (all if none)."""
    rows = {
        str(g): (a, int(m))
        for g, a, m in query(
            url,
            "SELECT id, account, amount FROM transfers WHERE %s IS NULL OR id LIKE %s",
            (node, f"{node}:%"),
        )
    }
    balances = {
        int(i): int(b)
        for i, b in query(url, "SELECT id, balance FROM accounts")
        if not accounts or i in accounts
    }
    return PgState(rows, balances, prepared_in(url, node))


@dataclass(frozen=True)
class Databases:
    """Named databases with the worker's schema (`pg_worker.SCHEMA`)."""

    urls: dict[str, str]

    @classmethod
    def create(cls, make: Callable[[], str], names: Iterable[str]) -> Databases:
        """``make()`` returns a fresh database's URL."""
        dbs = cls({name: make() for name in names})
        for url in dbs.urls.values():
            for statement in SCHEMA:
                query(url, statement)
        return dbs

    def open_accounts(
        self, names: Iterable[str], accounts: Iterable[int]
    ) -> dict[str, dict[int, int]]:
        """Open ``accounts`` with `OPENING` in the databases ``names``; the opening balances."""
        opening: dict[str, dict[int, int]] = {}
        for name in names:
            opening[name] = {}
            for account in accounts:
                query(self.urls[name], "INSERT INTO accounts VALUES (%s, %s)", (account, OPENING))
                opening[name][account] = OPENING
        return opening

    def args(self) -> list[str]:
        return [f"--db={name}={url}" for name, url in self.urls.items()]

    def read(self, node: str | None = None, accounts: Sequence[int] = ()) -> dict[str, PgState]:
        return {name: read_pg_state(url, node, accounts) for name, url in self.urls.items()}


# -- running the worker --------------------------------------------------------------------------


def worker_env(crash_at: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    if crash_at:
        env["TWOPC_CRASH_AT"] = crash_at
    return env


def pg_worker_command(*args: str) -> list[str]:
    return [sys.executable, str(PG_WORKER), *args]


class ForkServer:
    """``pg_worker.py serve``: each `run` forks a fresh child from a process that has already
    imported SQLAlchemy, so a scenario pays for its work, not for three imports."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.count = 0
        self.proc = subprocess.Popen(
            pg_worker_command("serve"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_env(None),
            cwd=ROOT,
            text=True,
            start_new_session=True,  # a group of its own: a hung child dies with the server
        )

    def run(
        self, args: Sequence[str], crash_at: str | None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """As ``subprocess.run`` of ``pg_worker.py *args`` with ``TWOPC_CRASH_AT=crash_at``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.count += 1
        out, err = (self.directory / f"{self.count}.{kind}" for kind in ("out", "err"))
        request = {"argv": list(args), "crash_at": crash_at, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            raise AssertionError(f"pg_worker {list(args)} did not finish within {timeout}s")
        answer = self.proc.stdout.readline()
        assert answer, f"the fork server died: {self.proc.wait()}"
        code = json.loads(answer)["returncode"]
        return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture(scope="module")
def forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    server = ForkServer(tmp_path_factory.mktemp("pg-worker-output"))
    yield server
    server.close()


def recovered(forks: ForkServer, args: Sequence[str]) -> dict[str, Any]:
    """Run ``pg_worker.py recover``; its report, which must show no failure."""
    proc = forks.run(["recover", *args], None)
    assert proc.returncode == 0, f"recovery failed\n{proc.stdout}\n{proc.stderr}"
    report: dict[str, Any] = json.loads(proc.stdout.split("RECOVERED ", 1)[1])
    # no crash here takes a branch out of the coordinator's hands: a heuristic is a bug
    assert not report["failures"] and not report["heuristics"], report
    assert not report["heuristic_records"], report
    return report


#: The SQL log's lease in these tests: a killed worker's lease blocks its successor until it
#: expires, so it is short; a live worker renews it every third of it, so it does not lapse.
LEASE_SECONDS = 1.0


@dataclass(frozen=True)
class Log:
    """A decision log the worker opens: ``file`` under a directory, or ``sql`` in a database."""

    kind: str
    where: str

    def args(self, *, run: bool = False) -> list[str]:
        if self.kind == "file":
            return ["--log", f"file:{self.where}"]
        wait = 0.0 if run else LEASE_SECONDS * 10  # a successor waits out the dead one's lease
        spec = ["--log", f"sql:{self.where}", "--lease-seconds", str(LEASE_SECONDS)]
        return [*spec, "--acquire-timeout", str(wait)]

    def pending(self, report: dict[str, Any], node: str) -> list[str]:
        """Pending decisions: what the recovering process saw, and what a fresh reader sees (a
        lazy END the recovering process never wrote would be hidden from its own view)."""
        return list(report["pending_after"]) + self.read_pending(node)

    def read_pending(self, node: str) -> list[str]:
        if self.kind == "file":
            return pending_decisions(Path(self.where))
        engine = create_engine(self.where, poolclass=NullPool)
        log = SqlDecisionLog(engine, node, read_only=True)
        try:
            return [d.gtrid for d in log.pending()]
        finally:
            log.close()
            engine.dispose()


def make_log(kind: str, directory: Path, sql_url: Callable[[], str]) -> Log:
    """A file log in ``directory``, or a SQL log in the database ``sql_url()`` returns."""
    return Log("sql", sql_url()) if kind == "sql" else Log("file", str(directory / "log"))


# -- invariants ----------------------------------------------------------------------------------


def atomicity(states: dict[str, PgState], t: Transcript) -> list[str]:
    return [
        f"atomicity: {g} is applied in some of {t.writers[g]} only"
        for g in t.kinds
        if fate(states, g, t.writers[g]) == "mixed"
    ]


def half_applied(states: dict[str, PgState], names: Sequence[str]) -> list[str]:
    """``atomicity`` without a transcript: every gtrid present in one database is in all."""
    everywhere = [set(states[n].rows) for n in names]
    torn = set().union(*everywhere) - set.intersection(*everywhere)
    return [f"atomicity: {g} is applied in some of {list(names)} only" for g in sorted(torn)]


def exactly_once(states: dict[str, PgState], opening: dict[str, dict[int, int]]) -> list[str]:
    """Each balance moved by exactly its transfer rows; the total is what was put in."""
    problems = []
    for name, accounts in opening.items():
        state = states[name]
        for account, start in accounts.items():
            moved = sum(m for a, m in state.rows.values() if a == account)
            held = state.balances.get(account)
            if held != start + moved:
                problems.append(
                    f"exactly_once: {name} account {account} holds {held}, its opening "
                    f"{start} and transfers {moved:+} say {start + moved}"
                )
    total = sum(sum(states[n].balances.values()) for n in opening)
    put_in = sum(sum(accounts.values()) for accounts in opening.values())
    if total != put_in:
        problems.append(f"conserved: the databases hold {total} in total, {put_in} was put in")
    return problems


def stayed_rolled_back(states: dict[str, PgState], t: Transcript) -> list[str]:
    """``decision_stable`` for a transcript with no interrupted transaction."""
    return [
        f"decision_stable: {g} reported rolled back but committed somewhere"
        for g in t.aborted
        if fate(states, g, t.writers[g]) != ROLLED_BACK
    ]


def decision_rows_left(url: str, node: str) -> list[str]:
    """A last resource keeps no commit row once recovery saw every branch of it ended."""
    rows = query(
        url,
        "SELECT gtrid FROM twopc_decision_row WHERE node_id = %s AND outcome = 'c'",
        (node,),
    )
    found = sorted(str(g) for (g,) in rows)
    return [f"decision_rows_cleaned: commit rows left for {found}"] if found else []


def invariants(
    states: dict[str, PgState],
    t: Transcript,
    expect: str | None,
    opening: dict[str, dict[int, int]],
    pending: list[str],
) -> tuple[str, list[str]]:
    """Every invariant; ``expect`` is the interrupted transaction's end (None: nothing was)."""
    if expect is None:
        ended, problems = "", stayed_rolled_back(states, t)
    else:
        ended, problems = decision_stable(states, t, expect)
    problems += atomicity(states, t)
    problems += no_in_doubt_residue(states, pending)
    problems += durable_ack(states, t)
    problems += exactly_once(states, opening)
    return ended, problems


# -- the matrix ----------------------------------------------------------------------------------


def points_in(paths: Iterable[Path]) -> set[str]:
    """Every crash point named in ``paths``, as regexes (the file matrix's scan)."""
    found = set()
    for path in paths:
        for is_f, _, text in (m.groups() for m in _CALL.finditer(path.read_text())):
            parts = re.split(r"\{[^}]*\}", text) if is_f else [text]
            found.add("[^.]+".join(re.escape(p) for p in parts))
    return found


def names(scenario: Scenario) -> list[str]:
    return [scenario.name] + ([scenario.first.partition(":")[0]] if scenario.first else [])


def declared_by(points: set[str], scenario: Scenario) -> bool:
    return all(any(re.fullmatch(p, n) for p in points) for n in names(scenario))


COORDINATOR_POINTS = points_in((ROOT / "coordinator").rglob("*.py"))
JOURNAL_POINTS = points_in((ROOT / "coordinator/journal").rglob("*.py"))
POSTGRES_POINTS = points_in((ROOT / "resource_managers/postgres").glob("*.py"))
DATABASES = ("a", "b", "c")

#: the coordinator points only a branch committing lazily (`coordinator.lazy_commit`) or a carried
#: branch (`coordinator.carried`) reaches: PostgreSQL and Redis branches commit durably and are
#: never carried, so the file matrix's lazy and carried test resources and the message log's and
#: cursor's kill tests cover them
LAZY_POINTS = frozenset(
    re.escape(p)
    for p in (
        "tm.end_deferred",
        "tm.before_deferred_end",
        "tm.carried.after_stage",
        "tm.carried.before_forget",
        "recovery.carried.after_restore",
    )
)

PG_SCENARIOS = [
    *(s for s in SCENARIOS if declared_by(COORDINATOR_POINTS, s) and not s.lazy and not s.carried),
    # PostgreSQL prepared the branch; the coordinator never heard the vote.
    *(Scenario(f"postgres.{r}.after_prepare:3", ROLLED_BACK) for r in DATABASES),
    # c is the last resource: recovery killed as it is about to read (and fence) c's table
    Scenario(
        "postgres.c.before_decision_lookup",
        COMMITTED,
        first="tm.llr.after_commit:3",
        label="llr redo",
        last="c",
    ),
    Scenario(
        "postgres.c.before_decision_lookup",
        ROLLED_BACK,
        first="tm.llr.before_commit:3",
        label="llr abort",
        last="c",
    ),
]


def journal_only(scenario: Scenario) -> bool:
    """A point inside the journal, which the SQL log does not use: it would never fire."""
    return any(any(re.fullmatch(p, n) for p in JOURNAL_POINTS) for n in names(scenario))


#: the scenarios psycopg 3 runs too (file log): the two-phase path's steps on PostgreSQL, and
#: every last-resource scenario
PG3_POINTS = (
    "tm.after_prepare.2",
    "tm.read_only.after_vote",
    "tm.after_decision_fsync",
    "tm.after_commit.1",
    "tm.after_rollback.2",
    "tm.one_phase.before_ack",
    "recovery.after_resolve.1",
)


def on_psycopg3(scenario: Scenario) -> bool:
    return bool(scenario.last or scenario.id.startswith(("postgres.", *PG3_POINTS)))


def carried(scenario: Scenario) -> bool:
    """A last-resource scenario that holds when c carries the SQL log's own record instead (the
    log in c's database, no ``--last``): all but the points only a last resource's table has."""
    return scenario.last == "c" and not scenario.name.startswith(
        ("postgres.", "recovery.llr.", "fileres.")
    )


CASES = [
    *(
        pytest.param(log, s, "psycopg2", id=f"{log}-{s.id}")
        for log in ("file", "sql")
        for s in PG_SCENARIOS
        if log == "file" or not journal_only(s)
    ),
    *(
        pytest.param("carried", s, "psycopg2", id=f"carried-{s.id}")
        for s in PG_SCENARIOS
        if carried(s)
    ),
    *(
        pytest.param("file", s, "psycopg", id=f"file-pg3-{s.id}")
        for s in PG_SCENARIOS
        if on_psycopg3(s)
    ),
]


@dataclass(frozen=True)
class Shared:
    """The databases every scenario of this module shares: a, b (accounts), c (ledger), and
    one for the SQL log. Scenarios keep apart by node id (recovery touches only its own node's
    branches, and the SQL log keys everything by node) and by account."""

    dbs: Databases
    log_url: str
    counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def scenario(self) -> tuple[str, int]:
        """A node id and an account no other scenario of this module uses."""
        n = next(self.counter)
        return f"pgm{n}", n


@pytest.fixture(scope="module")
def shared(pg_server: Any) -> Iterator[Shared]:
    made: list[str] = []

    def make() -> str:
        made.append(pg_server.create_database())
        return str(pg_server.url(made[-1]))

    try:
        dbs = Databases.create(make, DATABASES)
        yield Shared(dbs, make())
        # each scenario checked its own node; nothing of any node may be left either
        left = {name: prepared_in(url) for name, url in dbs.urls.items()}
        assert not any(left.values()), f"no_in_doubt_residue: left prepared: {left}"
    finally:
        for name in made:
            pg_server.drop_database(name)


@pytest.mark.parametrize(("log_kind", "scenario", "driver"), CASES)
def test_pg_crash_point(
    log_kind: str,
    scenario: Scenario,
    tmp_path: Path,
    shared: Shared,
    forks: ForkServer,
    *,
    driver: str,
    crash_matrix: Any,
) -> None:
    if log_kind == "carried":  # the SQL log in c's database: c carries its records
        log, carrier = Log("sql", shared.dbs.urls["c"]), True
    else:
        log, carrier = make_log(log_kind, tmp_path, lambda: shared.log_url), False
    node, account = shared.scenario()
    opening = shared.dbs.open_accounts(("a", "b"), [account])
    segment = ["--segment-bytes", str(scenario.segment_bytes)] if scenario.segment_bytes else []
    last = ["--last", scenario.last] if scenario.last and not carrier else []
    asynchronous = ["--async-phase-two"] if scenario.asynchronous else []
    common = [
        *shared.dbs.args(),
        "--node",
        node,
        *segment,
        *last,
        *asynchronous,
        "--driver",
        driver,
    ]

    plan = ["--plan", ",".join(scenario.plan), "--account", str(account)]
    first = forks.run(
        ["run", *common, *log.args(run=True), *plan], scenario.first or scenario.point
    )
    killed_at(first, scenario.first or scenario.point)
    if scenario.first:
        killed_at(forks.run(["recover", *common, *log.args()], scenario.point), scenario.point)
    report = recovered(forks, [*common, *log.args()])

    states = shared.dbs.read(node, [account])
    transcript = Transcript.parse(first.stdout, asynchronous=scenario.asynchronous)
    ended, problems = invariants(
        states, transcript, scenario.expect, opening, log.pending(report, node)
    )
    if scenario.last and not carrier:
        problems += decision_rows_left(shared.dbs.urls[scenario.last], node)
    crash_matrix.add(
        point=f"pg/{log_kind}{'/pg3' if driver == 'psycopg' else ''} {scenario.id}",
        expected=scenario.expect,
        outcome=ended,
        resolved=f"{len(report['committed'])} commit, {len(report['rolled_back'])} abort",
        recovery_ms=report["recovery_ms"],
        verdict="ok" if not problems else "FAIL " + ",".join(p.split(":")[0] for p in problems),
    )
    assert not problems, "\n".join(problems)


def test_pg_matrix_covers_every_crash_point() -> None:
    """Every point of the coordinator and of the PostgreSQL resource has a scenario here."""
    assert len(POSTGRES_POINTS) >= 1, POSTGRES_POINTS  # the scan itself works
    assert JOURNAL_POINTS and JOURNAL_POINTS < COORDINATOR_POINTS, JOURNAL_POINTS
    covered = {n for s in PG_SCENARIOS for n in names(s)}
    assert LAZY_POINTS < COORDINATOR_POINTS, LAZY_POINTS  # the names still match the code
    declared = (COORDINATOR_POINTS - LAZY_POINTS) | POSTGRES_POINTS
    uncovered = [p for p in declared if not any(re.fullmatch(p, n) for n in covered)]
    unknown = [n for n in covered if not any(re.fullmatch(p, n) for p in declared)]
    assert not uncovered, f"crash points with no PostgreSQL scenario: {uncovered}"
    assert not unknown, f"scenarios naming no declared crash point: {unknown}"
    sql_covered = {n for log, s, _ in (c.values for c in CASES) if log == "sql" for n in names(s)}
    sql_uncovered = [
        p for p in declared - JOURNAL_POINTS if not any(re.fullmatch(p, n) for n in sql_covered)
    ]
    assert not sql_uncovered, f"points with no SQL-log scenario: {sql_uncovered}"


def test_the_pg_checkers_catch_what_they_name() -> None:
    """A checker that cannot fail proves nothing: feed each one a state that breaks its rule."""
    g1, g2 = "n:x-1", "n:x-2"
    t = Transcript({g1: "2pc", g2: "2pc"}, {g1: ["a", "b"], g2: ["a", "b"]}, [g1], [])
    states = {
        "a": PgState({g1: (1, -1), g2: (1, -1)}, {1: 998}, ()),
        "b": PgState({g1: (1, 1)}, {1: 1001}, (Prepared(g2, "gid"),)),
    }
    opening = {"a": {1: 1000}, "b": {1: 1000}}
    assert atomicity(states, t) == [f"atomicity: {g2} is applied in some of ['a', 'b'] only"]
    assert half_applied(states, ["a", "b"]) == atomicity(states, t)
    assert exactly_once(states, opening) == [
        "conserved: the databases hold 1999 in total, 2000 was put in"
    ]
    states["b"].balances[1] = 1005
    assert exactly_once(states, opening)[0].startswith("exactly_once: b account 1 holds 1005")
    assert no_in_doubt_residue(states, []) == [
        f"no_in_doubt_residue: b still holds prepared {[g2]}"
    ]
    assert states["b"].outcome(g2) == PREPARED


# -- the server crashes ----------------------------------------------------------------------------

SERVER_KILLS = [
    pytest.param(log, point, expect, id=f"{log}-{point}")
    for log in ("file", "sql")
    for point, expect in (
        ("tm.before_decision_write", ROLLED_BACK),  # every branch prepared, no decision
        ("tm.after_decision_fsync", COMMITTED),  # decision forced, no branch told
    )
]


@pytest.mark.parametrize(("log_kind", "point", "expect"), SERVER_KILLS)
def test_postmaster_kill9_keeps_prepared_branches(
    log_kind: str,
    point: str,
    expect: str,
    *,
    tmp_path: Path,
    private_pg: Callable[..., Any],
    forks: ForkServer,
) -> None:
    """``durable_prepare``: a prepared transaction outlives the postmaster's crash (and the
    coordinator's, both by SIGKILL); then recovery commits it after a decision and rolls it back
    without one (``presumed_abort``). With the SQL log the decision itself lives in the crashed
    server, and must be there after its crash recovery."""
    server = private_pg()

    def make() -> str:
        return str(server.url(server.create_database()))

    dbs = Databases.create(make, ("a", "b"))
    opening = dbs.open_accounts(("a", "b"), [1])
    log = make_log(log_kind, tmp_path, make)
    node = "pmkill"
    common = [*dbs.args(), "--node", node]

    first = forks.run(["run", *common, *log.args(run=True), "--plan", "2pc,2pc"], f"{point}:2")
    killed_at(first, point)
    transcript = Transcript.parse(first.stdout)
    gtrid = transcript.interrupted
    before = {name: prepared_in(url) for name, url in dbs.urls.items()}
    assert [[p.gtrid for p in found] for found in before.values()] == [[gtrid], [gtrid]], before

    server.kill9()
    server.restart()
    after = {name: prepared_in(url) for name, url in dbs.urls.items()}
    assert after == before, "prepared transactions lost in the server's crash"

    report = recovered(forks, [*common, *log.args()])
    if expect == COMMITTED:
        assert gtrid in report["committed"], report
    else:
        assert sorted(report["rolled_back"]) == sorted(p.gid for p in [*before["a"], *before["b"]])
    ended, problems = invariants(dbs.read(), transcript, expect, opening, log.pending(report, node))
    assert ended == expect
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("point", "expect"),
    [("tm.llr.before_commit", ROLLED_BACK), ("tm.llr.after_commit", COMMITTED)],
)
def test_a_down_last_resource_stops_presumed_abort(
    point: str,
    expect: str,
    *,
    tmp_path: Path,
    private_pg: Callable[..., Any],
    forks: ForkServer,
) -> None:
    """b, on a cluster of its own, is the last resource. The coordinator is killed before or
    after b's commit, then b's postmaster is killed too. While b is down, recovery must presume
    nothing about a's prepared branch (its decision may be b's row): it fails and retries. Once
    b's server is back from its crash recovery, the row (or its absence) decides."""
    servers = {name: private_pg() for name in ("a", "b")}
    urls = iter([str(s.url(s.create_database())) for s in servers.values()])
    dbs = Databases.create(lambda: next(urls), ("a", "b"))
    opening = dbs.open_accounts(("a", "b"), [1])
    log = make_log("file", tmp_path, lambda: "")
    common = [*dbs.args(), "--node", "llrdown", "--last", "b"]

    first = forks.run(["run", *common, *log.args(run=True), "--plan", "2pc,2pc"], f"{point}:2")
    killed_at(first, point)
    transcript = Transcript.parse(first.stdout)
    gtrid = transcript.interrupted
    assert [p.gtrid for p in prepared_in(dbs.urls["a"])] == [gtrid]

    servers["b"].kill9()
    down = forks.run(["recover", *common, *log.args()], None)
    assert down.returncode == 0, down.stderr
    report = json.loads(down.stdout.split("RECOVERED ", 1)[1])
    assert report["failures"] and not report["rolled_back"] and not report["committed"], report
    assert [p.gtrid for p in prepared_in(dbs.urls["a"])] == [gtrid]  # nothing presumed

    servers["b"].restart()
    report = recovered(forks, [*common, *log.args()])
    assert (report["committed"] == [gtrid]) == (expect == COMMITTED), report
    ended, problems = invariants(
        dbs.read(), transcript, expect, opening, log.pending(report, "llrdown")
    )
    assert ended == expect
    problems += decision_rows_left(dbs.urls["b"], "llrdown")
    assert not problems, "\n".join(problems)


def test_live_coordinator_after_postmaster_restart(
    tmp_path: Path, private_pg: Callable[..., Any], managers: list[TransactionManager]
) -> None:
    """``availability``: a coordinator that lived through the server's crash works as soon as the
    server is back: its next transaction commits and its next recovery pass fails nothing."""
    server = private_pg()
    dbs = Databases.create(lambda: str(server.url(server.create_database())), ("a", "b"))
    opening = dbs.open_accounts(("a", "b"), [1])
    resources = [PostgresResource(create_engine(url), name) for name, url in dbs.urls.items()]
    tm = make_manager(managers, resources, FileDecisionLog(tmp_path / "log"), node_id="live")

    def transfer() -> str:
        with tm.transaction() as tx:
            move(tx.join(resources[0]), tx.gtrid, 1, -1)
            move(tx.join(resources[1]), tx.gtrid, 1, 1)
        return tx.gtrid

    first = transfer()  # leaves a pooled connection per database, which the crash kills
    server.kill9()
    server.restart()
    report = tm.recover(force=True)
    second = transfer()
    assert not report.failures, report.failures
    states = dbs.read()
    assert not half_applied(states, ("a", "b")) and not exactly_once(states, opening)
    assert {first, second} <= set(states["a"].rows)


# -- a paused coordinator ----------------------------------------------------------------------


class Lines:
    """A child's stdout, line by line, read by a thread so that waiting can time out."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, word: str, timeout: float = 30) -> list[str]:
        """The words of the first line starting with ``word``."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, f"the child ended before {word}: {self.seen}"
            self.seen.append(line)
            if line.split()[0] == word:
                return line.split()

    def rest(self, timeout: float = 30) -> list[str]:
        self._thread.join(timeout)
        while not self.lines.empty():
            line = self.lines.get()
            if line is not None:
                self.seen.append(line)
        return self.seen


def wait_stopped(pid: int, timeout: float = 30) -> None:
    """Until the process is stopped by a signal (state T in /proc/<pid>/stat)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout}s"
        time.sleep(0.01)


PAUSES = [
    # every branch prepared, no decision: the new owner presumes abort, the old one is fenced
    pytest.param("tm.before_decision_write", ROLLED_BACK, None, id="before-decision"),
    # the decision written: the new owner commits it, the old one's commits are repeats
    pytest.param("tm.after_decision_fsync", COMMITTED, None, id="after-decision"),
    # b is the last resource: the new owner's lookup leaves an abort row, so A, let run again,
    # can no longer commit b (its lease, and failing that the row's key, refuse it)
    pytest.param("tm.llr.before_commit", ROLLED_BACK, "b", id="llr-before-commit"),
    # b committed with its decision row: the new owner reads it and commits a
    pytest.param("tm.llr.after_commit", COMMITTED, "b", id="llr-after-commit"),
]


@pytest.mark.parametrize(("point", "expect", "last"), PAUSES)
def test_paused_coordinator_and_takeover(
    point: str,
    expect: str,
    last: str | None,
    *,
    tmp_path: Path,
    private_pg: Callable[..., Any],
    forks: ForkServer,
) -> None:
    """``fencing``: coordinator A, SIGSTOPped at ``point`` in its transaction, loses its SQL-log
    lease; another process takes node A over (a new epoch) and recovers. Before the decision it
    presumes abort, and A, let run again, must have its decision write refused (FencedError) and
    report a rollback; after the decision it commits, and A reports the commit. Either way every
    branch ends the same way, nothing is left prepared and nothing pending."""
    server = private_pg()

    def make() -> str:
        return str(server.url(server.create_database()))

    dbs = Databases.create(make, ("a", "b"))
    opening = dbs.open_accounts(("a", "b"), [1])
    log = Log("sql", make())
    common = [*dbs.args(), "--node", "A", *(["--last", last] if last else [])]
    command = ["run", *common, *log.args(run=True), "--plan", "2pc", "--stop-at", point]
    stderr = tmp_path / "a.err"
    child = subprocess.Popen(
        pg_worker_command(*command),
        stdout=subprocess.PIPE,
        stderr=stderr.open("w"),
        env=worker_env(None),
        cwd=ROOT,
        text=True,
    )
    try:
        lines = Lines(child)
        gtrid = lines.until("BEGIN")[1]
        lines.until("STOPPED")
        wait_stopped(child.pid)  # the worker SIGSTOPs itself right after saying so
        prepared = {name: prepared_in(url) for name, url in dbs.urls.items()}
        two_phase = [[] if name == last else [gtrid] for name in dbs.urls]  # a last never prepares
        assert [[p.gtrid for p in found] for found in prepared.values()] == two_phase

        takeover = recovered(forks, [*common, *log.args()])  # waits out A's lease
        assert takeover["epoch"] == 2, takeover  # A held epoch 1
        if expect == COMMITTED:
            assert takeover["committed"] == [gtrid], takeover
        else:
            gids = sorted(p.gid for found in prepared.values() for p in found)
            assert sorted(takeover["rolled_back"]) == gids, takeover

        os.kill(child.pid, signal.SIGCONT)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    seen = lines.rest()
    assert child.returncode == 0, stderr.read_text()
    ends = [line.split() for line in seen if line.split()[0] in ("ACK", "ABORTED", "UNKNOWN")]
    if expect == COMMITTED:
        assert ends == [["ACK", gtrid, "committed"]], seen
    else:
        # a rollback caused by the fenced decision write: TransactionRolledBack itself, not
        # TransactionTimedOut (a transient error, inviting a retry that cannot succeed)
        assert ends == [["ABORTED", gtrid, "rolled-back", "fenced"]], seen

    final = recovered(forks, [*common, *log.args()])
    assert final["committed"] == final["rolled_back"] == [], final
    transcript = Transcript.parse("\n".join(seen))
    states = dbs.read()
    _, problems = invariants(states, transcript, None, opening, log.pending(final, "A"))
    assert not problems, "\n".join(problems)
    assert fate(states, gtrid, ["a", "b"]) == expect
