"""A log server whose cursor is down says so at WARNING, naming the cursor, without flooding:
the first failure, then after 10 s, 20 s, 40 s ... (at most every 5 minutes), and once more
when it is reached again. Driven by a fake clock, so the back-off is exact."""

from __future__ import annotations

import itertools
import logging

import pytest

from messaging.transfer.sender import UNREACHABLE_WARN_CAP, _Unreachable


def test_cannot_reach_cursor_is_a_warning_with_back_off(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    watch = _Unreachable(lambda: now[0])
    caplog.set_level(logging.INFO, logger="twopc.transfer")
    warned_at = []
    for _ in range(2000):  # one failed attempt every 0.5 s for 1000 s
        before = len([r for r in caplog.records if r.levelno == logging.WARNING])
        watch.failed("transfer", "10.0.0.7:7402", ConnectionRefusedError("refused"))
        if len([r for r in caplog.records if r.levelno == logging.WARNING]) > before:
            warned_at.append(now[0])
        now[0] += 0.5
    assert warned_at[:5] == [0.0, 10.0, 30.0, 70.0, 150.0]
    gaps = [b - a for a, b in itertools.pairwise(warned_at)]
    assert max(gaps) == UNREACHABLE_WARN_CAP and len(warned_at) < 10
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.getMessage().startswith("transfer: cannot reach cursor 10.0.0.7:7402: refused")
    assert any(r.levelno == logging.INFO for r in caplog.records)  # every attempt, at INFO

    caplog.clear()
    watch.reached("transfer", "10.0.0.7:7402")
    (back,) = caplog.records
    assert back.levelno == logging.WARNING and "after 2000 failed attempts" in back.getMessage()
    watch.failed("transfer", "10.0.0.7:7402", ConnectionRefusedError("refused"))
    assert caplog.records[-1].levelno == logging.WARNING  # a new outage warns at once
