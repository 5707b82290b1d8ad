"""``twopc status`` and ``twopc recover`` for a node whose decisions live in the SQL log."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from coordinator import Xid
from coordinator.cli import main
from coordinator.decision_log import Decision
from resource_managers.postgres import PostgresResource, SqlDecisionLog
from tests.support.pg import ledger_engine, move, prepared_gids, transfer_ids


def test_status_reads_beside_the_owner_and_recover_finishes_after_it(
    make_pg_database: Callable[[], str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log_url, ledger_url = make_pg_database(), make_pg_database()
    monkeypatch.setenv("TWOPC_CLI_TEST_LOG_URL", log_url)
    monkeypatch.setenv("TWOPC_CLI_TEST_LEDGER_URL", ledger_url)
    config = tmp_path / "twopc.json"
    config.write_text(
        json.dumps(
            {
                "node_id": "svc-1",
                "log_factory": "tests.integration.cli_factories:decision_log",
                "resources": {"ledger": "tests.integration.cli_factories:ledger"},
            }
        )
    )
    log_engine, ledger = sa.create_engine(log_url), ledger_engine(ledger_url)
    try:
        xid = Xid.branch_of("svc-1:crashed-1", "ledger")
        branch = PostgresResource(ledger, "ledger")
        move(branch.start(xid), "t1", 1, 10)
        branch.prepare(xid)
        owner = SqlDecisionLog(log_engine, "svc-1")
        owner.log_commit(Decision(xid.gtrid, ("ledger",)))

        assert main(["status", "--config", str(config)]) == 0  # the owner still holds the lease
        assert xid.gtrid in capsys.readouterr().out
        owner.close()  # the owner goes away; an operator finishes its work

        assert main(["recover", "--config", str(config)]) == 0
        assert "committed (re-driven): 1" in capsys.readouterr().out
        assert transfer_ids(ledger) == {"t1"}
        assert prepared_gids(ledger) == []
        assert main(["status", "--config", str(config)]) == 0
        assert xid.gtrid not in capsys.readouterr().out
    finally:
        log_engine.dispose()
        ledger.dispose()
