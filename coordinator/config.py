"""The small config file the command line uses to rebuild a manager after a crash.

Resources are named by the import path of a factory, never by a connection string: the factory
reads its own credentials (environment, a secrets file) when it runs, so nothing secret is ever
written to the config, the log or a terminal. Example ``twopc.toml``::

    node_id = "orders-1"
    log = "/var/lib/orders/txlog"

    [resources]
    ledger = "orders.twopc:ledger_resource"
    cache = "orders.twopc:cache_resource"

A decision log that is not a local directory (the SQL log, for a node another host must be able
to recover) is named by a factory instead of ``log``: ``log_factory = "orders.twopc:decision_log"``.
It is called as ``factory(node_id)`` for ``twopc recover`` and ``factory(node_id, read_only=True)``
for ``twopc status``, which must read a log while its live owner holds it and never write.

``sub_branch_grace`` (seconds, default 900) is how long recovery leaves a branch begun by a process
it does not know (a Spark task's) before presuming it aborted: set it to what the writers use
(the Spark source's ``log.grace_seconds``), never less.

JSON with the same keys works too (and is the only format on Python 3.10, which has no tomllib).
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .decision_log import DecisionLog, FileDecisionLog
from .errors import ConfigurationError
from .resource import Resource
from .xid import validate_node_id, validate_resource_name


@dataclass(frozen=True)
class Config:
    node_id: str
    log: Path | None
    resources: dict[str, str] = field(default_factory=dict)
    log_factory: str | None = None
    sub_branch_grace: float = 900.0

    def build_log(self, *, read_only: bool = False) -> DecisionLog:
        if self.log is not None:
            return FileDecisionLog(self.log)
        assert self.log_factory is not None  # load() requires one of the two
        factory: Callable[..., Any] = load_object(self.log_factory)
        built = factory(self.node_id, read_only=True) if read_only else factory(self.node_id)
        if not isinstance(built, DecisionLog):
            raise ConfigurationError(f"log factory {self.log_factory} did not build a DecisionLog")
        return built

    def build_resources(self) -> list[Resource[Any]]:
        built = []
        for name, target in self.resources.items():
            resource = load_object(target)()
            if resource.name != name:
                raise ConfigurationError(
                    f"factory {target} built a resource named {resource.name!r}, "
                    f"but the config names it {name!r}"
                )
            built.append(resource)
        return built


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        raw = _parse(path)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(raw.get("node_id"), str):
        raise ConfigurationError(f"config {path}: 'node_id' must be a string")
    has_log, has_factory = isinstance(raw.get("log"), str), isinstance(raw.get("log_factory"), str)
    if has_log == has_factory:
        raise ConfigurationError(
            f"config {path}: give exactly one of 'log' (a directory) and 'log_factory' "
            "('package.module:function')"
        )
    resources = raw.get("resources", {})
    if not isinstance(resources, dict):
        raise ConfigurationError(f"config {path}: [resources] must map names to factories")
    for name in resources:
        validate_resource_name(name)
    grace = raw.get("sub_branch_grace", 900.0)
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace > 0:
        raise ConfigurationError(f"config {path}: 'sub_branch_grace' must be seconds above 0")
    log_dir = Path(raw["log"]) if has_log else None
    if log_dir is not None and not log_dir.is_absolute():
        log_dir = path.parent / log_dir
    return Config(
        validate_node_id(raw["node_id"]),
        log_dir,
        {str(k): str(v) for k, v in resources.items()},
        raw.get("log_factory"),
        float(grace),
    )


def _parse(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    elif sys.version_info >= (3, 11):
        import tomllib  # noqa: PLC0415 - 3.11+ only

        data = tomllib.loads(text)
    else:
        raise ValueError("TOML needs Python 3.11+; use a .json config on Python 3.10")
    if not isinstance(data, dict):
        raise ValueError("the top level must be a table")
    return data


def load_object(target: str) -> Callable[[], Resource[Any]]:
    """``"package.module:attribute"`` -> the attribute, with an error that says what failed."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"factory {target!r} must look like 'package.module:function'")
    try:
        obj = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load factory {target!r}: {exc}") from exc
    if not callable(obj):
        raise ConfigurationError(f"factory {target!r} is not callable")
    return obj  # type: ignore[no-any-return]
