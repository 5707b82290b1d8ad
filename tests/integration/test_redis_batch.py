"""Phase two of several Redis branches on one connection pool in one pipelined round trip
(`coordinator.batch_commit`), against a real redis-server: the batch is taken, what it costs in
round trips, and every way a pipelined commit can fail ends as individual commits would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.connection import Connection

from coordinator import Outcome, Vote, Xid, crashpoints
from coordinator.batch_commit import batches
from coordinator.transaction import Branch
from resource_managers.redis import RedisResource
from tests.support.managers import make_manager


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    left = list(c.scan_iter(match=b"twopc:*:lock:*")) + list(c.scan_iter(match=b"twopc:*:ws:*"))
    assert left == [] and not c.zcard(b"twopc:{twopc}:prepared")
    c.close()


@pytest.fixture
def seen() -> Iterator[list[str]]:
    points: list[str] = []
    crashpoints.observe(points.append)
    yield points
    crashpoints._observers.remove(points.append)


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
    assert trips.count == 3  # two prepares, one pipelined commit
    assert client.mget("ka", "kb") == [b"1", b"1"]
    assert [p for p in seen if p.startswith("redis.")] == [
        "redis.a.after_stage",
        "redis.a.after_prepare_marker",
        "redis.b.after_stage",
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
    da = RedisResource(dead, "a")
    da._staged[xa] = a._staged.pop(xa)
    db = RedisResource(dead, "b")
    db._staged[xb] = b._staged.pop(xb)
    answers = da.commit_batch([(da, xa), (db, xb)])
    assert [type(x).__name__ for x in answers] == ["TransientError", "TransientError"]
    assert (a.recover(), b.recover()) == ([xa], [xb])
    assert a.commit(xa) is None and b.commit(xb) is None
    assert client.mget("ka", "kb") == [b"v1", b"v2"]
