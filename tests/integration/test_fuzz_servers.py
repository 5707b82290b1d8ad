"""Structure-aware fuzzing of live ``twopc serve log`` and ``twopc serve cursor`` processes.

Hypothesis draws sessions from the frame schema (`tests.support.fuzz_frames`): unauthenticated
handshakes at both servers, and bursts authenticated as ``transfer`` and ``consumer`` (cursor) and
``producer`` (log), some frames damaged behind a recomputed CRC. A few thousand frames in all.

Invariants: ``no_defect_answer`` (no session ends in ``internal-error`` or a hang, and both
servers stay up), ``still_serves`` (afterwards a normal client's message goes through the log to
the cursor), ``restartable`` (both stop cleanly and open their journals again), ``no_traceback``
(nothing the fuzzer sent made either server print one), ``deep`` (the frames reached the stores:
accepted messages, successful XA verbs, a completed handshake, not only refusals).

``bench/fuzz_servers.py`` runs the same frames a million at a time.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.fuzz_frames import ROLES, HypothesisDraw, State
from tests.support.fuzz_servers import Servers, Tally, describe, run_session

SESSIONS = 500
BURST = 16


def test_fuzzed_frames_leave_both_servers_serving_and_restartable(tmp_path: Path) -> None:
    servers = Servers(tmp_path)
    tally = Tally()
    servers.start()

    # no shrinking: the servers keep what earlier sessions did, so a replay is not the same case;
    # the failing session's frames are printed decoded instead
    @settings(max_examples=SESSIONS, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data())
    def session(data: st.DataObject) -> None:
        before = tally.failures
        draw = HypothesisDraw(data)
        # what is drawn may depend only on earlier draws (Hypothesis replays them): a fresh state
        # per session, whose streams start a new epoch so that their messages are accepted
        tally.states = {role: State(epoch=7 + tally.sessions) for role in ROLES}
        run_session(servers, draw, tally, draw.integer(1, BURST))
        assert tally.failures == before, describe(tally.last_sent)
        assert servers.alive() == ["cursor", "log"], servers.tracebacks()

    try:
        session()
        assert tally.frames >= 2000, tally
        assert servers.round_trip("fuzz-check-1")
    finally:
        servers.stop()
    assert servers.stops == []
    servers.start()
    try:
        assert servers.round_trip("fuzz-check-2")
    finally:
        servers.stop()
    assert servers.stops == []
    assert servers.tracebacks() == []
    for kind in ("ACK", "NACK invalid-message", "XA_REPLY ok", "XA_REPLY bad-request", "WELCOME",
                 "ERROR bad-frame", "ERROR auth-failed", "ERROR forbidden-role"):  # fmt: skip
        assert tally.answers[kind] > 0, (kind, tally.answers)
