"""What the demo checks at the end: money conserved, every acknowledged transfer in both stores,
every committed transfer's message consumed exactly once, nothing left prepared or in flight."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from coordinator.cli import summarize, table
from coordinator.decision_log import inspect_log

from .bank import ACCOUNTS, OPENING, REDIS
from .stores import Run

if TYPE_CHECKING:
    pass


def _redis_balances(state: Run) -> dict[str, int]:
    keys = [f"{state.store.keys}balance:{a}" for a in ACCOUNTS[REDIS]]
    return {a: int(v) for a, v in zip(ACCOUNTS[REDIS], state.client.mget(keys), strict=True)}


def ledger_gtrids(state: Run) -> list[str]:
    """The gtrid of every entry in the Redis ledger stream, duplicates kept."""
    entries = state.client.xrange(f"{state.store.keys}ledger")
    return [fields[b"gtrid"].decode() for _, fields in entries]


def total(state: Run) -> int:
    pg = int(state.query("SELECT sum(balance) FROM accounts")[0][0])
    return pg + sum(_redis_balances(state).values())


def _drift(state: Run) -> list[str]:
    """Accounts whose balance is not the opening balance plus their transfer records."""
    drift = [
        account
        for account, balance, delta in state.query(
            "SELECT a.id, a.balance, COALESCE(sum(t.delta), 0) FROM accounts a "
            "LEFT JOIN transfers t ON t.account = a.id GROUP BY a.id, a.balance"
        )
        if balance != OPENING + delta
    ]
    moved = dict.fromkeys(ACCOUNTS[REDIS], 0)
    for _, fields in state.client.xrange(f"{state.store.keys}ledger"):
        moved[fields[b"account"].decode()] += int(fields[b"delta"])
    balances = _redis_balances(state)
    return drift + [a for a in ACCOUNTS[REDIS] if balances[a] != OPENING + moved[a]]


def _residue(state: Run) -> tuple[bool, str]:
    """Anything a transaction can leave behind: prepared branches, locks, staged sets, decisions."""
    pg = state.query("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")
    prefix = state.twopc_keys
    redis = [
        state.client.zcard(prefix + b"prepared"),
        state.redis_count(prefix + b"lock:*"),
        state.redis_count(prefix + b"ws:*"),
    ]
    pending, _, _ = summarize(inspect_log(state.log))
    left = [pg[0][0], *redis, len(pending)]
    detail = "prepared {} pg, {} redis; locks {}; staged {}; pending {}".format(*left)
    return not any(left), detail


def _in_flight(state: Run) -> tuple[bool, str]:
    """Messages anywhere but consumed: in the log (unacknowledged or prepared), in the cursor."""
    assert state.mlog is not None and state.cursor is not None
    log, cursor = state.mlog.stats(), state.cursor.stats()
    left = [log.pending, log.prepared, cursor.available, cursor.in_flight, cursor.prepared]
    detail = "log: pending {}, prepared {}; cursor: available {}, in flight {}, prepared {}"
    return not any(left), detail.format(*left)


def audit(state: Run, before: int, acked: list[str], attempted: list[str]) -> int:
    in_pg = {r[0] for r in state.query("SELECT gtrid FROM transfers")}
    ledger = ledger_gtrids(state)
    in_redis = set(ledger)
    drift, after = _drift(state), total(state)
    wrong = f"; wrong: {', '.join(drift)}" if drift else ""
    notified = Counter(r[0] for r in state.query("SELECT gtrid FROM notifications"))
    twice = sorted(g for g, count in notified.items() if count > 1)
    missed = sorted(in_pg - notified.keys())
    rolled_back = set(attempted) - in_pg
    strays = sorted(notified.keys() - in_pg)
    checks = [
        (
            "conservation: same total, balances match records",
            after == before and not drift,
            f"{before} -> {after}{wrong}",
        ),
        (
            "atomicity: no transfer in one store only",
            in_pg == in_redis,
            f"{len(in_pg & in_redis)} in both",
        ),
        (
            "exactly_once: no transfer applied twice",
            len(ledger) == len(in_redis),
            f"{len(ledger)} ledger entries",
        ),
        (
            "durable_ack: every acknowledged transfer in both",
            all(g in in_pg and g in in_redis for g in acked),
            f"{len(acked)} acknowledged",
        ),
        ("no_in_doubt_residue: nothing prepared, locked, staged", *_residue(state)),
        (
            "messages exactly once: every committed transfer notified once",
            notified == Counter(in_pg),
            f"{notified.total()} notifications for {len(in_pg)} transfers"
            + "".join(
                f"; {w}: {', '.join(g)}" for w, g in (("twice", twice), ("none", missed)) if g
            ),
        ),
        (
            "no message of a rolled-back transfer",
            not strays,
            f"{len(rolled_back)} rolled back"
            + (f"; notified anyway: {', '.join(strays)}" if strays else ", none notified"),
        ),
        ("nothing in flight: log and cursor empty", *_in_flight(state)),
    ]
    print("\n5. audit:")
    rows = [(name, "yes" if ok else "NO", detail) for name, ok, detail in checks]
    print(indent(table(["invariant", "holds", "detail"], rows)))
    ok = all(ok for _, ok, _ in checks)
    print(
        "PASS: PostgreSQL and Redis agree, every message was consumed exactly once, and nothing "
        "is left in doubt"
        if ok
        else "FAIL"
    )
    return 0 if ok else 1


def indent(text: str) -> str:
    return "\n".join(f"   {line}" for line in text.splitlines())
