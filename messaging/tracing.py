"""OpenTelemetry spans for transactions and the messages they carry (the ``otel`` extra).

``instrument()`` installs an `OpenTelemetryTracer` as the process's tracer
(`coordinator.tracing`); from then on, in that process:

- every transaction is a span ``twopc.transaction`` (attributes ``twopc.gtrid``, ``twopc.node``,
  ``twopc.outcome``), with a child span per phase (``twopc.prepare``, ``twopc.decision``,
  ``twopc.commit_phase``) and per branch verb (``twopc.branch.prepare``, ``.commit``,
  ``.rollback``, ``.one_phase_commit``; attribute ``twopc.branch``; status ERROR with the
  branch's answer when it refused or could not be reached);
- a message sent inside a transaction carries that transaction's span context in the reserved
  header ``twopc-traceparent`` (W3C ``traceparent``);
- the log (``twopc.log.capture``), the transfer (``twopc.transfer.send``) and the cursor
  (``twopc.cursor.accept``) record a span per such message, child of the sender's;
- a transaction that receives such a message before its span exists (a consumer's: it is made
  lazily, with the transaction's start time) becomes a child of the first message's span, so one
  trace runs from the producer's transaction to the consumer's. A span already made (the
  transaction sent a message first) gets a link instead.

The transaction's span is the child of the context current where the transaction began (a web
request's span, say). Spans are made when the transaction ends, from the times the coordinator
recorded, so the commit path pays only for the recording; a tracer provider that samples a
transaction out costs nothing more. Nothing here raises into a transaction: a failure to make a
span is logged and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from coordinator import tracing
from coordinator.tracing import TRACE_HEADER, TransactionTrace

try:
    from opentelemetry import context, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # pragma: no cover - the extra is installed where tests run
    raise ImportError("tracing needs OpenTelemetry: pip install 'twopc[otel]'") from exc

log = logging.getLogger("twopc.tracing")

_TRACEPARENT = "traceparent"


class OpenTelemetryTracer:
    """`coordinator.tracing.Tracer` on OpenTelemetry's API (``tracer_provider``: None for the
    global one)."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self._trace = trace
        self._context = context
        self._propagator = TraceContextTextMapPropagator()
        self._tracer = trace.get_tracer("twopc", tracer_provider=tracer_provider)

    # -- coordinator.tracing.Tracer ---------------------------------------------------------------

    def started(self, trace: TransactionTrace) -> None:
        trace.context = self._context.get_current()  # the parent, unless a message says otherwise

    def message_headers(self, trace: TransactionTrace) -> Mapping[str, str]:
        try:
            carrier: dict[str, str] = {}
            self._propagator.inject(
                carrier, context=self._trace.set_span_in_context(self._span(trace))
            )
            value = carrier.get(_TRACEPARENT)
            return {TRACE_HEADER: value} if value else {}
        except Exception:
            log.exception("tracing: no trace header for a message of %s", trace.gtrid)
            return {}

    def received(self, trace: TransactionTrace, headers: Mapping[str, str]) -> None:
        try:
            parent = self._extract(headers)
            if trace.span is None:
                trace.context = parent  # a consumer's transaction joins its message's trace
            else:
                link = self._trace.get_current_span(parent).get_span_context()
                trace.span.add_link(link, {"twopc.link": "received"})
        except Exception:
            log.exception("tracing: a received message's context dropped (%s)", trace.gtrid)

    def finished(self, trace: TransactionTrace) -> None:
        try:
            span = self._span(trace)
            span.set_attribute("twopc.outcome", trace.outcome or "")
            parent = self._trace.set_span_in_context(span)
            for step in trace.steps:
                name = (
                    "twopc." + step.name
                    if step.branch is None or step.name == "decision"
                    else ("twopc.branch." + step.name)
                )
                child = self._tracer.start_span(name, context=parent, start_time=step.start_ns)
                if step.branch is not None:
                    child.set_attribute("twopc.branch", step.branch)
                if step.error is not None:
                    child.set_status(self._trace.Status(self._trace.StatusCode.ERROR, step.error))
                child.end(end_time=step.end_ns)
            if trace.outcome not in ("committed", "read-only", "commit-pending"):
                span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, trace.outcome))
            span.end()
        except Exception:
            log.exception("tracing: the spans of %s dropped", trace.gtrid)

    def activate(self, trace: TransactionTrace) -> AbstractContextManager[object]:
        try:
            span = self._span(trace)
        except Exception:
            log.exception("tracing: no span for %s", trace.gtrid)
            return nullcontext()
        result: AbstractContextManager[object] = self._trace.use_span(span, end_on_exit=False)
        return result

    def message_event(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, str]
    ) -> None:
        try:
            span = self._tracer.start_span(f"twopc.{name}", context=self._extract(headers))
            for key, value in attributes.items():
                span.set_attribute(f"twopc.{key}", value)
            span.end()
        except Exception:
            log.exception("tracing: a %s span dropped", name)

    # -- helpers ----------------------------------------------------------------------------------

    def _span(self, trace: TransactionTrace) -> Any:
        """The transaction's span, made on first need with the transaction's start time."""
        if trace.span is None:
            trace.span = self._tracer.start_span(
                "twopc.transaction",
                context=trace.context,
                start_time=trace.start_ns,
                attributes={"twopc.gtrid": trace.gtrid, "twopc.node": trace.node_id},
            )
        return trace.span

    def _extract(self, headers: Mapping[str, str]) -> Any:
        value = headers.get(TRACE_HEADER)
        return self._propagator.extract({_TRACEPARENT: value} if value else {})


def instrument(tracer_provider: Any = None) -> OpenTelemetryTracer:
    """Trace every transaction begun from now on in this process, and the messages they send
    and receive (see the module's text); returns the tracer installed. ``tracer_provider``:
    None for OpenTelemetry's global provider (configure it, or nothing is exported)."""
    tracer = OpenTelemetryTracer(tracer_provider)
    tracing.install(tracer)
    return tracer


def uninstrument() -> None:
    """Stop tracing (transactions begun from now on carry no trace)."""
    tracing.install(None)
