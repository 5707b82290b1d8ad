"""The SQL of `SqlDecisionLog`: its three tables, and every statement it runs, each fenced by the
node's lease (why each looks as it does is said beside it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import BigInteger, Column, DateTime, Double, MetaData, Table, Text, text
from sqlalchemy.engine import Engine
from sqlalchemy.sql import TextClause

from coordinator.errors import ConfigurationError

# PostgreSQL truncates identifiers past 63 bytes; the longest table suffix is "heuristic".
_PREFIX = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]{0,53})?\Z")
_SCHEMA = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}\Z")
# Two processes creating the tables at once: the loser trips over a catalog unique index.
DUPLICATE = {"42P07", "42710", "23505"}
LOCK_NOT_AVAILABLE = "55P03"


def tables(prefix: str, schema: str | None) -> tuple[MetaData, Table, Table, Table]:
    md = MetaData(schema=schema)
    lease = Table(
        f"{prefix}lease",
        md,
        Column("node_id", Text, primary_key=True),
        Column("epoch", BigInteger, nullable=False),
        Column("owner", Text, nullable=False),
        Column("expires_at", DateTime(timezone=True), nullable=False),
        Column("acquired_at", DateTime(timezone=True)),
    )
    decision = Table(
        f"{prefix}decision",
        md,
        Column("node_id", Text, primary_key=True),
        Column("gtrid", Text, primary_key=True),
        Column("branches", Text, nullable=False),  # a JSON array of resource names, commit order
        Column("deadline", Double),
        Column("written_at", Double, nullable=False),
        Column("epoch", BigInteger, nullable=False),  # the lease epoch that wrote it
    )
    heuristic = Table(
        f"{prefix}heuristic",
        md,
        Column("node_id", Text, primary_key=True),
        Column("gtrid", Text, primary_key=True),
        Column("branch", Text, primary_key=True),
        Column("outcome", Text, nullable=False),
        Column("detail", Text, nullable=False),
        Column("recorded_at", Double, nullable=False),
    )
    return md, lease, decision, heuristic


# Every write starts with this CTE and writes only FROM (or if EXISTS) it. FOR SHARE is what makes
# the check hold until our COMMIT: under READ COMMITTED a plain read of the lease would let a
# takeover commit its new epoch while our insert is still uncommitted; the new owner would then
# read the decisions without ours, presume abort, and our COMMIT would land afterwards. With the
# share lock the takeover's UPDATE waits for our commit (and then sees our rows), and a write that
# arrives after a takeover waits for it and re-checks the new row version, finding no lease.
_HELD = """held AS MATERIALIZED (
    SELECT epoch FROM {lease}
    WHERE node_id = :node AND epoch = :epoch AND owner = :owner
      AND expires_at > clock_timestamp()
    FOR SHARE)"""

_BATCH = """WITH {held}, ins AS (
    INSERT INTO {decision} (node_id, gtrid, branches, deadline, written_at, epoch)
    SELECT :node, d.gtrid, d.branches, d.deadline, d.written_at, held.epoch
    FROM held, unnest(CAST(:gtrids AS text[]), CAST(:branches AS text[]),
                      CAST(:deadlines AS double precision[]),
                      CAST(:written AS double precision[]))
         AS d(gtrid, branches, deadline, written_at)
    ON CONFLICT (node_id, gtrid) DO NOTHING
    RETURNING 1
), del AS (
    DELETE FROM {decision}
    WHERE node_id = :node AND gtrid = ANY(CAST(:ended AS text[])) AND EXISTS (SELECT 1 FROM held)
    RETURNING 1
)
SELECT (SELECT count(*) FROM held), (SELECT count(*) FROM ins), (SELECT count(*) FROM del)"""

_HEURISTIC = """WITH {held}, ins AS (
    INSERT INTO {heuristic} (node_id, gtrid, branch, outcome, detail, recorded_at)
    SELECT :node, :gtrid, :branch, :outcome, :detail, CAST(:recorded_at AS double precision)
    FROM held
    ON CONFLICT (node_id, gtrid, branch) DO UPDATE
    SET outcome = excluded.outcome, detail = excluded.detail, recorded_at = excluded.recorded_at
    RETURNING 1
)
SELECT (SELECT count(*) FROM held), (SELECT count(*) FROM ins)"""

_FORGET = """WITH {held}, del AS (
    DELETE FROM {heuristic}
    WHERE node_id = :node AND gtrid = :gtrid
      AND (CAST(:branch AS text) IS NULL OR branch = CAST(:branch AS text))
      AND EXISTS (SELECT 1 FROM held)
    RETURNING 1
)
SELECT (SELECT count(*) FROM held), (SELECT count(*) FROM del)"""

# The decision as a participant's commit carries it (`SqlDecisionLog.commit_carried`): the same
# fenced insert, one row, in the participant's own transaction, then its COMMIT, one message.
# The aggregate always yields one row, so without a lease of ours ``1 / count(*)`` fails the
# statement (division_by_zero) and with it the whole transaction: the participant's data can
# never commit without its decision. FOR SHARE holds until that COMMIT, as for a batch.
_CARRY = """WITH {held}
INSERT INTO {decision} (node_id, gtrid, branches, deadline, written_at, epoch)
SELECT %s, %s, %s, CAST(%s AS double precision), %s, max(held.epoch) * (1 / count(*)) FROM held;
COMMIT"""
# Can a participant carry our records? It sees our own lease row (so it is our database), it is
# not a standby, and it runs READ COMMITTED (FOR SHARE's reasoning, as for the log's own writes).
_CARRIER = """SELECT NOT pg_is_in_recovery()
  AND current_setting('transaction_isolation') = 'read committed'
  AND EXISTS (SELECT 1 FROM {lease} WHERE node_id = %s AND epoch = %s AND owner = %s)"""
DIVISION_BY_ZERO = "22012"
UNDEFINED_TABLE = "42P01"

_TTL = "clock_timestamp() + make_interval(secs => CAST(:ttl AS double precision))"
_OURS = "node_id = :node AND epoch = :epoch AND owner = :owner"
_ACQUIRE = f"""INSERT INTO {{lease}} AS cur (node_id, epoch, owner, expires_at, acquired_at)
VALUES (:node, 1, :owner, {_TTL}, clock_timestamp())
ON CONFLICT (node_id) DO UPDATE
SET epoch = cur.epoch + 1, owner = excluded.owner, expires_at = excluded.expires_at,
    acquired_at = excluded.acquired_at
WHERE cur.expires_at < clock_timestamp()
RETURNING epoch"""
_HOLDER = """SELECT owner, epoch, expires_at,
       EXTRACT(EPOCH FROM expires_at - clock_timestamp()) AS remaining
FROM {lease} WHERE node_id = :node"""
_RENEW = f"UPDATE {{lease}} SET expires_at = {_TTL} WHERE {_OURS} RETURNING epoch"
_RELEASE = f"UPDATE {{lease}} SET expires_at = clock_timestamp() WHERE {_OURS}"


@dataclass(frozen=True)
class Sql:
    acquire: TextClause
    holder: TextClause
    renew: TextClause
    release: TextClause
    batch: TextClause
    heuristic: TextClause
    forget: TextClause
    carry: str  # driver-level SQL (``%s`` parameters): a participant's connection runs it
    carrier: str

    @classmethod
    def build(cls, engine: Engine, lease: Table, decision: Table, heuristic: Table) -> Sql:
        """The statements, with table names quoted by the dialect; data only ever binds."""
        quote = engine.dialect.identifier_preparer.format_table
        names = {"lease": quote(lease), "decision": quote(decision), "heuristic": quote(heuristic)}
        names["held"] = _HELD.format(**names)
        sql = {"acquire": _ACQUIRE, "holder": _HOLDER, "renew": _RENEW, "release": _RELEASE}
        sql |= {"batch": _BATCH, "heuristic": _HEURISTIC, "forget": _FORGET}
        clauses = {key: text(statement.format(**names)) for key, statement in sql.items()}
        held = _HELD.format(**names).replace(":node", "%s").replace(":epoch", "%s")
        held = held.replace(":owner", "%s")
        carry = _CARRY.format(held=held, decision=names["decision"])
        return cls(**clauses, carry=carry, carrier=_CARRIER.format(**names))


def check_config(
    node_id: str, prefix: str, schema: str | None, lease_seconds: float, renew: float
) -> None:
    """Names reach SQL as identifiers (quoted, but still), so they are held to a strict shape."""
    if not node_id:
        raise ConfigurationError("a decision log needs a non-empty node_id")
    if not _PREFIX.match(prefix):
        raise ConfigurationError(f"table_prefix {prefix!r}: letters, digits, _ (54 at most)")
    if schema is not None and not _SCHEMA.match(schema):
        raise ConfigurationError(f"schema {schema!r}: letters, digits and _ only (63 at most)")
    if not lease_seconds > 0:
        raise ConfigurationError(f"lease_seconds must be positive, not {lease_seconds!r}")
    if not 0 < renew < lease_seconds:
        raise ConfigurationError(
            f"renew_interval {renew!r} must be positive and shorter than lease_seconds "
            f"{lease_seconds!r}, or the lease lapses between renewals"
        )
