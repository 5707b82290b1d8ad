"""What a resource learns from its server once: whether it can prepare at all, and where twopc's
own tables are (the outcome markers; a last resource's decision table), created if missing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from coordinator import ConfigurationError

from . import _errors
from ._decision_table import DecisionTable
from ._driver import Driver
from ._pooled import Pooled

log = logging.getLogger("twopc.postgres")


@dataclass(frozen=True)
class ServerFacts:
    database: str
    role: str
    max_prepared: int
    marker_table: str | None  # schema-qualified and quoted, or None without markers
    decisions: DecisionTable | None  # a last resource's decision table


@dataclass(frozen=True)
class Tables:
    """The tables a resource keeps in its database: ``None`` for one it does not keep."""

    marker: str | None
    decision: str | None


def look_up(pool: Pooled, driver: Driver, name: str, tables: Tables) -> ServerFacts:
    """The settings that make 2PC possible, and our tables (created if missing)."""

    def look() -> ServerFacts:
        with pool.connection() as connection:
            (database, role, max_prepared, schema), *_ = driver.query(
                connection,
                "SELECT current_database(), current_user, "
                "current_setting('max_prepared_transactions')::int, current_schema()",
            )
            marker, decisions = None, None
            if (tables.marker or tables.decision) and schema is None:
                raise ConfigurationError(
                    f"{name}: no schema of the search_path exists, so there is "
                    "nowhere to keep twopc's tables; create one or set search_path"
                )
            if tables.marker:
                marker = f'"{schema}"."{tables.marker}"'
                _ensure(
                    driver, connection, name, marker, ddl=_marker_ddl(marker), what="outcome marker"
                )
            if tables.decision:
                table = f'"{schema}"."{tables.decision}'
                decisions = DecisionTable(f'{table}"', epochs=f'{table}_epoch"')
                _ensure(
                    driver, connection, name, decisions.table, ddl=decisions.ddl(), what="decision"
                )
                decisions = _with_carried_columns(driver, connection, name, decisions)
        return ServerFacts(str(database), str(role), int(max_prepared), marker, decisions)

    return pool.once_more(look)


def _ensure(
    driver: Driver,
    connection: Any,
    name: str,
    table: str,
    *,
    ddl: str,
    what: str,
    grants: str = "SELECT, INSERT, DELETE",
) -> None:
    """Create one of our tables if it is missing, or say exactly what an admin must run.

    Looked up first, because ``CREATE TABLE IF NOT EXISTS`` needs the CREATE privilege on the
    schema even when the table is there, and PostgreSQL 15 took that from ordinary roles.
    """
    if driver.query(connection, "SELECT to_regclass(%s) IS NOT NULL", [table])[0][0]:
        return
    for attempt in range(3):
        try:
            driver.run(connection, ddl)
            return
        except Exception as exc:
            if _errors.is_permission_denied(exc):
                raise ConfigurationError(
                    f"{name}: the role may not create the {what} table "
                    f"({_errors.describe(exc)}); have an administrator run: {ddl}; "
                    f"GRANT {grants} ON {table} TO <role>"
                ) from exc
            # two processes creating it at once: one wins, the other sees a unique violation
            if attempt == 2 or _errors.is_unreachable(exc):
                raise


def _with_carried_columns(
    driver: Driver, connection: Any, name: str, decisions: DecisionTable
) -> DecisionTable:
    """The table, able to carry branches (`coordinator.carried`) if it has the columns and its
    node epoch table exists. A table made by an earlier version gets them added; where the role
    may not, the resource works as before (every other branch prepares) and the log says what an
    administrator can run."""
    found = driver.query(
        connection,
        "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass(%s) "
        "AND attname IN ('carried_names', 'carried') AND NOT attisdropped",
        [decisions.table],
    )[0][0]
    columns = int(found) == 2
    try:
        if not columns:
            driver.run(connection, decisions.add_carried_columns())
            columns = True
        _store_plainly(driver, connection, decisions)
        _ensure(
            driver, connection, name, decisions.epochs, ddl=decisions.epochs_ddl(),
            what="node epoch", grants="SELECT, INSERT, UPDATE",
        )  # fmt: skip
        privileges = driver.query(
            connection, "SELECT has_table_privilege(%s, 'SELECT, INSERT, UPDATE')",
            [decisions.epochs],
        )  # fmt: skip
        if not privileges[0][0]:
            raise ConfigurationError(
                f"{name}: the role may not use the node epoch table {decisions.epochs}"
            )
    except Exception as exc:
        if _errors.is_unreachable(exc):
            raise
        log.warning(
            "%s: the decision table %s cannot carry branches, so they prepare as before (%s); "
            "an administrator can run: %s",
            name,
            decisions.table,
            _errors.describe(exc),
            f"{decisions.add_carried_columns()}; {decisions.epochs_ddl()}; GRANT SELECT, "
            f"INSERT, UPDATE ON {decisions.epochs} TO <role>",
        )
        return DecisionTable(decisions.table, epochs=decisions.epochs, columns=columns)
    return DecisionTable(decisions.table, carries=True, epochs=decisions.epochs, columns=True)


def _store_plainly(driver: Driver, connection: Any, decisions: DecisionTable) -> None:
    """A table made by an earlier version gets its payloads stored without compression, where
    the role may alter it and the lock comes at once (a catalog change; otherwise it is only
    slower)."""
    found = driver.query(
        connection,
        "SELECT attstorage FROM pg_attribute WHERE attrelid = to_regclass(%s) "
        "AND attname = 'carried' AND NOT attisdropped",
        [decisions.table],
    )
    if not found or found[0][0] == "e":
        return
    try:  # one implicit transaction: the timeout is local to it
        driver.run(
            connection,
            f"SELECT set_config('lock_timeout', '1000', true); "
            f"{decisions.store_payloads_plainly()}",
        )
    except Exception as exc:
        if _errors.is_unreachable(exc):
            raise
        log.info("%s: decision payloads stay compressed (%s)", decisions.table, exc)


def _marker_ddl(table: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (gid text PRIMARY KEY, "
        "committed_at timestamptz NOT NULL DEFAULT now())"
    )
