"""RedisResource against a real redis-server: every command through every protocol path,
read-your-writes, watches, locks, awkward bytes, heuristics, recovery (also after ``kill -9`` of
the server), a transaction across PostgreSQL and Redis, a real three-node cluster, and a
randomized differential test that holds a branch's answers and commits to Redis's own.

Every test ends with nothing of twopc left behind but markers and tombstones, which expire: no
lock keys, no staged write sets, an empty prepared set (the ``client`` fixture checks)."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from coordinator import (
    ConfigurationError,
    FileDecisionLog,
    HeuristicError,
    Outcome,
    ProgrammingError,
    TransactionRolledBack,
    TransientError,
    Vote,
    Xid,
    crashpoints,
)
from coordinator.decision_log import Decision
from resource_managers.postgres import PostgresResource
from resource_managers.redis import BranchConflict, BranchFailed, RedisBranch, RedisResource
from resource_managers.redis._writeset import Op, pack
from tests.support.flaky_resource import FlakyResource
from tests.support.managers import make_manager
from tests.support.pg import ledger_engine, move, prepared_gids, total

AWKWARD = [
    b"plain",
    b"with 'single' and \"double\" quotes",
    b"line\nbreak\r\n",
    b"nul\x00inside",
    bytes(range(256)),
    b"]] redis.call('FLUSHALL') --",
    b"'); redis.call('FLUSHALL'); --",
    b"",
]


def leftovers(client: redis.Redis) -> list[bytes]:
    """What a finished branch must never leave: locks, staged write sets, prepared entries."""
    found = [k for k in client.scan_iter(match=b"*:lock:*")] + list(client.scan_iter(b"*:ws:*"))
    for key in client.scan_iter(match=b"*:prepared"):
        found += [key] if client.zcard(key) else []
    return found


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    assert leftovers(c) == []
    c.close()


@pytest.fixture
def cache(client: redis.Redis) -> RedisResource:
    return RedisResource(client, "cache", lock_wait=0.2)


def xid(n: int, bqual: str = "cache") -> Xid:
    return Xid.branch_of(f"node-1:t-{n}", bqual)


def seed(client: redis.Redis) -> None:
    client.set("n", 10)
    client.set("gone", "x")
    client.hset("h", mapping={"a": "1"})
    client.sadd("s", "x")
    client.zadd("z", {"m": 1})
    client.rpush("l", "a")
    client.xadd("x", {"f": "0"}, id="1-1")


def every_command(b: RedisBranch) -> dict[str, Any]:
    """One of each command; returns what each call answered."""
    return {
        "set": b.set("str", b"v", ex=100),
        "set_nx": b.set("fresh", "v", nx=True),
        "set_xx_absent": b.set("absent", "v", xx=True),
        "incrby": b.incrby("n", 5),
        "decrby": b.decrby("n", 2),
        "delete": b.delete("gone", "never"),
        "expire": b.expire("h", 1000),
        "hset": b.hset("h", "b", "2", mapping={"c": "3"}),
        "hdel": b.hdel("h", "a", "zz"),
        "hincrby": b.hincrby("h", "n", 7),
        "sadd": b.sadd("s", "y", "x"),
        "srem": b.srem("s", "x"),
        "zadd": b.zadd("z", {"m": 5, "k": 1}),
        "zrem": b.zrem("z", "k"),
        "zincrby": b.zincrby("z", 2, "m"),
        "lpush": b.lpush("l", "b"),
        "rpush": b.rpush("l", "c", "d"),
        "xadd": b.xadd("x", {"f": "1"}),
        "xadd_id": b.xadd("x2", {"g": "v"}, id="5-1"),
    }


EXPECTED_ANSWERS = {
    "set": True,
    "set_nx": True,
    "set_xx_absent": None,
    "incrby": 15,
    "decrby": 13,
    "delete": 1,
    "expire": True,
    "hset": 2,
    "hdel": 1,
    "hincrby": 7,
    "sadd": 1,
    "srem": 1,
    "zadd": 1,
    "zrem": 1,
    "zincrby": 7.0,
    "lpush": 2,
    "rpush": 4,
    "xadd": None,
    "xadd_id": None,
}


def state_after_every_command(client: redis.Redis) -> dict[str, Any]:
    return {
        "str": client.get("str"),
        "fresh": client.get("fresh"),
        "absent": client.exists("absent"),
        "n": client.get("n"),
        "gone": client.exists("gone"),
        "h": client.hgetall("h"),
        "h_ttl": client.ttl("h") > 900,
        "str_ttl": 90 < client.ttl("str") <= 100,
        "s": client.smembers("s"),
        "z": client.zrange("z", 0, -1, withscores=True),
        "l": client.lrange("l", 0, -1),
        "x": [fields for _, fields in client.xrange("x")],
        "x2": client.xrange("x2"),
    }


COMMITTED = {
    "str": b"v",
    "fresh": b"v",
    "absent": 0,
    "n": b"13",
    "gone": 0,
    "h": {b"b": b"2", b"c": b"3", b"n": b"7"},
    "h_ttl": True,
    "str_ttl": True,
    "s": {b"y"},
    "z": [(b"m", 7.0)],
    "l": [b"b", b"a", b"c", b"d"],
    "x": [{b"f": b"0"}, {b"f": b"1"}],
    "x2": [(b"5-1", {b"g": b"v"})],
}


# -- every command through every path --------------------------------------------------------------


@pytest.mark.parametrize("path", ["two-phase", "one-phase", "rollback"])
def test_every_command(client: redis.Redis, cache: RedisResource, path: str) -> None:
    seed(client)
    before = state_after_every_command(client)
    branch = cache.start(xid(1))
    assert every_command(branch) == EXPECTED_ANSWERS
    assert state_after_every_command(client) == before  # buffered: nothing visible yet
    if path == "two-phase":
        assert cache.prepare(xid(1)) == Vote.COMMIT
        assert cache.commit(xid(1)) is None
    elif path == "one-phase":
        assert cache.commit(xid(1), one_phase=True) is None
    else:
        assert cache.rollback(xid(1)) is None
    assert state_after_every_command(client) == (before if path == "rollback" else COMMITTED)


def test_every_command_through_recovery_with_a_decision(
    client: redis.Redis, cache: RedisResource, tmp_path: Path, managers: list
) -> None:
    """Prepared by a process that died; a new manager finds the decision and commits."""
    seed(client)
    every_command(cache.start(xid(1)))
    assert cache.prepare(xid(1)) == Vote.COMMIT
    with FileDecisionLog(tmp_path / "log") as log:
        log.log_commit(Decision(xid(1).gtrid, ("cache",)))
    fresh = RedisResource(client, "cache")  # the new process knows nothing of the branch
    tm = make_manager(managers, [fresh], FileDecisionLog(tmp_path / "log"))
    assert state_after_every_command(client) == COMMITTED
    assert tm.log.pending() == []


def test_recovery_presumes_abort_without_a_decision(
    client: redis.Redis, cache: RedisResource, tmp_path: Path, managers: list
) -> None:
    seed(client)
    before = state_after_every_command(client)
    every_command(cache.start(xid(1)))
    cache.prepare(xid(1))
    assert cache.recover() == [xid(1)]
    make_manager(managers, [RedisResource(client, "cache")], FileDecisionLog(tmp_path / "log"))
    assert state_after_every_command(client) == before
    assert client.hget(b"twopc:{twopc}:tx:" + xid(1).to_gid().encode(), "state") == b"aborted"


def test_through_the_transaction_manager_one_phase_and_two_phase(
    client: redis.Redis, managers: list
) -> None:
    a, b = RedisResource(client, "a"), RedisResource(client, "b")
    tm = make_manager(managers, [a, b])
    with tm.transaction() as tx:
        tx.join(a).incrby("balance:1", 10)
    with tm.transaction() as tx:
        tx.join(a).decrby("balance:1", 4)
        tx.join(b).incrby("balance:2", 4)
    with pytest.raises(RuntimeError), tm.transaction() as tx:
        tx.join(a).decrby("balance:1", 100)
        raise RuntimeError("changed my mind")
    assert client.mget("balance:1", "balance:2") == [b"6", b"4"]
    assert tm.metrics.as_dict()["one_phase"] == 1


# -- read-your-writes ------------------------------------------------------------------------------


def test_reads_see_the_branchs_own_writes(client: redis.Redis, cache: RedisResource) -> None:
    client.set("k", 5)
    client.hset("h", mapping={"a": "1", "b": "2"})
    client.sadd("s", "x")
    b = cache.start(xid(1))
    assert b.get("k") == b"5"
    b.incrby("k", 2)
    assert b.get("k") == b"7"
    b.set("k", "text")
    assert b.get("k") == b"text"
    b.delete("k")
    assert b.get("k") is None
    b.incrby("k", 3)
    assert b.get("k") == b"3"
    assert (b.hget("h", "a"), b.hget("h", "b")) == (b"1", b"2")
    b.hset("h", "a", "new")
    b.hdel("h", "b")
    b.hincrby("h", "c", 4)
    assert (b.hget("h", "a"), b.hget("h", "b"), b.hget("h", "c")) == (b"new", None, b"4")
    b.delete("h")
    assert b.hget("h", "a") is None
    assert b.sismember("s", "x") == 1
    b.srem("s", "x")
    b.sadd("s", "y")
    assert (b.sismember("s", "x"), b.sismember("s", "y")) == (0, 1)
    b.delete("s")
    assert b.sismember("s", "y") == 0
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        b.hget("k", "f")  # the branch made "k" a string
    assert client.get("k") == b"5"  # and the server still has the old value
    cache.rollback(xid(1))


def test_blind_writes_neither_read_nor_watch(client: redis.Redis) -> None:
    blind = RedisResource(client, "cache", blind_writes=True)
    client.set("k", 1)
    b = blind.start(xid(1))
    assert b.incrby("k", 1) is None and b.sadd("s", "a") is None and b.set("x", 1) is True
    assert b.get("k") == b"2"  # a read still sees the overlay
    client.set("k", 10)  # a concurrent change is fine: the increment is relative
    assert blind.prepare(xid(1)) == Vote.COMMIT
    blind.commit(xid(1))
    assert client.get("k") == b"11"


def test_a_blind_mset_buffers_what_one_set_per_key_would(client: redis.Redis) -> None:
    """The Spark writer stages a chunk with one ``mset``, which a blind branch buffers in one
    step: the ops, the overlay and the committed values are those of a SET per key."""
    blind = RedisResource(client, "cache", blind_writes=True)
    one_by_one = blind.start(xid(1))
    for name, value in (("a", "1"), ("b", 2), ("a", "3")):
        one_by_one.set(name, value)
    blind.rollback(xid(1))
    b = blind.start(xid(2))
    assert b.mset({"a": "1", "b": 2}) is True and b.mset({"a": "3"}) is True
    assert b.ops == one_by_one.ops
    assert (b.get("a"), b.get("b")) == (b"3", b"2")
    assert blind.prepare(xid(2)) == Vote.COMMIT
    blind.commit(xid(2))
    assert (client.get("a"), client.get("b")) == (b"3", b"2")
    with pytest.raises(ProgrammingError):
        blind.start(xid(3)).mset({"c": True})  # checked before anything is buffered
    blind.rollback(xid(3))


@pytest.mark.parametrize("count", [1, 2, 3, 999, 1000, 1001, 2500])
@pytest.mark.parametrize("path", ["two-phase", "one-phase"])
def test_a_write_set_of_plain_sets_lands_every_last_value(
    client: redis.Redis, count: int, path: str
) -> None:
    """A write set of nothing but ``SET key value`` (a Spark partition's) skips the simulation
    and the op tables in the scripts and is applied as MSETs of 1,000 pairs: every key ends
    with its last value whatever type it held, across the 8-field decode and the MSET chunk
    boundaries. Two-phase: committed by another resource, which knows nothing of the branch."""
    blind = RedisResource(client, "cache", blind_writes=True)
    client.hset("k0", "f", "a hash a SET replaces")
    client.rpush("k1", "a list a SET replaces")
    distinct = max(1, count * 2 // 3)  # a third of the keys are written twice
    b = blind.start(xid(1))
    expected: dict[bytes, bytes] = {}
    for i in range(count):
        key, value = f"k{i % distinct}", f"v{i}" + "x" * (i % 7)
        b.set(key, value)
        expected[key.encode()] = value.encode()
    if path == "one-phase":
        assert blind.commit(xid(1), one_phase=True) is None
    else:
        assert blind.prepare(xid(1)) == Vote.COMMIT
        assert RedisResource(client, "cache").commit(xid(1)) is None
    keys = list(expected)
    assert dict(zip(keys, client.mget(keys), strict=True)) == expected


def _steps(seen: list[str], name: str = "cache") -> int:
    return seen.count(f"redis.{name}.after_commit_step")


@pytest.fixture
def seen() -> Iterator[list[str]]:
    points: list[str] = []
    crashpoints.observe(points.append)
    yield points
    crashpoints._observers.remove(points.append)


@pytest.mark.parametrize("chunk", [1, 4, 7, 25, 26])
def test_a_large_branch_commits_in_bounded_steps(
    client: redis.Redis, seen: list[str], chunk: int
) -> None:
    """``commit_chunk``: more plain SETs than that are applied ``chunk`` at a time, then the
    locks released ``chunk`` at a time, one call each; the end state is the one-call commit's."""
    blind = RedisResource(client, "cache", blind_writes=True)
    b = blind.start(xid(1))
    expected: dict[bytes, bytes] = {}
    for i in range(25):
        key, value = f"k{i % 17}", f"v{i}"  # eight keys written twice: the later value wins
        b.set(key, value)
        expected[key.encode()] = value.encode()
    assert blind.prepare(xid(1)) == Vote.COMMIT
    driver = RedisResource(client, "cache", commit_chunk=chunk)
    assert driver.commit(xid(1)) is None
    keys = list(expected)
    assert dict(zip(keys, client.mget(keys), strict=True)) == expected
    steps = -(-25 // chunk) + -(-17 // chunk) - 2  # the last SETs' call releases locks too
    assert _steps(seen) == steps
    assert client.hget(driver._tx(xid(1).to_gid()), "state") == b"committed"
    assert driver.commit(xid(1)) is None  # a repeat finds the marker


@pytest.mark.parametrize("finisher", ["commit", "rollback"])
def test_a_commit_interrupted_between_steps_is_finished_by_the_next_and_never_undone(
    client: redis.Redis, seen: list[str], finisher: str
) -> None:
    blind = RedisResource(client, "cache", blind_writes=True)
    b = blind.start(xid(1))
    b.mset({f"k{i}": f"v{i}" for i in range(10)})
    assert blind.prepare(xid(1)) == Vote.COMMIT

    def stop(point: str) -> None:
        if point == "redis.cache.after_commit_step" and _steps(seen) == 2:
            raise RuntimeError("the process dies here")

    crashpoints.observe(stop)
    try:
        with pytest.raises(RuntimeError):
            RedisResource(client, "cache", commit_chunk=3).commit(xid(1))
    finally:
        crashpoints._observers.remove(stop)
    gid = xid(1).to_gid()
    other = RedisResource(client, "cache")
    assert client.hget(other._tx(gid), "state") == b"committing"
    assert client.mget("k0", "k5", "k6") == [b"v0", b"v5", None]  # two steps of three applied
    assert other.recover() == [xid(1)]
    other.forget(xid(1))  # refused: the record stays until the commit is done
    assert client.hget(other._tx(gid), "state") == b"committing"
    if finisher == "commit":
        assert other.commit(xid(1)) is None  # no bound here: the rest at once
    else:  # only a COMMIT decision starts a commit: a rollback finishes it, never undoes it
        assert other.rollback(xid(1)) == Outcome.HEURISTIC_COMMIT
    assert client.mget([f"k{i}" for i in range(10)]) == [f"v{i}".encode() for i in range(10)]
    assert other.recover() == []


def test_a_bound_applies_only_to_plain_sets_prepared_by_this_version(
    client: redis.Redis, seen: list[str]
) -> None:
    """Other commands are checked and applied in one call whatever the bound (the simulation
    needs the whole set); so is a branch whose record does not say it is plain SETs (prepared
    before the record said so)."""
    blind = RedisResource(client, "cache", blind_writes=True)
    b = blind.start(xid(1))
    for i in range(6):
        b.incrby(f"n{i}", i)
    old = blind.start(xid(2))
    old.mset({f"o{i}": i for i in range(6)})
    assert blind.prepare(xid(1)) == Vote.COMMIT and blind.prepare(xid(2)) == Vote.COMMIT
    client.hdel(blind._tx(xid(2).to_gid()), "plain")
    driver = RedisResource(client, "cache", commit_chunk=2)
    assert driver.commit(xid(1)) is None and driver.commit(xid(2)) is None
    assert _steps(seen) == 0
    assert client.mget("n5", "o5") == [b"5", b"5"]


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "10"])
def test_a_commit_chunk_that_is_not_a_count_is_refused(client: redis.Redis, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="commit_chunk"):
        RedisResource(client, "cache", commit_chunk=bad)


def test_one_op_that_is_not_a_plain_set_validates_the_whole_set(client: redis.Redis) -> None:
    """The fast path takes plain SETs only: a single SET NX among them sends the set through
    the simulation, which still catches what would fail and still honours NX."""
    blind = RedisResource(client, "cache", blind_writes=True)
    client.set("taken", "old")
    b = blind.start(xid(1))
    b.mset({f"k{i}": i for i in range(50)})
    b.set("taken", "new", nx=True)
    b.mset({"last": "x"})
    assert blind.prepare(xid(1)) == Vote.COMMIT
    assert RedisResource(client, "cache").commit(xid(1)) is None
    assert (client.get("taken"), client.get("k49"), client.get("last")) == (b"old", b"49", b"x")
    b = blind.start(xid(2))
    b.mset({f"k{i}": i for i in range(50)})
    b.incrby("last", 1)  # not a number: found by the simulation, nothing written
    with pytest.raises(BranchFailed, match="not an integer"):
        blind.prepare(xid(2))
    blind.rollback(xid(2))
    assert client.get("k0") == b"0"


def test_a_wrong_write_is_refused_at_the_call_when_the_server_shows_it(
    client: redis.Redis, cache: RedisResource
) -> None:
    client.hset("h", "f", "not a number")
    client.set("big", 2**63 - 2)
    b = cache.start(xid(1))
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        b.incrby("h", 1)
    with pytest.raises(ResponseError, match="not an integer"):
        b.hincrby("h", "f", 1)
    with pytest.raises(ResponseError, match="overflow"):
        b.incrby("big", 10)
    assert b.ops == []  # refused calls buffer nothing
    cache.rollback(xid(1))


# -- validation at prepare and commit --------------------------------------------------------------


def test_an_invalid_write_set_votes_no_before_anything_is_written(client: redis.Redis) -> None:
    blind = RedisResource(client, "cache", blind_writes=True)
    client.hset("h", "f", "1")
    b = blind.start(xid(1))
    b.set("first", "written?")
    b.incrby("h", 1)  # blind: not checked at the call
    with pytest.raises(BranchFailed, match=r"key b'h'.*WRONGTYPE"):
        blind.prepare(xid(1))
    blind.rollback(xid(1))
    assert client.exists("first") == 0


def test_type_changes_inside_the_write_set_are_simulated(client: redis.Redis) -> None:
    """SET makes a string, DEL makes nothing: what would fail only in order is caught."""
    blind = RedisResource(client, "cache", blind_writes=True)
    client.hset("h", "f", "1")
    ok = blind.start(xid(1))
    ok.delete("h")
    ok.incrby("h", 2)  # valid: the key is gone by then
    ok.set("s", "12")
    ok.incrby("s", 1)
    assert blind.prepare(xid(1)) == Vote.COMMIT
    blind.commit(xid(1))
    assert client.mget("h", "s") == [b"2", b"13"]
    bad = blind.start(xid(2))
    bad.set("s", "abc")
    bad.incrby("s", 1)
    with pytest.raises(BranchFailed, match="not an integer"):
        blind.prepare(xid(2))
    blind.rollback(xid(2))


def test_a_key_broken_outside_twopc_before_commit_applies_nothing(
    client: redis.Redis, cache: RedisResource
) -> None:
    """Locks are cooperative: a plain client can make a staged INCRBY impossible."""
    client.set("n", 1)
    b = cache.start(xid(1))
    b.set("other", "v")
    b.incrby("n", 1)
    cache.prepare(xid(1))
    client.set("n", "not a number")  # bypasses the lock
    assert cache.commit(xid(1)) == Outcome.HEURISTIC_ROLLBACK
    assert client.exists("other") == 0 and client.get("n") == b"not a number"
    assert cache.commit(xid(1)) == Outcome.HEURISTIC_ROLLBACK  # and stays so


# -- watches and locks -----------------------------------------------------------------------------


def test_a_watched_key_changed_by_anyone_votes_no(
    client: redis.Redis, cache: RedisResource
) -> None:
    client.set("k", 1)
    b = cache.start(xid(1))
    b.watch("k")
    b.set("copy", b.get("k"))
    client.set("k", 2)
    with pytest.raises(BranchConflict, match="watched key b'k' changed"):
        cache.prepare(xid(1))
    cache.rollback(xid(1))
    assert client.exists("copy") == 0


def test_a_server_dependent_answer_watches_the_key(
    client: redis.Redis, cache: RedisResource
) -> None:
    client.set("k", 1)
    b = cache.start(xid(1))
    assert b.incrby("k", 1) == 2
    client.set("k", 5)
    with pytest.raises(BranchConflict, match="changed"):
        cache.prepare(xid(1))
    cache.rollback(xid(1))


def test_a_read_only_branch_checks_its_watches(client: redis.Redis, cache: RedisResource) -> None:
    b = cache.start(xid(1))
    b.watch("k")
    assert b.get("k") is None
    assert cache.prepare(xid(1)) == Vote.READ_ONLY
    b2 = cache.start(xid(2))
    b2.watch("k")
    client.set("k", 1)
    with pytest.raises(BranchConflict):
        cache.prepare(xid(2))
    cache.rollback(xid(2))
    assert cache.rollback(xid(1)) is None  # unknown by now: leaves only a tombstone


def test_a_locked_key_makes_the_second_branch_wait_then_vote_no(
    client: redis.Redis, cache: RedisResource
) -> None:
    first = cache.start(xid(1))
    first.set("k", "first")
    cache.prepare(xid(1))
    second = cache.start(xid(2))
    second.set("k", "second")
    started = time.monotonic()
    with pytest.raises(BranchConflict, match=r"key b'k' is locked by branch node-1:t-1"):
        cache.prepare(xid(2))
    assert time.monotonic() - started >= 0.2
    cache.rollback(xid(2))
    with pytest.raises(BranchConflict, match="locked"):  # one phase waits and refuses alike
        third = cache.start(xid(3))
        third.set("k", "third")
        cache.commit(xid(3), one_phase=True)
    cache.rollback(xid(3))
    cache.commit(xid(1))
    assert client.get("k") == b"first"


def test_a_lock_released_within_lock_wait_lets_the_second_branch_prepare(
    client: redis.Redis,
) -> None:
    patient = RedisResource(client, "cache", lock_wait=5)
    first = patient.start(xid(1))
    first.set("k", "first")
    patient.prepare(xid(1))
    second = patient.start(xid(2))
    second.set("k", "second")
    votes: list[Vote] = []
    waiter = threading.Thread(target=lambda: votes.append(patient.prepare(xid(2))))
    waiter.start()
    time.sleep(0.1)
    patient.commit(xid(1))
    waiter.join(5)
    assert votes == [Vote.COMMIT]
    patient.commit(xid(2))
    assert client.get("k") == b"second"


# -- bytes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["two-phase", "one-phase", "recovery"])
def test_awkward_keys_and_values_round_trip(
    client: redis.Redis, cache: RedisResource, path: str
) -> None:
    client.set("sentinel", "still here")
    b = cache.start(xid(1))
    for i, text in enumerate(AWKWARD):
        b.set(text + b"#s", text)
        b.hset(b"hash", text, text)
        b.sadd(b"set", text)
        b.rpush(b"list", text)
        b.zadd(b"zset", {text: i})
        assert b.get(text + b"#s") == text and b.hget(b"hash", text) == text
    if path == "one-phase":
        cache.commit(xid(1), one_phase=True)
    else:
        cache.prepare(xid(1))
        resource = RedisResource(client, "cache") if path == "recovery" else cache
        assert resource.recover() == [xid(1)]
        resource.commit(xid(1))
    assert [client.get(t + b"#s") for t in AWKWARD] == AWKWARD
    assert client.hgetall(b"hash") == {t: t for t in AWKWARD}
    assert client.smembers(b"set") == set(AWKWARD)
    assert client.lrange(b"list", 0, -1) == AWKWARD
    assert client.zrange(b"zset", 0, -1) == AWKWARD
    assert client.get("sentinel") == b"still here"  # no FLUSHALL ran


def test_a_client_that_decodes_responses(redis_url: str, client: redis.Redis) -> None:
    text_client = redis.Redis.from_url(redis_url, decode_responses=True)
    cache = RedisResource(text_client, "cache")
    client.set("k", "grüße")
    b = cache.start(xid(1))
    assert b.get("k") == "grüße"
    b.set("k", b"\xff binary \x00")  # the staged list and replies stay bytes inside
    b.hset("h", "f", "v")
    assert b.hget("h", "f") == "v"
    cache.prepare(xid(1))
    cache.commit(xid(1))
    assert client.get("k") == b"\xff binary \x00"
    text_client.close()


# -- idempotence, tombstones, heuristics -----------------------------------------------------------


def prepared(cache: RedisResource, n: int, key: str = "k") -> Xid:
    branch = xid(n, cache.name)
    cache.start(branch).set(key, f"v{n}")
    assert cache.prepare(branch) == Vote.COMMIT
    return branch


def test_commit_and_rollback_are_idempotent(client: redis.Redis, cache: RedisResource) -> None:
    one = prepared(cache, 1)
    assert cache.commit(one) is None
    assert cache.commit(one) is None
    assert RedisResource(client, "cache").commit(one) is None  # another process, same answer
    two = prepared(cache, 2)
    assert cache.rollback(two) is None
    assert cache.rollback(two) is None
    assert client.get("k") == b"v1"
    assert cache.rollback(one) == Outcome.HEURISTIC_COMMIT
    assert cache.commit(two) == Outcome.HEURISTIC_ROLLBACK
    cache.forget(one)
    assert client.exists(b"twopc:{twopc}:tx:" + one.to_gid().encode()) == 0
    assert cache.commit(one) == Outcome.HEURISTIC_HAZARD  # no record left: cannot know


def test_the_aborted_tombstone_refuses_a_late_prepare(
    client: redis.Redis, cache: RedisResource
) -> None:
    """Recovery (another process) rolled the branch back while its owner was still working."""
    b = cache.start(xid(1))
    b.set("k", "late")
    assert RedisResource(client, "cache").rollback(xid(1)) is None
    with pytest.raises(BranchFailed, match="already aborted"):
        cache.prepare(xid(1))
    cache.rollback(xid(1))
    assert client.exists("k") == 0


def test_a_rolled_back_branch_reported_at_commit_is_a_heuristic(
    client: redis.Redis, managers: list
) -> None:
    a = RedisResource(client, "a")
    b = RedisResource(client, "b")

    def operator_rolls_back(x: Xid) -> None:
        RedisResource(client, "b").rollback(x)

    flaky_b = FlakyResource(b, before={"commit": operator_rolls_back})
    tm = make_manager(managers, [a, flaky_b])
    with pytest.raises(HeuristicError) as raised, tm.transaction() as tx:
        tx.join(a).set("ka", "1")
        tx.join(flaky_b).set("kb", "1")
    assert "heuristic" in str(raised.value)
    [record] = tm.heuristics()
    assert (record.branch, record.outcome) == ("b", Outcome.HEURISTIC_ROLLBACK.value)
    assert client.mget("ka", "kb") == [b"1", None]


def test_unknown_branches_roll_back_to_a_tombstone(
    client: redis.Redis, cache: RedisResource
) -> None:
    assert cache.rollback(xid(9)) is None
    gid = xid(9).to_gid().encode()
    assert client.hget(b"twopc:{twopc}:tx:" + gid, "state") == b"aborted"
    assert 0 < client.ttl(b"twopc:{twopc}:tx:" + gid) <= cache.tombstone_ttl


def test_recover_lists_only_our_branches(client: redis.Redis, cache: RedisResource) -> None:
    ours = prepared(cache, 1)
    other = RedisResource(client, "other")
    theirs = prepared(other, 2, key="k2")
    client.zadd(b"twopc:{twopc}:prepared", {b"not-a-gid": 1, b"\xff\x00": 2})
    assert cache.recover() == [ours]
    client.zrem(b"twopc:{twopc}:prepared", b"not-a-gid", b"\xff\x00")
    cache.rollback(ours)
    other.rollback(theirs)


def test_scripts_flushed_between_calls_are_loaded_again(
    client: redis.Redis, cache: RedisResource
) -> None:
    one = prepared(cache, 1)
    client.script_flush()
    assert cache.commit(one) is None
    client.script_flush()
    b = cache.start(xid(2))
    b.incrby("n", 1)
    cache.commit(xid(2), one_phase=True)
    assert client.mget("k", "n") == [b"v1", b"1"]


def _functions_supported(client: redis.Redis) -> bool:
    return int(str(client.info("server")["redis_version"]).split(".")[0]) >= 7


def test_functions_flushed_between_calls_are_loaded_again(
    client: redis.Redis, cache: RedisResource
) -> None:
    if not _functions_supported(client):
        pytest.skip("Redis < 7.0 has no functions; the scripts test covers it")
    one = prepared(cache, 1)
    assert cache._scripts.functions is True
    client.function_flush()
    assert cache.commit(one) is None
    client.function_flush()
    b = cache.start(xid(2))
    b.incrby("n", 1)
    cache.commit(xid(2), one_phase=True)
    assert client.mget("k", "n") == [b"v1", b"1"]
    assert client.info("commandstats").get("cmdstat_evalsha") is None  # never fell back


def test_a_server_refusing_functions_runs_scripts(redis_url: str, client: redis.Redis) -> None:
    """An ACL that denies FUNCTION (as an older server does): EVALSHA, with its own fallback."""
    if not _functions_supported(client):
        pytest.skip("Redis < 7.0: every test runs the scripts")
    client.acl_setuser(
        "twopc-nofn", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
        commands=["+@all", "-function"],
    )  # fmt: skip
    limited = redis.Redis.from_url(redis_url, username="twopc-nofn", password="pw")
    try:
        cache = RedisResource(limited, "cache")
        one = prepared(cache, 1)
        assert cache._scripts.functions is False
        client.script_flush()
        assert cache.commit(one) is None
        client.script_flush()
        b = cache.start(xid(2))
        b.incrby("n", 1)
        cache.commit(xid(2), one_phase=True)
        assert client.mget("k", "n") == [b"v1", b"1"]
    finally:
        limited.close()
        client.acl_deluser("twopc-nofn")


@pytest.mark.parametrize("functions", [True, False], ids=["functions", "scripts"])
def test_a_malformed_packed_write_set_is_refused_before_any_write(
    client: redis.Redis, functions: bool
) -> None:
    cache = RedisResource(client, "cache")
    if not functions:
        cache._scripts._functions = False
    elif not _functions_supported(client):
        pytest.skip("Redis < 7.0 has no functions")
    gid = xid(1).to_gid()
    keys = [cache._tx(gid), cache._ws(gid), cache._prepared, *cache._locks([b"k"]), b"k"]
    head: list[Any] = [gid, cache.prefix, 1, 0]
    good = b"\x03\x00\x00\x00SET\x01\x00\x00\x00k\x01\x00\x00\x001\x01\x00\x00\x00v"
    ops = [Op("SET", b"k", (b"v",)), Op("SET", b"k", (b"w",)), Op("DEL", b"k")]
    three, whole = pack(ops), {len(pack(ops[:1])), len(pack(ops[:2]))}  # cut there: valid
    cuts = [three[:end] for end in range(1, len(three)) if end not in whole]
    for packed in [good[:-1], good[:2], [good, b"extra"], *cuts]:
        args = [*head, *packed] if isinstance(packed, list) else [*head, packed]
        reply = cache._scripts.run("prepare", keys, args)
        assert reply[0] == b"BAD", reply
    assert client.keys("*") == []  # nothing written, not even a lock
    assert cache._scripts.run("prepare", keys, [*head, good]) == [b"OK"]
    assert cache.commit(xid(1)) is None and client.get("k") == b"v"


@pytest.mark.parametrize("functions", [True, False], ids=["functions", "scripts"])
def test_at_maxmemory_prepare_votes_no_but_commit_and_rollback_finish(
    client: redis.Redis, functions: bool
) -> None:
    """noeviction at maxmemory: what docs/redis.md promises, through FCALL and EVALSHA alike."""
    cache = RedisResource(client, "cache")
    if not functions:
        cache._scripts._functions = False
    elif not _functions_supported(client):
        pytest.skip("Redis < 7.0 has no functions")
    one = prepared(cache, 1)
    client.set("w", "0")
    b = cache.start(xid(2))
    b.watch("w")
    b.incrby("n", 1)
    client.config_set("maxmemory", 1)
    try:
        with pytest.raises(TransientError, match="out of memory"):
            cache.prepare(xid(2))
        assert cache.rollback(xid(2)) is None
        assert cache.commit(one) is None
        reader = cache.start(xid(3))
        assert reader.get("k") == b"v1" and reader.incrby("n", 2) == 2  # reads still work
        assert cache.rollback(xid(3)) is None
    finally:
        client.config_set("maxmemory", 0)
    assert client.mget("k", "n") == [b"v1", None]


def test_crash_points_are_reached_in_order(cache: RedisResource) -> None:
    seen: list[str] = []
    crashpoints.observe(seen.append)
    try:
        cache.commit(prepared(cache, 1))
        b = cache.start(xid(2))
        b.set("k", "v")
        cache.commit(xid(2), one_phase=True)
    finally:
        crashpoints._observers.remove(seen.append)
    assert seen == [
        "redis.cache.after_stage",
        "redis.cache.after_prepare_marker",
        "redis.cache.after_apply",
        "redis.cache.after_apply",
    ]


def test_gauges(client: redis.Redis, cache: RedisResource, managers: list) -> None:
    dead = RedisResource(
        redis.Redis(port=1, retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)), "dead"
    )
    tm = make_manager(managers, [cache, dead])
    one = prepared(cache, 1)
    metrics = tm.metrics.as_dict()
    assert metrics["resource_cache_prepared_transactions"] == 1
    assert 0 <= metrics["resource_cache_oldest_prepared_age_seconds"] < 60
    assert math.isnan(metrics["resource_dead_prepared_transactions"])
    cache.rollback(one)


# -- a single slot ---------------------------------------------------------------------------------


def test_a_single_slot_branch_refuses_keys_of_other_slots(client: redis.Redis) -> None:
    """Redis Cluster's rule, applied on a standalone server (``single_slot=True``)."""
    from coordinator import ConfigurationError, ProgrammingError

    with pytest.raises(ConfigurationError, match="hash_tag"):
        RedisResource(client, "cache", single_slot=True)
    slotted = RedisResource(client, "cache", hash_tag="acct", single_slot=True)
    b = slotted.start(xid(1))
    with pytest.raises(ProgrammingError, match=r"use keys with the hash tag \{acct\}"):
        b.set("balance:1", 1)
    b.set("{acct}:balance:1", 1)
    b.incrby("balance:{acct}:2", 2)
    slotted.prepare(xid(1))
    slotted.commit(xid(1))
    assert client.mget("{acct}:balance:1", "balance:{acct}:2") == [b"1", b"2"]
    assert client.exists(b"twopc:{acct}:tx:" + xid(1).to_gid().encode())


# -- PostgreSQL and Redis in one transaction -------------------------------------------------------


def test_postgres_and_redis_commit_and_roll_back_together(
    client: redis.Redis, make_pg_database: Callable[[], str], managers: list
) -> None:
    engine = ledger_engine(make_pg_database())
    pg, cache = PostgresResource(engine, "pg"), RedisResource(client, "cache")
    tm = make_manager(managers, [pg, cache])
    try:
        with tm.transaction() as tx:
            move(tx.join(pg), "t1", 1, -10)
            tx.join(cache).incrby("balance:2", 10)
        with pytest.raises(TransactionRolledBack, match="changed"), tm.transaction() as tx:
            move(tx.join(pg), "t2", 1, -10)
            assert tx.join(cache).incrby("balance:2", 10) == 20  # read, so the key is watched
            client.set("balance:2", 0)  # a writer outside twopc: Redis votes no
        assert total(engine) == 3990
        assert client.get("balance:2") == b"0"
        assert prepared_gids(engine) == []
    finally:
        engine.dispose()


def test_kill9_after_prepare_then_recovery_commits_from_the_aof(
    private_redis: Callable[..., Any],
    make_pg_database: Callable[[], str],
    tmp_path: Path,
    managers: list,
) -> None:
    server = private_redis()
    engine = ledger_engine(make_pg_database())
    pg = PostgresResource(engine, "pg")
    c = redis.Redis.from_url(server.url())
    cache = RedisResource(c, "cache")
    try:
        gtrid = "node-1:crashed-1"
        move(pg.start(Xid.branch_of(gtrid, "pg")), "t1", 1, -10)
        pg.prepare(Xid.branch_of(gtrid, "pg"))
        cache.start(Xid.branch_of(gtrid, "cache")).incrby("balance:2", 10)
        cache.prepare(Xid.branch_of(gtrid, "cache"))
        with FileDecisionLog(tmp_path / "log") as log:
            log.log_commit(Decision(gtrid, ("cache", "pg")))
        server.kill9()
        server.restart()
        c2 = redis.Redis.from_url(server.url())
        assert c2.zcard(b"twopc:{twopc}:prepared") == 1  # the prepare survived the crash
        make_manager(
            managers,
            [pg, RedisResource(c2, "cache")],
            FileDecisionLog(tmp_path / "log"),
        )
        assert c2.get("balance:2") == b"10" and total(engine) == 3990
        assert leftovers(c2) == []
        c2.close()
    finally:
        c.close()
        engine.dispose()


def test_a_committer_an_acl_refuses_a_key_stops_part_way_and_loses_nothing(
    client: redis.Redis, redis_url: str
) -> None:
    """The commit of plain SETs reads its keys from the staged set, so an ACL that refuses the
    committing user a data key stops it inside the script: before the SETs are known applied,
    with every lock and the staged set kept; a committer with the rights then finishes it."""
    blind = RedisResource(client, "cache", blind_writes=True)
    blind.start(xid(1)).mset({f"k{i}": f"v{i}" for i in range(5)})
    assert blind.prepare(xid(1)) == Vote.COMMIT
    client.acl_setuser(
        "committer", enabled=True, passwords=["+pw"], categories=["+@all"], keys=["twopc:*"]
    )
    try:
        narrow = redis.Redis.from_url(redis_url, username="committer", password="pw")
        with pytest.raises(TransientError, match="part-way"):
            RedisResource(narrow, "cache").commit(xid(1))
        narrow.close()
    finally:
        client.acl_deluser("committer")
    gid = xid(1).to_gid()
    assert client.hget(blind._tx(gid), "state") in (b"prepared", b"committing")
    assert client.exists(blind._ws(gid), *blind._locks([b"k0", b"k4"])) == 3
    assert RedisResource(client, "cache").commit(xid(1)) is None
    assert client.mget([f"k{i}" for i in range(5)]) == [f"v{i}".encode() for i in range(5)]


def test_kill9_between_commit_steps_then_the_server_then_recovery_finishes(
    private_redis: Callable[..., Any], tmp_path: Path, managers: list
) -> None:
    """A process committing a large branch in bounded steps is killed (SIGKILL) after two,
    then Redis too; restarted from its AOF, Redis holds exactly the two steps and the record
    of them, and recovery (the decision is COMMIT) finishes the rest: every key once."""
    import os
    import subprocess
    import sys

    server = private_redis()
    c = redis.Redis.from_url(server.url())
    blind = RedisResource(c, "cache", blind_writes=True)
    blind.start(xid(1)).mset({f"k{i}": f"v{i}" for i in range(10)})
    assert blind.prepare(xid(1)) == Vote.COMMIT
    with FileDecisionLog(tmp_path / "log") as log:
        log.log_commit(Decision(xid(1).gtrid, ("cache",)))
    child = (
        "import redis\n"
        "from coordinator import Xid\n"
        "from resource_managers.redis import RedisResource\n"
        f"r = RedisResource(redis.Redis.from_url({server.url()!r}), 'cache', commit_chunk=3)\n"
        f"r.commit(Xid.branch_of({xid(1).gtrid!r}, 'cache'))\n"
    )
    env = {**os.environ, "TWOPC_CRASH_AT": "redis.cache.after_commit_step:2"}
    done = subprocess.run([sys.executable, "-c", child], env=env, timeout=60, check=False)
    assert done.returncode == -9
    c.close()
    server.kill9()
    server.restart()
    c2 = redis.Redis.from_url(server.url())
    try:
        record = c2.hgetall(blind._tx(xid(1).to_gid()))
        assert (record[b"state"], record[b"applied"]) == (b"committing", b"6")
        assert c2.mget("k5", "k6") == [b"v5", None]
        make_manager(managers, [RedisResource(c2, "cache")], FileDecisionLog(tmp_path / "log"))
        assert c2.mget([f"k{i}" for i in range(10)]) == [f"v{i}".encode() for i in range(10)]
        assert leftovers(c2) == []
    finally:
        c2.close()


def test_a_real_three_node_cluster(private_redis: Callable[..., Any]) -> None:
    """A branch in one hash slot of a real cluster: scripts route by their KEYS."""
    import shutil
    import subprocess

    from redis.cluster import RedisCluster

    from coordinator import ProgrammingError

    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is needed to create a cluster")
    nodes = [private_redis(port=_cluster_port(), extra=["--cluster-enabled", "yes"]) for _ in "abc"]
    addresses = [f"127.0.0.1:{node.port}" for node in nodes]
    subprocess.run(
        [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    deadline = time.monotonic() + 20  # a new master waits 2 s before it serves
    probes = [redis.Redis(port=node.port) for node in nodes]
    while not all(b"cluster_state:ok" in p.execute_command("CLUSTER", "INFO") for p in probes):
        assert time.monotonic() < deadline, "the cluster did not become ready"
        time.sleep(0.05)
    client = RedisCluster(host="127.0.0.1", port=nodes[0].port)
    cache = RedisResource(client, "cache", hash_tag="acct")
    b = cache.start(xid(1))
    with pytest.raises(ProgrammingError, match="one hash slot"):
        b.set("plain", 1)
    with pytest.raises(ProgrammingError, match="one hash slot"):
        b.mset({"{acct}:fine": 1, "plain": 1})
    assert b.incrby("{acct}:a", 5) == 5
    b.hset("{acct}:h", "f", AWKWARD[4])
    b.watch("{acct}:w")
    assert cache.prepare(xid(1)) == Vote.COMMIT
    assert cache.recover() == [xid(1)]
    client.script_flush()
    assert cache.commit(xid(1)) is None
    one = cache.start(xid(2))
    one.sadd("{acct}:s", "m")
    cache.commit(xid(2), one_phase=True)
    assert client.get("{acct}:a") == b"5" and client.hget("{acct}:h", "f") == AWKWARD[4]
    assert client.smembers("{acct}:s") == {b"m"}
    gone = cache.start(xid(3))  # its locks found from the staged set, on the slot's node
    gone.set("{acct}:r", "never")
    assert cache.prepare(xid(3)) == Vote.COMMIT
    assert RedisResource(client, "cache", hash_tag="acct").rollback(xid(3)) is None
    assert client.get("{acct}:r") is None
    # the slot moving away while a commit runs: the keys are declared on a cluster, so the
    # move is found before the script runs; nothing is written, and it finishes later
    moving = cache.start(xid(4))
    moving.set("{acct}:new", "late")
    assert cache.prepare(xid(4)) == Vote.COMMIT
    slot, owner = key_slot(b"acct"), client.get_node_from_key("{acct}:new")
    source = next(p for p, n in zip(probes, nodes, strict=True) if n.port == owner.port)
    target = next(p for p, n in zip(probes, nodes, strict=True) if n.port != owner.port)
    source_id, target_id = (p.execute_command("CLUSTER", "MYID") for p in (source, target))
    target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    with pytest.raises(TransientError):
        cache.commit(xid(4))
    gid = xid(4).to_gid()
    assert source.hget(cache._tx(gid), "state") == b"prepared"
    assert source.exists(cache._ws(gid), cache._locks([b"{acct}:new"])[0]) == 2
    for probe in (source, target):
        probe.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    assert cache.commit(xid(4)) is None and client.get("{acct}:new") == b"late"
    assert cache.prepared_stats()[0] == 0
    assert [k for k in client.scan_iter(match="*:lock:*")] == []
    client.close()
    for probe in probes:
        probe.close()


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; both must stay below 65536."""
    import random
    import socket

    while True:
        port = random.randint(20000, 45000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


def test_a_large_write_set_stays_under_luas_unpack_limit(client: redis.Redis) -> None:
    """Thousands of keys (locks, the staged header) and of members in one command, chunked."""
    blind = RedisResource(client, "cache", blind_writes=True)
    b = blind.start(xid(1))
    for i in range(8500):
        b.set(f"k{i}", i)
    b.sadd("big", *range(9000))
    b.hset("hash", mapping={f"f{i}": i for i in range(9000)})
    blind.prepare(xid(1))
    RedisResource(client, "cache").commit(xid(1))  # reads the 8502 staged keys from the header
    assert client.get("k8499") == b"8499"
    assert (client.scard("big"), client.hlen("hash")) == (9000, 9000)


# -- differential: a branch behaves like Redis itself ---------------------------------------------

_KEYS = ["a", "b", "c"]
_MEMBERS = ["x", "y"]
_VALUES = ["1", "-3", "abc", "9223372036854775800"]


def _random_write(rng: random.Random) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    key, member, value = rng.choice(_KEYS), rng.choice(_MEMBERS), rng.choice(_VALUES)
    amount = rng.choice([1, -2, 10**18])
    return rng.choice(
        [
            ("set", (key, value), rng.choice([{}, {"nx": True}, {"xx": True}, {"ex": 100}])),
            ("delete", tuple(rng.sample(_KEYS, rng.randint(1, 2))), {}),
            ("incrby", (key, amount), {}),
            ("expire", (key, rng.choice([100, -1])), {}),
            ("hset", (key, member, value), {}),
            ("hdel", (key, member), {}),
            ("hincrby", (key, member, amount), {}),
            ("sadd", (key, member), {}),
            ("srem", (key, member), {}),
            ("zadd", (key, {member: rng.choice([1.5, -2.0])}), {}),
            ("zrem", (key, member), {}),
            ("zincrby", (key, 2, member), {}),
            ("lpush", (key, value), {}),
            ("rpush", (key, value), {}),
            ("xadd", (key, {"f": value}), {}),
            ("incr", (key,), {}),
            ("decr", (key, rng.choice([1, 3])), {}),
            ("setex", (key, rng.choice([50, 100]), value), {}),
            ("mset", ({key: value, rng.choice(_KEYS): amount},), {}),
        ]
    )


def _random_read(rng: random.Random) -> tuple[str, tuple[Any, ...]]:
    key, member = rng.choice(_KEYS), rng.choice(_MEMBERS)
    return rng.choice(
        [
            ("get", (key,)),
            ("hget", (key, member)),
            ("sismember", (key, member)),
            ("exists", tuple(rng.sample(_KEYS, rng.randint(1, 3)))),
            ("ttl", (key,)),
            ("mget", (rng.sample(_KEYS, rng.randint(1, 3)),)),
            ("hgetall", (key,)),
            ("hmget", (key, _MEMBERS)),
            ("smembers", (key,)),
            ("lrange", (key, rng.choice([0, 1, -2]), rng.choice([-1, 0, 5]))),
        ]
    )


def _same_read(read: str, got: Any, expected: Any) -> bool:
    """A read's answers agree; a time to live may have ticked by a second between the two."""
    if read == "ttl" and isinstance(got, int) and isinstance(expected, int):
        return got == expected or (min(got, expected) > 0 and abs(got - expected) <= 1)
    return bool(got == expected)


def _outcome(target: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``target.name(*args, **kwargs)`` answers, or the error Redis gives."""
    try:
        return getattr(target, name)(*args, **kwargs)
    except ResponseError as exc:
        return ("error", str(exc))


def _snapshot(c: redis.Redis) -> dict[str, Any]:
    readers = {
        b"string": c.get,
        b"hash": c.hgetall,
        b"set": c.smembers,
        b"zset": lambda k: c.zrange(k, 0, -1, withscores=True),
        b"list": lambda k: c.lrange(k, 0, -1),
        b"stream": lambda k: [fields for _, fields in c.xrange(k)],
        b"none": lambda k: None,
    }
    return {k: (c.type(k), readers[c.type(k)](k), c.ttl(k) > 0) for k in _KEYS}


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")  # the mirror's
@pytest.mark.parametrize("blind", [False, True])
def test_a_branch_behaves_like_redis_itself(
    redis_url: str, client: redis.Redis, blind: bool
) -> None:
    """Random commands go to a branch and, directly, to a mirror database: every answer, every
    read and the committed state agree; what Redis refuses, the branch refuses (at the call or,
    for what it could not see, by voting no)."""
    mirror = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/1")
    cache = RedisResource(client, "cache", blind_writes=blind)
    rng = random.Random(20261121 + blind)
    refused_late = committed = 0
    for scenario in range(40):
        client.flushdb()
        mirror.flushdb()
        for _ in range(6):  # the same starting data in both
            name, args, kwargs = _random_write(rng)
            for target in (client, mirror):
                _outcome(target, name, args, kwargs)
        branch = cache.start(xid(scenario))
        invalid = False
        for _ in range(rng.randint(1, 12)):
            name, args, kwargs = _random_write(rng)
            expected = _outcome(mirror, name, args, kwargs)
            got = _outcome(branch, name, args, kwargs)
            if isinstance(expected, tuple):
                assert got == expected or not isinstance(got, tuple), (name, args, got)
                invalid = invalid or not isinstance(got, tuple)  # accepted: prepare must refuse
                if invalid:
                    break
            elif not blind and name != "xadd":
                assert got == expected, (scenario, name, args, kwargs)
            read, read_args = _random_read(rng)
            mirrored = _outcome(mirror, read, read_args, {})
            got = _outcome(branch, read, read_args, {})
            assert _same_read(read, got, mirrored), (scenario, read, read_args, got, mirrored)
        if invalid:
            with pytest.raises(BranchFailed, match="would fail"):
                cache.prepare(xid(scenario))
            cache.rollback(xid(scenario))
            refused_late += 1
            continue
        if scenario % 2:
            cache.commit(xid(scenario), one_phase=True)
        elif cache.prepare(xid(scenario)) == Vote.COMMIT:  # READ_ONLY if every call was refused
            cache.commit(xid(scenario))
        committed += 1
        assert _snapshot(client) == _snapshot(mirror), scenario
    assert committed >= (1 if blind else 20), (committed, refused_late)
    assert refused_late > 0 or not blind  # blind calls are refused late, by prepare
    mirror.close()


def test_emptying_a_collection_deletes_it_as_redis_does(client: redis.Redis) -> None:
    """Regression: HDEL of the last field deletes the hash, so a later SET NX applies and a hash
    command after it would fail half-way through the commit; prepare must see that coming."""
    client.hset("h", "f", "1")
    blind = RedisResource(client, "cache", blind_writes=True)
    b = blind.start(xid(1))
    b.hdel("h", "f")
    b.set("h", "now a string", nx=True)
    b.hset("h", "g", "1")
    with pytest.raises(BranchFailed, match="WRONGTYPE"):
        blind.prepare(xid(1))
    blind.rollback(xid(1))
    assert client.hgetall("h") == {b"f": b"1"}
    cache = RedisResource(client, "cache")
    checked = cache.start(xid(2))
    assert checked.hdel("h", "f") == 1
    assert checked.set("h", "now a string", nx=True) is True
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        checked.hset("h", "g", "1")
    assert checked.get("h") == b"now a string"
    cache.rollback(xid(2))
