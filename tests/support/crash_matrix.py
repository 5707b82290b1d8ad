"""Crash-matrix plumbing (a pytest plugin, see tests/conftest.py): rows collected by the tests,
printed as one table after the session. A plugin of the root conftest rather than a conftest of
tests/crash: with pytest-xdist the tests run in worker processes and the controller, which
prints the summary, loads only the root conftest and its plugins."""

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


#: the name of a test report's user property that carries one matrix row
_ROW = "crash_matrix_row"


class Matrix:
    """One test's rows: each goes into the test's report (``user_properties``), which pytest-xdist
    sends from its workers to the controller, where `pytest_runtest_logreport` collects it."""

    def __init__(self, node: pytest.Item) -> None:
        self._node = node

    def add(self, **fields: object) -> None:
        MatrixRow(**fields)  # type: ignore[arg-type]  # the fields must make a row
        self._node.user_properties.append((_ROW, fields))


_ROWS: list[MatrixRow] = []  # the session's rows, in the order their reports arrived
_COLUMNS = ("point", "expected", "outcome", "in-doubt resolved", "recovery ms", "invariants")


@pytest.fixture
def crash_matrix(request: pytest.FixtureRequest) -> Matrix:
    """Tests add one row per crash scenario; `pytest_terminal_summary` prints them."""
    return Matrix(request.node)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call":
        return
    for name, fields in report.user_properties:
        if name == _ROW:
            _ROWS.append(MatrixRow(**fields))  # type: ignore[arg-type]


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
    if not _ROWS:
        return
    terminalreporter.section("crash matrix")
    for text in render(_ROWS):
        terminalreporter.write_line(text)
