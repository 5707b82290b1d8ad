"""The crash matrix over one PostgreSQL database and one Redis: SIGKILL the coordinator at every
crash point, recover in a fresh process, check invariants.

The scenarios are the file matrix's (`tests/crash/test_crash_matrix.py`) whose points are
declared in ``coordinator/`` (its last-resource ones with the PostgreSQL branch ``a`` as the last
resource), plus the PostgreSQL resource's point and every point of the Redis
resource (``after_stage``, ``after_prepare_send``: b's and c's prepare scripts in flight while a
prepares, see `coordinator.early_prepare`; ``after_prepare_marker``, ``after_apply``, the last also
on the one-phase path, and ``after_batch_send``: b's and c's commits pipelined in one round trip,
see `coordinator.batch_commit`), all with the file decision log. ``redis_worker.py run`` moves one
unit from an account in PostgreSQL (``a``) to the same account in Redis (``b``: ``INCRBY`` and a
transfer record keyed by the gtrid) and writes a ledger entry through a second Redis resource
(``c``, same client) so that a transaction has the three branches the ``.3`` points need. Then, by
name:

- ``atomicity``, ``decision_stable``, ``durable_ack``, ``exactly_once`` and ``conserved``: as in
  the PostgreSQL matrix, with Redis's transfer records standing in for ``transfers`` rows.
- ``no_in_doubt_residue``: ``pg_prepared_xacts`` empty; Redis's prepared set empty; nothing
  pending in the decision log.
- ``no_redis_residue``: no lock key, no staged write set, no branch record still ``prepared``
  (the ``committed`` markers and ``aborted`` tombstones may stay: they expire).

Beyond the matrix: ``redis-server`` killed with ``kill -9`` while every branch is prepared and
the coordinator is dead, before and after the decision; restarted from its AOF it must hold the
prepared branches exactly as before, and recovery commits them after a decision and rolls them
back without one. And ``redis-server`` killed under a live coordinator, before Redis's prepare,
before the decision and after it: the caller is told the truth, one recovery pass finishes the
transaction once Redis is back, and the coordinator goes on committing.

Speed: scenarios share one PostgreSQL database (apart by node id and account) and the session's
Redis (apart by namespace); workers are forked by ``redis_worker.py serve``. Only the Redis kills
get a private server.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine

from coordinator import (
    FileDecisionLog,
    Outcome,
    TransactionManager,
    TransactionRolledBack,
    Xid,
    crashpoints,
)
from coordinator.errors import InvalidXidError
from resource_managers.postgres import PostgresResource
from resource_managers.redis import RedisResource
from tests.crash.pg_worker import SCHEMA, move
from tests.crash.redis_worker import (
    NONE,
    balance_key,
    credit,
    enter,
    ledger_key,
    redis_client,
    xfer_key,
)
from tests.crash.test_crash_matrix import (
    SCENARIOS,
    Scenario,
    Transcript,
    killed_at,
    pending_decisions,
)
from tests.crash.test_pg_crash_matrix import (
    COORDINATOR_POINTS,
    LAZY_POINTS,
    OPENING,
    POSTGRES_POINTS,
    ROOT,
    Databases,
    ForkServer,
    PgState,
    Prepared,
    decision_rows_left,
    declared_by,
    invariants,
    names,
    points_in,
    query,
    read_pg_state,
    recovered,
    worker_env,
)
from tests.support.file_resource import COMMITTED, PREPARED, ROLLED_BACK
from tests.support.managers import make_manager

REDIS_WORKER = Path(__file__).with_name("redis_worker.py")
REDIS_POINTS = points_in((ROOT / "resource_managers/redis").glob("*.py"))
REDIS_BRANCHES = ("b", "c")  # the Redis resources of redis_worker.py, in prepare order
STEP_POINT = r"redis\.[^.]+\.after_commit_step"  # as `points_in` writes a declared point

pytestmark = pytest.mark.crash


# -- Redis, as the checkers see it ---------------------------------------------------------------


def twopc_prefix(client: redis.Redis, namespace: str) -> bytes:
    """Where `RedisResource` keeps its own keys for ``namespace`` (asked of the class itself)."""
    return RedisResource(client, "probe", namespace=namespace).prefix


def _scan(client: redis.Redis, pattern: bytes) -> list[bytes]:
    return sorted(client.scan_iter(match=pattern, count=1000))


def _records(client: redis.Redis, ns: str, kind: str) -> dict[str, bytes]:
    """key suffix (the gtrid) -> key, for the data keys ``<ns>:<kind>:*``."""
    head = f"{ns}:{kind}:".encode()
    return {k[len(head) :].decode(): k for k in _scan(client, head + b"*")}


def read_redis_state(client: redis.Redis, ns: str, accounts: Sequence[int]) -> dict[str, PgState]:
    """What b and c hold, in the PostgreSQL matrix's shape: b's transfer records as rows and its
    balances; c's ledger entries as rows; the prepared branches of each."""
    prepared: dict[str, list[Prepared]] = {r: [] for r in REDIS_BRANCHES}
    for gid in client.zrange(twopc_prefix(client, ns) + b"prepared", 0, -1):
        try:
            xid = Xid.from_gid(gid.decode())
        except (UnicodeDecodeError, InvalidXidError):
            prepared["b"].append(Prepared(repr(gid), repr(gid)))  # not ours: still a residue
            continue
        prepared.setdefault(xid.bqual, []).append(Prepared(xid.gtrid, gid.decode()))
    rows: dict[str, tuple[int | None, int]] = {}
    for gtrid, key in _records(client, ns, "xfer").items():
        record = client.hgetall(key)
        account = record[b"account"].decode()
        rows[gtrid] = (None if account == NONE else int(account), int(record[b"amount"]))
    balances = {}
    for account in accounts:
        held = client.get(balance_key(ns, account))
        if held is not None:  # a missing balance is missing here too, for exactly_once to see
            balances[account] = int(held)
    ledger = {gtrid: (None, 0) for gtrid in _records(client, ns, "ledger")}
    return {
        "b": PgState(rows, balances, tuple(sorted(prepared["b"]))),
        "c": PgState(ledger, {}, tuple(sorted(prepared["c"]))),
    }


def no_redis_residue(client: redis.Redis, ns: str) -> list[str]:
    """No lock, no staged write set, no prepared entry or record: what only a prepared branch
    may hold. Markers and tombstones (``tx:<gid>`` not in state prepared) are allowed."""
    prefix = twopc_prefix(client, ns)
    problems = [f"no_redis_residue: lock {k!r} left" for k in _scan(client, prefix + b"lock:*")]
    problems += [
        f"no_redis_residue: staged set {k!r} left" for k in _scan(client, prefix + b"ws:*")
    ]
    if client.zcard(prefix + b"prepared"):
        members = client.zrange(prefix + b"prepared", 0, -1)
        problems.append(f"no_redis_residue: prepared set holds {members}")
    states = {k: client.hget(k, "state") for k in _scan(client, prefix + b"tx:*")}
    problems += [
        f"no_redis_residue: {k!r} is still {state.decode()}"
        for k, state in states.items()
        if state in (b"prepared", b"committing")
    ]
    entries, seen = (set(_records(client, ns, kind)) for kind in ("ledger", "seen"))
    problems += [f"c_atomicity: {g} has one of c's two keys" for g in sorted(entries ^ seen)]
    return problems


def snapshot(client: redis.Redis, ns: str) -> dict[bytes, Any]:
    """Every key of twopc and of the data under ``ns``, read by type (not DUMP, whose encoding
    may change when the AOF is replayed)."""
    read: dict[bytes, Callable[[bytes], Any]] = {
        b"string": client.get,
        b"hash": client.hgetall,
        b"list": lambda k: client.lrange(k, 0, -1),
        b"zset": lambda k: client.zrange(k, 0, -1, withscores=True),
    }
    found = {}
    for pattern in (twopc_prefix(client, ns) + b"*", f"{ns}:*".encode()):
        for key in _scan(client, pattern):
            found[key] = read[client.type(key)](key)
    return found


# -- the worker ----------------------------------------------------------------------------------


def redis_worker_command(*args: str) -> list[str]:
    return [sys.executable, str(REDIS_WORKER), *args]


class RedisForkServer(ForkServer):
    """`ForkServer` over ``redis_worker.py serve``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.count = 0
        self.proc = subprocess.Popen(
            redis_worker_command("serve"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_env(None),
            cwd=ROOT,
            text=True,
            start_new_session=True,  # a group of its own: a hung child dies with the server
        )


@pytest.fixture(scope="module")
def forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisForkServer]:
    server = RedisForkServer(tmp_path_factory.mktemp("redis-worker-output"))
    yield server
    server.close()


@dataclass(frozen=True)
class Setup:
    """One PostgreSQL database (a) and one Redis, as the worker is told of them."""

    pg: str
    redis_url: str
    namespace: str
    node: str
    log_dir: Path

    def args(self) -> list[str]:
        return [
            *("--pg", self.pg, "--redis", self.redis_url, "--namespace", self.namespace),
            *("--node", self.node, "--log", f"file:{self.log_dir}", "--ledger"),
        ]

    def open_account(self, account: int) -> dict[str, dict[int, int]]:
        """``account`` with `OPENING` in a and in b; the opening balances."""
        query(self.pg, "INSERT INTO accounts VALUES (%s, %s)", (account, OPENING))
        client = redis_client(self.redis_url)
        try:
            client.set(balance_key(self.namespace, account), OPENING)
        finally:
            client.close()
        return {"a": {account: OPENING}, "b": {account: OPENING}}

    def read(self, accounts: Sequence[int]) -> tuple[dict[str, PgState], list[str]]:
        """Every branch's state, and what Redis holds that no finished branch may."""
        client = redis_client(self.redis_url)
        try:
            states = {"a": read_pg_state(self.pg, self.node, accounts)}
            states |= read_redis_state(client, self.namespace, accounts)
            return states, no_redis_residue(client, self.namespace)
        finally:
            client.close()


def check(
    setup: Setup,
    account: int,
    first: str,
    expect: str | None,
    report: dict[str, Any],
    *,
    asynchronous: bool = False,
) -> tuple[str, list[str]]:
    """(how the interrupted transaction ended, every broken invariant)."""
    states, residue = setup.read([account])
    opening = {"a": {account: OPENING}, "b": {account: OPENING}}
    pending = list(report["pending_after"]) + pending_decisions(setup.log_dir)
    transcript = Transcript.parse(first, asynchronous=asynchronous)
    ended, problems = invariants(states, transcript, expect, opening, pending)
    return ended, problems + residue


# -- the matrix ----------------------------------------------------------------------------------

REDIS_SCENARIOS = [
    *(s for s in SCENARIOS if declared_by(COORDINATOR_POINTS, s) and not s.lazy and not s.carried),
    # PostgreSQL prepared the branch; the coordinator never heard the vote.
    Scenario("postgres.a.after_prepare:3", ROLLED_BACK),
    # The write set is built, nothing of it in Redis yet (a is prepared).
    *(Scenario(f"redis.{r}.after_stage:3", ROLLED_BACK) for r in REDIS_BRANCHES),
    # b's and c's prepare scripts are in flight (`early_prepare`), a not yet prepared: Redis may
    # or may not have run them; no vote was heard
    *(Scenario(f"redis.{r}.after_prepare_send:3", ROLLED_BACK) for r in REDIS_BRANCHES),
    Scenario("redis.c.after_prepare_send:3", ROLLED_BACK, label="llr", last="a"),
    # Redis holds the locks, the staged set and the prepared entry; no vote was heard.
    *(Scenario(f"redis.{r}.after_prepare_marker:3", ROLLED_BACK) for r in REDIS_BRANCHES),
    # The commit script applied the write set; the coordinator never heard it.
    *(Scenario(f"redis.{r}.after_apply:3", COMMITTED) for r in REDIS_BRANCHES),
    # c commits its two SETs in steps (commit_chunk=1): killed between them, its record says
    # how far it got, and recovery goes on from there; also recovery killed there
    Scenario("redis.c.after_commit_step:3", COMMITTED),
    Scenario(
        "redis.c.after_commit_step", COMMITTED, first="tm.after_decision_fsync:3", label="redo"
    ),
    # Recovery dies right after Redis applied the commit it re-drove: the next one must find the
    # committed marker and apply nothing twice.
    *(
        Scenario(
            f"redis.{r}.after_apply", COMMITTED, first="tm.after_decision_fsync:3", label="redo"
        )
        for r in REDIS_BRANCHES
    ),
    # Redis alone: the one-phase script applied the write set, the caller was never told.
    Scenario("redis.b.after_apply:3", COMMITTED, ("2pc", "2pc", "1pc"), label="one-phase"),
    # a is the last resource: recovery killed as it is about to read (and fence) a's table
    *(
        Scenario(
            "postgres.a.before_decision_lookup", expect, first=first, label=f"llr {how}", last="a"
        )
        for first, expect, how in (
            ("tm.llr.after_commit:3", COMMITTED, "redo"),
            ("tm.llr.before_commit:3", ROLLED_BACK, "abort"),
        )
    ),
    # Redis applied its commit after a's commit with the decision row; never heard
    Scenario("redis.c.after_apply:3", COMMITTED, label="llr", last="a"),
    # b and c share a client: their commit scripts went out in one pipeline, no reply was read
    # (Redis may or may not have run them): recovery commits both, or finds them committed
    *(Scenario(f"redis.{r}.after_batch_send:3", COMMITTED) for r in REDIS_BRANCHES),
    Scenario("redis.b.after_batch_send:3", COMMITTED, label="llr", last="a"),
    Scenario("redis.c.after_batch_send:3", COMMITTED, label="async", asynchronous=True),
]


@dataclass(frozen=True)
class Shared:
    """What every scenario of this module shares: database a and the session's Redis. Scenarios
    keep apart by node id and account (PostgreSQL) and by namespace (Redis)."""

    pg: str
    redis_url: str
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def scenario(self, log_dir: Path) -> tuple[Setup, int]:
        n = next(self.counter)
        return Setup(self.pg, self.redis_url, f"rcm-{self.token}-{n}", f"rcm{n}", log_dir), n


@pytest.fixture(scope="module")
def shared(pg_server: Any, redis_server: Any) -> Iterator[Shared]:
    name = pg_server.create_database()
    try:
        url = str(pg_server.url(name))
        dbs = Databases({"a": url})
        for statement in SCHEMA:
            query(url, statement)
        state = Shared(url, redis_server.url(0))
        yield state
        # each scenario checked its own node and namespace; nothing of any may be left either
        assert not dbs.read()["a"].prepared, "no_in_doubt_residue: left prepared in a"
        client = redis_client(state.redis_url)
        try:
            left = [
                k
                for pattern in (
                    f"rcm-{state.token}-*:lock:*".encode(),
                    f"rcm-{state.token}-*:ws:*".encode(),
                )
                for k in client.scan_iter(match=pattern)
            ]
        finally:
            client.close()
        assert not left, f"no_redis_residue: left {left}"
    finally:
        pg_server.drop_database(name)


@pytest.mark.parametrize("scenario", REDIS_SCENARIOS, ids=[s.id for s in REDIS_SCENARIOS])
def test_redis_crash_point(
    scenario: Scenario, tmp_path: Path, shared: Shared, forks: RedisForkServer, crash_matrix: Any
) -> None:
    setup, account = shared.scenario(tmp_path / "log")
    setup.open_account(account)
    segment = ["--segment-bytes", str(scenario.segment_bytes)] if scenario.segment_bytes else []
    last = ["--last", "a"] if scenario.last else []  # the PostgreSQL branch; b and c prepare
    asynchronous = ["--async-phase-two"] if scenario.asynchronous else []
    common = [*setup.args(), *segment, *last, *asynchronous]

    plan = ["--plan", ",".join(scenario.plan), "--account", str(account)]
    first = forks.run(["run", *common, *plan], scenario.first or scenario.point)
    killed_at(first, scenario.first or scenario.point)
    if scenario.first:
        killed_at(forks.run(["recover", *common], scenario.point), scenario.point)
    report = recovered(forks, common)

    ended, problems = check(
        setup, account, first.stdout, scenario.expect, report, asynchronous=scenario.asynchronous
    )
    if scenario.last:
        problems += decision_rows_left(setup.pg, setup.node)
    crash_matrix.add(
        point=f"pg+redis {scenario.id}",
        expected=scenario.expect,
        outcome=ended,
        resolved=f"{len(report['committed'])} commit, {len(report['rolled_back'])} abort",
        recovery_ms=report["recovery_ms"],
        verdict="ok" if not problems else "FAIL " + ",".join(p.split(":")[0] for p in problems),
    )
    assert not problems, "\n".join(problems)


def test_redis_matrix_covers_every_crash_point() -> None:
    """Every point of the coordinator, of PostgreSQL and of Redis has a scenario here."""
    assert len(REDIS_POINTS) >= 3, REDIS_POINTS  # the scan itself works
    covered = {n for s in REDIS_SCENARIOS for n in names(s)}
    declared = (COORDINATOR_POINTS - LAZY_POINTS) | POSTGRES_POINTS | REDIS_POINTS
    uncovered = [p for p in declared if not any(re.fullmatch(p, n) for n in covered)]
    unknown = [n for n in covered if not any(re.fullmatch(p, n) for p in declared)]
    assert not uncovered, f"crash points with no PostgreSQL + Redis scenario: {uncovered}"
    assert not unknown, f"scenarios naming no declared crash point: {unknown}"
    for resource in REDIS_BRANCHES:  # each Redis branch, not just one of them
        mine = {n for n in covered if n.startswith(f"redis.{resource}.")}
        # b's write set (INCRBY, HSET) never commits in steps: only plain SETs do (c's)
        points = REDIS_POINTS - ({STEP_POINT} if resource == "b" else set())
        assert all(any(re.fullmatch(p, n) for n in mine) for p in points), (resource, mine)


def test_the_redis_checkers_catch_what_they_name(shared: Shared) -> None:
    """A checker that cannot fail proves nothing: leave what each one looks for, see it found."""
    client = redis.Redis.from_url(shared.redis_url)
    ns, gtrid = f"probe-{shared.token}", "n:x-1"
    gid = Xid.branch_of(gtrid, "b").to_gid()
    prefix = twopc_prefix(client, ns)
    lock, staged, record = (prefix + part + gid.encode() for part in (b"lock:", b"ws:", b"tx:"))
    try:
        client.set(lock, gid)
        client.rpush(staged, b"twopc-ws-1")
        client.zadd(prefix + b"prepared", {gid: 1})
        client.hset(record, "state", "prepared")
        client.hset(xfer_key(ns, gtrid), mapping={"account": 1, "amount": 1})
        client.set(ledger_key(ns, "n:x-2"), 1)
        assert no_redis_residue(client, ns) == [
            f"no_redis_residue: lock {lock!r} left",
            f"no_redis_residue: staged set {staged!r} left",
            f"no_redis_residue: prepared set holds {[gid.encode()]}",
            f"no_redis_residue: {record!r} is still prepared",
            "c_atomicity: n:x-2 has one of c's two keys",
        ]
        states = read_redis_state(client, ns, [1])
        assert states["b"].rows == {gtrid: (1, 1)} and states["b"].outcome(gtrid) == COMMITTED
        assert states["b"].prepared == (Prepared(gtrid, gid),)
        assert states["c"].outcome("n:x-2") == COMMITTED
        assert states["c"].outcome(gtrid) == ROLLED_BACK
        client.delete(xfer_key(ns, gtrid))
        assert read_redis_state(client, ns, [1])["b"].outcome(gtrid) == PREPARED
    finally:
        client.delete(*_scan(client, prefix + b"*"), *_scan(client, f"{ns}:*".encode()))
        client.close()


# -- the server crash ------------------------------------------------------------------------------

REDIS_KILLS = [
    pytest.param("tm.before_decision_write", ROLLED_BACK, None, id="before-decision"),
    pytest.param("tm.after_decision_fsync", COMMITTED, None, id="after-decision"),
    # PostgreSQL (a) as the last resource: b and c prepared, then a's commit carries the decision
    pytest.param("tm.llr.before_commit", ROLLED_BACK, "a", id="llr-before-decision"),
    pytest.param("tm.llr.after_commit", COMMITTED, "a", id="llr-after-decision"),
]


@pytest.mark.parametrize(("point", "expect", "last"), REDIS_KILLS)
def test_redis_kill9_keeps_prepared_branches(
    point: str,
    expect: str,
    last: str | None,
    *,
    tmp_path: Path,
    private_redis: Callable[..., Any],
    make_pg_database: Callable[[], str],
    forks: RedisForkServer,
) -> None:
    """``durable_prepare``: prepared Redis branches (b's and c's locks, staged write sets, records
    and prepared entries) outlive ``kill -9`` of ``redis-server`` and of the coordinator, byte for
    byte, from the AOF; then recovery commits them after a decision and rolls them back without
    one (``presumed_abort``). The staged writes stay invisible until the commit."""
    server = private_redis()
    pg = make_pg_database()
    for statement in SCHEMA:
        query(pg, statement)
    setup = Setup(pg, server.url(0), "rkill", "rkill", tmp_path / "log")
    setup.open_account(1)
    common = [*setup.args(), *(["--last", last] if last else [])]

    first = forks.run(["run", *common, "--plan", "2pc,2pc"], f"{point}:2")
    killed_at(first, point)
    gtrid = Transcript.parse(first.stdout).interrupted
    client = redis_client(setup.redis_url)
    before = snapshot(client, setup.namespace)
    client.close()
    assert [k for k in before if b":lock:" in k] and [k for k in before if b":ws:" in k], before
    states, _ = setup.read([1])
    prepared = "bc" if last else "abc"  # a last resource never prepares
    assert [[p.gtrid for p in states[r].prepared] for r in prepared] == [[gtrid]] * len(prepared)
    assert states["b"].balances == {1: OPENING + 1}, "the first transfer only"

    server.kill9()
    server.restart()
    client = redis_client(setup.redis_url)
    assert snapshot(client, setup.namespace) == before, "Redis lost prepared state in its crash"
    client.close()

    report = recovered(forks, common)
    if expect == COMMITTED:
        assert report["committed"] == [gtrid], report
    else:  # a, b and c (or b and c: the last resource's work died with its session)
        assert len(report["rolled_back"]) == len(prepared), report
    ended, problems = check(setup, 1, first.stdout, expect, report)
    assert ended == expect
    assert not problems, "\n".join(problems)


LIVE_KILLS = [
    # before b's prepare script: b cannot vote, the transaction rolls back; b's rollback fails
    # (Redis is down) and is left to recovery, which finds nothing prepared in Redis
    pytest.param("redis.b.after_stage", ROLLED_BACK, False, id="before-redis-prepare"),
    # both branches prepared, no decision yet: the decision is commit, b's commit fails
    pytest.param("tm.after_prepare.2", COMMITTED, False, id="before-decision"),
    # the decision forced, no branch told: a commits, b is left to recovery
    pytest.param("tm.after_decision_fsync", COMMITTED, False, id="after-decision"),
    # a (PostgreSQL) is the last resource: b prepared, then Redis dies before a's commit, which
    # carries the decision all the same; b's commit fails and waits for recovery to read a's row
    pytest.param("tm.llr.before_commit", COMMITTED, True, id="llr-before-decision"),
    pytest.param("tm.llr.after_commit", COMMITTED, True, id="llr-after-decision"),
    pytest.param("redis.b.after_stage", ROLLED_BACK, True, id="llr-before-redis-prepare"),
]
#: with c too, on b's client: b's and c's commits go out in one pipeline (`batch_commit`)
LIVE_BATCH_KILLS = [
    # the pipeline is sent and Redis dies before a reply is read: run alone, each commit fails
    # too, and both are left to recovery (Redis may or may not have applied them before dying)
    pytest.param("redis.b.after_batch_send", COMMITTED, False, True, id="batch-sent"),
    pytest.param("redis.c.after_batch_send", COMMITTED, True, True, id="llr-batch-sent"),
    # Redis dies with the decision forced, before the pipeline: nothing of it can be sent
    pytest.param("tm.after_decision_fsync", COMMITTED, False, True, id="batch-after-decision"),
]


@pytest.mark.parametrize(
    ("point", "expect", "llr", "ledger"),
    [*(pytest.param(*p.values, False, id=p.id) for p in LIVE_KILLS), *LIVE_BATCH_KILLS],
)
def test_live_coordinator_through_a_redis_kill9(
    point: str,
    expect: str,
    llr: bool,
    ledger: bool,
    *,
    tmp_path: Path,
    private_redis: Callable[..., Any],
    make_pg_database: Callable[[], str],
    managers: list[TransactionManager],
) -> None:
    """``availability`` and ``durable_ack``: ``redis-server`` dies by ``kill -9`` at ``point``
    of a live coordinator's commit. The caller is told the truth (rolled back, or committed with
    Redis left to recovery), and once Redis is back from its AOF one recovery pass finishes the
    transaction, the branch ends as the caller was told, and the same coordinator commits again.
    With ``ledger``, c joins on b's client, so phase two pipelines b's and c's commits."""
    server = private_redis()
    pg = make_pg_database()
    for statement in SCHEMA:
        query(pg, statement)
    setup = Setup(pg, server.url(0), "live", "live", tmp_path / "log")
    opening = setup.open_account(1)
    a = PostgresResource(create_engine(pg), "a", last_resource=llr)
    client = redis_client(setup.redis_url)
    b = RedisResource(client, "b", namespace=setup.namespace)
    c = RedisResource(client, "c", namespace=setup.namespace)
    resources = [a, b, c] if ledger else [a, b]
    tm = make_manager(managers, resources, FileDecisionLog(setup.log_dir), node_id=setup.node)

    def transfer() -> tuple[str, Outcome | None]:
        tx = tm.begin()
        move(tx.join(a), tx.gtrid, 1, -1)
        credit(tx.join(b), setup.namespace, tx.gtrid, 1, 1)
        if ledger:
            enter(tx.join(c), setup.namespace, tx.gtrid)
        try:
            return tx.gtrid, tx.commit()
        except TransactionRolledBack:
            return tx.gtrid, None

    def kill(name: str) -> None:
        if name == point and server.running:
            server.kill9()

    crashpoints.observe(kill)
    try:
        with warnings.catch_warnings(record=True):  # CompletionPending, when Redis was left
            gtrid, outcome = transfer()
    finally:
        crashpoints._observers.remove(kill)
    assert not server.running, f"{point} was never reached"
    # the pipeline was sent before the kill: Redis may have answered both commits (each after
    # its AOF fsync) before it died, and then the caller is told committed, which is the truth
    answered = point.endswith("after_batch_send") and outcome == Outcome.COMMITTED
    if expect == COMMITTED:
        assert outcome == Outcome.COMMIT_PENDING or answered, outcome
    else:
        assert outcome is None, outcome
    server.restart()

    report = tm.recover(force=True)
    assert not report.failures and not report.heuristics, report
    # a branch Redis committed before it died is not re-driven: with the file log when the
    # caller was told committed (END written), with a last resource whenever (its decision row is
    # finished only for branches still prepared)
    done_before = (answered or llr) and point.endswith("after_batch_send")
    expected = [gtrid] if expect == COMMITTED else []
    assert report.committed == expected or (done_before and report.committed == []), report
    again, outcome = transfer()
    assert outcome == Outcome.COMMITTED, outcome
    acked, aborted = ([gtrid, again], []) if expect == COMMITTED else ([again], [gtrid])
    both = {g: [r.name for r in resources] for g in acked + aborted}
    transcript = Transcript(dict.fromkeys(both, "2pc"), both, acked, aborted)
    states, residue = setup.read([1])
    pending = [d.gtrid for d in tm.log.pending()]
    _, problems = invariants(states, transcript, None, opening, pending)
    assert not problems + residue, "\n".join(problems + residue)
