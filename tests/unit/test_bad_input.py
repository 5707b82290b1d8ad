"""Bad input and failing servers: refused at the boundary, or survived without guessing.

Invariants named here: ``invalid_xid_refused`` (nothing malformed becomes an xid),
``gid_quotable`` (a gid holds only digits, '_' and base64, whatever the parts held),
``presumed_abort`` (a failed or timed-out transaction writes no COMMIT and ends rolled back),
``illegal_state`` (a call the state machine does not allow raises instead of doing something),
``errors_pickle`` (every error crosses a process boundary with its attributes).
"""

from __future__ import annotations

import base64
import builtins
import functools
import inspect
import pickle
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import coordinator.errors as errors_module
from coordinator import (
    FencedError,
    FileDecisionLog,
    IllegalStateError,
    InvalidXidError,
    MemoryDecisionLog,
    Outcome,
    TransactionManager,
    TransactionRolledBack,
    TransactionTimedOut,
    Xid,
)
from coordinator.states import TxState
from coordinator.xid import FORMAT_ID, custom_gtrid, validate_node_id, validate_resource_name
from tests.support.file_resource import COMMITTED, ROLLED_BACK, FileResource
from tests.support.flaky_resource import FlakyResource
from tests.support.managers import make_manager

INJECTION = "'); DROP TABLE x; --"
GID_SHAPE = re.compile(r"[0-9]+_[A-Za-z0-9+/=]+_[A-Za-z0-9+/=]+")


manager = functools.partial(make_manager, node_id="bad-1")


# -- invalid_xid_refused -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "node_id", [INJECTION, "a:b", "", "n" * 33, "nul\x00id", "é", None, 7, b"node"]
)
def test_invalid_node_ids_are_refused(node_id: Any) -> None:
    with pytest.raises(InvalidXidError):
        validate_node_id(node_id)
    with pytest.raises(InvalidXidError):
        TransactionManager(node_id, MemoryDecisionLog(), recovery_interval=None)


@pytest.mark.parametrize(
    ("gtrid", "bqual"),
    [
        ("g" * 65, "b"),
        ("g", "b" * 65),
        ("", "b"),
        ("g", ""),
        ("nul\x00", "b"),
        ("g", "nul\x00"),
        ("tab\there", "b"),
        ("g", "newline\n"),
        ("café", "b"),
        (b"g", "b"),
        ("g", 1),
        (None, "b"),
    ],
)
def test_invalid_parts_are_refused(gtrid: Any, bqual: Any) -> None:
    with pytest.raises(InvalidXidError):
        Xid(FORMAT_ID, gtrid, bqual)


@pytest.mark.parametrize(
    "format_id",
    [
        -1,
        2**31,
        "1",
        1.5,
        None,
        True,
    ],
)
def test_format_id_out_of_range_is_refused(format_id: Any) -> None:
    with pytest.raises(InvalidXidError):
        Xid(format_id, "g", "b")


def test_longest_valid_parts_are_accepted_and_one_more_is_not() -> None:
    assert Xid(0, "g" * 64, "b" * 64).to_gid()
    assert Xid(2**31 - 1, "g", "b").format_id == 2**31 - 1
    with pytest.raises(InvalidXidError):
        validate_resource_name("r" * 65)
    with pytest.raises(InvalidXidError):
        custom_gtrid("node", "s" * 64)  # "node:" + 64 is past the 64-byte gtrid limit


def test_injection_text_is_a_valid_bqual_and_its_gid_is_inert() -> None:
    # Printable ASCII within 64 bytes is a legal XA part; safety comes from the encoding.
    xid = Xid.branch_of(custom_gtrid("n1", INJECTION), INJECTION)
    gid = xid.to_gid()
    assert GID_SHAPE.fullmatch(gid), gid
    assert not set(gid) & set("'\";- ()\\")
    assert Xid.from_gid(gid) == xid
    assert xid.belongs_to("n1")
    # Without our node prefix the same text is a foreign gtrid: recovery never touches it.
    assert not Xid(FORMAT_ID, INJECTION, "b").belongs_to("n1")


def _b64(text: bytes) -> str:
    return base64.b64encode(text).decode("ascii")


@pytest.mark.parametrize(
    "gid",
    [
        INJECTION,
        "",
        "not-a-gid",
        "1_Zw==",  # two parts
        "1_Zw==_Yg==_Yg==",  # four parts
        "-1_Zw==_Yg==",  # sign
        "x_Zw==_Yg==",  # non-numeric format id
        "99999999999_Zw==_Yg==",  # format id past 2**31-1
        "1_Zw_Yg==",  # bad padding
        "1_Z!==_Yg==",  # not base64
        "1_Zw==_Yg==\x00",  # NUL
        f"1_{_b64(b'g' * 65)}_Yg==",  # gtrid past 64 bytes
        "1_" + _b64(b"nul\x00") + "_Yg==",  # decodes to a NUL
        "1_" + _b64("café".encode()) + "_Yg==",  # decodes to non-ASCII
        "1__Yg==",  # empty gtrid
        "1_" + "A" * 200 + "_Yg==",  # past the PostgreSQL gid length
        "1_Zw==_Yg==; DROP TABLE x",
        b"1_Zw==_Yg==",
        None,
        "²_Zw==_Yg==",
    ],
)
def test_foreign_and_garbage_gids_are_refused(gid: Any) -> None:
    with pytest.raises(InvalidXidError):
        Xid.from_gid(gid)


def test_only_ascii_digits_make_a_format_id() -> None:
    with pytest.raises(InvalidXidError):
        Xid.from_gid("١٢_Zw==_Yg==")


def test_resource_named_like_an_injection_commits_end_to_end(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    evil = FileResource(INJECTION, tmp_path / "evil")
    plain = FileResource("plain", tmp_path / "plain")
    tm = manager(managers, [evil, plain])
    with tm.transaction(gtrid_suffix=INJECTION[:40]) as tx:
        tx.join(evil).set("k", INJECTION)
        tx.join(plain).set("k", "v")
    assert evil.snapshot() == {"k": INJECTION}
    assert evil.state().outcome(tx.gtrid) == COMMITTED
    assert [e.bqual for e in evil.state().audit] == [INJECTION]


# -- a resource that fails every call ----------------------------------------------------------


def test_join_of_a_down_resource_fails_cleanly(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    good = FileResource("good", tmp_path / "good")
    down = FlakyResource.down(FileResource("down", tmp_path / "down"))
    tm = manager(managers, [good, down])  # start-up recovery meets the dead server, survives
    with tm.transaction() as tx:
        tx.join(good).set("k", "v")
        with pytest.raises(ConnectionRefusedError):
            tx.join(down)
        assert tx.state == TxState.ACTIVE
        assert set(tx.branches) == {"good"}
    assert tx.outcome == Outcome.COMMITTED
    assert good.snapshot() == {"k": "v"}


def test_commit_with_a_down_resource_rolls_back(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    a, b = FileResource("a", tmp_path / "a"), FileResource("b", tmp_path / "b")
    flaky = FlakyResource(FileResource("c", tmp_path / "c"))
    log = MemoryDecisionLog()
    tm = manager(managers, [a, b, flaky], log)
    tx = tm.begin()
    for resource in (a, b, flaky):
        tx.join(resource).add("n", 1)
    flaky.fail_on |= {"prepare", "commit", "rollback", "recover", "forget"}
    with pytest.raises(TransactionRolledBack) as caught:
        tx.commit()
    assert vars(caught.value)["gtrid"] == tx.gtrid
    assert log.pending() == [] and log.stats().forced_records == 0  # presumed_abort
    for resource in (a, b):
        assert resource.state().outcome(tx.gtrid) == ROLLED_BACK
        assert resource.snapshot() == {}
    assert tm.metrics_dict()["rollback_unreachable"] == 1

    report = tm.recover(force=True)  # the dead server is reported, nothing raised
    assert any(f.startswith("listing resource c:") for f in report.failures)
    assert not report.clean


def test_unreachable_rollback_is_finished_by_presumed_abort(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    a, c = FileResource("a", tmp_path / "a"), FileResource("c", tmp_path / "c")
    inner_b = FileResource("b", tmp_path / "b")
    b = FlakyResource(inner_b)
    tm = manager(managers, [a, b, c])
    tx = tm.begin()
    for resource in (a, b, c):
        tx.join(resource).add("n", 1)
    tx.branches["c"].handle.veto()
    b.fail_on.add("rollback")  # b prepared, then cannot be told to roll back
    with pytest.raises(TransactionRolledBack):
        tx.commit()
    assert inner_b.recover() == [tx.branches["b"].xid]
    b.fail_on.clear()
    report = tm.recover(force=True)
    assert report.rolled_back == [tx.branches["b"].xid.to_gid()]
    assert inner_b.recover() == []
    assert inner_b.state().outcome(tx.gtrid) == ROLLED_BACK


# -- a prepare that hangs past the timeout -------------------------------------------------------


def test_hung_prepare_times_out_and_never_commits(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    a, b, c = (FileResource(name, tmp_path / name) for name in "abc")
    hung = FlakyResource(b, stall={"prepare": 3.0})
    log = FileDecisionLog(tmp_path / "log")
    tm = manager(managers, [a, hung, c], log, inline_completion=False)
    tx = tm.begin(timeout=0.5)
    for resource in (a, hung, c):
        tx.join(resource).add("n", 1)

    started = time.monotonic()
    with pytest.raises(TransactionTimedOut) as caught:
        tx.commit()
    assert time.monotonic() - started < 2.5
    assert caught.value.reason == "timeout"

    assert hung.wait_finished("prepare", timeout=10)  # the late vote arrives ...
    deadline = time.monotonic() + 10
    while not tx.state.is_final and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.state == TxState.ROLLED_BACK  # ... and is fenced: no COMMIT after the caller left
    assert log.pending() == []
    assert log.stats().forced_records == 0
    tm.recover(force=True)
    for resource in (a, b, c):
        state = resource.state()
        assert state.outcome(tx.gtrid) == ROLLED_BACK
        assert not state.prepared


# -- illegal_state -------------------------------------------------------------------------------


def test_set_rollback_only_makes_commit_roll_back(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    a, b = FileResource("a", tmp_path / "a"), FileResource("b", tmp_path / "b")
    tm = manager(managers, [a, b])
    tx = tm.begin()
    tx.join(a).set("k", "v")
    tx.join(b).set("k", "v")
    tx.set_rollback_only()
    assert tx.rollback_only
    with pytest.raises(TransactionRolledBack):
        tx.join(FileResource("c", tmp_path / "c"))  # doomed work fails fast
    with pytest.raises(TransactionRolledBack) as caught:
        tx.commit()
    assert caught.value.reason == "application"
    assert a.snapshot() == {} and b.snapshot() == {}
    assert a.state().outcome(tx.gtrid) == ROLLED_BACK


def test_join_after_timeout_is_refused(tmp_path: Path, managers: list[TransactionManager]) -> None:
    a = FileResource("a", tmp_path / "a")
    tm = manager(managers, [a])
    tx = tm.begin(timeout=0.05)
    time.sleep(0.1)
    with pytest.raises(TransactionTimedOut):
        tx.join(a)
    assert tx.rollback_only
    with pytest.raises(TransactionTimedOut):
        tx.commit()


def test_illegal_calls_raise(tmp_path: Path, managers: list[TransactionManager]) -> None:
    a = FileResource("a", tmp_path / "a")
    tm = manager(managers, [a])
    tx = tm.begin()
    with pytest.raises(IllegalStateError):
        tm.begin()  # nested
    tx.join(a).set("k", "v")
    assert tx.commit() == Outcome.COMMITTED
    with pytest.raises(IllegalStateError):
        tx.commit()
    with pytest.raises(IllegalStateError):
        tx.join(a)
    with pytest.raises(IllegalStateError):
        tx.rollback()
    with pytest.raises(IllegalStateError):
        tx.before_completion(lambda: None)

    rolled = tm.begin()  # the committed one is final: a new one may begin
    rolled.rollback()
    rolled.rollback()  # idempotent
    with pytest.raises(IllegalStateError):
        rolled.commit()

    with tm.transaction(), pytest.raises(IllegalStateError):  # nested context manager
        tm.begin()

    tm.close()
    with pytest.raises(IllegalStateError):
        tm.begin()


def test_join_of_two_resources_with_one_name_is_refused(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    first, second = FileResource("x", tmp_path / "1"), FileResource("x", tmp_path / "2")
    tm = manager(managers, [first])
    with tm.transaction() as tx:
        tx.join(first)
        with pytest.raises(IllegalStateError):
            tx.join(second)
        assert tx.join(first) is tx.join(first)  # joining twice returns the same handle


def test_fencing_a_late_prepare_of_a_rolled_back_branch(tmp_path: Path) -> None:
    a = FileResource("a", tmp_path / "a")
    xid = Xid.branch_of("n1:late-1", "a")
    a.start(xid).set("k", "v")
    a.rollback(xid)  # recovery presumed abort first ...
    with pytest.raises(FencedError):  # ... so the late prepare is refused
        a.prepare(xid)
    with pytest.raises(FencedError):  # and the gid is never used again
        a.start(xid)


# -- errors_pickle -------------------------------------------------------------------------------


def _error_classes() -> list[type[BaseException]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors_module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == errors_module.__name__
    ]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_attributes(cls: type[BaseException]) -> None:
    if issubclass(cls, errors_module.TransactionError):
        error: BaseException = cls("it failed", gtrid="n1:x-1", reason="vote", durable=None)
    else:
        error = cls("it failed")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__
    if isinstance(error, errors_module.TransactionError):
        assert copy.gtrid == "n1:x-1" and copy.reason == "vote"  # type: ignore[attr-defined]
        assert copy.code == cls.code  # type: ignore[attr-defined]


def test_error_codes_are_unique_and_defaults_survive_pickling() -> None:
    classes = [c for c in _error_classes() if issubclass(c, errors_module.TransactionError)]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    timed_out = pickle.loads(pickle.dumps(TransactionTimedOut("late")))
    assert timed_out.reason == "timeout" and isinstance(timed_out, TransactionRolledBack)
    assert not any(cls.__name__ in vars(builtins) for cls in _error_classes())  # no shadowing


def test_down_resource_recovery_keeps_running_in_the_background(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    down = FlakyResource.down(FileResource("down", tmp_path / "down"))
    tm = manager(managers, [down], recovery_interval=0.02)
    deadline = time.monotonic() + 5
    while down.calls["recover"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert down.calls["recover"] >= 3  # the ticker survived every failure
    assert tm.metrics_dict()["recovery_failures"] >= 3


def test_inline_completion_holds_the_caller_but_still_fences_a_late_decision(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    """``inline_completion``: no thread hop, so a hung prepare holds the caller; the deadline in
    the decision record still refuses the COMMIT once the prepare finally answers."""
    a, b = (FileResource(name, tmp_path / name) for name in "ab")
    hung = FlakyResource(b, stall={"prepare": 1.0})
    log = FileDecisionLog(tmp_path / "log")
    tm = manager(managers, [a, hung], log, inline_completion=True)
    tx = tm.begin(timeout=0.3)
    for resource in (a, hung):
        tx.join(resource).add("n", 1)
    started = time.monotonic()
    with pytest.raises(TransactionTimedOut):
        tx.commit()
    assert time.monotonic() - started >= 0.9  # held: the caller's own thread ran the prepare
    assert tx.state == TxState.ROLLED_BACK
    assert log.pending() == [] and log.stats().forced_records == 0
    for resource in (a, b):
        assert resource.state().outcome(tx.gtrid) == ROLLED_BACK


def test_inline_completion_runs_on_the_callers_thread(
    tmp_path: Path, managers: list[TransactionManager]
) -> None:
    seen: list[int] = []
    a = FlakyResource(
        FileResource("a", tmp_path / "a"),
        before={"commit": lambda xid: seen.append(threading.get_ident())},
    )
    tm = manager(managers, [a], FileDecisionLog(tmp_path / "log"), inline_completion=True)
    with tm.transaction(timeout=5) as tx:
        tx.join(a).add("n", 1)
    assert seen == [threading.get_ident()]
