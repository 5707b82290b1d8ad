"""Redis round trips that overlap, against a real redis-server: phase two of several branches on
one connection pool in one pipelined round trip (`coordinator.batch_commit`), and the prepare
script in flight while other branches prepare (`coordinator.early_prepare`). Every way either can
fail ends as the plain one-call-at-a-time path would."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.connection import Connection

from coordinator import Outcome, Vote, Xid, crashpoints
from coordinator.batch_commit import batches
from coordinator.transaction import Branch
from resource_managers.postgres import PostgresResource
from resource_managers.redis import BranchConflict, RedisResource
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move
from tests.support.trace import traced


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    left = list(c.scan_iter(match=b"twopc:*:lock:*")) + list(c.scan_iter(match=b"twopc:*:ws:*"))
    assert left == [] and not c.zcard(b"twopc:{twopc}:prepared")
    c.close()


@pytest.fixture
def seen() -> Iterator[list[str]]:
    with traced() as points:
        yield points


class Trips:
    """Counts what the process sends to Redis (a pipeline is one send)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        send = Connection.send_packed_command

        def counting(conn: Connection, command: Any, check_health: bool = True) -> None:
            self.count += 1
            send(conn, command, check_health)

        monkeypatch.setattr(Connection, "send_packed_command", counting)


def prepared(resource: RedisResource, n: int, key: str) -> Xid:
    xid = Xid.branch_of(f"node-1:b-{n}", resource.name)
    resource.start(xid).set(key, f"v{n}")
    assert resource.prepare(xid) == Vote.COMMIT
    return xid


def test_two_branches_on_one_client_commit_in_one_round_trip(
    client: redis.Redis, managers: list, seen: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = RedisResource(client, "a"), RedisResource(client, "b")
    tm = make_manager(managers, [a, b])
    with tm.transaction() as tx:  # warm: durability checked, library loaded
        tx.join(a).set("ka", "0")
        tx.join(b).set("kb", "0")
    trips = Trips(monkeypatch)
    seen.clear()
    with tm.transaction() as tx:
        tx.join(a).set("ka", "1")
        tx.join(b).set("kb", "1")
    assert trips.count == 3  # two prepares (sent before either reply is read), one commit
    assert client.mget("ka", "kb") == [b"1", b"1"]
    assert [p for p in seen if p.startswith("redis.")] == [
        "redis.a.after_stage",
        "redis.a.after_prepare_send",  # both prepares in flight (`early_prepare`)
        "redis.b.after_stage",
        "redis.b.after_prepare_send",
        "redis.a.after_prepare_marker",
        "redis.b.after_prepare_marker",
        "redis.a.after_batch_send",
        "redis.b.after_batch_send",
        "redis.a.after_apply",
        "redis.b.after_apply",
    ]
    assert seen.index("tm.after_commit.1") > seen.index("redis.b.after_apply")


def test_only_branches_on_one_pool_are_batched(redis_url: str, client: redis.Redis) -> None:
    other = redis.Redis.from_url(redis_url)
    a, b, c = RedisResource(client, "a"), RedisResource(client, "b"), RedisResource(other, "c")
    branches = [Branch(r, Xid.branch_of("node-1:g-1", r.name), None) for r in (a, c, b)]
    grouped = batches(branches)
    assert grouped is not None and set(grouped) == {"a", "b"}
    assert [x.resource.name for x in grouped["a"]] == ["a", "b"]
    assert batches(branches[:2]) is None  # a and c: two pools
    other.close()


def test_the_parallel_manager_batches_too(client: redis.Redis, managers: list) -> None:
    a, b = RedisResource(client, "a"), RedisResource(client, "b")
    tm = make_manager(managers, [a, b], parallel=True)
    for _ in range(3):
        with tm.transaction() as tx:
            tx.join(a).incrby("na", 1)
            tx.join(b).incrby("nb", 1)
    assert client.mget("na", "nb") == [b"3", b"3"]


def test_lost_functions_are_loaded_again_one_branch_at_a_time(client: redis.Redis) -> None:
    a, b = RedisResource(client, "a"), RedisResource(client, "b")
    xa, xb = prepared(a, 1, "ka"), prepared(b, 2, "kb")
    client.function_flush()
    client.script_flush()
    assert a.commit_batch([(a, xa), (b, xb)]) == [None, None]
    assert client.mget("ka", "kb") == [b"v1", b"v2"]


def test_a_heuristic_in_a_batch_is_that_branchs_answer(client: redis.Redis) -> None:
    a, b = RedisResource(client, "a"), RedisResource(client, "b")
    xa, xb = prepared(a, 1, "ka"), prepared(b, 2, "kb")
    RedisResource(client, "b").rollback(xb)  # an operator, from another process
    assert a.commit_batch([(a, xa), (b, xb)]) == [None, Outcome.HEURISTIC_ROLLBACK]
    assert client.mget("ka", "kb") == [b"v1", None]


def test_a_repeated_batch_commits_nothing_twice(client: redis.Redis) -> None:
    a, b = RedisResource(client, "a"), RedisResource(client, "b")
    xa, xb = prepared(a, 1, "ka"), prepared(b, 2, "kb")
    assert b.commit(xb) is None  # b committed alone first (recovery, say)
    client.set("kb", "changed")
    assert a.commit_batch([(a, xa), (b, xb)]) == [None, None]
    assert client.mget("ka", "kb") == [b"v1", b"changed"]


def test_a_connection_lost_after_the_send_is_rerun_alone(
    client: redis.Redis, redis_url: str, seen: list[str]
) -> None:
    """The pipeline went out and its connection dies before any reply is read: each branch's
    commit runs again alone, and the committed marker makes the repeat harmless."""
    a, b = RedisResource(client, "a"), RedisResource(client, "b")
    xa, xb = prepared(a, 1, "ka"), prepared(b, 2, "kb")
    killer = redis.Redis.from_url(redis_url)

    def cut(point: str) -> None:
        if point == "redis.a.after_batch_send":
            killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")

    crashpoints.observe(cut)
    try:
        assert a.commit_batch([(a, xa), (b, xb)]) == [None, None]
    finally:
        crashpoints._observers.remove(cut)
        killer.close()
    assert client.mget("ka", "kb") == [b"v1", b"v2"]


def test_a_server_gone_leaves_every_branch_to_recovery(client: redis.Redis) -> None:
    """Nothing can be sent: every answer is an exception (the coordinator leaves those branches
    prepared for recovery), then a commit once the server is back finishes them."""
    a, b = RedisResource(client, "a"), RedisResource(client, "b")
    xa, xb = prepared(a, 1, "ka"), prepared(b, 2, "kb")
    dead = redis.Redis(port=1, retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    da, db = RedisResource(dead, "a"), RedisResource(dead, "b")
    answers = da.commit_batch([(da, xa), (db, xb)])
    assert [type(x).__name__ for x in answers] == ["TransientError", "TransientError"]
    assert (a.recover(), b.recover()) == ([xa], [xb])
    assert a.commit(xa) is None and b.commit(xb) is None
    assert client.mget("ka", "kb") == [b"v1", b"v2"]


# -- the prepare in flight -------------------------------------------------------------------------


def test_the_prepare_script_is_in_flight_while_postgresql_prepares(
    client: redis.Redis, make_pg_database: Callable[[], str], managers: list, seen: list[str]
) -> None:
    engine = ledger_engine(make_pg_database())
    tm = make_manager(managers, [PostgresResource(engine, "pg"), RedisResource(client, "cache")])
    with tm.transaction() as tx:
        move(tx.join(tm.resource("pg")), "t1", 1, -10)
        tx.join(tm.resource("cache")).incrby("balance:2", 10)
    engine.dispose()
    steps = [p for p in seen if p.split(".")[0] in ("redis", "postgres") or "decision" in p]
    assert steps[:5] == [
        "redis.cache.after_stage",
        "redis.cache.after_prepare_send",
        "postgres.pg.after_prepare",
        "redis.cache.after_prepare_marker",
        "tm.before_decision_write",
    ]
    assert client.get("balance:2") == b"10"


def in_flight(resource: RedisResource, n: int, key: str, value: str) -> Callable[[], Vote]:
    xid = Xid.branch_of(f"node-1:f-{n}", resource.name)
    resource.start(xid).set(key, value)
    return resource.send_prepare(xid)


def test_a_locked_key_in_flight_waits_as_prepare_does(client: redis.Redis) -> None:
    patient = RedisResource(client, "cache", lock_wait=5)
    first = prepared(patient, 1, "k")
    finish = in_flight(patient, 2, "k", "second")  # LOCKED comes back: wait, as prepare does
    threading.Timer(0.1, patient.commit, [first]).start()
    assert finish() == Vote.COMMIT
    patient.commit(Xid.branch_of("node-1:f-2", "cache"))
    assert client.get("k") == b"second"


def test_lost_functions_in_flight_are_loaded_again(client: redis.Redis) -> None:
    cache = RedisResource(client, "cache")
    prepared_one = prepared(cache, 1, "k1")  # the library is loaded
    client.function_flush()
    client.script_flush()
    assert in_flight(cache, 2, "k2", "v")() == Vote.COMMIT
    cache.commit(prepared_one)
    cache.commit(Xid.branch_of("node-1:f-2", "cache"))
    assert client.mget("k1", "k2") == [b"v1", b"v"]


def test_a_refusal_in_flight_votes_no(client: redis.Redis) -> None:
    cache = RedisResource(client, "cache")
    xid = Xid.branch_of("node-1:f-1", "cache")
    branch = cache.start(xid)
    branch.watch("w")
    branch.set("k", "v")
    client.set("w", "changed")
    finish = cache.send_prepare(xid)
    started = time.monotonic()
    with pytest.raises(BranchConflict, match="changed"):
        finish()
    assert time.monotonic() - started < 1
    cache.rollback(xid)
    assert client.get("k") is None
