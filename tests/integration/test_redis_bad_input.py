"""RedisResource given what it must refuse: servers that would lose a prepare, a server that is
down, a wrong password, bad settings and bad arguments. Each refusal says what to change."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from coordinator import ConfigurationError, ProgrammingError, TransientError, Xid
from resource_managers.redis import (
    BranchConflict,
    BranchFailed,
    DurabilityWarning,
    RedisResource,
)
from resource_managers.throwaway import free_port

XID = Xid.branch_of("node-1:t-1", "cache")


def quick(url: str, **kwargs: Any) -> redis.Redis:
    """A client that gives up at once instead of retrying for seconds (redis-py's default)."""
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_timeout=2, **kwargs)


# -- durability ---------------------------------------------------------------------------------


def test_a_server_without_aof_is_refused_naming_the_setting(
    private_redis: Callable[..., Any],
) -> None:
    server = private_redis(appendonly=False)
    with pytest.raises(ConfigurationError) as raised:
        RedisResource(quick(server.url()), "cache").start(XID)
    message = str(raised.value)
    assert "appendonly is 'no' (needs 'yes')" in message
    assert 'durability="relaxed"' in message


def test_relaxed_durability_accepts_it_with_one_warning(
    private_redis: Callable[..., Any],
) -> None:
    server = private_redis(appendonly=False)
    cache = RedisResource(quick(server.url()), "cache", durability="relaxed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        branch = cache.start(XID)
        cache.start(Xid.branch_of("node-1:t-2", "cache"))
    assert [type(w.message) for w in caught] == [DurabilityWarning]
    assert "appendonly" in str(caught[0].message)
    branch.set("k", "v")
    cache.commit(XID, one_phase=True)
    cache.rollback(Xid.branch_of("node-1:t-2", "cache"))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"appendfsync": "everysec"}, "appendfsync is 'everysec' (needs 'always')"),
        (
            {"extra": ["--maxmemory-policy", "allkeys-lru"]},
            "maxmemory-policy is 'allkeys-lru' (needs 'noeviction')",
        ),
    ],
)
def test_weaker_fsync_and_eviction_are_refused(
    private_redis: Callable[..., Any], options: dict[str, Any], named: str
) -> None:
    server = private_redis(**options)
    with pytest.raises(ConfigurationError, match=named.replace("(", r"\(").replace(")", r"\)")):
        RedisResource(quick(server.url()), "cache").start(XID)


def test_a_server_that_refuses_config_needs_an_explicit_opt_in(
    private_redis: Callable[..., Any],
) -> None:
    """Managed services often block CONFIG: twopc cannot check, so the user must say so."""
    server = private_redis(extra=["--rename-command", "CONFIG", ""])
    with pytest.raises(ConfigurationError, match='pass durability="relaxed" explicitly'):
        RedisResource(quick(server.url()), "cache").start(XID)
    relaxed = RedisResource(quick(server.url()), "cache", durability="relaxed")
    with pytest.warns(DurabilityWarning, match="unchecked"):
        relaxed.start(XID)
    relaxed.rollback(XID)


# -- a server that is down -------------------------------------------------------------------------


def test_a_server_that_is_down_is_a_transient_error_and_nothing_is_guessed(
    private_redis: Callable[..., Any],
) -> None:
    with pytest.raises(TransientError, match=r"cannot reach Redis at 127\.0\.0\.1:\d+"):
        RedisResource(quick(f"redis://127.0.0.1:{free_port()}/0"), "cache").start(XID)

    server = private_redis()
    client = quick(server.url())
    cache = RedisResource(client, "cache")
    branch = cache.start(XID)
    branch.set("k", "v")
    server.kill9()
    with pytest.raises(TransientError, match="cannot reach Redis"):
        branch.get("other")
    with pytest.raises(TransientError, match="cannot reach Redis"):
        cache.prepare(XID)  # a no vote; the coordinator rolls back
    with pytest.raises(TransientError):
        cache.rollback(XID)  # the prepare might have landed: only the server can say
    with pytest.raises(TransientError):
        cache.recover()
    server.restart()
    assert cache.rollback(XID) is None
    assert cache.recover() == []
    assert client.get("k") is None
    assert client.hget(b"twopc:{twopc}:tx:" + XID.to_gid().encode(), "state") == b"aborted"


# -- authentication --------------------------------------------------------------------------------


@pytest.mark.parametrize("password", ["wrong-one", None])
def test_a_wrong_password_is_named_as_authentication_without_the_secret(
    private_redis: Callable[..., Any], password: str | None
) -> None:
    server = private_redis(extra=["--requirepass", "s3cret"])
    client = quick(server.url(), password=password)
    with pytest.raises(ConfigurationError, match="authentication") as raised:
        RedisResource(client, "cache").start(XID)
    text = str(raised.value) + repr(raised.value)
    assert "s3cret" not in text and "wrong-one" not in text
    good = RedisResource(quick(server.url(), password="s3cret"), "cache")
    assert "s3cret" not in repr(good)
    good.start(XID).set("k", "v")
    good.commit(XID, one_phase=True)


# -- settings and arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"namespace": "a{b}"}, "namespace"),
        ({"hash_tag": "x}y"}, "hash_tag"),
        ({"durability": "maybe"}, "durability"),
        ({"lock_wait": -1}, "lock_wait"),
        ({"tombstone_ttl": 0}, "tombstone_ttl"),
        ({"name": "has space\n"}, "resource name"),
    ],
)
def test_bad_settings_are_refused_at_construction(
    redis_url: str, kwargs: dict[str, Any], match: str
) -> None:
    kwargs.setdefault("name", "cache")
    with pytest.raises((ConfigurationError, ProgrammingError), match=match):
        RedisResource(quick(redis_url), **kwargs)


def test_bad_arguments_are_refused_at_the_call(redis_url: str) -> None:
    cache = RedisResource(quick(redis_url), "cache")
    branch = cache.start(XID)
    for call, match in [
        (lambda: branch.set("k", "v", nx=True, xx=True), "mutually exclusive"),
        (lambda: branch.set("k", "v", ex=0), "positive"),
        (lambda: branch.set("k", True), "bool"),
        (lambda: branch.set("k", object()), "invalid Redis value"),
        (lambda: branch.incrby("k", 2**63), "64-bit"),
        (lambda: branch.zadd("z", {"m": float("nan")}), "NaN"),
        (lambda: branch.xadd("s", {"f": "v"}, id="5-*"), "partial ids"),
        (lambda: branch.hset("h"), "at least one"),
        (lambda: branch.set(b"twopc:{twopc}:lock:x", "v"), "twopc's own"),
        (lambda: branch.mset({"fine": 1, "twopc:{twopc}:ws:x": "v"}), "twopc's own"),
        (lambda: branch.mset({"fine": 1, 2.5j: "v"}), "invalid Redis key"),
        (lambda: branch.mset({"fine": 1, "k": True}), "bool"),
        (lambda: branch.mset({}), "at least one"),
    ]:
        with pytest.raises(ProgrammingError, match=match):
            call()
    branch.xadd("s", {"f": "v"})
    with pytest.raises(ProgrammingError, match="explicit id after an automatic one"):
        branch.xadd("s", {"f": "v"}, id="9-9")
    assert cache.prepare(XID).value == "commit"
    cache.commit(XID)
    with pytest.raises(ProgrammingError, match="finished"):
        branch.set("k", "after the end")


def test_vote_errors_pickle_with_their_message() -> None:
    """Spark ships exceptions between processes."""
    for error in (BranchFailed("no"), BranchConflict("locked")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
    assert isinstance(BranchConflict("x"), TransientError)  # tm.run retries a conflict
