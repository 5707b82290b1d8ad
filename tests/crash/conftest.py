"""Crash-matrix plumbing: rows collected by the tests, printed as one table after the session."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass
class MatrixRow:
    point: str
    expected: str
    outcome: str
    resolved: str
    recovery_ms: float | None
    verdict: str = "ok"


class Matrix:
    """The rows of this session, in the order the scenarios ran."""

    def __init__(self) -> None:
        self.rows: list[MatrixRow] = []

    def add(self, **fields: object) -> None:
        self.rows.append(MatrixRow(**fields))  # type: ignore[arg-type]


_MATRIX = Matrix()
_COLUMNS = ("point", "expected", "outcome", "in-doubt resolved", "recovery ms", "invariants")


@pytest.fixture(scope="session")
def crash_matrix() -> Matrix:
    """Tests add one row per crash scenario; `pytest_terminal_summary` prints them."""
    return _MATRIX


def render(rows: list[MatrixRow]) -> list[str]:
    cells = [
        (
            r.point,
            r.expected,
            r.outcome,
            r.resolved,
            "-" if r.recovery_ms is None else f"{r.recovery_ms:.1f}",
            r.verdict,
        )
        for r in rows
    ]
    widths = [max(len(str(c)) for c in column) for column in zip(_COLUMNS, *cells, strict=True)]

    def line(values: tuple[str, ...]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return [line(_COLUMNS), rule, *(line(c) for c in cells)]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _MATRIX.rows:
        return
    terminalreporter.section("crash matrix")
    for text in render(_MATRIX.rows):
        terminalreporter.write_line(text)
