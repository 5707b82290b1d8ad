"""What a transaction did, step by step, for a tracer to turn into spans (off by default).

The coordinator stays free of third-party code, so it does not speak OpenTelemetry itself: while
a `Tracer` is installed (`install`; `messaging.tracing.instrument` installs the OpenTelemetry
one), each transaction carries a `TransactionTrace` that completion fills with timed steps — each
phase (``prepare``, ``decision``, ``commit_phase``) and each branch's verb (``prepare``,
``commit``, ``rollback``, ``one_phase_commit``), with the error a branch answered — and hands to
the tracer when the transaction ends. The tracer makes the spans then, with the times recorded
here, so nothing it does sits on the commit path and nothing depends on which thread finished.

Messages carry the trace across processes: a send made inside a traced transaction asks the
tracer for headers (`message_headers`), a receive hands the tracer the headers of what it took
(`received`), and the servers between report what they did with a message (`message_event`).

Uninstalled, a transaction's ``trace`` is None and every hook here is one global lookup.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

#: the reserved message header holding the W3C ``traceparent`` of the sending transaction
TRACE_HEADER = "twopc-traceparent"


class Step(NamedTuple):
    """One timed step: a phase (``branch`` None) or a branch's verb."""

    name: str
    branch: str | None
    start_ns: int
    end_ns: int
    error: str | None


@dataclass(slots=True)
class TransactionTrace:
    """One transaction's steps, filled by completion; ``context`` and ``span`` are the tracer's
    own (for OpenTelemetry: the parent context captured at begin, and the transaction's span
    once made)."""

    gtrid: str
    node_id: str
    start_ns: int = field(default_factory=time.time_ns)
    steps: list[Step] = field(default_factory=list)
    outcome: str | None = None
    context: Any = None
    span: Any = None

    def step(
        self, name: str, start_ns: int, branch: str | None = None, error: str | None = None
    ) -> None:
        self.steps.append(Step(name, branch, start_ns, time.time_ns(), error))


class Tracer(Protocol):
    """What the coordinator and the stores call; `messaging.tracing.OpenTelemetryTracer` is the
    implementation. Every method must be quick and must not raise (a tracer's failure is logged
    by it, never turned into the transaction's)."""

    def started(self, trace: TransactionTrace) -> None:
        """A transaction began (on its caller's thread and context)."""

    def finished(self, trace: TransactionTrace) -> None:
        """It ended: ``trace.outcome`` and every step are final."""

    def message_headers(self, trace: TransactionTrace) -> Mapping[str, str]:
        """Headers that carry ``trace`` in a message sent inside it."""
        ...

    def received(self, trace: TransactionTrace, headers: Mapping[str, str]) -> None:
        """``trace``'s transaction received a message with ``headers``."""

    def activate(self, trace: TransactionTrace) -> AbstractContextManager[object]:
        """Make the transaction current for the tracer's own context (code run inside makes
        its spans children of the transaction's)."""
        ...

    def message_event(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, str]
    ) -> None:
        """A server did ``name`` (``log.capture``, ``transfer.send``, ``cursor.accept``) with a
        message whose headers are ``headers``."""


_installed: Tracer | None = None
#: the traces of transactions not yet ended, by gtrid: a store's branch knows its xid, not the
#: transaction object (a plain dict: one entry added and removed per traced transaction)
_active: dict[str, TransactionTrace] = {}


def install(tracer: Tracer | None) -> None:
    """Make ``tracer`` the process's (None: tracing off). Transactions begun later carry a
    trace; those already running do not."""
    global _installed
    _installed = tracer


def installed() -> Tracer | None:
    return _installed


def begin(gtrid: str, node_id: str) -> TransactionTrace | None:
    """A new transaction's trace, or None while no tracer is installed."""
    tracer = _installed
    if tracer is None:
        return None
    trace = TransactionTrace(gtrid, node_id)
    tracer.started(trace)
    _active[gtrid] = trace
    return trace


def end(trace: TransactionTrace, outcome: str) -> None:
    _active.pop(trace.gtrid, None)
    tracer = _installed
    trace.outcome = outcome
    if tracer is not None:
        tracer.finished(trace)


def message_headers(gtrid: str) -> Mapping[str, str]:
    """Headers a message sent in transaction ``gtrid`` carries (none when it is not traced)."""
    tracer = _installed
    if tracer is None:
        return {}
    trace = _active.get(gtrid)
    return {} if trace is None else tracer.message_headers(trace)


def received(gtrid: str, headers: Mapping[str, str]) -> None:
    """Transaction ``gtrid`` received a message with ``headers``."""
    tracer = _installed
    if tracer is not None and TRACE_HEADER in headers:
        trace = _active.get(gtrid)
        if trace is not None:
            tracer.received(trace, headers)


def activated(gtrid: str) -> AbstractContextManager[object]:
    """`Tracer.activate` for transaction ``gtrid``; nothing when it is not traced."""
    tracer = _installed
    trace = None if tracer is None else _active.get(gtrid)
    if tracer is None or trace is None:
        return nullcontext()
    return tracer.activate(trace)


def message_event(name: str, headers: Mapping[str, str], **attributes: str) -> None:
    """A server's step with one message (only messages sent in a traced transaction count)."""
    tracer = _installed
    if tracer is not None and TRACE_HEADER in headers:
        tracer.message_event(name, headers, attributes)
