"""The scenario's fixed facts: names, accounts, where the stores come from, what to install."""

from __future__ import annotations

URL_ENV = "TWOPC_DEMO_POSTGRES_URL"
REDIS_URL_ENV = "TWOPC_DEMO_REDIS_URL"
NODE_ID = "demo-1"
CONSUMER_ID = "demo-consumer"
# Do not rename: phases run in ascending name order, "mlog" < "postgres" < "redis", and crash
# points count branches from 1, so tm.after_commit.2 (the second branch to commit) leaves the
# message log and PostgreSQL committed (the log's record lazily: maybe prepared on disk) and Redis
# prepared.
MLOG, PG, REDIS = "mlog", "postgres", "redis"
CURSOR = "cursor"
DESTINATION = "transfers"  # where every transfer's message goes
CRASH_AT = "tm.after_commit.2:7"
LOG_ID, CURSOR_ID = "demo-log", "demo-cursor"  # the transfer connection's two ends
ACCOUNTS = {PG: ("alice", "bob", "carol"), REDIS: ("dave", "erin", "frank")}
OPENING = 1_000
NEEDS = (
    "no PostgreSQL server found. Install PostgreSQL (Debian/Ubuntu: "
    "apt-get install postgresql; macOS: brew install postgresql) so that initdb and postgres are "
    "on PATH or in /usr/lib/postgresql/<version>/bin, or start Docker (the demo then runs "
    f"postgres:16 through testcontainers), or set {URL_ENV} to a server whose role may create "
    "databases and whose max_prepared_transactions is above 0."
)
REDIS_NEEDS = (
    "no redis-server found. Install Redis (Debian/Ubuntu: apt-get install redis-server; macOS: "
    f"brew install redis) so that redis-server is on PATH, or set {REDIS_URL_ENV} to a server "
    "with appendonly yes, appendfsync always and maxmemory-policy noeviction."
)
