"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coordinator import TransactionManager

#: real PostgreSQL and Redis servers: pg_server, pg_url, make_pg_database, private_pg, redis_*
#: the crash matrix's rows and its table after the session (tests/support/crash_matrix.py)
pytest_plugins = ["tests.support.servers", "tests.support.crash_matrix"]


@pytest.fixture
def managers() -> Iterator[list[TransactionManager]]:
    """A list for `tests.support.managers.make_manager`; every manager in it is closed after."""
    made: list[TransactionManager] = []
    yield made
    for tm in made:
        tm.close()
