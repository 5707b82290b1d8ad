"""Which driver a branch runs on, by the engine's dialect (`_driver` says how they differ)."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from coordinator import ConfigurationError

from ._driver import Driver
from ._psycopg2 import PSYCOPG2


def for_engine(engine: Engine) -> Driver:
    driver = engine.dialect.driver
    if driver == "psycopg2":
        return PSYCOPG2
    if driver == "psycopg":
        from ._psycopg3 import PSYCOPG3  # noqa: PLC0415 - optional: only with psycopg 3

        return PSYCOPG3
    raise ConfigurationError(
        "PostgresResource needs a postgresql+psycopg2 or postgresql+psycopg engine, not "
        f"{engine.url.drivername}"
    )
