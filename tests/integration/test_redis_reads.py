"""What a read in a Redis branch costs, and that the cheap read keeps the watch's promise.

A string key (or a missing one) is read with one plain ``GET``, and the watch it records is its
value's SHA-1, checked by the prepare, one-phase and read-only scripts with ``GET`` again; other
types keep the ``read`` script and the ``DUMP`` fingerprint. Counted against the real server's
``INFO commandstats``: one command per read, none for a key the branch already read or wrote, one
script call per phase. And every way a watched key can change (another value, another type,
deleted, created) still makes the branch vote no, on every path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from coordinator import Vote
from resource_managers.redis import BranchConflict, RedisResource
from tests.integration.test_redis_resource import AWKWARD, cache, client, xid  # noqa: F401


def commands(client: redis.Redis) -> dict[str, int]:  # noqa: F811
    """Calls per command since the last reset, as the server counts them (scripts' own included)."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def test_a_reading_incrby_is_one_get_and_the_commit_one_script(
    client: redis.Redis,  # noqa: F811
    cache: RedisResource,  # noqa: F811
) -> None:
    client.set("a", 5)
    client.config_resetstat()
    b = cache.start(xid(1))
    assert b.incrby("a", 1) == 6
    assert b.incrby("a", 1) == 7  # replayed on what was read: no second read
    assert b.get("a") == b"7"  # served from the branch's buffer
    before = commands(client)
    assert before.get("get") == 1 and "fcall" not in before and "evalsha" not in before
    cache.commit(xid(1), one_phase=True)
    after = commands(client)
    assert after.get("fcall", 0) + after.get("evalsha", 0) == 1
    assert client.get("a") == b"7"


def test_a_watch_then_a_get_is_one_read(client: redis.Redis, cache: RedisResource) -> None:  # noqa: F811
    client.set("k", "v")
    client.config_resetstat()
    b = cache.start(xid(1))
    b.watch("k")
    assert b.get("k") == b"v"  # the watch's own read answers it
    assert commands(client).get("get") == 1
    assert cache.prepare(xid(1)) == Vote.READ_ONLY


CHANGES: dict[str, Callable[[redis.Redis], object]] = {
    "another value": lambda c: c.set("k", "other"),
    "another type": lambda c: (c.delete("k"), c.hset("k", "f", "v")),
    "deleted": lambda c: c.delete("k"),
    "longer": lambda c: c.append("k", "x"),
}


@pytest.mark.parametrize("path", ["prepare", "one-phase", "read-only"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_string_read_by_get_votes_no_when_it_changes(
    client: redis.Redis,  # noqa: F811
    cache: RedisResource,  # noqa: F811
    path: str,
    change: str,
) -> None:
    client.set("k", AWKWARD[4])  # every byte value: the watch hashes the bytes, not text
    b = cache.start(xid(1))
    if path == "read-only":
        b.watch("k")
    else:
        b.incrby("n", 1)
        b.watch("k")
        b.set("copy", b.get("k"))
    CHANGES[change](client)
    with pytest.raises(BranchConflict, match="watched key b'k' changed"):
        if path == "one-phase":
            cache.commit(xid(1), one_phase=True)
        else:
            cache.prepare(xid(1))
    cache.rollback(xid(1))
    assert client.exists("copy", "n") == 0


def test_a_missing_key_read_by_get_votes_no_when_it_appears(
    client: redis.Redis,  # noqa: F811
    cache: RedisResource,  # noqa: F811
) -> None:
    b = cache.start(xid(1))
    assert b.incrby("fresh", 3) == 3  # read as missing, and watched so
    client.set("fresh", 10)
    with pytest.raises(BranchConflict, match="changed"):
        cache.commit(xid(1), one_phase=True)
    cache.rollback(xid(1))
    assert client.get("fresh") == b"10"


def test_the_same_value_written_again_or_a_new_ttl_keeps_the_watch(
    client: redis.Redis,  # noqa: F811
    cache: RedisResource,  # noqa: F811
) -> None:
    """Value semantics, as the DUMP fingerprint has: only what the key holds counts."""
    client.set("k", "v")
    b = cache.start(xid(1))
    b.watch("k")
    b.set("copy", b.get("k"))
    client.set("k", "v")
    client.expire("k", 1000)
    assert cache.prepare(xid(1)) == Vote.COMMIT
    assert cache.commit(xid(1)) is None
    assert client.get("copy") == b"v"


def test_other_types_keep_the_dump_fingerprint(client: redis.Redis, cache: RedisResource) -> None:  # noqa: F811
    client.hset("h", mapping={"a": "1", "b": "2"})
    b = cache.start(xid(1))
    assert b.hincrby("h", "a", 1) == 2  # reads one field, watches the whole hash
    client.hset("h", "b", "3")  # a field the branch never read
    with pytest.raises(BranchConflict, match="watched key b'h' changed"):
        cache.prepare(xid(1))
    cache.rollback(xid(1))
    assert client.hgetall("h") == {b"a": b"1", b"b": b"3"}


def test_a_key_that_turns_into_a_string_after_a_dump_watch_votes_no(
    client: redis.Redis,  # noqa: F811
    cache: RedisResource,  # noqa: F811
) -> None:
    client.sadd("s", "x")
    b = cache.start(xid(1))
    b.watch("s")
    b.set("copy", "1")
    client.delete("s")
    client.set("s", "x")
    with pytest.raises(BranchConflict):
        cache.commit(xid(1), one_phase=True)
    cache.rollback(xid(1))


def test_a_connection_dropped_between_calls_is_reopened(
    redis_url: str,
    client: redis.Redis,  # noqa: F811
    cache: RedisResource,  # noqa: F811
) -> None:
    """Script calls go straight to a pooled connection; a dead one is replaced, as redis-py's
    own commands do (its retry, then a reconnect)."""
    b = cache.start(xid(1))
    b.incrby("n", 1)
    cache.commit(xid(1), one_phase=True)
    killer = redis.Redis.from_url(redis_url)
    assert killer.client_kill_filter(_type="normal", skipme=True) >= 1  # all but its own
    killer.close()
    b = cache.start(xid(2))
    assert b.incrby("n", 1) == 2
    cache.commit(xid(2), one_phase=True)
    assert client.get("n") == b"2"


def test_a_single_connection_client_goes_through_the_client(redis_url: str) -> None:
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        res = RedisResource(single, "cache")
        b = res.start(xid(1))
        assert b.incrby("sc", 2) == 2
        res.commit(xid(1), one_phase=True)
        assert single.get("sc") == b"2"
    finally:
        single.delete("sc")
        single.close()


def test_a_client_that_overrides_execute_command_keeps_it(redis_url: str) -> None:
    """Instrumentation in a subclass sees every command the branch sends."""
    seen: list[bytes | str] = []

    class Counting(redis.Redis):
        def execute_command(self, *args: object, **options: object) -> object:
            seen.append(args[0])  # type: ignore[arg-type]
            return super().execute_command(*args, **options)

    counting = Counting.from_url(redis_url)
    try:
        res = RedisResource(counting, "cache")
        b = res.start(xid(1))
        assert b.incrby("ov", 2) == 2
        res.commit(xid(1), one_phase=True)
        assert "GET" in seen and ("FCALL" in seen or "EVALSHA" in seen)
    finally:
        counting.delete("ov")
        counting.close()
