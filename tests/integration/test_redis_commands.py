"""The redis-py commands a Redis branch offers, one test each, against a real redis-server.

Each test checks the answer redis-py would give, that a read after a buffered write sees it
(read-your-writes: the branch's ops replayed over the server's value), that nothing is visible
to other clients before commit, and what commit and rollback leave. The randomized differential
test in ``test_redis_resource.py`` holds every command against Redis's own answers; these show
each one plainly. Commands the branch does not offer raise `UnsupportedCommandError`."""

from __future__ import annotations

import pickle
import time

import pytest
import redis

from coordinator import ProgrammingError, Vote
from resource_managers.redis import RedisBranch, RedisResource, UnsupportedCommandError
from resource_managers.redis.branch import SUPPORTED_COMMANDS
from tests.integration.test_redis_resource import cache, client, xid  # noqa: F401

PATHS = ["two-phase", "one-phase", "rollback"]


def finish(resource: RedisResource, path: str, n: int = 1) -> None:
    """End branch ``n`` the way ``path`` says: prepare and commit, commit in one phase, or
    roll back."""
    if path == "two-phase":
        assert resource.prepare(xid(n)) == Vote.COMMIT
        resource.commit(xid(n))
    elif path == "one-phase":
        resource.commit(xid(n), one_phase=True)
    else:
        resource.rollback(xid(n))


@pytest.mark.parametrize("path", PATHS)
def test_incr_and_decr(client: redis.Redis, cache: RedisResource, path: str) -> None:  # noqa: F811
    client.set("n", 10)
    b = cache.start(xid(1))
    assert b.incr("n") == 11
    assert b.decr("n", 3) == 8
    assert b.incr("fresh", 5) == 5
    assert b.decr("below") == -1
    assert b.get("n") == b"8" and b.mget("fresh", "below") == [b"5", b"-1"]  # read-your-writes
    assert client.get("n") == b"10" and client.exists("fresh", "below") == 0
    finish(cache, path)
    expected = [b"10", None, None] if path == "rollback" else [b"8", b"5", b"-1"]
    assert client.mget("n", "fresh", "below") == expected


@pytest.mark.parametrize("path", PATHS)
def test_mset_and_mget(client: redis.Redis, cache: RedisResource, path: str) -> None:  # noqa: F811
    client.mset({"a": "1", "c": "3"})
    client.hset("h", "f", "v")
    b = cache.start(xid(1))
    assert b.mget(["a", "c", "missing", "h"]) == [b"1", b"3", None, None]  # untouched: one MGET
    assert b.mset({"a": "x", "b": 2}) is True
    # written, untouched, missing and of another type: None for the last two, as MGET answers
    assert b.mget("a", "b", "c", "missing", "h") == [b"x", b"2", b"3", None, None]
    assert b.delete("c") == 1
    assert b.mget("c", "a") == [None, b"x"]
    assert client.mget("a", "b", "c") == [b"1", None, b"3"]
    with pytest.raises(ProgrammingError, match="bool"):  # nothing of a refused mset is buffered
        b.mset({"d": "ok", "e": True})
    assert b.mget("d") == [None]
    finish(cache, path)
    expected = [b"1", None, b"3"] if path == "rollback" else [b"x", b"2", None]
    assert client.mget("a", "b", "c") == expected


@pytest.mark.parametrize("path", PATHS)
def test_exists(client: redis.Redis, cache: RedisResource, path: str) -> None:  # noqa: F811
    client.set("a", 1)
    client.sadd("s", "only")
    b = cache.start(xid(1))
    assert b.exists("a", "b", "a") == 2  # a key named twice counts twice, as in Redis
    b.delete("a")
    b.set("b", "now")
    assert b.exists("a", "b") == 1
    assert b.srem("s", "only") == 1  # removing the last member deletes the set
    assert b.exists("s") == 0
    b.sadd("s", "back")
    assert b.exists("s", "s") == 2
    assert client.exists("a", "b") == 1
    finish(cache, path)
    assert client.exists("a") == (1 if path == "rollback" else 0)
    assert client.exists("b") == (0 if path == "rollback" else 1)
    assert client.smembers("s") == ({b"only"} if path == "rollback" else {b"back"})


@pytest.mark.parametrize("path", PATHS)
def test_expire_setex_and_ttl(client: redis.Redis, cache: RedisResource, path: str) -> None:  # noqa: F811
    """A time to live set in a branch starts when the branch commits, not at the call: the
    branch answers ``ttl`` with the seconds it was given, and after a commit a second later
    the key still has all of them."""
    client.set("k", "v")
    client.set("short", "v", ex=1000)
    b = cache.start(xid(1))
    assert b.ttl("k") == -1 and b.ttl("missing") == -2 and 995 <= b.ttl("short") <= 1000
    assert b.expire("k", 100) is True
    assert b.ttl("k") == 100  # read-your-writes
    assert b.expire("missing", 100) is False and b.ttl("missing") == -2
    assert b.setex("s", 50, "value") is True
    assert b.ttl("s") == 50 and b.get("s") == b"value"
    assert b.set("short", "again") is True  # SET drops the time to live, as in Redis
    assert b.ttl("short") == -1
    assert b.setex("count", 60, 5) is True and b.incr("count") == 6
    assert b.ttl("count") == 60  # INCR keeps a string's time to live, as in Redis
    assert client.ttl("k") == -1 and client.exists("s") == 0
    time.sleep(1.5)  # between the calls and the commit
    finish(cache, path)
    if path == "rollback":
        assert client.ttl("k") == -1 and client.exists("s") == 0
        assert 990 <= client.ttl("short") <= 1000
        return
    assert client.ttl("k") == 100, "the time to live counts from the commit"
    assert client.ttl("s") == 50 and client.ttl("short") == -1 and client.ttl("count") == 60


def test_setex_refuses_a_time_that_is_not_positive(cache: RedisResource) -> None:  # noqa: F811
    b = cache.start(xid(1))
    with pytest.raises(ProgrammingError, match="positive"):
        b.setex("k", 0, "v")
    assert b.expire("k", 0) is False  # as in Redis: a time <= 0 deletes the key (none here)
    cache.rollback(xid(1))


def test_a_ttl_of_a_prepared_branch_starts_at_its_commit(
    client: redis.Redis,  # noqa: F811
    cache: RedisResource,  # noqa: F811
) -> None:
    """Prepared now, committed later (by phase two, or by recovery after a crash): the time to
    live is applied by the commit script, relative to the moment it runs."""
    b = cache.start(xid(1))
    b.setex("session", 30, "token")
    b.incr("hits")
    assert cache.prepare(xid(1)) == Vote.COMMIT
    time.sleep(2)
    assert client.exists("session") == 0
    cache.commit(xid(1))
    assert client.ttl("session") == 30


@pytest.mark.parametrize("path", PATHS)
def test_hgetall_and_hmget(client: redis.Redis, cache: RedisResource, path: str) -> None:  # noqa: F811
    client.hset("h", mapping={"a": "1", "b": "2"})
    b = cache.start(xid(1))
    assert b.hgetall("h") == {b"a": b"1", b"b": b"2"}  # untouched: one HGETALL
    assert b.hmget("h", ["a", "zz"]) == [b"1", None]  # untouched: one HMGET
    assert b.hset("h", "c", "3") == 1
    assert b.hdel("h", "a") == 1
    assert b.hincrby("h", "b", 5) == 7
    assert b.hgetall("h") == {b"b": b"7", b"c": b"3"}  # read-your-writes
    assert b.hmget("h", "a", "b", "c") == [None, b"7", b"3"]
    assert b.hgetall("missing") == {} and b.hmget("missing", "x") == [None]
    b.delete("gone")
    b.hset("gone", "x", "1")
    assert b.hgetall("gone") == {b"x": b"1"}  # not read: the branch replaced the key
    assert client.hgetall("h") == {b"a": b"1", b"b": b"2"}
    finish(cache, path)
    committed = {b"b": b"7", b"c": b"3"}
    assert client.hgetall("h") == ({b"a": b"1", b"b": b"2"} if path == "rollback" else committed)


@pytest.mark.parametrize("path", PATHS)
def test_hdel(client: redis.Redis, cache: RedisResource, path: str) -> None:  # noqa: F811
    client.hset("h", mapping={"a": "1", "b": "2"})
    b = cache.start(xid(1))
    assert b.hdel("h", "a", "zz") == 1
    assert b.hget("h", "a") is None and b.hgetall("h") == {b"b": b"2"}
    assert b.hdel("h", "b") == 1
    assert b.exists("h") == 0 and b.hgetall("h") == {}  # the last field takes the hash
    assert b.set("h", "string now", nx=True) is True
    finish(cache, path)
    if path == "rollback":
        assert client.hgetall("h") == {b"a": b"1", b"b": b"2"}
    else:
        assert client.get("h") == b"string now"


@pytest.mark.parametrize("path", PATHS)
def test_sadd_srem_and_smembers(client: redis.Redis, cache: RedisResource, path: str) -> None:  # noqa: F811
    client.sadd("s", "x", "y")
    b = cache.start(xid(1))
    assert b.smembers("s") == {b"x", b"y"}  # untouched: one SMEMBERS
    assert b.sadd("s", "z", "x") == 1
    assert b.srem("s", "y", "w") == 1
    assert b.smembers("s") == {b"x", b"z"}  # read-your-writes
    assert b.sismember("s", "y") == 0
    assert b.sadd("new", "a") == 1 and b.smembers("new") == {b"a"}
    assert client.smembers("s") == {b"x", b"y"}
    finish(cache, path)
    assert client.smembers("s") == ({b"x", b"y"} if path == "rollback" else {b"x", b"z"})
    assert client.smembers("new") == (set() if path == "rollback" else {b"a"})


@pytest.mark.parametrize("path", PATHS)
def test_lpush_rpush_and_lrange(client: redis.Redis, cache: RedisResource, path: str) -> None:  # noqa: F811
    client.rpush("l", "a", "b")
    b = cache.start(xid(1))
    assert b.lrange("l", 0, -1) == [b"a", b"b"]  # untouched: one LRANGE
    assert b.lpush("l", "x", "y") == 4  # y ends first, as in Redis
    assert b.rpush("l", "z") == 5
    assert b.lrange("l", 0, -1) == [b"y", b"x", b"a", b"b", b"z"]  # read-your-writes
    assert b.lrange("l", 1, 2) == [b"x", b"a"]
    assert b.lrange("l", -2, -1) == [b"b", b"z"]
    assert b.lrange("l", 3, 100) == [b"b", b"z"] and b.lrange("l", 4, 1) == []
    assert b.rpush("new", "1") == 1 and b.lrange("new", 0, -1) == [b"1"]
    assert client.lrange("l", 0, -1) == [b"a", b"b"]
    finish(cache, path)
    committed = [b"y", b"x", b"a", b"b", b"z"]
    assert client.lrange("l", 0, -1) == ([b"a", b"b"] if path == "rollback" else committed)


def test_reads_follow_decode_responses(redis_url: str, client: redis.Redis) -> None:  # noqa: F811
    text = RedisResource(redis.Redis.from_url(redis_url, decode_responses=True), "cache")
    client.hset("h", "a", "1")
    b = text.start(xid(1))
    b.hset("h", "b", "2")
    b.sadd("s", "m")
    b.rpush("l", "i")
    b.mset({"k": "v"})
    assert b.hgetall("h") == {"a": "1", "b": "2"} and b.hmget("h", "b") == ["2"]
    assert b.smembers("s") == {"m"} and b.lrange("l", 0, -1) == ["i"]
    assert b.mget("k", "nothing") == ["v", None]
    text.rollback(xid(1))


def test_an_unsupported_command_names_itself_and_what_is_supported(
    cache: RedisResource,  # noqa: F811
) -> None:
    b = cache.start(xid(1))
    with pytest.raises(UnsupportedCommandError) as caught:
        b.zunionstore("dest", ["a", "b"])
    message = str(caught.value)
    assert message.startswith("[redis-unsupported-command] redis-py's 'zunionstore' is not ")
    assert "supported: " in message and "hgetall" in message and "lrange" in message
    assert caught.value.command == "zunionstore"
    assert isinstance(caught.value, ProgrammingError) and isinstance(caught.value, AttributeError)
    copy = pickle.loads(pickle.dumps(caught.value))  # Spark ships errors between processes
    assert str(copy) == message and copy.command == "zunionstore"
    assert not hasattr(b, "pipeline")  # getattr/hasattr answer as for any missing attribute
    with pytest.raises(AttributeError) as typo:
        b.no_such_thing  # noqa: B018
    assert not isinstance(typo.value, UnsupportedCommandError)  # not a redis-py command
    assert b.ops == []  # nothing was buffered
    cache.rollback(xid(1))


def test_every_supported_command_is_a_redis_py_command() -> None:
    """The list the error gives is exactly the branch's redis-py subset."""
    wanted = {"incr", "decr", "mget", "mset", "exists", "expire", "setex", "ttl", "hgetall"}
    wanted |= {"hmget", "hdel", "sadd", "srem", "smembers", "lpush", "rpush", "lrange", "watch"}
    assert wanted <= set(SUPPORTED_COMMANDS)
    assert all(callable(getattr(RedisBranch, name)) for name in SUPPORTED_COMMANDS)
    assert all(hasattr(redis.Redis, name) for name in SUPPORTED_COMMANDS)
