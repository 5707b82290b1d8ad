"""Crashes of a real Spark driver and a real executor around the ``twopc`` commit point.

Why child processes: the crash must take down what really dies in production — the driver JVM
with the Python worker running ``commit`` in it, or one executor JVM with its Python worker — and
leave the test (and its databases) standing to restart the query and count rows. So every write
runs in `tests/spark/driver_worker.py`, started in its own process group and killed as a group.

Where the crash point fires: a Python Data Source's ``commit`` runs in a Python worker the driver
JVM forks (through the pyspark daemon), not in the driver's Python process; ``TWOPC_CRASH_AT`` in
the child's environment reaches that worker through the JVM. The point SIGKILLs only the worker.
Left alone, the JVM then sees ``commit`` fail, calls ``abort`` (which finds the durable COMMIT and
rolls forward) and fails the query. To get a whole-driver crash, the test watches the child's
stderr for the crash point's line and SIGKILLs the child's process group at once: the ``abort``
the JVM would start first waits for the dead worker's lease on the decision log
(``log.lease_seconds``), so nothing of it runs before the group is gone. Both cases are tested.

What every scenario checks at the end: each id once in PostgreSQL and in Redis, no prepared
branch anywhere (data database, log database, Redis), no pending decision.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from tests.support.spark_stores import SparkStores, spark_stores

if importlib.util.find_spec("pyspark") is None or not (
    os.environ.get("JAVA_HOME") or shutil.which("java")
):  # under CI a missing Spark must not pass
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("pyspark or java is missing: pip install -e '.[spark]'")
    pytest.skip("pyspark or java is missing", allow_module_level=True)

from spark_integration.recovery import recovery_manager

pytestmark = [pytest.mark.spark, pytest.mark.crash, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("driver_worker.py")
BATCHES = 3
PER_BATCH = 100
#: a killed commit worker holds the node's lease this long; the next driver waits it out
LEASE_SECONDS = "3"
CHILD_TIMEOUT = 150.0


class Stores(SparkStores):
    def pending_decisions(self) -> int:
        with self.log.connect() as conn:
            query = "SELECT count(*) FROM twopc_decision"
            return int(conn.execute(text(query)).scalar_one())

    def expect_exactly_once(self, n: int) -> None:
        assert self.rows() == [(i, f"n{i}") for i in range(n)]
        assert self.redis_items() == {f"item:{i}": f"n{i}" for i in range(n)}
        assert self.prepared() == []
        assert self.pending_decisions() == 0


@pytest.fixture
def stores(make_pg_database: Callable[[], str], redis_url: str) -> Iterator[Stores]:
    log = {"appId": "crashes", "log.acquire_timeout": "60", "log.lease_seconds": LEASE_SECONDS}
    with spark_stores(Stores, make_pg_database, redis_url, **log) as s:
        yield s


class Child:
    """One `driver_worker.py` run in its own process group, output in files the test can poll."""

    def __init__(self, tmp: Path, label: str, args: list[str], crash_at: str | None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TWOPC_CRASH_AT"}
        env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
        env.update(SPARK_LOCAL_IP="127.0.0.1", PYTHONUNBUFFERED="1")
        if crash_at:
            env["TWOPC_CRASH_AT"] = crash_at
        self.stdout_path = tmp / f"{label}.out"
        self.stderr_path = tmp / f"{label}.err"
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        """Poll every 20 ms: the crash line must be answered before the JVM does much else."""
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not predicate():
            if self.proc.poll() is not None and not predicate():
                raise AssertionError(f"child ended ({self.proc.returncode}) before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {CHILD_TIMEOUT}s")
            time.sleep(0.02)

    def finish(self) -> int:
        try:
            return self.proc.wait(CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"child still running after {CHILD_TIMEOUT}s") from None

    def describe(self) -> str:
        return f"stdout:\n{self.stdout}\nstderr (tail):\n{self.stderr[-4000:]}"


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Callable[..., Child]]:
    """Start children; every one still running at the end is killed with its whole group."""
    started: list[Child] = []

    def start(label: str, *args: str, crash_at: str | None = None) -> Child:
        child = Child(tmp_path, label, list(args), crash_at)
        started.append(child)
        return child

    yield start
    for child in started:
        if child.proc.poll() is None:
            child.kill_group()


def crash_line(point: str) -> Callable[[Child], bool]:
    return lambda child: f"twopc: crash point {point} reached" in child.stderr


def csv_batches(directory: Path) -> int:
    """One CSV file of ids per micro-batch (``maxFilesPerTrigger=1``)."""
    directory.mkdir()
    for b in range(BATCHES):
        ids = range(b * PER_BATCH, (b + 1) * PER_BATCH)
        (directory / f"part-{b}.csv").write_text("".join(f"{i},n{i}\n" for i in ids))
    return BATCHES * PER_BATCH


def commits_of(checkpoint: Path) -> list[int]:
    folder = checkpoint / "commits"
    return sorted(int(p) for p in os.listdir(folder) if p.isdigit()) if folder.exists() else []


def stream_args(tmp: Path, options: dict[str, str]) -> list[str]:
    options_file = tmp / "options.json"
    options_file.write_text(json.dumps(options))
    return ["stream", str(options_file), str(tmp / "in"), str(tmp / "checkpoint")]


def ledger_rows(stores: Stores) -> dict[str, int]:
    """Committed ledger rows per gtrid: one per committed micro-batch, never two."""
    with stores.log.connect() as conn:
        query = "SELECT gtrid, count(*) FROM twopc_spark_ledger GROUP BY gtrid"
        return {str(g): int(c) for g, c in conn.execute(text(query))}


def finish_query(child: Child) -> list[int]:
    """Wait for a restarted query to drain the source; the batch ids Spark logged as done."""
    assert child.finish() == 0, child.describe()
    last = child.stdout.strip().splitlines()[-1]
    assert last.startswith("DONE"), child.describe()
    return [int(b) for b in last.split()[1:]]


# -- 1. the driver dies right after the COMMIT decision is durable ----------------------------


@pytest.mark.parametrize("crash", ["driver-killed", "commit-worker-killed"])
def test_driver_crash_after_the_decision_replays_the_batch_as_a_no_op(
    stores: Stores, children: Callable[..., Child], tmp_path: Path, crash: str
) -> None:
    """The issue's scenario: batch 1's COMMIT is durable, phase two has not run, and Spark has not
    logged ``commits/1``. Spark re-runs batch 1 with the same id on restart; its tasks must skip
    (the ledger/decision says committed), its ``commit`` must finish the recorded decision, and
    nothing may be written twice.

    ``:2``: the crash point counts hits per process, and Spark reuses the idle commit worker
    for the next micro-batch (observed), so the second hit is batch 1's commit.

    ``driver-killed``: the whole driver goes at the crash point (the test kills the group), so
    the decision is still pending with every branch prepared. ``commit-worker-killed``: only the
    Python commit worker dies; Spark sees ``commit`` fail, calls ``abort``, which must roll
    FORWARD, and fails the query."""
    n = csv_batches(tmp_path / "in")
    args = stream_args(tmp_path, stores.options)
    point = "spark.driver_after_commit"
    child = children("crashed", *args, crash_at=f"{point}:2")
    if crash == "driver-killed":
        child.wait_for(lambda: crash_line(point)(child), "crash point line")
        child.kill_group()
        assert stores.pending_decisions() == 1  # decided, phase two never ran
        assert len(stores.prepared()) == 3  # batch 1's pg, redis and ledger branches
        assert len(stores.rows()) == PER_BATCH  # batch 0 only
    else:
        assert child.finish() == 3, child.describe()
        assert "FAILED" in child.stdout and crash_line(point)(child)
        assert stores.pending_decisions() == 0  # abort rolled batch 1 forward
        assert stores.prepared() == []
        assert len(stores.rows()) == 2 * PER_BATCH
    checkpoint = tmp_path / "checkpoint"
    assert commits_of(checkpoint) == [0]  # Spark never logged batch 1: it will run it again

    restarted = children("restarted", *args)
    assert finish_query(restarted) == list(range(BATCHES))
    stores.expect_exactly_once(n)
    assert sorted(ledger_rows(stores).values()) == [1] * BATCHES


def test_driver_killed_between_branch_commits_of_phase_two_finishes_on_replay(
    stores: Stores, children: Callable[..., Child], tmp_path: Path
) -> None:
    """Phase two commits branches in parallel (`driver_commit.PHASE_TWO_WORKERS`): the driver
    dies after batch 1's first branch committed and before the rest answered (``:4``: batch 0's
    commit reached the point three times, once per branch, in the same reused worker). The
    decision stays pending with some branches committed and some prepared; the restarted query
    finishes it with the recorded winners, and every row is there once."""
    n = csv_batches(tmp_path / "in")
    args = stream_args(tmp_path, stores.options)
    point = "spark.driver_after_branch_commit"
    child = children("crashed", *args, crash_at=f"{point}:4")
    child.wait_for(lambda: crash_line(point)(child), "crash point line")
    child.kill_group()
    assert stores.pending_decisions() == 1  # decided, phase two cut short
    assert len(stores.prepared()) <= 2  # at least one of pg, redis, ledger committed
    assert commits_of(tmp_path / "checkpoint") == [0]

    restarted = children("restarted", *args)
    assert finish_query(restarted) == list(range(BATCHES))
    stores.expect_exactly_once(n)
    assert sorted(ledger_rows(stores).values()) == [1] * BATCHES


# -- 2. the driver dies before the decision ---------------------------------------------------


def test_driver_crash_before_the_decision_is_presumed_aborted_and_rerun(
    stores: Stores, children: Callable[..., Child], tmp_path: Path
) -> None:
    """The driver dies in batch 1's ``commit`` after preparing its ledger branch, just before
    ``log_commit``: every branch of batch 1 is prepared and nothing is decided. Recovery must
    leave them alone within the grace period (the driver might still decide) and roll them back
    after it (presumed abort); the restarted query then re-runs batch 1 from scratch, once.

    The grace is short here (``log.grace_seconds``) so the test waits seconds, not minutes; it
    still has to be longer than a micro-batch takes from prepare to decision."""
    grace = 12.0
    options = {**stores.options, "log.grace_seconds": str(grace)}
    n = csv_batches(tmp_path / "in")
    args = stream_args(tmp_path, options)
    point = "postgres.spark-ledger.after_prepare"  # the ledger branch is the driver's own
    child = children("crashed", *args, crash_at=f"{point}:2")
    child.wait_for(lambda: crash_line(point)(child), "crash point line")
    child.kill_group()
    crashed_at = time.time()
    assert stores.pending_decisions() == 0
    assert len(stores.prepared()) == 3  # batch 1's pg, redis and ledger branches, undecided
    assert len(stores.rows()) == PER_BATCH and commits_of(tmp_path / "checkpoint") == [0]

    with recovery_manager(options) as tm:
        tm.recover()
        assert len(stores.prepared()) == 3  # within the grace: the driver might still decide
        deadline = crashed_at + grace + 30
        while stores.prepared() and time.time() < deadline:
            time.sleep(1.0)
            tm.recover()
    assert stores.prepared() == []
    assert len(stores.rows()) == PER_BATCH  # batch 1's rows rolled back everywhere
    assert len(stores.redis_items()) == PER_BATCH

    restarted = children("restarted", *args)
    assert finish_query(restarted) == list(range(BATCHES))
    stores.expect_exactly_once(n)
    assert sorted(ledger_rows(stores).values()) == [1] * BATCHES


# -- 3. an executor JVM is killed after its task prepared ------------------------------------


def test_executor_killed_after_prepare_is_retried_elsewhere_exactly_once(
    stores: Stores, children: Callable[..., Child], tmp_path: Path
) -> None:
    """``local-cluster[2,1,1024]``: two executor JVMs. Partition 1's first attempt prepares its
    branches and then kills its own executor JVM, as a lost machine would: Spark reports the
    executor lost, retries the task on the other executor, and commits the job with the retry's
    message. The dead attempt's branches are prepared, unknown to Spark and holding Redis locks
    the retry needs: the retry retires them (same partition, earlier attempt) before writing.
    Every id once, the dead attempt's branches gone."""
    options_file = tmp_path / "options.json"
    options_file.write_text(json.dumps(stores.options))
    marker = tmp_path / "killed-attempt.json"
    child = children("executor", "kill-executor", str(options_file), str(marker))
    assert child.finish() == 0, child.describe()
    assert child.stdout.strip().endswith("DONE"), child.describe()
    killed = json.loads(marker.read_text())
    assert len(killed["branches"]) == 2  # attempt 0 of partition 1 did prepare pg and redis
    assert not Path(f"/proc/{killed['jvm']}").exists()  # that executor JVM is gone
    stores.expect_exactly_once(1000)


# -- 4. spark_integration.save: RDD tasks, the commit in the driver's own process --------------


def save_args(tmp: Path, options: dict[str, str]) -> list[str]:
    options_file = tmp / "save-options.json"
    options_file.write_text(json.dumps({**options, "txnVersion": "save-1"}))
    return ["save", str(options_file)]


def test_save_task_workers_killed_after_prepare_are_retried_exactly_once(
    stores: Stores, children: Callable[..., Child], tmp_path: Path
) -> None:
    """``spark.save.after_prepare.0``: a first attempt's Python worker dies with its partition
    prepared, before Spark hears of it. Spark retries the task; the retry retires the dead
    attempt's branches (their Redis locks would stop it) and the job commits once."""
    child = children("save", *save_args(tmp_path, stores.options),
                     crash_at="spark.save.after_prepare.0")  # fmt: skip
    assert child.finish() == 0, child.describe()
    assert child.stdout.strip().endswith("DONE committed fresh"), child.describe()
    assert crash_line("spark.save.after_prepare.0")(child), child.describe()
    stores.expect_exactly_once(1000)


def test_save_driver_killed_after_the_decision_finishes_on_rerun(
    stores: Stores, children: Callable[..., Child], tmp_path: Path
) -> None:
    """``spark.driver_after_commit`` in `save`: the driver process itself dies with the COMMIT
    durable and no branch told. Nothing is visible; the same job run again (same
    ``txnVersion``) writes nothing, finds the decision and finishes it."""
    args = save_args(tmp_path, stores.options)
    crashed = children("crashed", *args, crash_at="spark.driver_after_commit")
    crashed.wait_for(lambda: crash_line("spark.driver_after_commit")(crashed), "crash point line")
    crashed.kill_group()
    assert stores.rows() == [] and stores.pending_decisions() == 1
    rerun = children("rerun", *args)
    assert rerun.finish() == 0, rerun.describe()
    assert rerun.stdout.strip().endswith("DONE committed replay"), rerun.describe()
    stores.expect_exactly_once(1000)
    assert sorted(ledger_rows(stores).values()) == [1]
