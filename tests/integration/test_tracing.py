"""Tracing with OpenTelemetry's SDK and its in-memory exporter: one trace from a producer's
transaction (PostgreSQL and a message log, two-phase) through the log, the transfer and the
cursor to the consumer's transaction (the cursor and PostgreSQL); a span per phase and per branch
verb; a refusing branch's span marked as an error; and nothing traced once uninstrumented."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, get_current_span

from coordinator import FileDecisionLog, TransactionManager, TransactionRolledBack
from coordinator.tracing import TRACE_HEADER
from messaging import tracing
from messaging.auth import SharedSecret
from messaging.consumer import consume_once
from messaging.server import CursorServer, LogServer
from resource_managers.postgres import PostgresResource
from tests.support.no_voter import NoVoter

SECRET = SharedSecret(b"tracing-test-secret-0123456789abcdef")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.instrument(provider)
    yield exporter
    tracing.uninstrument()
    provider.shutdown()


@pytest.fixture
def engine(make_pg_database: Callable[[], str]) -> Iterator[sa.Engine]:
    engine = sa.create_engine(make_pg_database(), pool_size=2)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE seen (body text PRIMARY KEY)"))
    yield engine
    engine.dispose()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.name, []).append(span)
    return out


def test_one_trace_from_the_producer_to_the_consumer(
    tmp_path: Path, engine: sa.Engine, spans: InMemorySpanExporter
) -> None:
    with (
        CursorServer(tmp_path / "cursor", SECRET, listen=("127.0.0.1", 0)) as cursor,
        LogServer(tmp_path / "log", SECRET, cursor=cursor.address) as log,
    ):
        db = PostgresResource(engine, "db")
        with TransactionManager(
            "producer", FileDecisionLog(tmp_path / "ptx"), [db, log.resource]
        ) as producer:
            with producer.transaction() as tx:
                tx.join(db).execute(sa.text("INSERT INTO seen VALUES ('sent')"))
                tx.join(log.resource).send("orders", b"order 1")
            assert log.wait_idle(10)
        with TransactionManager(
            "consumer", FileDecisionLog(tmp_path / "ctx"), [cursor.resource, db]
        ) as consumer:
            current: list[int] = []

            def handle(ctx: Any, delivery: Any) -> None:
                assert TRACE_HEADER in delivery.headers
                current.append(get_current_span().get_span_context().span_id)
                ctx.join(db).execute(sa.text("INSERT INTO seen VALUES ('got')"))

            assert consume_once(consumer, cursor.resource, "orders", handle, timeout=5) == 1
    found = by_name(spans)
    transactions = found["twopc.transaction"]
    assert len(transactions) == 2
    produced = next(s for s in transactions if s.attributes["twopc.node"] == "producer")
    consumed = next(s for s in transactions if s.attributes["twopc.node"] == "consumer")
    trace_id = produced.context.trace_id
    for name in ("twopc.log.capture", "twopc.transfer.send", "twopc.cursor.accept"):
        (span,) = found[name]
        assert span.context.trace_id == trace_id, name
        assert span.parent.span_id == produced.context.span_id, name
    assert consumed.context.trace_id == trace_id  # the consumer's transaction joins the trace
    assert consumed.parent.span_id == produced.context.span_id
    assert current == [consumed.context.span_id]  # the handler ran inside the transaction's span
    assert produced.attributes["twopc.outcome"] == "committed"
    children = [s for s in spans.get_finished_spans() if s.parent is not None
                and s.parent.span_id == produced.context.span_id]  # fmt: skip
    names = {(s.name, s.attributes.get("twopc.branch")) for s in children}
    assert ("twopc.prepare", None) in names and ("twopc.decision", None) in names
    assert ("twopc.branch.prepare", "db") in names
    assert ("twopc.branch.prepare", "mlog") in names or ("twopc.branch.prepare", "log") in names
    assert any(n == "twopc.branch.commit" for n, _ in names)
    for span in children:  # the protocol's steps lie inside it (the messages' go on after it)
        if span.name.startswith(("twopc.log.", "twopc.transfer.", "twopc.cursor.", "twopc.tr")):
            continue
        assert produced.start_time <= span.start_time <= span.end_time <= produced.end_time, (
            span.name,
            span.attributes,
            span.end_time - produced.end_time,
        )


def test_a_refusing_branch_is_an_error_span(
    tmp_path: Path, engine: sa.Engine, spans: InMemorySpanExporter
) -> None:
    db = PostgresResource(engine, "db")
    refuses = NoVoter(RuntimeError("disk full"), "zz-refuses")
    log = FileDecisionLog(tmp_path / "tx")
    with (
        TransactionManager("node", log, [db, refuses]) as tm,  # type: ignore[list-item]
        pytest.raises(TransactionRolledBack),
        tm.transaction() as tx,
    ):
        tx.join(db).execute(sa.text("INSERT INTO seen VALUES ('x')"))
        tx.join(refuses)  # type: ignore[arg-type]
    found = by_name(spans)
    (transaction,) = found["twopc.transaction"]
    assert transaction.attributes["twopc.outcome"] == "rolled-back"
    assert transaction.status.status_code == StatusCode.ERROR
    prepares = found["twopc.branch.prepare"]
    refused = [s for s in prepares if s.attributes["twopc.branch"] == refuses.name]
    assert refused and refused[0].status.status_code == StatusCode.ERROR
    assert "disk full" in (refused[0].status.description or "")
    assert {s.attributes["twopc.branch"] for s in found["twopc.branch.rollback"]} >= {"db"}


def test_nothing_is_traced_once_uninstrumented(tmp_path: Path, engine: sa.Engine) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.instrument(provider)
    tracing.uninstrument()
    db = PostgresResource(engine, "db")
    log = FileDecisionLog(tmp_path / "tx")
    with TransactionManager("node", log, [db]) as tm, tm.transaction() as tx:
        tx.join(db).execute(sa.text("INSERT INTO seen VALUES ('y')"))
        assert tx.trace is None
    assert exporter.get_finished_spans() == ()
