"""The Spark commit protocol without Spark: executors' `write_partition`, the driver's `commit` and
`abort`, and recovery, against real PostgreSQL and Redis. Each test plays Spark's part by hand:
which attempts run, which message per partition reaches the driver, where the driver dies."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import text

from coordinator import ConfigurationError, TransactionRolledBack, Xid
from coordinator.decision_log import Decision
from coordinator.xid import MAX_GID_BYTES, branches_of, resource_of, sub_branch_born
from messaging.auth import SharedSecret
from messaging.connection import Listener
from messaging.remote import PRODUCER_ROLE, ProducerService
from resource_managers.message_log import MessageLog
from resource_managers.postgres import SqlDecisionLog
from spark_integration import (
    CommitMessage,
    StaleAttemptError,
    abort,
    commit,
    make_gtrid,
    new_run,
    parse_options,
    recovery_manager,
    write_partition,
)
from spark_integration.ids import branch_xid, gid_length, parse_branch
from spark_integration.ledger import Ledger
from tests.support.spark_stores import SparkStores, spark_stores

ROWS = [{"id": i, "name": f"n{i}"} for i in range(30)]


def split(rows: list[dict[str, Any]], parts: int = 3) -> list[list[dict[str, Any]]]:
    return [rows[i::parts] for i in range(parts)]


class Env(SparkStores):
    def expect_exactly_once(
        self, rows: list[dict[str, Any]] = ROWS, redis_too: bool = True
    ) -> None:
        assert self.rows() == sorted((r["id"], r["name"]) for r in rows)
        if redis_too:
            assert self.redis_items() == {f"item:{r['id']}": r["name"] for r in rows}
        assert self.prepared() == []


@pytest.fixture
def env(make_pg_database: Callable[[], str], redis_url: str) -> Iterator[Env]:
    # log.lease_seconds: a killed driver's lease blocks the next one this long
    log = {"log.acquire_timeout": "10", "log.lease_seconds": "2"}
    with spark_stores(Env, make_pg_database, redis_url, **log) as e:
        yield e


def write_all(
    options: Mapping[str, str],
    rows: list[dict[str, Any]] = ROWS,
    *,
    gtrid: str | None = None,
    batch_id: int | None = None,
    attempt: int = 0,
) -> list[CommitMessage]:
    return [
        write_partition(
            options,
            part,
            partition=p,
            attempt=attempt,
            task_attempt_id=100 * attempt + p,
            gtrid=gtrid,
            batch_id=batch_id,
        )
        for p, part in enumerate(split(rows))
    ]


def pending(env: Env, options: Mapping[str, str]) -> list[str]:
    log = SqlDecisionLog(env.log, "spark", read_only=True)
    return [d.gtrid for d in log.pending()]


# -- the happy path and Spark's duplicates -------------------------------------------------------


def test_three_partitions_exactly_once_in_postgres_and_redis(env: Env) -> None:
    messages = write_all(env.options, batch_id=7)
    assert all(len(m.branches) == 2 and m.rows == 10 for m in messages)
    assert pickle.loads(pickle.dumps(messages)) == messages  # Spark ships them to the driver
    assert pickle.loads(pickle.dumps(parse_options(env.options))) == parse_options(env.options)
    assert env.rows() == [] and env.redis_items() == {}  # prepared, invisible
    report = commit(env.options, messages, batch_id=7)
    assert report.outcome == "committed" and not report.replay and not report.pending
    assert len(report.committed) == 7  # 3 partitions x 2 targets + the ledger branch
    env.expect_exactly_once()
    assert pending(env, env.options) == []
    assert Ledger(env.log).lookup("spark:orders:7") is not None


def test_failed_first_attempt_is_rolled_back_by_commit(env: Env) -> None:
    gtrid = make_gtrid("orders", txn_version="v1")
    parts = split(ROWS)
    lost = write_partition(
        env.pg_only, parts[1], partition=1, attempt=0, task_attempt_id=1, gtrid=gtrid
    )
    # the attempt's executor died after the prepare: its message never reaches the driver
    chosen = [
        write_partition(
            env.pg_only, part, partition=p, attempt=int(p == 1), task_attempt_id=10 + p, gtrid=gtrid
        )
        for p, part in enumerate(parts)
    ]
    report = commit(env.pg_only, chosen)
    assert report.outcome == "committed"
    # the retry (attempt 1) retired it before writing, or the driver's prefix scan would have
    assert not set(lost.branches) & set(env.prepared())
    env.expect_exactly_once(redis_too=False)


def test_speculative_duplicate_only_the_chosen_attempt_commits(env: Env) -> None:
    gtrid = make_gtrid("orders")
    parts = split(ROWS)
    first = write_all(env.pg_only, gtrid=gtrid)
    speculative = write_partition(
        env.pg_only, parts[2], partition=2, attempt=1, task_attempt_id=77, gtrid=gtrid
    )
    report = commit(env.pg_only, [first[0], first[1], speculative], gtrid=gtrid)
    assert set(speculative.branches) <= set(report.committed)
    assert not set(first[2].branches) & set(env.prepared())  # retired by the later attempt
    env.expect_exactly_once(redis_too=False)  # no duplicate rows of partition 2


def test_a_speculative_race_won_by_the_retired_attempt_fails_and_writes_nothing(
    env: Env,
) -> None:
    """Spark picks the original attempt after its speculative copy retired it: the driver finds
    a winner no longer prepared and refuses to decide; abort then cleans up. Never twice."""
    gtrid = make_gtrid("orders")
    parts = split(ROWS)
    first = write_all(env.pg_only, gtrid=gtrid)
    write_partition(env.pg_only, parts[2], partition=2, attempt=1, task_attempt_id=78, gtrid=gtrid)
    with pytest.raises(TransactionRolledBack):
        commit(env.pg_only, first, gtrid=gtrid)
    abort(env.pg_only, first, gtrid=gtrid)
    assert env.rows() == [] and env.prepared() == []


def test_a_zombie_attempt_starting_after_its_retry_prepared_writes_nothing(env: Env) -> None:
    """Partition 1's first attempt failed in Spark's eyes before its Python worker even began
    (a slow worker start under load): the retry (a higher task attempt id of the same run) has
    prepared when the zombie starts writing. The zombie must not retire the retry's branches,
    or the driver finds its winner gone and fails the whole write."""
    gtrid = make_gtrid("orders")
    run = new_run()
    parts = split(ROWS)
    messages = [
        write_partition(env.options, part, partition=p, attempt=int(p == 1),
                        task_attempt_id=10 + p, gtrid=gtrid, run=run)
        for p, part in enumerate(parts)
    ]  # fmt: skip
    with pytest.raises(StaleAttemptError, match="newer attempt"):
        write_partition(
            env.options, parts[1], partition=1, attempt=0, task_attempt_id=1, gtrid=gtrid, run=run
        )
    assert set(messages[1].branches) <= set(env.prepared())  # the retry's branches stand
    report = commit(env.options, messages, gtrid=gtrid)
    assert report.outcome == "committed" and not report.pending
    env.expect_exactly_once()


def test_a_replayed_run_retires_every_attempt_of_the_dead_run(env: Env) -> None:
    """The driver died before its decision; the restarted job (a new run, task attempt ids from
    0 again) replays the write. The dead run's branches, a retry with a higher task attempt id
    included, are older whatever their ids say: the new attempts retire them and commit."""
    gtrid = make_gtrid("orders", txn_version="v1")
    parts = split(ROWS)
    dead_run = new_run()
    dead = write_partition(env.pg_only, parts[1], partition=1, attempt=1, task_attempt_id=57,
                           gtrid=gtrid, run=dead_run)  # fmt: skip
    run = next(r for r in iter(new_run, None) if r != dead_run)
    messages = [
        write_partition(env.pg_only, part, partition=p, attempt=0, task_attempt_id=p,
                        gtrid=gtrid, run=run)
        for p, part in enumerate(parts)
    ]  # fmt: skip
    assert not set(dead.branches) & set(env.prepared())  # retired by the new run's partition 1
    commit(env.pg_only, messages, gtrid=gtrid)
    env.expect_exactly_once(redis_too=False)


def test_commit_twice_is_idempotent(env: Env) -> None:
    messages = write_all(env.options, batch_id=3)
    commit(env.options, messages, batch_id=3)
    again = commit(env.options, messages, batch_id=3)  # a restarted driver re-commits the batch
    assert again.replay and again.outcome == "committed"
    env.expect_exactly_once()


def test_abort_after_commit_decision_rolls_forward(env: Env) -> None:
    messages = write_all(env.options, batch_id=4)
    _decide_only(env, messages)  # COMMIT is durable, phase two never ran
    report = abort(env.options, messages, batch_id=4)
    assert report.outcome == "committed" and report.replay
    env.expect_exactly_once()
    assert pending(env, env.options) == []


def test_abort_without_decision_rolls_back_by_prefix(env: Env) -> None:
    messages = write_all(env.options, batch_id=5)
    # and an attempt that abort never hears of:
    write_partition(
        env.options,
        [{"id": 99, "name": "zombie"}],
        partition=3,
        attempt=1,
        task_attempt_id=9,
        batch_id=5,
    )
    report = abort(env.options, [messages[0], None, None], batch_id=5)  # Spark's best effort
    assert report.outcome == "rolled-back" and len(report.rolled_back) == 8
    assert env.rows() == [] and env.redis_items() == {} and env.prepared() == []


def test_attempt_fenced_by_a_decision_made_while_it_wrote(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages = write_all(env.options, batch_id=6)
    commit(env.options, messages, batch_id=6)
    from spark_integration.connect import Opened

    real = Opened.committed
    calls: list[int] = []

    def blind_once(self: Opened, gtrid: str) -> Any:  # the first look came before the decision
        calls.append(1)
        return None if len(calls) == 1 else real(self, gtrid)

    monkeypatch.setattr(Opened, "committed", blind_once)
    zombie = write_partition(
        env.options,
        [{"id": 77, "name": "zombie"}],
        partition=1,
        attempt=3,
        task_attempt_id=42,
        batch_id=6,
    )
    assert zombie.skipped and not zombie.branches and len(calls) == 2
    env.expect_exactly_once()  # the zombie rolled its own prepared branches back


def test_commit_refuses_when_a_winner_is_no_longer_prepared(env: Env) -> None:
    messages = write_all(env.pg_only, batch_id=9)
    with env.data.connect() as conn:  # recovery (after its grace) or an operator got there first
        conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql("ROLLBACK PREPARED %s", (messages[1].branches[0],))
    with pytest.raises(TransactionRolledBack, match="no longer prepared"):
        commit(env.pg_only, messages, batch_id=9)
    assert pending(env, env.pg_only) == [] and Ledger(env.log).lookup("spark:orders:9") is None
    report = abort(env.pg_only, messages, batch_id=9)  # what Spark does next
    assert report.outcome == "rolled-back" and env.rows() == [] and env.prepared() == []


def test_replayed_batch_writes_nothing(env: Env) -> None:
    commit(env.options, write_all(env.options, batch_id=8), batch_id=8)
    changed = [{"id": r["id"], "name": "again"} for r in ROWS]
    replay = write_all(env.options, changed, batch_id=8)  # same batch id after a restart
    assert all(m.skipped and not m.branches for m in replay)
    report = commit(env.options, replay, batch_id=8)
    assert report.replay
    env.expect_exactly_once()


def test_driver_crash_after_decision_is_finished_by_recovery(env: Env) -> None:
    messages = write_all(env.options, batch_id=11)
    _decide_only(env, messages)
    late = write_partition(
        env.options,
        [{"id": 500, "name": "x"}],
        partition=0,
        attempt=9,
        task_attempt_id=900,
        batch_id=11,
    )
    assert late.skipped and not late.branches  # decided: a late attempt writes nothing
    with recovery_manager(env.options) as tm:
        report = tm.recover(force=True)
    assert report.committed == ["spark:orders:11"] and not report.failures
    env.expect_exactly_once()
    assert pending(env, env.options) == []


def test_driver_killed_at_the_crash_point_is_finished_by_recovery(env: Env) -> None:
    messages = write_all(env.options, batch_id=13)
    script = (
        "import json, pickle, sys\n"
        "from spark_integration import commit\n"
        "options, messages = pickle.loads(sys.stdin.buffer.read())\n"
        "commit(options, messages, 13)\n"
    )
    env_vars = {**os.environ, "TWOPC_CRASH_AT": "spark.driver_after_commit"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=pickle.dumps((env.options, messages)),
        env=env_vars,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert pending(env, env.options) == ["spark:orders:13"] and env.rows() == []
    with recovery_manager(
        env.options,
    ) as tm:
        assert tm.recover(force=True).committed == ["spark:orders:13"]
    env.expect_exactly_once()


def test_recovery_presumes_abort_for_spark_orphans_only_after_the_grace(env: Env) -> None:
    write_all(env.options, batch_id=12)  # the driver died before deciding
    with recovery_manager(env.options) as tm:
        young = tm.recover(force=True)
    assert young.rolled_back == [] and young.left_alone == 6
    with recovery_manager({**env.options, "log.grace_seconds": "0.001"}) as tm:
        time.sleep(1.1)  # birth stamps have one-second resolution
        old = tm.recover(force=True)
    assert len(old.rolled_back) == 6
    assert env.rows() == [] and env.prepared() == []


def test_message_log_target_with_retry_and_recovery(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "spark-protocol-test-secret-0123456789"
    monkeypatch.setenv("TWOPC_SECRET", secret)
    mlog = MessageLog(tmp_path / "mlog")
    listener = Listener(
        ("127.0.0.1", 0),
        SharedSecret(secret.encode()),
        "test-log",
        {PRODUCER_ROLE: ProducerService(mlog)},
    ).start()
    try:
        host, port = listener.address
        options = {**env.pg_only, "mlog.address": f"{host}:{port}", "mlog.destination": "events"}
        options["mlog.value"] = "{id}:{name}"
        gtrid = make_gtrid("orders", txn_version="m1")
        failed = write_partition(
            options, split(ROWS)[0], partition=0, attempt=0, task_attempt_id=5, gtrid=gtrid
        )
        messages = write_all(options, gtrid=gtrid, attempt=1)
        assert sum(len(m.xids) for m in messages) == 6
        report = commit(options, messages)
        assert report.outcome == "committed"
        assert not set(failed.branches) & set(env.prepared())  # retired by attempt 1
        bodies = sorted(m.body.decode() for _, m in mlog.pending("events"))
        assert bodies == sorted(f"{r['id']}:{r['name']}" for r in ROWS)
        env.expect_exactly_once(redis_too=False)
        assert mlog.prepared_gids() == []
    finally:
        listener.close()
        mlog.close()


# -- bad input ---------------------------------------------------------------------------------


def test_missing_option_is_named(env: Env) -> None:
    options = dict(env.options)
    del options["pg.table"]
    with pytest.raises(ConfigurationError, match=r"'pg\.table' is required"):
        write_partition(options, ROWS, partition=0, attempt=0, task_attempt_id=0, batch_id=1)
    with pytest.raises(ConfigurationError, match="'appId' is required"):
        parse_options({k: v for k, v in env.options.items() if k != "appId"})


def test_unknown_target_and_option_are_named(env: Env) -> None:
    with pytest.raises(ConfigurationError, match="unknown target 'kafka'"):
        parse_options({**env.options, "kafka.url": "k:1"})
    with pytest.raises(ConfigurationError, match=r"'pg\.colour'"):
        parse_options({**env.options, "pg.colour": "red"})
    with pytest.raises(ConfigurationError, match="no target"):
        parse_options({"appId": "a", "log.url": "postgresql://x/y"})
    with pytest.raises(ConfigurationError, match="appId"):
        parse_options({**env.options, "appId": "has:colon"})
    with pytest.raises(ConfigurationError, match=r"redis\.key"):
        parse_options({**env.options, "redis.key": "{id.__class__}"})


def test_constraint_violation_fails_the_attempt_and_leaves_nothing_prepared(env: Env) -> None:
    options = {**env.pg_only, "pg.table": "strict_items"}
    bad = [{"id": 1, "qty": 5}, {"id": 2, "qty": -1}]
    with pytest.raises(sa.exc.IntegrityError, match=r"strict_items_qty_check"):
        write_partition(options, bad, partition=0, attempt=0, task_attempt_id=0, batch_id=1)
    assert env.prepared() == []
    with env.data.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM strict_items")).scalar_one() == 0


def test_a_template_column_missing_from_the_rows_is_named_and_nothing_stays_prepared(
    env: Env,
) -> None:
    """Templates render straight through ``format_map``; a row without a column the template
    names still fails with the column's name, and the attempt leaves nothing behind."""
    options = {**env.options, "redis.value": "{nickname}"}
    with pytest.raises(ConfigurationError, match="no column 'nickname'"):
        write_partition(
            options,
            [{"id": 1, "name": "n1"}],
            partition=0,
            attempt=0,
            task_attempt_id=0,
            batch_id=1,
        )
    assert env.prepared() == []


def test_ids_fit_postgres_gid_limit() -> None:
    gtrid = make_gtrid("a" * 24)  # the longest appId with a uuid suffix
    assert len(gtrid) <= 64
    xid = branch_xid(gtrid, "r" * 24, partition=99999, attempt=99, task_attempt_id=10**11)
    assert len(xid.bqual) <= 64 and len(xid.to_gid()) == gid_length(gtrid, xid.bqual)
    assert len(xid.to_gid()) <= MAX_GID_BYTES
    info = parse_branch(xid.bqual)
    assert info is not None and (info.partition, info.attempt) == (99999, 99)
    assert sub_branch_born(xid.bqual) == info.born
    assert Xid.from_gid(xid.to_gid()) == xid
    with pytest.raises(ConfigurationError, match="appId"):
        make_gtrid("a" * 25)


def test_sub_branches_are_found_only_by_resources_that_opt_in() -> None:
    gtrid = make_gtrid("orders", batch_id=1)
    spark = branch_xid(gtrid, "pg", partition=0, attempt=0, task_attempt_id=0)
    plain, other = Xid.branch_of(gtrid, "pg"), Xid.branch_of(gtrid, "pg2")
    gids = [x.to_gid() for x in (spark, plain, other)]
    assert branches_of(gids, "pg") == [plain]  # the old behaviour, unchanged
    assert branches_of(gids, "pg", sub_branches=True) == [spark, plain]
    assert resource_of(spark.bqual, ["pg", "pg2"]) == "pg"
    assert resource_of("pg", ["pg", "pg2"]) == "pg" and resource_of("pgx~1", ["pg"]) is None


# -- helpers -----------------------------------------------------------------------------------


def _decide_only(env: Env, messages: list[CommitMessage]) -> None:
    """What a driver killed at ``spark.driver_after_commit`` leaves: a durable COMMIT, no phase
    two. Built as the driver does it (ledger branch prepared, decision forced), minus the rest."""
    from spark_integration import driver_commit
    from spark_integration.connect import open_targets
    from spark_integration.ids import driver_xid

    config = parse_options(env.options)
    with open_targets(config) as opened:
        opened.ledger.ensure()
        log = opened.write_log()
        gtrid = messages[0].gtrid
        bquals = [x.bqual for m in messages for x in m.xids]
        ledger_xid = driver_xid(gtrid, config.log.ledger_name)
        branches = (*bquals, ledger_xid.bqual)
        driver_commit._prepare_ledger(opened, ledger_xid, branches)
        log.log_commit(Decision(gtrid, branches))


def test_awkward_values_survive_the_copy_path_and_its_fallback(env: Env) -> None:
    """Inserts go through COPY's text format when every value is plain, else execute_values:
    tabs, backslashes, line ends, a literal backslash-N, NULL, unicode, huge floats, quoted
    mixed-case names, and (fallback) dates and decimals all read back exactly."""
    with env.data.begin() as conn:
        conn.execute(text('CREATE TABLE "Odd" (id int, "Name" text, f float8, d date, n numeric)'))
    texts = ["a\tb", "back\\slash", "line\nend", "cr\rlf", "", "literal \\N", "ünïcødé ✓", None]
    plain = [{"id": i, "Name": t, "f": 1e300 if i % 2 else -0.5} for i, t in enumerate(texts)]
    typed = [{"id": 100, "Name": "typed", "f": 2.5, "d": date(2026, 11, 21), "n": Decimal("1.10")}]
    options = {**env.pg_only, "pg.table": "Odd"}
    gtrid = make_gtrid("orders", txn_version="odd")
    messages = [
        write_partition(options, rows, partition=p, attempt=0, task_attempt_id=p, gtrid=gtrid)
        for p, rows in enumerate((plain, typed))
    ]
    assert commit(options, messages, gtrid=gtrid).outcome == "committed"
    with env.data.connect() as conn:
        got = conn.execute(text('SELECT id, "Name", f, d, n FROM "Odd" ORDER BY id')).all()
    expected = [(r["id"], r["Name"], r["f"], None, None) for r in plain]
    expected.append((100, "typed", 2.5, date(2026, 11, 21), Decimal("1.10")))
    assert [tuple(r) for r in got] == expected
    assert env.prepared() == []


def test_twopc_recover_from_the_command_line_finishes_a_crashed_driver(
    env: Env, tmp_path: Path
) -> None:
    """The operator's path: a ``twopc.toml`` naming the SQL log and the writer's resources, and
    ``twopc recover`` rolls the dead driver's decision forward."""
    messages = write_all(env.options, batch_id=11)
    _decide_only(env, messages)
    config = tmp_path / "twopc.json"
    config.write_text(json.dumps({
        "node_id": "spark",
        "log_factory": "tests.integration.cli_factories:decision_log",
        "sub_branch_grace": 900,
        "resources": {
            "pg": "tests.integration.cli_factories:spark_pg",
            "redis": "tests.integration.cli_factories:spark_redis",
            "spark-ledger": "tests.integration.cli_factories:spark_ledger",
        },
    }))  # fmt: skip
    environment = {
        **os.environ,
        "TWOPC_CLI_TEST_LOG_URL": env.options["log.url"],
        "TWOPC_CLI_TEST_SPARK_PG_URL": env.options["pg.url"],
        "TWOPC_CLI_TEST_SPARK_REDIS_URL": env.options["redis.url"],
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "recover", "-c", str(config)],
        capture_output=True, text=True, env=environment, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "committed (re-driven): 1" in done.stdout
    env.expect_exactly_once()
    assert pending(env, env.options) == []
