"""The crash matrix: SIGKILL the coordinator at every named crash point, recover, check invariants.

Each scenario runs ``worker.py run`` in a subprocess with ``TWOPC_CRASH_AT`` armed, so the process
really dies (no ``finally``, no flush) over three durable `FileResource`s and a `FileDecisionLog`.
Earlier transactions of the same run commit first, so the crash must not disturb what was already
acknowledged. A fresh process then opens the same files under the same node id and runs
``tm.recover()``; for ``recovery.*`` points a first recovery is itself killed half-way. Finally
this process reads the durable state and checks, by name:

- ``atomicity``: no gtrid committed on one resource and rolled back on another.
- ``decision_stable``: the interrupted transaction ended as the point implies (a crash before the
  decision is forced aborts; after it, commits; a crash inside the log write goes either way, the
  same way everywhere), and every transaction that reported a rollback stayed rolled back.
- ``no_in_doubt_residue``: no prepared branch left on any resource; no pending decision in the log.
- ``durable_ack``: every commit the worker acknowledged is committed on each resource it wrote.
- ``exactly_once``: balances and counters equal the number of committed transactions (a commit
  re-driven by recovery applied nothing twice), and each audit log agrees with its data.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coordinator import FileDecisionLog, Xid
from tests.support.file_resource import (
    COMMITTED,
    ROLLED_BACK,
    AuditEntry,
    DurableState,
    read_state,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
RESOURCES = ("a", "b", "c")
EITHER = "either"
LEDGER = ("2pc", "2pc", "2pc")  # the third transaction is the one the crash interrupts

pytestmark = pytest.mark.crash


@dataclass(frozen=True)
class Scenario:
    """Crash at ``point`` (``name[:nth]``) while running ``plan``; expect ``expect`` after recovery.

    ``first``: a crash point for the run before ``point`` (then ``point`` is armed in recovery).
    ``last``: the resource that is the logging last resource (``c``), or None for none.
    """

    point: str
    expect: str
    plan: tuple[str, ...] = LEDGER
    first: str | None = None
    segment_bytes: int | None = None
    label: str = ""
    last: str | None = None
    asynchronous: bool = False  # async_phase_two: phase two on a background worker
    lazy: bool = False  # the resources (but a last one) write their commit records lazily
    carried: bool = False  # a rides c's commit (`coordinator.carried`): needs ``last="c"``

    @property
    def name(self) -> str:
        return self.point.partition(":")[0]

    @property
    def id(self) -> str:
        return f"{self.name}{f' ({self.label})' if self.label else ''}"


def _llr(point: str, expect: str, plan: tuple[str, ...] = LEDGER, **kw: str) -> Scenario:
    label = f"llr {kw.pop('label')}" if "label" in kw else "llr"
    return Scenario(point, expect, plan, label=label, last="c", **kw)  # type: ignore[arg-type]


#: c is the logging last resource: a and b prepare, c commits with the decision row (the commit
#: point), then a and b commit; recovery reads c's row.
LLR_SCENARIOS = [
    _llr("tm.before_prepare:3", ROLLED_BACK),
    _llr("tm.after_prepare.2:3", ROLLED_BACK),
    _llr("tm.llr.before_commit:3", ROLLED_BACK),
    _llr("fileres.c.after_apply:3", COMMITTED),  # c's data and decision row are on disk
    _llr("tm.llr.after_commit:3", COMMITTED),
    _llr("tm.after_commit.1:3", COMMITTED),
    _llr("tm.after_commit.2:3", COMMITTED),
    _llr("tm.before_end_record:3", COMMITTED),
    _llr("tm.read_only.after_vote", ROLLED_BACK, ("2pc", "2pc", "rob")),  # before c commits
    _llr("tm.after_rollback.1", ROLLED_BACK, ("2pc", "2pc", "veto")),  # c's commit refuses
    _llr("tm.after_rollback.3", ROLLED_BACK, ("2pc", "2pc", "veto")),
    _llr("recovery.llr.after_lookup", COMMITTED, first="tm.llr.after_commit:3", label="redo"),
    _llr("recovery.llr.after_lookup", ROLLED_BACK, first="tm.llr.before_commit:3", label="abort"),
    _llr("recovery.after_resolve.1", COMMITTED, first="tm.llr.after_commit:3", label="redo"),
    _llr("recovery.after_resolve.2", ROLLED_BACK, first="tm.llr.before_commit:3", label="abort"),
]


def _async(point: str, **kw: Any) -> Scenario:
    label = "async llr" if kw.get("last") else "async"
    return Scenario(point, COMMITTED, label=label, asynchronous=True, **kw)


#: async_phase_two: the caller returns once the decision is durable, a worker commits the
#: branches; a kill there (the caller may have acknowledged already) is finished by recovery
ASYNC_SCENARIOS = [
    _async("tm.async_phase_two.handed_off:3"),
    _async("tm.after_commit.1:3"),
    _async("tm.after_commit.3:3"),
    _async("tm.before_end_record:3"),
    _async("tm.after_commit.1:3", last="c"),
]


def _lazy(point: str, **kw: Any) -> Scenario:
    label = "lazy llr" if kw.get("last") else "lazy"
    return Scenario(point, COMMITTED, label=kw.pop("label", label), lazy=True, **kw)


#: lazy commit records: phase two queues a and b's commits, which reach the disk a moment later;
#: the decision (COMMIT record, or c's decision row) is kept until they have. A kill before that
#: leaves them prepared for recovery; after it (maybe after the acknowledgment) recovery ends it.
LAZY_SCENARIOS = [
    _lazy("fileres.a.after_lazy_commit:3"),
    _lazy("fileres.b.after_lazy_commit:3", last="c"),
    _lazy("tm.end_deferred:3"),
    _lazy("tm.end_deferred:3", last="c"),
    _lazy("fileres.a.lazy_durable:3"),
    _lazy("fileres.b.lazy_durable:3", last="c"),
    _lazy("tm.before_deferred_end:3"),
    _lazy("tm.before_deferred_end:3", last="c"),
    _lazy("recovery.after_resolve.1", first="tm.end_deferred:3", label="lazy redo"),
]


def _carried(point: str, expect: str, **kw: Any) -> Scenario:
    label = kw.pop("label", "carried lazy" if kw.get("lazy") else "carried")
    return Scenario(point, expect, label=label, last="c", carried=True, **kw)


#: a rides c's commit: it stages its write set in memory, c's decision row holds it, and a
#: applies it after the commit point, remembering the gid until the row is gone. A kill before
#: a's apply is durable leaves the write set only in the row (recovery restores it); one after
#: leaves it in both (recovery must not apply it twice); one before a forgets leaves a gid
#: remembered with no row (recovery forgets it).
CARRIED_SCENARIOS = [
    _carried("fileres.a.after_stage:3", ROLLED_BACK),
    _carried("tm.carried.after_stage:3", ROLLED_BACK),
    _carried("tm.llr.before_commit:3", ROLLED_BACK),
    _carried("fileres.c.after_apply:3", COMMITTED),
    _carried("tm.llr.after_commit:3", COMMITTED),
    _carried("fileres.a.after_apply:3", COMMITTED),
    _carried("tm.end_deferred:3", COMMITTED, lazy=True),
    _carried("tm.before_deferred_end:3", COMMITTED, lazy=True),
    _carried("tm.carried.before_forget:2", COMMITTED),
    _carried("fileres.a.after_lazy_commit:3", COMMITTED, lazy=True),
    _carried("fileres.a.lazy_durable:3", COMMITTED, lazy=True),
    _carried("recovery.carried.after_restore", COMMITTED, first="tm.llr.after_commit:3"),
]

SCENARIOS = [
    Scenario("tm.before_prepare:3", ROLLED_BACK),
    Scenario("tm.after_prepare.1:3", ROLLED_BACK),
    Scenario("tm.after_prepare.2:3", ROLLED_BACK),
    Scenario("tm.after_prepare.3:3", ROLLED_BACK),
    Scenario("tm.read_only.after_vote", ROLLED_BACK, ("2pc", "2pc", "ro")),
    Scenario("tm.before_decision_write:3", ROLLED_BACK),
    # The journal writes one batch per COMMIT (each carrying the previous END): batch 3 is the
    # third transaction's decision. A kill leaves unsynced writes in the page cache, so a crash
    # after the write but before the fsync still commits; a torn write is cut off on reopen.
    Scenario("log.before_write:3", ROLLED_BACK),
    Scenario("log.torn_write:3", EITHER),
    Scenario("log.after_write:3", EITHER),
    Scenario("log.after_fsync:3", COMMITTED),
    Scenario("tm.after_decision_fsync:3", COMMITTED),
    Scenario("tm.after_commit.1:3", COMMITTED),
    Scenario("tm.after_commit.2:3", COMMITTED),
    Scenario("tm.after_commit.3:3", COMMITTED),
    Scenario("tm.before_end_record:3", COMMITTED),
    Scenario("tm.after_rollback.1", ROLLED_BACK, ("2pc", "2pc", "veto")),
    Scenario("tm.after_rollback.2", ROLLED_BACK, ("2pc", "2pc", "veto")),
    Scenario("tm.after_rollback.3", ROLLED_BACK, ("2pc", "2pc", "veto")),
    Scenario("tm.one_phase.before_ack", COMMITTED, ("2pc", "2pc", "1pc")),
    # Tiny segments make the log compact after a few transactions; the rollover runs after a
    # durable append, so the interrupted transaction's decision is already on disk.
    Scenario("log.during_compaction", COMMITTED, ("2pc",) * 8, segment_bytes=512),
    Scenario(
        "recovery.after_resolve.1", COMMITTED, first="tm.after_decision_fsync:3", label="redo"
    ),
    Scenario(
        "recovery.after_resolve.2", COMMITTED, first="tm.after_decision_fsync:3", label="redo"
    ),
    Scenario("recovery.after_resolve.1", ROLLED_BACK, first="tm.after_prepare.3:3", label="abort"),
    Scenario("recovery.after_resolve.2", ROLLED_BACK, first="tm.after_prepare.3:3", label="abort"),
    *(Scenario(f"fileres.{r}.after_stage:3", ROLLED_BACK) for r in RESOURCES),
    *(Scenario(f"fileres.{r}.after_apply:3", COMMITTED) for r in RESOURCES),
    *LLR_SCENARIOS,
    *ASYNC_SCENARIOS,
    *LAZY_SCENARIOS,
    *CARRIED_SCENARIOS,
]


# -- running the worker --------------------------------------------------------------------------


def worker(args: Sequence[str], crash_at: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
    if crash_at:
        env["TWOPC_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, str(WORKER), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def killed_at(proc: subprocess.CompletedProcess[str], spec: str) -> None:
    """The point must have fired: a scenario that never reaches its point tests nothing."""
    name = spec.partition(":")[0]
    assert proc.returncode == -signal.SIGKILL, (
        f"expected death by SIGKILL at {spec}, got returncode {proc.returncode}: the point never "
        f"fired\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    assert f"crash point {name} reached" in proc.stderr, proc.stderr


@dataclass
class Transcript:
    """What the killed worker printed: every transaction begun, and how each one ended."""

    kinds: dict[str, str]
    writers: dict[str, list[str]]
    acked: list[str]
    aborted: list[str]
    #: phase two ran behind the caller: the killed transaction may have been acknowledged
    asynchronous: bool = False

    @classmethod
    def parse(cls, stdout: str, *, asynchronous: bool = False) -> Transcript:
        t = cls({}, {}, [], [], asynchronous)
        for line in stdout.splitlines():
            word, *rest = line.split()
            if word == "BEGIN":
                t.kinds[rest[0]], t.writers[rest[0]] = rest[1], rest[2].split(",")
            elif word == "ACK":
                t.acked.append(rest[0])
            elif word == "ABORTED":
                t.aborted.append(rest[0])
        return t

    @property
    def interrupted(self) -> str:
        open_ = [g for g in self.kinds if g not in self.acked and g not in self.aborted]
        if self.asynchronous and not open_:
            return list(self.kinds)[-1]  # acknowledged, then killed in its phase two
        assert len(open_) == 1, f"expected one interrupted transaction, found {open_}"
        return open_[0]


# -- invariants ----------------------------------------------------------------------------------


def atomicity(states: dict[str, DurableState]) -> list[str]:
    committed = set().union(*(s.audited(COMMITTED) for s in states.values()))
    rolled_back = set().union(*(s.audited(ROLLED_BACK) for s in states.values()))
    return [f"atomicity: {g} committed and rolled back" for g in sorted(committed & rolled_back)]


def fate(states: dict[str, DurableState], gtrid: str, writers: list[str]) -> str:
    """committed (on every writer), rolled-back (on none), or mixed."""
    on = [states[r].outcome(gtrid) == COMMITTED for r in writers]
    return COMMITTED if all(on) else ROLLED_BACK if not any(on) else "mixed"


def decision_stable(
    states: dict[str, DurableState], t: Transcript, expect: str
) -> tuple[str, list[str]]:
    gtrid = t.interrupted
    ended = fate(states, gtrid, t.writers[gtrid])
    problems = []
    if ended == "mixed" or expect not in (EITHER, ended):
        problems.append(f"decision_stable: interrupted {gtrid} ended {ended}, expected {expect}")
    for g in t.aborted:
        if fate(states, g, t.writers[g]) != ROLLED_BACK:
            problems.append(f"decision_stable: {g} reported rolled back but committed somewhere")
    return ended, problems


def no_in_doubt_residue(states: dict[str, DurableState], pending: list[str]) -> list[str]:
    problems = [
        f"no_in_doubt_residue: {name} still holds prepared {sorted(x.gtrid for x in s.prepared)}"
        for name, s in states.items()
        if s.prepared
    ]
    return problems + [f"no_in_doubt_residue: decision pending for {g}" for g in pending]


def durable_ack(states: dict[str, DurableState], t: Transcript) -> list[str]:
    return [
        f"durable_ack: acknowledged {g} is {states[r].outcome(g)} on {r}"
        for g in t.acked
        for r in t.writers[g]
        if states[r].outcome(g) != COMMITTED
    ]


def exactly_once(states: dict[str, DurableState], t: Transcript) -> list[str]:
    def committed_ledger(resource: str) -> int:
        return sum(
            states[resource].outcome(g) == COMMITTED
            for g, kind in t.kinds.items()
            if kind != "1pc" and resource in t.writers[g]
        )

    problems = [f"exactly_once: {p}" for s in states.values() for p in s.audit_problems()]
    seen = {
        "a": states["a"].data.get("balance", 0),
        "b": states["b"].data.get("balance", 0),
        "c": states["c"].data.get("count", 0),
    }
    wanted = {"a": -committed_ledger("a"), "b": committed_ledger("b"), "c": committed_ledger("c")}
    return problems + [
        f"exactly_once: {r} holds {seen[r]}, {wanted[r]} committed transactions say otherwise"
        for r in RESOURCES
        if seen[r] != wanted[r]
    ]


def decision_rows_cleaned(last: DurableState) -> list[str]:
    """A last resource keeps no commit row once recovery saw every branch of it ended."""
    rows = sorted(g for g, row in last.decisions.items() if row["o"] == "c")
    return [f"decision_rows_cleaned: commit rows left for {rows}"] if rows else []


def pending_decisions(log_dir: Path) -> list[str]:
    log = FileDecisionLog(log_dir)
    try:
        return [d.gtrid for d in log.pending()]
    finally:
        log.close()


# -- the matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.id for s in SCENARIOS])
def test_crash_point(scenario: Scenario, tmp_path: Path, crash_matrix: Any) -> None:
    run_args = ["run", str(tmp_path), "--plan", ",".join(scenario.plan)]
    recover_args = ["recover", str(tmp_path)]
    if scenario.last:
        run_args += ["--last", scenario.last]
        recover_args += ["--last", scenario.last]
    if scenario.asynchronous:
        run_args += ["--async-phase-two"]
    if scenario.lazy:
        run_args += ["--lazy"]
    if scenario.carried:
        run_args += ["--carried"]
        recover_args += ["--carried"]
    if scenario.segment_bytes:
        run_args += ["--segment-bytes", str(scenario.segment_bytes)]
        recover_args += ["--segment-bytes", str(scenario.segment_bytes)]

    first = worker(run_args, scenario.first or scenario.point)
    killed_at(first, scenario.first or scenario.point)
    if scenario.first:
        killed_at(worker(recover_args, scenario.point), scenario.point)
    recovered = worker(recover_args, None)
    assert recovered.returncode == 0, recovered.stderr
    report = json.loads(recovered.stdout.split("RECOVERED ", 1)[1])
    assert not report["failures"], report

    # a lazy record's durability (and the END it releases) may come after the acknowledgment
    transcript = Transcript.parse(first.stdout, asynchronous=scenario.asynchronous or scenario.lazy)
    states = {r: read_state(tmp_path / r) for r in RESOURCES}
    ended, problems = decision_stable(states, transcript, scenario.expect)
    problems += atomicity(states)
    problems += no_in_doubt_residue(states, pending_decisions(tmp_path / "log"))
    problems += durable_ack(states, transcript)
    problems += exactly_once(states, transcript)
    if scenario.last:
        problems += decision_rows_cleaned(states[scenario.last])
    if scenario.carried:
        problems += [f"carried: {g} still remembered" for g in sorted(states["a"].remembered)]

    crash_matrix.add(
        point=scenario.id,
        expected=scenario.expect,
        outcome=ended,
        resolved=f"{len(report['committed'])} commit, {len(report['rolled_back'])} abort",
        recovery_ms=report["recovery_ms"],
        verdict="ok" if not problems else "FAIL " + ",".join(p.split(":")[0] for p in problems),
    )
    assert not problems, "\n".join(problems)


# -- the matrix covers the code ------------------------------------------------------------------

_CALL = re.compile(r"""crash_point\(\s*(f?)(["'])(.+?)\2""")


def declared_points() -> set[str]:
    """Every crash point named in the coordinator and the test resource, as regexes."""
    sources = [*(ROOT / "coordinator").rglob("*.py"), ROOT / "tests/support/file_resource.py"]
    found = set()
    for path in sources:
        for is_f, _, text in (m.groups() for m in _CALL.finditer(path.read_text())):
            parts = re.split(r"\{[^}]*\}", text) if is_f else [text]
            found.add("[^.]+".join(re.escape(p) for p in parts))
    return found


def test_matrix_covers_every_crash_point() -> None:
    points = {s.name for s in SCENARIOS} | {s.first.partition(":")[0] for s in SCENARIOS if s.first}
    declared = declared_points()
    assert len(declared) >= 15, declared  # the scan itself works
    uncovered = [p for p in declared if not any(re.fullmatch(p, name) for name in points)]
    unknown = [n for n in points if not any(re.fullmatch(p, n) for p in declared)]
    assert not uncovered, f"crash points with no scenario: {uncovered}"
    assert not unknown, f"scenarios naming no declared crash point: {unknown}"


def test_the_checkers_catch_what_they_name() -> None:
    """A checker that cannot fail proves nothing: feed each one a state that breaks its rule."""
    g1, g2 = "crash-node:x-1", "crash-node:x-2"

    def xid(gtrid: str, r: str) -> Xid:
        return Xid.branch_of(gtrid, r)

    def audit(gtrid: str, r: str, outcome: str) -> AuditEntry:
        return AuditEntry(xid(gtrid, r).to_gid(), gtrid, r, outcome)

    t = Transcript({g1: "2pc", g2: "2pc"}, {g1: ["a", "b", "c"], g2: ["a", "b", "c"]}, [g1], [])
    states = {
        "a": DurableState(
            {"balance": -2}, {xid(g1, "a")}, set(), set(), [audit(g1, "a", COMMITTED)]
        ),
        "b": DurableState({}, set(), {xid(g1, "b")}, {xid(g2, "b")}, [audit(g1, "b", ROLLED_BACK)]),
        "c": DurableState({"count": 1}, {xid(g1, "c")}, set(), set(), []),
    }
    assert atomicity(states) == [f"atomicity: {g1} committed and rolled back"]
    assert decision_stable(states, t, COMMITTED) == (
        ROLLED_BACK,
        [f"decision_stable: interrupted {g2} ended rolled-back, expected committed"],
    )
    assert fate(states, g1, t.writers[g1]) == "mixed"
    assert no_in_doubt_residue(states, [g2]) == [
        f"no_in_doubt_residue: b still holds prepared {[g2]}",
        f"no_in_doubt_residue: decision pending for {g2}",
    ]
    assert durable_ack(states, t) == [f"durable_ack: acknowledged {g1} is rolled-back on b"]
    problems = exactly_once(states, t)
    assert f"exactly_once: {g1} is committed but audited None" in problems  # c's audit line
    assert "exactly_once: a holds -2, -1 committed transactions say otherwise" in problems
    last = DurableState(decisions={g1: {"o": "c", "b": ["a"]}, g2: {"o": "a", "b": []}})
    assert decision_rows_cleaned(last) == [f"decision_rows_cleaned: commit rows left for {[g1]}"]
