"""Fixtures the cursor's integration tests share: a cursor directory and a cursor open on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from resource_managers.cursor import Cursor


@pytest.fixture
def curdir(tmp_path: Path) -> Path:
    return tmp_path / "cursor"


@pytest.fixture
def cursor(curdir: Path) -> Iterator[Cursor]:
    with Cursor(curdir) as c:
        yield c


@pytest.fixture(params=["psycopg2", "psycopg"])
def pg_driver(request: pytest.FixtureRequest) -> str:
    """The PostgreSQL driver a test's engines use: psycopg2 (the default) and psycopg 3."""
    return str(request.param)
