"""The small config file the command line uses to rebuild a manager after a crash.

Resources are named by the import path of a factory, never by a connection string: the factory
reads its own credentials (environment, a secrets file) when it runs, so nothing secret is ever
written to the config, the log or a terminal. Example ``twopc.toml``::

    node_id = "orders-1"
    log = "/var/lib/orders/txlog"

    [resources]
    ledger = "orders.twopc:ledger_resource"
    cache = "orders.twopc:cache_resource"

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

from .errors import ConfigurationError
from .resource import Resource
from .xid import validate_node_id, validate_resource_name


@dataclass(frozen=True)
class Config:
    node_id: str
    log: Path
    resources: dict[str, str] = field(default_factory=dict)

    def build_resources(self) -> list[Resource]:
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
    for key in ("node_id", "log"):
        if not isinstance(raw.get(key), str):
            raise ConfigurationError(f"config {path}: '{key}' must be a string")
    resources = raw.get("resources", {})
    if not isinstance(resources, dict):
        raise ConfigurationError(f"config {path}: [resources] must map names to factories")
    for name in resources:
        validate_resource_name(name)
    log_dir = Path(raw["log"])
    return Config(
        validate_node_id(raw["node_id"]),
        log_dir if log_dir.is_absolute() else path.parent / log_dir,
        {str(k): str(v) for k, v in resources.items()},
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


def load_object(target: str) -> Callable[[], Resource]:
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
