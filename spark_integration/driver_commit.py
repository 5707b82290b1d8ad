"""The driver side: decide a Spark write once, finish it, and clean up every attempt Spark forgot.

Why it looks like this:

- Spark hands ``commit`` exactly one message per partition (the attempt it chose), and nothing
  about the others: failed attempts, speculative losers and attempts on lost executors have
  prepared branches too. So the decision names the winners, and after it every *other* prepared
  branch under the gtrid is rolled back, found by scanning each target's ``recover()``, never by
  trusting a message list.
- Spark may call ``commit`` again for the same batch (a driver restart between the sink commit
  and its own commit log) and calls ``abort`` after a ``commit`` that raised. Both therefore look
  for an existing decision first (`spark_integration.ledger`): once COMMIT is durable, the only
  direction is forward, with the *recorded* winners.
- The commit point is ``COMMIT(gtrid, winners + ledger branch)`` forced into the SQL decision log
  under the node's lease. The decision carries a deadline: the oldest winner's birth plus the
  grace period (less a margin). Past it recovery may already have presumed that branch aborted,
  so the log refuses the COMMIT (`coordinator.FencedError`) instead of committing half a batch;
  Spark then aborts the job.
- Before deciding, every winner must still be prepared (one ``recover()`` scan per target): a
  winner rolled back meanwhile (recovery after its grace, an operator) would otherwise be
  committed as a heuristic rollback, losing that partition. Then nothing is decided and the call
  raises `coordinator.TransactionRolledBack`.
- Phase two commits the branches a few at a time in parallel (each is independent once COMMIT
  is durable, and each waits on its own server), retries a little and leaves stragglers to
  ``TransactionManager.recover()`` (same names, same log): the decision stays pending until
  every branch answered, and END is written only after all of them.
- Without a decision, ``abort`` rolls back every branch under the gtrid prefix. No ABORT record is
  written (presumed abort): a zombie attempt that prepares afterwards stays prepared until
  recovery's grace period passes, and is then rolled back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from coordinator import (
    FencedError,
    LogWriteError,
    ProgrammingError,
    Resource,
    TransactionRolledBack,
    Xid,
)
from coordinator.crashpoints import crash_point
from coordinator.decision_log import Decision, DecisionLog, HeuristicRecord
from coordinator.protocol import BranchResult, branch_result
from coordinator.xid import resource_of

from .connect import Opened, open_targets, prepared_of, rollback_prepared, rollback_quietly
from .ids import driver_xid
from .ledger import Committed, committed
from .partition_writer import CommitMessage, resolve_gtrid
from .targets import WriteConfig

log = logging.getLogger("twopc.spark.driver")

COMMIT_TRIES = 3
#: branches committed at once in phase two: each commit is a round trip (a Redis branch's a
#: server-side apply of its whole staged set) that waits on its server, not on this process, so
#: a few in flight overlap them; more would only queue on the same servers
PHASE_TWO_WORKERS = 4


@dataclass(frozen=True)
class CommitReport:
    """How a ``commit`` or ``abort`` ended.

    ``outcome`` is ``committed`` or ``rolled-back``; ``replay`` says the gtrid was already
    decided when we came; ``committed``/``rolled_back`` are gids this call finished;
    ``pending`` are gids it could not reach, which recovery will finish as decided.
    """

    gtrid: str
    outcome: str
    replay: bool
    committed: tuple[str, ...] = ()
    rolled_back: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()


def commit(
    options: Mapping[str, str],
    messages: Sequence[CommitMessage | None],
    batch_id: int | None = None,
    *,
    gtrid: str | None = None,
) -> CommitReport:
    """Decide COMMIT for the winners in ``messages`` (one per partition), then finish it."""
    gtrid, config = _gtrid_of(options, messages, batch_id, gtrid)
    with open_targets(config) as opened:
        opened.ledger.ensure()
        decision_log = opened.write_log()
        decided = committed(decision_log, opened.ledger, gtrid)
        if decided is not None:
            log.info("%s is already committed: finishing it again", gtrid)
            return _finish(opened, decision_log, decided, replay=True)
        winners = [m for m in messages if m is not None and not m.skipped and m.branches]
        bquals = [xid.bqual for m in winners for xid in m.xids]
        _check_still_prepared(opened, gtrid, bquals)
        ledger_xid = driver_xid(gtrid, config.log.ledger_name)
        branches = (*bquals, ledger_xid.bqual)
        _prepare_ledger(opened, ledger_xid, branches)
        deadline = _deadline(config, winners)
        try:
            decision_log.log_commit(Decision(gtrid, branches, deadline))
        except (FencedError, LogWriteError) as exc:
            # FencedError and durable=False: certainly not written, so the ledger branch goes;
            # durable=None: it may be written, so only recovery may decide its fate
            if not isinstance(exc, LogWriteError) or exc.durable is False:
                rollback_quietly(opened.ledger_resource, ledger_xid)
            raise
        crash_point("spark.driver_after_commit")
        return _finish(opened, decision_log, Committed(gtrid, branches, True), replay=False)


def abort(
    options: Mapping[str, str],
    messages: Sequence[CommitMessage | None],
    batch_id: int | None = None,
    *,
    gtrid: str | None = None,
) -> CommitReport:
    """Roll back every branch of the write, unless it is already committed (then finish it)."""
    gtrid, config = _gtrid_of(options, messages, batch_id, gtrid)
    with open_targets(config) as opened:
        decision_log = opened.write_log()
        decided = committed(decision_log, opened.ledger, gtrid)
        if decided is not None:
            log.warning("abort of %s, which is committed: rolling forward", gtrid)
            return _finish(opened, decision_log, decided, replay=True)
        rolled, failed = rollback_prepared(opened.all_resources(), gtrid, lambda _: True)
        return CommitReport(gtrid, "rolled-back", False, (), rolled, failed)


# -- steps ------------------------------------------------------------------------------------


def _gtrid_of(
    options: Mapping[str, str],
    messages: Sequence[CommitMessage | None],
    batch_id: int | None,
    gtrid: str | None,
) -> tuple[str, WriteConfig]:
    seen = {m.gtrid for m in messages if m is not None}
    if gtrid is None and batch_id is None and len(seen) == 1:
        gtrid = next(iter(seen))
    gtrid, config = resolve_gtrid(options, batch_id, gtrid)
    if seen - {gtrid}:
        raise ProgrammingError(f"commit messages of {sorted(seen)} given to the write {gtrid}")
    return gtrid, config


def _check_still_prepared(opened: Opened, gtrid: str, bquals: Sequence[str]) -> None:
    """Refuse to decide for a winner that is no longer prepared (rolled back by recovery after
    its grace, or by an operator): committing the rest would lose that partition's rows."""
    prepared: set[str] = set()
    for resource in opened.resources.values():
        prepared |= {x.bqual for x in prepared_of(resource, gtrid)}
    missing = [b for b in bquals if b not in prepared]
    if missing:
        raise TransactionRolledBack(
            f"{gtrid}: winning branch(es) {missing} are no longer prepared; nothing was "
            "committed (Spark will abort the write; re-run it)",
            reason="vote",
            gtrid=gtrid,
        )


def _prepare_ledger(opened: Opened, xid: Xid, branches: tuple[str, ...]) -> None:
    session = opened.ledger_resource.start(xid)
    try:
        opened.ledger.record(session, xid.gtrid, branches)
        opened.ledger_resource.prepare(xid)
    except BaseException:
        rollback_quietly(opened.ledger_resource, xid)
        raise


def _deadline(config: WriteConfig, winners: Sequence[CommitMessage]) -> float | None:
    """The last moment the COMMIT may still be written (see the module docstring)."""
    born = [m.prepared_at for m in winners if m.prepared_at]
    if not born:
        return None
    grace = config.log.grace_seconds
    return min(born) + grace - min(60.0, grace / 10)


def _finish(
    opened: Opened, decision_log: DecisionLog, decided: Committed, *, replay: bool
) -> CommitReport:
    """Phase two for a pending decision, then roll back every branch it does not name."""
    resources = {r.name: r for r in opened.all_resources()}
    done: list[str] = []
    pending: list[str] = []
    if decided.pending:
        xids = [Xid.branch_of(decided.gtrid, bqual) for bqual in decided.branches]

        def finish_one(xid: Xid) -> bool:
            owner = resource_of(xid.bqual, resources)
            return owner is not None and _commit(resources[owner], xid, decision_log)

        with ThreadPoolExecutor(min(PHASE_TWO_WORKERS, len(xids)) or 1) as pool:
            for xid, ok in zip(xids, pool.map(finish_one, xids), strict=True):
                (done if ok else pending).append(xid.to_gid())
        if not pending:
            try:
                decision_log.log_end(decided.gtrid)
            except Exception as exc:  # a lost END costs recovery one idempotent re-commit
                log.warning("END of %s not written: %r", decided.gtrid, exc)
    keep = frozenset(decided.branches)
    rolled, failed = rollback_prepared(
        opened.all_resources(), decided.gtrid, lambda x: x.bqual not in keep
    )
    return CommitReport(
        decided.gtrid, "committed", replay, tuple(done), rolled, (*pending, *failed)
    )


def _commit(resource: Resource[Any], xid: Xid, decision_log: DecisionLog) -> bool:
    """Commit one branch, a few tries; a heuristic outcome is recorded, not raised."""
    for attempt in range(COMMIT_TRIES):
        try:
            reported = resource.commit(xid)
        except Exception as exc:
            log.warning("commit of %s failed (try %d): %r", xid, attempt + 1, exc)
            time.sleep(0.05 * 2**attempt)
            continue
        crash_point("spark.driver_after_branch_commit")
        result = branch_result(reported)
        if result != BranchResult.DONE:
            log.error("heuristic outcome %s on %s", result.value, xid)
            record = HeuristicRecord(xid.gtrid, xid.bqual, result.value, "", time.time())
            try:
                decision_log.log_heuristic(record)
            except Exception as exc:
                log.critical("heuristic of %s NOT recorded: %r", xid, exc)
        return True
    return False
