"""Small helpers for tests over real PostgreSQL databases: a ledger table and what is prepared."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import text

#: every test ledger: one row per account, and one row per applied transfer (to spot halves)
LEDGER_DDL = (
    "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)",
    "CREATE TABLE transfers (id text PRIMARY KEY, amount bigint NOT NULL)",
)


def ledger_engine(url: str, accounts: int = 4, balance: int = 1000, **kwargs: object) -> sa.Engine:
    """An engine on ``url`` whose database holds a fresh ledger."""
    engine = sa.create_engine(url, **kwargs)  # type: ignore[arg-type]
    with engine.begin() as conn:
        for ddl in LEDGER_DDL:
            conn.execute(text(ddl))
        conn.execute(
            text("INSERT INTO accounts SELECT g, :b FROM generate_series(1, :n) g"),
            {"b": balance, "n": accounts},
        )
    return engine


def total(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(text("SELECT coalesce(sum(balance), 0) FROM accounts")).scalar_one()
        )


def transfer_ids(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(text("SELECT id FROM transfers")).scalars())


def prepared_gids(engine: sa.Engine) -> list[str]:
    """What is still prepared in this database, by anyone."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
            ).scalars()
        )


def move(session: sa.orm.Session, transfer: str, account: int, amount: int) -> None:
    """One side of a transfer: change one balance and record the transfer id."""
    session.execute(
        text("UPDATE accounts SET balance = balance + :a WHERE id = :i"),
        {"a": amount, "i": account},
    )
    session.execute(
        text("INSERT INTO transfers (id, amount) VALUES (:t, :a)"), {"t": transfer, "a": amount}
    )


def on_driver(url: str, driver: str) -> str:
    """``url`` with its driver replaced: ``psycopg2`` or ``psycopg`` (psycopg 3)."""
    return sa.make_url(url).set(drivername=f"postgresql+{driver}").render_as_string(False)
