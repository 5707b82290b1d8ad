"""Pre-counted deliveries under ``kill -9``: a count is never low, nothing is lost or doubled.

The cursor raises a message's delivery count before handing it out, either by a forced ``H``
record or, ahead of time, in the ``p`` field of a forced record its consumer writes anyway (the
``P`` of a branch, a one-phase ``C``); handing out a pre-counted message then forces nothing.
`tests/crash/precount_worker.py` consumes a queue one transaction per receive (one-phase, or
two-phase with a `FileResource`) and is killed at every point around that step; then the cursor
is opened as a restart would, and:

- ``count_never_low``: every message still in the cursor has a count at least the number of
  times a handler got it (the ledger), before any further delivery;
- after a clean run to the end: nothing lost (every body handled), the k-th handling of a body
  read a count of at least k and higher than the one before, the cursor is empty and has no
  dead letters; one-phase: only the messages in doubt at the crash were handled twice;
  two-phase: the file resource committed every body exactly once (``exactly_once``).

And a poison message, its consumer killed inside the handler every time: its count rises with
each delivery and it reaches the dead-letter queue after ``max_deliveries``, never earlier.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from coordinator.crashpoints import ENV_VAR
from resource_managers.cursor import Cursor
from resource_managers.message_log import Message
from resource_managers.sequencing import Frame
from tests.support.file_resource import read_state

pytestmark = pytest.mark.crash

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "crash" / "precount_worker.py"
N = 20
MAX_DELIVERIES = 5


def fill(directory: Path, n: int = N, queue: str = "orders") -> dict[str, str]:
    """Accept ``n`` messages ``001``..``n`` in order; body -> message id."""
    ids: dict[str, str] = {}
    with Cursor(directory) as cursor:
        for seq in range(1, n + 1):
            m = Message(uuid.uuid4().hex, queue, f"{seq:03d}".encode())
            cursor.deliver(Frame(queue, 1, seq, seq - 1, m.message_id), m)
            ids[m.body.decode()] = m.message_id
    return ids


def run(tmp_path: Path, *extra: str, crash_at: str | None = None, killed: bool = False) -> str:
    """One worker run: with ``crash_at`` it must die at that point; ``killed``: by its own
    handler (a poison message); otherwise it must finish."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(ENV_VAR, None)
    if crash_at:
        env[ENV_VAR] = crash_at
    argv = [sys.executable, str(WORKER), "--cursor", str(tmp_path / "cursor"),
            "--state", str(tmp_path / "state"), "--ledger", str(tmp_path / "ledger"),
            "--max-deliveries", str(MAX_DELIVERIES), *extra]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, env=env, cwd=REPO, timeout=60)
    out = done.stdout.decode() + done.stderr.decode()
    if crash_at:
        point = crash_at.partition(":")[0]
        assert done.returncode == -signal.SIGKILL, f"{crash_at} did not fire:\n{out}"
        assert f"crash point {point} reached" in out, out
    elif killed:
        assert done.returncode == -signal.SIGKILL, out
    else:
        assert done.returncode == 0 and "DONE" in out, out
    return out


def ledger(tmp_path: Path) -> list[tuple[str, int]]:
    path = tmp_path / "ledger"
    if not path.exists():
        return []
    return [(b, int(n)) for b, n in (line.split() for line in path.read_text().splitlines())]


def assert_count_never_low(tmp_path: Path, ids: dict[str, str]) -> None:
    """Open the cursor as the restart will (branches a crash left handed out are rolled back):
    each message still there has a count >= the handlings the ledger saw."""
    handled = Counter(b for b, _ in ledger(tmp_path))
    with Cursor(tmp_path / "cursor", max_deliveries=MAX_DELIVERIES) as cursor:
        for body, times in handled.items():
            count = cursor.delivery_count(ids[body])
            assert count is None or count >= times, (body, count, times)


def assert_counts_rise(handled: list[tuple[str, int]]) -> None:
    """The k-th handling of a body read a count >= k, above the one before."""
    seen: dict[str, list[int]] = defaultdict(list)
    for body, count in handled:
        seen[body].append(count)
    for body, counts in seen.items():
        for k, count in enumerate(counts, 1):
            assert count >= k, (body, counts)
        assert counts == sorted(set(counts)), (body, counts)


def assert_cursor_empty(directory: Path) -> None:
    with Cursor(directory) as cursor:
        stats = cursor.stats()
        assert (stats.available, stats.in_flight, stats.prepared) == (0, 0, 0), stats
        assert cursor.dead_letters() == []


ONE_PHASE = [
    "cursor.after_precount:3",
    "cursor.after_credited_take:3",
    "cursor.cursor.after_receive:4",
    "tm.one_phase.before_ack:4",
    "log.before_write:6",
    "log.after_write:6",
    "log.after_fsync:6",
]
TWO_PHASE = [
    "cursor.after_precount:3",
    "cursor.after_credited_take:3",
    "cursor.cursor.after_receive:4",
    "cursor.cursor.after_prepare:4",
    "tm.after_prepare.1:4",
    "tm.after_decision_fsync:4",
    "cursor.cursor.after_lazy_commit:4",
    "cursor.cursor.commit_durable:4",
]
FORCED_COMMIT = ["cursor.cursor.after_commit:4"]  # with the cursor's C forced (lazy_commit off)
MODES = {"1pc": [], "2pc": ["--two-phase"], "2pc-forced": ["--two-phase", "--forced-commit"]}


def audit(tmp_path: Path, bodies: list[str], two_phase: bool, batch: int, crashes: int) -> None:
    handled = ledger(tmp_path)
    assert {b for b, _ in handled} == set(bodies), "a message was lost"
    assert_counts_rise(handled)
    doubled = [b for b, n in Counter(b for b, _ in handled).items() if n > 1]
    if two_phase:
        files = read_state(tmp_path / "state" / "ledger")
        assert files.data == dict.fromkeys(bodies, 1), "exactly_once"
        assert not files.prepared
    else:  # only what a crash caught in its transaction comes back
        assert len(doubled) <= batch * crashes, doubled
    assert_cursor_empty(tmp_path / "cursor")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    ("mode", "point"),
    [("1pc", p) for p in ONE_PHASE]
    + [("2pc", p) for p in TWO_PHASE]
    + [("2pc-forced", p) for p in FORCED_COMMIT],
)
def test_a_crash_around_a_precount_leaves_no_count_low(
    tmp_path: Path, crash_matrix, mode: str, point: str, batch: int
) -> None:
    ids = fill(tmp_path / "cursor")
    extra = ["--batch", str(batch), *MODES[mode]]
    run(tmp_path, *extra, crash_at=point)
    assert_count_never_low(tmp_path, ids)
    run(tmp_path, *extra)
    audit(tmp_path, list(ids), mode != "1pc", batch, crashes=1)
    crash_matrix.add(point=f"{point} ({mode}, batch {batch})",
                     expected="count >= deliveries, 0 lost",
                     outcome=f"{len(ledger(tmp_path))} handlings", resolved="cursor open",
                     recovery_ms=None)  # fmt: skip


@pytest.mark.parametrize("two_phase", [False, True])
def test_repeated_crashes_at_random_points(tmp_path: Path, two_phase: bool) -> None:
    """Several crashes in a row, each at a random point and hit (seed printed on failure)."""
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    ids = fill(tmp_path / "cursor", n=30)
    extra = ["--batch", "2", *(["--two-phase"] if two_phase else [])]
    points = TWO_PHASE if two_phase else ONE_PHASE
    for _ in range(4):
        point = f"{rnd.choice(points).partition(':')[0]}:{rnd.randint(1, 3)}"
        run(tmp_path, *extra, crash_at=point)
        assert_count_never_low(tmp_path, ids)
    run(tmp_path, *extra)
    audit(tmp_path, list(ids), two_phase, batch=2, crashes=4)


@pytest.mark.parametrize("precount", [1, 0])
@pytest.mark.parametrize("two_phase", [False, True])
def test_a_poison_message_reaches_the_dead_letter_queue(
    tmp_path: Path, two_phase: bool, precount: int
) -> None:
    """The consumer dies in the handler of ``005`` every time: each delivery raises its count
    (the first one pre-counted by the commit of ``004``, with precount on), and after
    ``max_deliveries`` handlings the cursor's open moves it to the dead-letter queue; every
    other message is handled once."""
    ids = fill(tmp_path / "cursor", n=12)
    extra = ["--poison", "005", "--precount", str(precount)]
    extra += ["--two-phase"] if two_phase else []
    for _ in range(MAX_DELIVERIES):
        run(tmp_path, *extra, killed=True)
    run(tmp_path, *extra)
    handled = ledger(tmp_path)
    assert [n for b, n in handled if b == "005"] == list(range(1, MAX_DELIVERIES + 1))
    assert Counter(b for b, _ in handled if b != "005") == dict.fromkeys(
        [b for b in ids if b != "005"], 1
    )
    with Cursor(tmp_path / "cursor") as cursor:
        (dead,) = cursor.dead_letters()
        assert dead.message_id == ids["005"] and dead.delivery_count == MAX_DELIVERIES
        assert dead.reason is not None and dead.reason.startswith("max-deliveries")
        assert cursor.available("orders") == []
