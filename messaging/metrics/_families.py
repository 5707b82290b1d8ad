"""Metric families as plain values: what a server measures, independent of who exports it.

One representation feeds three exporters, so the names cannot drift between them: the stdlib
text format (`render_text`, Prometheus exposition 0.0.4), a `prometheus_client` collector
(`messaging.metrics.prometheus`), and the ``stats`` administrative request (`to_value`,
`from_value`: the same families as a frame `Value`, for ``twopc stats --connect``).

A counter's ``name`` has no ``_total``: the exposition adds it, as `prometheus_client` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from coordinator.errors import ProgrammingError

from ..frames import Value

COUNTER = "counter"
GAUGE = "gauge"

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Family:
    """One metric: its name (``twopc_…``), ``counter`` or ``gauge``, what it means, and its
    samples, each a label set (sorted pairs) and a value."""

    name: str
    kind: str
    help: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> Family:
        self.samples.append((tuple(sorted(labels.items())), float(value)))
        return self

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == COUNTER else self.name

    def value(self, **labels: str) -> float | None:
        """The sample with exactly these labels (None if there is none): for tests and CLIs."""
        wanted = tuple(sorted(labels.items()))
        return next((v for got, v in self.samples if got == wanted), None)


def counter(name: str, help: str) -> Family:
    return Family(name, COUNTER, help)


def gauge(name: str, help: str) -> Family:
    return Family(name, GAUGE, help)


def _escape(text: str, quote: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render_text(families: Iterable[Family]) -> str:
    """The Prometheus text exposition format, version 0.0.4: ``# HELP``, ``# TYPE``, samples."""
    lines: list[str] = []
    for f in families:
        name = f.sample_name
        lines += [f"# HELP {name} {_escape(f.help, quote=False)}", f"# TYPE {name} {f.kind}"]
        for labels, value in f.samples:
            text = ",".join(f'{k}="{_escape(v, quote=True)}"' for k, v in labels)
            shown = f"{name}{{{text}}}" if text else name
            lines.append(f"{shown} {_number(value)}")
    return "\n".join(lines) + "\n"


def to_value(families: Iterable[Family]) -> list[Value]:
    """The families as a frame value (the ``stats`` administrative reply)."""
    return [
        {"name": f.name, "kind": f.kind, "help": f.help,
         "samples": [[dict(labels), value] for labels, value in f.samples]}
        for f in families
    ]  # fmt: skip


def from_value(value: Value) -> list[Family]:
    """`to_value` read back; a reply of another shape is a `ProgrammingError` (a server of
    another version, or not a twopc server)."""
    if not isinstance(value, list):
        raise ProgrammingError("the server's stats reply is not a list of metric families")
    return [_family(item) for item in value]


def _family(item: Value) -> Family:
    if not isinstance(item, Mapping) or not isinstance(item.get("samples"), list):
        raise ProgrammingError(f"the server's stats reply holds a bad family: {item!r:.200}")
    family = Family(str(item.get("name")), str(item.get("kind")), str(item.get("help")))
    for sample in item["samples"]:  # type: ignore[union-attr]
        if not (isinstance(sample, list) and len(sample) == 2 and isinstance(sample[0], Mapping)
                and isinstance(sample[1], int | float)):  # fmt: skip
            raise ProgrammingError(f"the server's stats reply holds a bad sample: {sample!r:.200}")
        family.add(sample[1], **{str(k): str(v) for k, v in sample[0].items()})
    return family
