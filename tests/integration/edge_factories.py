"""Factories for `test_cli_edge`'s configs. The test copies this file beside the config it
writes (as ``edge_factories.py``), so it is found from the config file's folder and from nowhere
else: the test's PYTHONPATH holds only the repository."""

from __future__ import annotations

import time
from pathlib import Path

from coordinator.decision_log import Decision, HeuristicRecord, LogStats
from tests.support.file_resource import FileResource
from tests.support.flaky_resource import FlakyResource

HERE = Path(__file__).resolve().parent


def ledger() -> FileResource:
    return FileResource("ledger", HERE / "ledger")


def ledger_down() -> FlakyResource:
    """The ledger's server is down: every call, listing its prepared branches too, is refused."""
    return FlakyResource.down(ledger())


def raises() -> FileResource:
    raise RuntimeError("ledger database refused the login")


def not_a_resource() -> int:
    return 42


def slow() -> FileResource:
    """Says it started, then takes its time: the test presses Ctrl-C meanwhile."""
    (HERE / "started").write_text("yes")
    time.sleep(60)
    return ledger()


class BrokenLog:
    """A log factory's log with a bug: it answers the protocol's shape, then fails inside."""

    def log_commit(self, decision: Decision) -> None: ...
    def log_end(self, gtrid: str) -> None: ...
    def log_heuristic(self, record: HeuristicRecord) -> None: ...
    def forget_heuristic(self, gtrid: str, branch: str | None = None) -> None: ...

    def pending(self) -> list[Decision]:
        raise RuntimeError("a bug in the log plugin")

    def heuristics(self) -> list[HeuristicRecord]:
        return []

    def stats(self) -> LogStats:
        return LogStats()

    def check_owner(self) -> None: ...
    def close(self) -> None: ...


def broken_log(node_id: str, read_only: bool = False) -> BrokenLog:
    return BrokenLog()
