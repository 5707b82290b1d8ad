"""The ``twopc`` command line's edge, run as an operator runs it (a process): every failure an
operator can cause is one line ``twopc: [code] message`` with the exit code of
docs/operations.md's table, and never a traceback; monitoring can act on the exit codes of
``status`` and ``recover``; ``forget`` writes nothing for a gtrid it has no heuristic of.

Each test names the failure it reproduces (issue 16, "One CLI edge").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator import FileDecisionLog
from coordinator.cli_edge import Exit
from coordinator.decision_log import Decision, HeuristicRecord, inspect_log
from tests.support.msg_cluster import free_port

REPO = Path(__file__).resolve().parents[2]
TWOPC = "import sys; from coordinator.cli import main; sys.exit(main())"
FACTORIES = Path(__file__).with_name("edge_factories.py")
NODE = "ops-1"
SECRET = "cli edge test secret, 16+ bytes"


def env() -> dict[str, str]:
    """Only the repository on the path: a factory is found beside its config or not at all."""
    return {**os.environ, "PYTHONPATH": str(REPO), "TWOPC_SECRET": SECRET}


def twopc(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", TWOPC, *args], capture_output=True, text=True, cwd=REPO,
        env=env(), timeout=timeout,
    )  # fmt: skip


def popen(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-c", TWOPC, *args], text=True, cwd=REPO, env=env(), **kwargs
    )


def one_line_error(done: subprocess.CompletedProcess[str], code: str, exit_code: int) -> str:
    """The failure contract: exit code, one line on stderr naming the code, no traceback."""
    assert done.returncode == exit_code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"twopc: [{code}] "), lines[0]
    return lines[0]


def config(folder: Path, resources: dict[str, str] | None = None, **keys: object) -> Path:
    """A config in its own folder, with the test factories beside it and an empty log (the
    service creates it at first start; the command line never does)."""
    (folder / "txlog").mkdir(parents=True, exist_ok=True)
    shutil.copy(FACTORIES, folder / "edge_factories.py")
    path = folder / "twopc.json"
    body = {"node_id": NODE, "log": "txlog", "resources": resources or {}, **keys}
    path.write_text(json.dumps(body))
    return path


LEDGER = {"ledger": "edge_factories:ledger"}


# -- usage and configuration: exit 2 ------------------------------------------------------------


def test_a_missing_config_file_says_where_it_looked(tmp_path: Path) -> None:
    line = one_line_error(twopc("status", "-c", str(tmp_path / "nope.toml")), "configuration", 2)
    assert "no config file" in line and "-c PATH" in line


def test_an_invalid_config_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "twopc.json"
    bad.write_text("{not json")
    assert "cannot read config" in one_line_error(
        twopc("recover", "-c", str(bad)), "configuration", 2
    )
    bad.write_text(json.dumps({"node_id": NODE}))
    assert "exactly one of 'log'" in one_line_error(
        twopc("status", "-c", str(bad)), "configuration", 2
    )


def test_a_usage_error_is_one_line_with_exit_2(tmp_path: Path) -> None:
    line = one_line_error(twopc("status", "--older-than", "soon"), "usage", 2)
    assert "--older-than" in line and "twopc status --help" in line
    one_line_error(twopc("no-such-command"), "usage", 2)


def test_a_factory_beside_the_config_is_found_without_pythonpath(tmp_path: Path) -> None:
    cfg = config(tmp_path / "etc", LEDGER)
    done = twopc("recover", "-c", str(cfg))  # cwd is the repository, not the config's folder
    assert done.returncode == 0, done.stderr
    assert "recover: resource ledger lists 0 prepared branches" in done.stderr  # progress


def test_a_factory_that_raises_names_the_factory(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"ledger": "edge_factories:raises"})
    line = one_line_error(twopc("recover", "-c", str(cfg)), "configuration", 2)
    assert "edge_factories:raises" in line and "RuntimeError: ledger database refused" in line


def test_a_factory_that_cannot_be_imported_says_where_it_looked(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"ledger": "no_such_module:ledger"})
    line = one_line_error(twopc("recover", "-c", str(cfg)), "configuration", 2)
    assert "no_such_module" in line and "config file's folder" in line
    (tmp_path / "broken_mod.py").write_text("raise ImportError('half installed')\nx = (\n")
    cfg = config(tmp_path, {"ledger": "broken_mod:ledger"})
    assert "broken_mod" in one_line_error(twopc("recover", "-c", str(cfg)), "configuration", 2)
    cfg = config(tmp_path, {"ledger": "edge_factories:not_a_resource"})
    line = one_line_error(twopc("recover", "-c", str(cfg)), "configuration", 2)
    assert "not a resource" in line


def test_a_wrong_directory_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(twopc("log", "inspect", str(tmp_path / "typo")), "configuration", 2)
    assert "does not exist" in line
    cfg = config(tmp_path, LEDGER, log="no-such-log")
    for command in ("status", "recover"):  # recover must not create an empty log and report 0
        done = twopc(command, "-c", str(cfg))
        assert "no decision log directory" in one_line_error(done, "configuration", 2)
    assert not (tmp_path / "no-such-log").exists()
    journal = twopc("journal", "check", "--dir", str(tmp_path / "typo"), "--kind", "cursor")
    assert "does not exist" in one_line_error(journal, "configuration", 2)
    serve = twopc("serve", "cursor", "--dir", str(cfg), "--listen", "127.0.0.1:0")
    assert "is a file" in one_line_error(serve, "configuration", 2)


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = twopc(
            "serve", "cursor", "--dir", str(tmp_path / "c"), "--listen", f"127.0.0.1:{port}"
        )
    line = one_line_error(done, "configuration", 2)
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in line


# -- the process's own edges ----------------------------------------------------------------------


def test_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    """``twopc log inspect DIR | head -1``: more rows than a pipe holds, the reader leaves."""
    log = FileDecisionLog(tmp_path / "txlog")
    for i in range(3000):
        log.log_commit(Decision(f"{NODE}:g-{i}", ("ledger",), None, time.time()))
    log.close()
    proc = popen("log", "inspect", str(tmp_path / "txlog"), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith("segment")
    proc.stdout.close()
    assert proc.wait(timeout=60) == Exit.PIPE_CLOSED
    assert proc.stderr.read() == ""
    shell = subprocess.run(
        ["bash", "-c", f"'{sys.executable}' -c '{TWOPC}' log inspect '{tmp_path / 'txlog'}' "
         "| head -1"],
        capture_output=True, text=True, cwd=REPO, env=env(), timeout=60,
    )  # fmt: skip
    assert shell.stdout.startswith("segment") and shell.stderr == ""


def test_ctrl_c_is_one_line(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"ledger": "edge_factories:slow"})
    proc = popen("recover", "-c", str(cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert "stopped by Ctrl-C" in one_line_error(done, "interrupted", Exit.INTERRUPTED)


def test_an_unexpected_exception_is_an_internal_error_and_v_shows_it(tmp_path: Path) -> None:
    cfg = tmp_path / "twopc.json"
    config(tmp_path)
    cfg.write_text(json.dumps({"node_id": NODE, "log_factory": "edge_factories:broken_log"}))
    line = one_line_error(twopc("status", "-c", str(cfg)), "internal-error", Exit.INTERNAL)
    assert "RuntimeError: a bug in the log plugin" in line and "-v" in line
    verbose = twopc("-v", "status", "-c", str(cfg))
    assert verbose.returncode == Exit.INTERNAL
    assert "Traceback" in verbose.stderr and verbose.stderr.rstrip().splitlines()[-1] == line


# -- exit codes monitoring acts on ----------------------------------------------------------------


def test_status_exits_3_for_an_old_in_doubt_and_json_is_readable(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    log = FileDecisionLog(tmp_path / "txlog")
    log.log_commit(Decision(f"{NODE}:old-1", ("ledger", "cache"), None, time.time() - 900))
    log.close()
    done = twopc("status", "-c", str(cfg))
    assert done.returncode == Exit.IN_DOUBT, done.stdout + done.stderr
    assert f"{NODE}:old-1" in done.stdout and "ledger,cache" in done.stdout
    assert "15m00s" in done.stdout or "15m01s" in done.stdout
    assert "None" not in done.stdout
    assert twopc("status", "-c", str(cfg), "--older-than", "3600").returncode == Exit.OK
    report = json.loads(twopc("status", "-c", str(cfg), "--json").stdout)
    (row,) = report["in_doubt"]
    assert row["gtrid"] == f"{NODE}:old-1" and row["branches"] == ["ledger", "cache"]
    assert row["written_at"].endswith("Z") and row["old"] is True  # ISO time, not an epoch float
    assert report["heuristics"] == [] and report["exit_code"] == Exit.IN_DOUBT


def test_a_live_heuristic_fails_status_and_recover_until_forgotten(tmp_path: Path) -> None:
    cfg = config(tmp_path, LEDGER)
    gtrid = f"{NODE}:heur-1"
    log = FileDecisionLog(tmp_path / "txlog")
    log.log_heuristic(HeuristicRecord(gtrid, "ledger", "heuristic-rollback", "", time.time()))
    log.close()

    status = twopc("status", "-c", str(cfg))
    assert status.returncode == Exit.HEURISTIC and gtrid in status.stdout
    recover = twopc("recover", "-c", str(cfg))
    assert recover.returncode == Exit.HEURISTIC, recover.stdout + recover.stderr
    assert f"{gtrid} on ledger: heuristic-rollback" in recover.stdout  # readable, no base64 gid
    assert "heuristic outcomes (a human must look; `twopc forget` when done): 1" in recover.stdout

    records = len(inspect_log(tmp_path / "txlog"))
    invalid = one_line_error(twopc("forget", "bad gtrid!!", "-c", str(cfg)), "invalid-xid", 2)
    assert "invalid gtrid 'bad gtrid!!'" in invalid
    unknown = one_line_error(twopc("forget", f"{NODE}:nope", "-c", str(cfg)), "no-heuristic", 2)
    assert "nothing written" in unknown
    other_branch = twopc("forget", gtrid, "--branch", "cache", "-c", str(cfg))
    one_line_error(other_branch, "no-heuristic", 2)
    assert len(inspect_log(tmp_path / "txlog")) == records  # no FORGET record was written

    forgot = twopc("forget", gtrid, "-c", str(cfg))
    assert forgot.returncode == 0, forgot.stderr
    assert forgot.stdout.startswith(f"forgot {gtrid} on ledger: heuristic-rollback (recorded ")
    assert twopc("status", "-c", str(cfg)).returncode == Exit.OK
    assert twopc("recover", "-c", str(cfg)).returncode == Exit.OK


def test_recover_exits_5_when_a_resource_is_unreachable_and_promises_no_retry(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, {"ledger": "edge_factories:ledger_down"})
    done = twopc("recover", "-c", str(cfg))
    assert done.returncode == Exit.UNREACHABLE, done.stdout + done.stderr
    assert "not finished (run `twopc recover` again once it is reachable): 1" in done.stdout
    assert "listing resource ledger: ConnectionRefusedError" in done.stdout
    assert "will retry" not in done.stdout + done.stderr and "Traceback" not in done.stderr
    report = json.loads(twopc("recover", "-c", str(cfg), "--json").stdout)
    assert report["not_finished"] and report["heuristics"] == []


def test_an_unreachable_cursor_server_exits_5() -> None:
    done = twopc("subscription", "list", "--connect", f"127.0.0.1:{free_port()}")
    assert "no cursor server answers" in one_line_error(done, "remote-unavailable", 5)


# -- twopc serve log: an unreachable cursor is said, without -v, without flooding ---------------


def test_serve_log_warns_that_it_cannot_reach_its_cursor_with_back_off(tmp_path: Path) -> None:
    cursor = f"127.0.0.1:{free_port()}"  # nobody listens there
    said = f"cannot reach cursor {cursor}"
    output = tmp_path / "serve.out"
    with output.open("w") as sink:
        proc = popen("serve", "log", "--dir", str(tmp_path / "log"), "--listen", "127.0.0.1:0",
                     "--cursor", cursor, stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while said not in output.read_text():
                assert time.monotonic() < deadline and proc.poll() is None, output.read_text()
                time.sleep(0.1)
            time.sleep(3)  # attempts back off from 0.1 s: several more fail meanwhile
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
    out = output.read_text()
    assert proc.returncode == 0, out
    warnings = [line for line in out.splitlines() if said in line]
    assert warnings[0].startswith(f"WARNING twopc.transfer: transfer: {said}: "), out
    assert len(warnings) == 1, out  # the next one only 10 s after the first
    assert "Traceback" not in out


@pytest.mark.parametrize("listing", [["status"], ["recover"], ["log", "inspect"]])
def test_every_listing_command_has_json(tmp_path: Path, listing: list[str]) -> None:
    cfg = config(tmp_path)
    FileDecisionLog(tmp_path / "txlog").close()
    where = [str(tmp_path / "txlog")] if listing[0] == "log" else ["-c", str(cfg)]
    done = twopc(*listing, *where, "--json")
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)


def test_recover_shows_progress_on_a_long_run(tmp_path: Path) -> None:
    """120 orphans of a crash (prepared, no decision): a line per resource listed and per 100
    branches resolved, on stderr, while the report stays on stdout."""
    from coordinator import Xid
    from tests.support.file_resource import FileResource

    cfg = config(tmp_path, LEDGER)
    ledger = FileResource("ledger", tmp_path / "ledger")
    for i in range(120):
        xid = Xid.branch_of(f"{NODE}:orphan-{i}", "ledger")
        ledger.start(xid).add("n", 1)
        ledger.prepare(xid)
    done = twopc("recover", "-c", str(cfg))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rolled back (presumed abort): 120" in done.stdout
    assert done.stderr.splitlines() == [
        "recover: resource ledger lists 120 prepared branches",
        "recover: 100 branches resolved so far",
    ]
