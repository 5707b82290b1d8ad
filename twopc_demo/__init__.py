"""``twopc demo``: move money between PostgreSQL and Redis atomically, with a message for every
transfer; crash, recover, deliver the messages exactly once, audit.

Accounts alice, bob and carol live in a PostgreSQL table; dave, erin and frank are Redis strings.
A child process (``python -m twopc_demo.service``) makes one transaction per transfer with a
`TransactionManager`, a file decision log, a `MessageLogResource` named ``mlog`` on an embedded
`MessageLog`, a `PostgresResource` named ``postgres`` and a `RedisResource` named ``redis``: odd
transfers move money from PostgreSQL to Redis, even ones back. Each side also records the transfer
(a ``transfers`` row; an entry in the Redis stream ``bank:ledger``), and the transaction sends a
message about it to the destination ``transfers``. While the child runs, a `LogTransfer` moves
committed messages to an embedded `Cursor` that the parent serves on 127.0.0.1 (a `Listener` with
a fresh shared secret, handed to the child on stdin).

Branches prepare and commit in name order, ``mlog``, ``postgres``, ``redis``, and crash points
count them from 1, so the default crash point ``tm.after_commit.2:7`` kills the child with
transfer 7 committed in the message log and PostgreSQL and only prepared in Redis (the message
log's commit record is written lazily, so the kill usually leaves that branch prepared on disk
too; the decision, kept until it is written, makes recovery commit it again): its credit
staged under the gid, its keys locked. The parent shows that state as Redis, PostgreSQL, the
message log and the decision log hold it, runs recovery in a new manager as a restarted service
would, restarts the transfer from the reopened log, consumes every message in a transaction with
a PostgreSQL insert (a ``notifications`` row, without a unique key, so a duplicate would show),
and audits the stores and the messages.

PostgreSQL, first match wins: ``TWOPC_DEMO_POSTGRES_URL`` (a role that may create databases; a
fresh one is created and dropped again), a throwaway cluster from local binaries, a Docker
container through testcontainers. Redis: ``TWOPC_DEMO_REDIS_URL`` (keys under a random prefix,
deleted again; the server must keep a prepare across a crash), else a throwaway ``redis-server``
from local binaries with ``appendonly yes`` and ``appendfsync always``. SQLAlchemy, psycopg2,
redis-py and the server helpers are imported only when the demo runs (hence the ``noqa:
PLC0415``), so ``twopc`` loads without the extras; the message log, the cursor and the messaging
modules are imported there too, so other ``twopc`` commands do not pay for them.
"""
