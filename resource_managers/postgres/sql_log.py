"""`SqlDecisionLog`: the decision log in PostgreSQL, so that another host can recover a dead node.

A file log dies with its disk; a coordinator that another host must be able to replace (a Spark
driver, one of a fleet of application servers) keeps its decisions in the database instead. Three
tables, shared by every node on one database and keyed by node id: ``<prefix>lease`` (who owns a
node now, and since which epoch), ``<prefix>decision`` (a row is a COMMIT; deleting it is the END)
and ``<prefix>heuristic``.

Who may write is settled inside the database, never by a local clock. The lease is acquired,
renewed and expires by the server's ``clock_timestamp()``; a takeover bumps its epoch. Every write
is one statement that re-reads our lease row ``FOR SHARE`` and writes only while our epoch is
current and unexpired, so a takeover and a write serialise on that row: once another host owns the
node, the old owner can write nothing, and whatever it wrote before, the new owner reads.

COMMITs are group-committed (one statement and one commit per batch of concurrent callers); ENDs
are lazy and ride on the next batch, the renewal thread's tick or `SqlDecisionLog.close`. When a
participant shares the log's database, its own commit carries the COMMIT row instead
(`coordinator.last_resource.CarryingLog`).

Why one module: the SQL lives in `_log_sql`, the batching in `_log_batches`; what stays here is
one class whose writes, lease and fencing share one state (the epoch, the fenced flag, the queued
ENDs): every write's failure path reads it, so splitting the lease from the writes would pass that
state back and forth.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, NoReturn

from sqlalchemy import select, text
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.sql import Select, TextClause

from coordinator.decision_log import Decision, HeuristicRecord, LogStats
from coordinator.decision_log._memory import Clock, End, admit
from coordinator.errors import (
    FencedError,
    LogError,
    LogLockedError,
    LogWriteError,
    OutcomeUnknownError,
)
from coordinator.xid import Xid

from ._errors import describe, sqlstate, unwrap
from ._log_batches import GroupCommit
from ._log_sql import (
    DIVISION_BY_ZERO,
    DUPLICATE,
    LOCK_NOT_AVAILABLE,
    UNDEFINED_TABLE,
    Sql,
    check_config,
    tables,
)
from .resource import PostgresResource

log = logging.getLogger("twopc.decision_log.sql")


@dataclass(frozen=True)
class _Holder:
    owner: str
    epoch: int
    expires_at: datetime
    remaining: float  # seconds to expiry by the server's clock; negative once expired


class SqlDecisionLog:
    """Decisions of ``node_id`` in PostgreSQL, written only while this instance holds the node's
    lease. Implements `coordinator.decision_log.DecisionLog`.

    The constructor creates the tables if missing and acquires the lease, waiting up to
    ``acquire_timeout`` seconds for a live owner's lease to expire, else `LogLockedError`. A daemon
    thread renews it every ``renew_interval`` (a third of ``lease_seconds`` by default). The engine
    stays the caller's: `close` releases the lease, never the engine. ``clock`` is what decision
    deadlines are checked against; ``stats().fsyncs`` counts the database commits of records.
    ``read_only=True`` takes no lease and writes nothing (every write raises): for reading a node's
    pending decisions and heuristics while its live owner runs, as ``twopc status`` does.
    """

    def __init__(
        self,
        engine: Engine,
        node_id: str,
        *,
        table_prefix: str = "twopc_",
        schema: str | None = None,
        lease_seconds: float = 30.0,
        renew_interval: float | None = None,
        acquire_timeout: float = 0.0,
        group_commit: bool = True,
        clock: Clock = time.time,
        read_only: bool = False,
    ) -> None:
        renew = lease_seconds / 3 if renew_interval is None else renew_interval
        check_config(node_id, table_prefix, schema, lease_seconds, renew)
        self.node_id = node_id
        # READ COMMITTED whatever the caller's engine says: the FOR SHARE reasoning assumes it.
        self._engine = engine.execution_options(isolation_level="READ COMMITTED")
        self._where = engine.url.render_as_string(hide_password=True)
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._ttl = float(lease_seconds)
        self._renew_every = renew
        self._margin = min(1.0, lease_seconds / 10)  # local clock rate vs the server's
        self._clock = clock
        self._lock = threading.Lock()
        self._ends: Counter[str] = Counter()  # queued, not yet written: hidden from pending()
        self._counts = Counter[str]()
        self._fenced: str | None = None
        #: a carried commit's answer was lost: fence before the next read of the decisions
        self._fence_due = False
        self._closed = False
        self._valid_until = 0.0
        self._metadata, lease, decision, heuristic = tables(table_prefix, schema)
        self._decision, self._heuristic = decision, heuristic
        self._sql = Sql.build(engine, lease, decision, heuristic)
        self._batcher = GroupCommit(self._flush, grouped=group_commit)
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew_loop, name=f"twopc-lease-{node_id}", daemon=True
        )
        self._read_only = read_only
        if read_only:
            # `twopc status` beside a live owner: no lease, no schema, no writes, only reads
            self._epoch = 0
            self._fenced = f"decision log of node {node_id!r} was opened read-only"
            return
        self._create_schema()
        self._epoch = self._acquire(acquire_timeout)
        self._renewer.start()

    # -- the DecisionLog protocol -------------------------------------------------------------

    def log_commit(self, decision: Decision) -> None:
        self._check_writable()
        self._batcher.submit(admit(decision, self._clock), force=True)

    def log_end(self, gtrid: str) -> None:
        """Queue END; it is written with the next batch, the next renewal tick, or at close."""
        if self._fenced is not None:
            raise LogWriteError(f"END of {gtrid} not written: {self._fenced}", durable=False)
        with self._lock:
            self._ends[gtrid] += 1
        try:
            self._batcher.submit(End(gtrid), force=False)
        except LogError:
            self._forget_queued([End(gtrid)])
            raise

    def log_heuristic(self, record: HeuristicRecord) -> None:
        self._check_writable()
        params: dict[str, Any] = {"gtrid": record.gtrid, "branch": record.branch}
        params |= {"outcome": record.outcome, "detail": record.detail}
        params["recorded_at"] = record.recorded_at
        self._write(self._sql.heuristic, params, f"HEURISTIC of {record.gtrid}/{record.branch}")
        self._count("forced")

    def forget_heuristic(self, gtrid: str, branch: str | None = None) -> None:
        self._check_writable()
        self._write(self._sql.forget, {"gtrid": gtrid, "branch": branch}, f"FORGET of {gtrid}")
        self._count("forced")

    # -- carried by a participant's commit (coordinator.last_resource.CarryingLog) -------------

    def carried_by(self, resource: object) -> bool:
        """A `PostgresResource` in this log's database (not a last resource of its own, not on a
        standby, READ COMMITTED) can carry our COMMIT records in its one-phase commit."""
        if self._read_only or not isinstance(resource, PostgresResource):
            return False
        if resource.last_resource or not resource.reads_committed:
            return False
        try:
            rows = resource._pool.query(  # same package: the resource's pool, its driver
                self._sql.carrier, [self.node_id, self._epoch, self._owner]
            )
        except Exception as exc:
            if sqlstate(exc) == UNDEFINED_TABLE:  # another database: our tables are not there
                return False
            log.warning(
                "%s: cannot tell whether it shares the decision log's database, so its branches "
                "prepare as usual: %s",
                resource.name,
                describe(exc),
            )
            return False
        carries = bool(rows and rows[0][0])
        if carries:
            log.info("%s shares the decision log's database: it carries the decisions", resource)
        return carries

    def commit_carried(self, resource: object, xid: Xid, decision: Decision) -> None:
        """Insert ``decision`` (lease-fenced) in ``resource``'s branch and commit it, one round
        trip. A lost answer leaves the next `pending` to fence first: our lease row is written,
        which waits for every transaction holding it FOR SHARE, so a commit still running on
        the server has landed (its row visible) or never will before the read."""
        if not isinstance(resource, PostgresResource):
            raise TypeError(f"{resource!r} cannot carry decisions of {self._where}")
        self._check_writable()
        params = [self.node_id, self._epoch, self._owner]
        params += [self.node_id, decision.gtrid, json.dumps(list(decision.branches))]
        params += [decision.deadline, decision.written_at]
        try:
            resource.commit_carrying(
                xid,
                self._sql.carry,
                params,
                fence=lambda exc: sqlstate(exc) == DIVISION_BY_ZERO,
                fenced=f"the decision log's lease of node {self.node_id!r} is no longer ours, "
                "so {gtrid} may not commit",
            )
        except OutcomeUnknownError:
            with self._lock:
                self._fence_due = True
            raise
        self._count("carried")

    def _fence_carried(self) -> None:
        """Before reading decisions after a carried commit's lost answer: write our lease row.

        The write waits for every transaction that holds the row FOR SHARE (every carried
        commit does, from its insert to its COMMIT), so when it returns a lost commit has either
        landed or can never land, and the read that follows is the truth."""
        with self._lock:
            due, self._fence_due = self._fence_due, False
        if not due:
            return
        try:
            self._renew()
        except BaseException:
            with self._lock:
                self._fence_due = True
            raise

    def pending(self) -> list[Decision]:
        """COMMITs of this node by any process or owner, in the order written, minus queued ENDs."""
        if self._fence_due:
            try:
                self._fence_carried()
            except SQLAlchemyError as exc:
                raise LogError(
                    f"cannot fence a carried commit in {self._where} before reading the "
                    f"decisions: {describe(exc)}"
                ) from exc
        with self._lock:  # read before the table: an END written meanwhile is gone from both
            ending = set(self._ends)
        t = self._decision
        query = select(t.c.gtrid, t.c.branches, t.c.deadline, t.c.written_at)
        query = query.where(t.c.node_id == self.node_id).order_by(t.c.written_at, t.c.gtrid)
        return [
            Decision(r.gtrid, tuple(json.loads(r.branches)), r.deadline, r.written_at)
            for r in self._read(query, "pending decisions")
            if r.gtrid not in ending
        ]

    def heuristics(self) -> list[HeuristicRecord]:
        t = self._heuristic
        query = select(t.c.gtrid, t.c.branch, t.c.outcome, t.c.detail, t.c.recorded_at)
        query = query.where(t.c.node_id == self.node_id)
        query = query.order_by(t.c.recorded_at, t.c.gtrid, t.c.branch)
        rows = self._read(query, "heuristic records")
        return [
            HeuristicRecord(r.gtrid, r.branch, r.outcome, r.detail, r.recorded_at) for r in rows
        ]

    def stats(self) -> LogStats:
        with self._lock:
            extra = {"epoch": self._epoch, "batches": self._counts["batches"]}
            extra |= {"fenced": self._fenced is not None, "queued_ends": self._ends.total()}
            extra["carried"] = self._counts["carried"]
            forced = self._batcher.forced + self._counts["forced"]
            return LogStats(forced, self._batcher.lazy, self._counts["commits"], 0, extra)

    def check_owner(self) -> None:
        """Raise `FencedError` unless this instance certainly still owns the node.

        Trusted locally while the last renewal is younger than the lease minus a margin: the
        server cannot have let anyone take over before then. Past that, ask the server.
        """
        if self._closed:
            raise FencedError(f"decision log of node {self.node_id!r} is closed", **self._who())
        if self._fenced is not None:
            raise FencedError(self._fenced, **self._who())
        if time.monotonic() < self._valid_until:
            return
        try:
            self._renew()
        except SQLAlchemyError as exc:
            raise FencedError(
                f"cannot confirm the lease of node {self.node_id!r}: not renewed for "
                f"{self._ttl - self._margin:.1f}s and {self._where} does not answer "
                f"({describe(exc)})",
                **self._who(),
            ) from exc

    def close(self) -> None:
        """Write queued ENDs, stop renewing, and release the lease so a successor starts at once.

        Idempotent. A renewal stuck on an unreachable server is left to die with the process;
        the lease is then not released (a late renewal could revive it) and simply expires.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._batcher.close()
        except (LogError, FencedError) as exc:
            log.warning("decision log %s: END records lost at close (%s)", self._where, exc)
        self._stop.set()
        if self._read_only:
            return
        self._renewer.join(self._ttl)
        if self._renewer.is_alive() or self._fenced is not None:
            return
        try:
            with self._engine.begin() as conn:
                conn.execute(self._sql.release, self._lease_params())
        except SQLAlchemyError as exc:
            log.warning("lease of %r not released, it expires by itself: %s", self.node_id, exc)

    def __enter__(self) -> SqlDecisionLog:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- writing ------------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._closed:
            raise LogWriteError("decision log is closed; nothing was written", durable=False)
        if self._fenced is not None:
            raise FencedError(self._fenced, **self._who())

    def _flush(self, records: list[Decision | End]) -> None:
        """One batch: its net effect in one fenced statement and one commit.

        Netted in order, because one statement cannot insert and delete the same row: a COMMIT
        followed by its END is just the END, and an END followed by a COMMIT just the COMMIT.
        """
        commits: dict[str, Decision] = {}
        ended: set[str] = set()
        for record in records:
            if isinstance(record, Decision):
                commits[record.gtrid] = record
                ended.discard(record.gtrid)
            else:
                commits.pop(record.gtrid, None)
                ended.add(record.gtrid)
        decisions = list(commits.values())
        params = {
            "gtrids": [d.gtrid for d in decisions],
            "branches": [json.dumps(list(d.branches)) for d in decisions],
            "deadlines": [d.deadline for d in decisions],
            "written": [d.written_at for d in decisions],
            "ended": sorted(ended),
        }
        try:
            self._write(self._sql.batch, params, f"{len(decisions)} COMMIT/{len(ended)} END")
            self._count("batches")
        finally:
            self._forget_queued([r for r in records if isinstance(r, End)])

    def _forget_queued(self, ends: Sequence[End]) -> None:
        with self._lock:
            self._ends.subtract(end.gtrid for end in ends)
            self._ends = +self._ends

    def _write(self, statement: TextClause, params: dict[str, Any], what: str) -> None:
        """Run a fenced statement and commit it, saying exactly what a failure leaves behind."""
        conn, row = self._execute(statement, {**params, **self._lease_params()}, what)
        with conn:
            if row[0]:
                try:
                    conn.commit()
                except SQLAlchemyError as exc:
                    raise LogWriteError(
                        f"{what} record(s): {self._where} failed during COMMIT, so they may or "
                        f"may not be recorded ({describe(exc)})",
                        durable=None,
                    ) from exc
        if not row[0]:
            self._not_leased(what)
        self._count("commits")

    def _execute(
        self, statement: TextClause, params: dict[str, Any], what: str
    ) -> tuple[Connection, Row[Any]]:
        """The statement's result on an open transaction; any failure here wrote nothing."""
        for attempt in range(2):
            conn: Connection | None = None
            try:
                conn = self._engine.connect()
                return conn, conn.execute(statement, params).one()
            except BaseException as exc:
                if conn is not None:
                    with contextlib.suppress(SQLAlchemyError):
                        conn.close()
                if not isinstance(exc, SQLAlchemyError):
                    raise
                # A pooled connection that died with a restarted server fails here, before any
                # COMMIT was sent: one retry on a fresh connection cannot write anything twice.
                if attempt == 0 and isinstance(exc, DBAPIError) and exc.connection_invalidated:
                    continue
                raise LogWriteError(
                    f"{what} record(s) not written to {self._where}: {describe(exc)}",
                    durable=False,
                ) from exc
        raise AssertionError("unreachable")

    def _not_leased(self, what: str) -> NoReturn:
        """The statement found no lease of ours: say whether it was taken over or just lapsed."""
        try:
            holder = self._holder()
        except SQLAlchemyError as exc:
            raise FencedError(
                f"{what} record(s) not written: the lease of node {self.node_id!r} is not ours "
                f"or has expired ({self._where} did not say more: {describe(exc)})",
                **self._who(),
            ) from exc
        if holder is None or (holder.owner, holder.epoch) != (self._owner, self._epoch):
            self._taken_over(holder)
        raise FencedError(
            f"{what} record(s) not written: the lease of node {self.node_id!r} (epoch "
            f"{self._epoch}) expired {-holder.remaining:.1f}s ago by the database clock and was "
            "not renewed in time (a slow database, or this process was paused)",
            **self._who(),
        )

    # -- the lease ----------------------------------------------------------------------------

    def _lease_params(self) -> dict[str, Any]:
        return {"node": self.node_id, "epoch": self._epoch, "owner": self._owner, "ttl": self._ttl}

    def _who(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "epoch": getattr(self, "_epoch", None)}

    def _acquire(self, timeout: float) -> int:
        give_up = time.monotonic() + timeout
        while True:
            sent = time.monotonic()
            epoch = self._try_acquire(max(1.0, give_up - sent))
            if epoch is not None:
                self._valid_until = sent + self._ttl - self._margin
                log.info("node %r: lease epoch %d taken as %s", self.node_id, epoch, self._owner)
                return epoch
            try:
                holder = self._holder()
            except SQLAlchemyError as exc:
                raise self._unreachable("reading the lease", exc) from exc
            left = give_up - time.monotonic()
            if left <= 0 and holder is not None:
                raise LogLockedError(
                    f"node {self.node_id!r} of the decision log in {self._where} is held by "
                    f"{holder.owner} (epoch {holder.epoch}) until {holder.expires_at.isoformat()} "
                    f"by the database clock, {holder.remaining:.1f}s from now; is that "
                    f"coordinator still running? (waited {timeout}s)",
                    node_id=self.node_id,
                    owner=holder.owner,
                    expires_at=holder.expires_at.isoformat(),
                )
            wait = 0.01 if holder is None else max(0.01, holder.remaining)
            time.sleep(min(wait, 0.25, max(left, 0.0)))

    def _try_acquire(self, lock_wait: float) -> int | None:
        """One attempt: the new epoch, or None while another owner's lease runs.

        ``lock_timeout`` bounds the wait on a row lock held by the owner's open transaction (a
        write in progress, or a paused process), so `acquire_timeout` is kept even then.
        """
        params = {"node": self.node_id, "owner": self._owner, "ttl": self._ttl}
        try:
            with self._engine.begin() as conn:
                ms = {"ms": str(int(lock_wait * 1000))}
                conn.execute(text("SELECT set_config('lock_timeout', :ms, true)"), ms)
                row = conn.execute(self._sql.acquire, params).first()
        except DBAPIError as exc:
            if getattr(unwrap(exc), "pgcode", None) == LOCK_NOT_AVAILABLE:
                return None
            raise self._unreachable("acquiring the lease", exc) from exc
        except SQLAlchemyError as exc:
            raise self._unreachable("acquiring the lease", exc) from exc
        return None if row is None else int(row[0])

    def _holder(self) -> _Holder | None:
        with self._engine.connect() as conn:
            row = conn.execute(self._sql.holder, {"node": self.node_id}).first()
        if row is None:
            return None
        return _Holder(str(row.owner), int(row.epoch), row.expires_at, float(row.remaining))

    def _renew(self) -> None:
        """Extend our lease, even one that lapsed; fenced for good if the epoch is not ours."""
        sent = time.monotonic()
        with self._engine.begin() as conn:
            row = conn.execute(self._sql.renew, self._lease_params()).first()
        if row is None:
            self._taken_over(self._holder())
        with self._lock:
            self._valid_until = max(self._valid_until, sent + self._ttl - self._margin)

    def _taken_over(self, holder: _Holder | None) -> NoReturn:
        by = "(its row was deleted)" if holder is None else f"by {holder.owner}"
        at = "" if holder is None else f" at epoch {holder.epoch}"
        reason = (
            f"the lease of node {self.node_id!r} in {self._where} was taken over {by}{at}; this "
            f"log held epoch {self._epoch} as {self._owner} and may no longer decide for the node"
        )
        with self._lock:
            first, self._fenced = self._fenced is None, self._fenced or reason
        if first:
            log.error("FENCED: %s", reason)
        raise FencedError(self._fenced, **self._who())

    def _renew_loop(self) -> None:
        """Renew, then write queued ENDs; retry sooner after a failure; stop once fenced."""
        wait = self._renew_every
        while not self._stop.wait(wait):
            wait = self._renew_every
            try:
                self._renew()
            except FencedError:
                return
            except Exception as exc:
                log.warning("node %r: lease not renewed, retrying: %s", self.node_id, exc)
                wait = min(wait, max(0.05, self._ttl / 10))
                continue
            if self._ends:
                with contextlib.suppress(LogError, FencedError):  # lost ENDs are re-driven
                    self._batcher.sync()

    # -- plumbing -----------------------------------------------------------------------------

    def _create_schema(self) -> None:
        """Create missing tables; a concurrent creator makes us fail once, then look again."""
        for attempt in range(3):
            try:
                with self._engine.begin() as conn:
                    self._metadata.create_all(conn, checkfirst=True)
                return
            except DBAPIError as exc:
                if attempt < 2 and getattr(unwrap(exc), "pgcode", None) in DUPLICATE:
                    continue
                raise self._unreachable("creating the decision log tables", exc) from exc
            except SQLAlchemyError as exc:
                raise self._unreachable("creating the decision log tables", exc) from exc

    def _read(self, query: Select[Any], what: str) -> Sequence[Row[Any]]:
        try:
            with self._engine.connect() as conn:
                return conn.execute(query).all()
        except SQLAlchemyError as exc:
            raise LogError(f"cannot read {what} from {self._where}: {describe(exc)}") from exc

    def _unreachable(self, what: str, exc: SQLAlchemyError) -> LogWriteError:
        return LogWriteError(
            f"decision log database {self._where} failed while {what} for node "
            f"{self.node_id!r}; nothing was written: {describe(exc)}",
            durable=False,
        )

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1
