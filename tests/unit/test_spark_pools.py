"""`spark_integration.pools`: one engine per URL per process, the least recently used closed past
the limit, and a forked child never uses its parent's sockets (Spark forks Python workers)."""

from __future__ import annotations

import os
from pathlib import Path

from spark_integration.pools import REDIS_REPLY_SECONDS, Pools


def test_one_engine_per_url_and_the_least_recently_used_goes(tmp_path: Path) -> None:
    pools = Pools(limit=2)
    a, b, c = (f"sqlite:///{tmp_path / name}.db" for name in "abc")
    first = pools.engine(a)
    assert pools.engine(a) is first
    pools.engine(b)
    pools.engine(a)  # a is now the most recent: b goes when c comes
    pools.engine(c)
    assert pools.engine(a) is first
    assert pools.redis("redis://127.0.0.1:1/0") is pools.redis("redis://127.0.0.1:1/0")
    pools.close()
    assert pools.engine(a) is not first


def test_a_forked_child_builds_its_own_pools(tmp_path: Path) -> None:
    pools = Pools()
    url = f"sqlite:///{tmp_path / 'a.db'}"
    parent = pools.engine(url)
    with parent.connect():
        pass  # a pooled connection the child must not reuse
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit code says whether it got a fresh engine
        try:
            fresh = pools.engine(url) is not parent
            os.write(write, b"1" if fresh else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert pools.engine(url) is parent  # the parent keeps its own


def test_redis_clients_wait_for_a_whole_partition_script() -> None:
    """A branch's prepare or commit is one script over the partition's keys: redis-py's 5 s reply
    timeout failed them under load, so the pooled clients wait 120 s unless the URL says."""
    pools = Pools()
    waits = pools.redis("redis://127.0.0.1:1/0").connection_pool.connection_kwargs
    assert waits["socket_timeout"] == REDIS_REPLY_SECONDS == 120.0
    given = pools.redis("redis://127.0.0.1:1/0?socket_timeout=7").connection_pool
    assert given.connection_kwargs["socket_timeout"] == 7.0
    pools.close()
