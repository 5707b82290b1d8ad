"""The operator's command line, run as users run it: a subprocess on a real log directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator import ConfigurationError, FileDecisionLog, InvalidXidError, TransactionManager
from coordinator import config as config_mod
from coordinator.cli import summarize, table


def twopc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True
    )


def write_config(tmp_path: Path, resources: dict[str, str] | None = None) -> Path:
    path = tmp_path / "twopc.json"
    path.write_text(json.dumps({"node_id": "ops-1", "log": "txlog", "resources": resources or {}}))
    return path


def test_table_formats_and_says_none() -> None:
    assert table(["a"], []) == "(none)"
    assert table(["a", "bb"], [(1, 2)]).splitlines() == ["a  bb", "-  --", "1  2"]


def test_config_is_validated(tmp_path: Path) -> None:
    cfg = config_mod.load(write_config(tmp_path, {"ledger": "json:loads"}))
    assert cfg.log == tmp_path / "txlog" and cfg.node_id == "ops-1"
    with pytest.raises(ConfigurationError, match="must look like"):
        config_mod.load_object("no-colon")
    with pytest.raises(ConfigurationError, match="cannot load"):
        config_mod.load_object("no.such.module:x")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"node_id": "a:b", "log": "x"}))
    with pytest.raises(InvalidXidError):
        config_mod.load(bad)
    assert cfg.sub_branch_grace == 900.0
    graced = tmp_path / "graced.json"
    graced.write_text(json.dumps({"node_id": "ops-1", "log": "x", "sub_branch_grace": 120}))
    assert config_mod.load(graced).sub_branch_grace == 120.0
    graced.write_text(json.dumps({"node_id": "ops-1", "log": "x", "sub_branch_grace": 0}))
    with pytest.raises(ConfigurationError, match="sub_branch_grace"):
        config_mod.load(graced)


def test_status_recover_and_inspect_on_an_empty_log(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    FileDecisionLog(tmp_path / "txlog").close()
    status = twopc("status", "-c", str(cfg))
    assert status.returncode == 0, status.stderr
    assert "in-doubt transactions" in status.stdout and "(none)" in status.stdout
    recover = twopc("recover", "-c", str(cfg))
    assert recover.returncode == 0, recover.stderr
    assert "rolled back (presumed abort): 0" in recover.stdout
    assert twopc("log", "inspect", str(tmp_path / "txlog")).returncode == 0


def test_status_lists_a_pending_decision_while_the_log_is_held(tmp_path: Path) -> None:
    from coordinator.decision_log import Decision

    log = FileDecisionLog(tmp_path / "txlog")
    log.log_commit(Decision("ops-1:x-1", ("a", "b"), None, 1.0))
    try:
        status = twopc("status", "-c", str(write_config(tmp_path)))  # the lock is held here
    finally:
        log.close()
    assert status.returncode == 3, status.stderr  # written in 1970: in doubt past --older-than
    assert "ops-1:x-1" in status.stdout and "a,b" in status.stdout
    assert "1970-01-01T00:00:01Z" in status.stdout


def test_recover_refuses_while_another_manager_holds_the_log(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    with TransactionManager("ops-1", FileDecisionLog(tmp_path / "txlog"), recovery_interval=None):
        proc = twopc("recover", "-c", str(cfg))
    assert proc.returncode == 2  # docs/operations.md, exit codes
    assert proc.stderr.startswith("twopc: [log-locked]") and proc.stderr.count("\n") == 1


def test_summarize_folds_end_and_forget() -> None:
    rows = [
        {"kind": "COMMIT", "gtrid": "g1", "branches": ["a"], "written_at": 0.0},
        {"kind": "COMMIT", "gtrid": "g2", "branches": ["a"], "written_at": 0.0},
        {"kind": "END", "gtrid": "g1"},
        {"kind": "HEURISTIC", "gtrid": "g2", "branch": "a", "outcome": "heuristic-rollback"},
        {"kind": "HEURISTIC", "gtrid": "g3", "branch": "b", "outcome": "heuristic-commit"},
        {"kind": "FORGET", "gtrid": "g3", "branch": None},
    ]
    pending, heuristics, notes = summarize(rows)
    assert list(pending) == ["g2"]
    assert [h["gtrid"] for h in heuristics] == ["g2"]
    assert notes == []


def test_cells_and_times_read_as_an_operator_reads_them() -> None:
    from coordinator.cli_output import age, cell, readable, when

    assert [cell(v) for v in (None, "", True, False, ["a", "b"], (), 1.5, 3)] == [
        "-", "-", "yes", "no", "a,b", "-", "1.5", "3",
    ]  # fmt: skip
    assert when(0) is None and when(None) is None and when(86400.0) == "1970-01-02T00:00:00Z"
    assert [age(s) for s in (5, 185, 7380, 93600, None)] == ["5s", "3m05s", "2h03m", "1d02h", None]
    assert readable({"written_at": 86400.0, "branches": ("a",), "deadline": None}) == {
        "written_at": "1970-01-02T00:00:00Z", "branches": ["a"], "deadline": None,
    }  # fmt: skip


def test_exit_codes_rank_by_urgency_and_errors_by_who_acts() -> None:
    from coordinator import HeuristicMixed, LogLockedError, TransientError
    from coordinator.cli_edge import Exit, exit_code_of, most_urgent

    assert most_urgent() == Exit.OK
    assert most_urgent(Exit.ATTENTION, Exit.IN_DOUBT) == Exit.IN_DOUBT
    assert most_urgent(Exit.IN_DOUBT, Exit.UNREACHABLE, Exit.HEURISTIC) == Exit.HEURISTIC
    assert exit_code_of(HeuristicMixed("x")) == Exit.HEURISTIC
    assert exit_code_of(TransientError("x")) == Exit.UNREACHABLE
    assert exit_code_of(LogLockedError("x")) == exit_code_of(InvalidXidError("x")) == Exit.USAGE


def test_recovery_names_branches_by_gtrid_not_by_gid() -> None:
    from coordinator import Xid
    from coordinator.recovery import describe_error, describe_key

    gid = Xid.branch_of("ops-1:x-1", "ledger").to_gid()
    assert describe_key(gid) == "ops-1:x-1 on ledger"
    assert describe_key("ops-1:x-1") == "ops-1:x-1"
    assert describe_key("recover:ledger") == "listing resource ledger"
    assert describe_error(ConnectionRefusedError("refused")) == "ConnectionRefusedError: refused"
    assert describe_error(InvalidXidError("bad")) == "[invalid-xid] bad"


def test_verbose_after_the_subcommand_shows_the_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``twopc status -v`` is ``twopc -v status``: the one-line error, then the traceback."""
    from coordinator.cli import main

    assert main(["status", "-c", str(tmp_path / "missing.toml"), "-v"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "[configuration] no config file" in err
