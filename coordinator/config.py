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

Where a factory is found: ``package.module`` is imported with the **config file's folder first**
on ``sys.path``, then the usual path (``PYTHONPATH``, the current directory when run as
``python -m``, installed packages). So a ``twopc_factories.py`` beside ``twopc.toml`` is found
without ``PYTHONPATH``, wherever ``twopc`` runs from; a module already imported (the standard
library's, twopc's own) is not shadowed by a file of the same name there. The folder stays on the
path while the factories run, so a factory may import its siblings lazily.

A factory that cannot be imported, is not callable, raises (other than with a twopc error, which
passes as it is), or builds the wrong thing is a `ConfigurationError` naming the factory.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .decision_log import DecisionLog, FileDecisionLog
from .errors import ConfigurationError, TransactionError
from .resource import Resource
from .xid import validate_node_id, validate_resource_name


@dataclass(frozen=True)
class Config:
    node_id: str
    log: Path | None
    resources: dict[str, str] = field(default_factory=dict)
    log_factory: str | None = None
    sub_branch_grace: float = 900.0
    #: the config file's folder: factories are imported from here first (see the module doc)
    base: Path | None = None

    def build_log(self, *, read_only: bool = False) -> DecisionLog:
        if self.log is not None:
            return FileDecisionLog(self.log)
        assert self.log_factory is not None  # load() requires one of the two
        with importable_from(self.base):
            factory: Callable[..., Any] = load_object(self.log_factory)
            kwargs = {"read_only": True} if read_only else {}
            built = _called(
                f"log factory {self.log_factory}", lambda: factory(self.node_id, **kwargs)
            )
        if not isinstance(built, DecisionLog):
            raise ConfigurationError(f"log factory {self.log_factory} did not build a DecisionLog")
        return built

    def build_resources(self) -> list[Resource[Any]]:
        built = []
        with importable_from(self.base):
            for name, target in self.resources.items():
                resource = _called(f"factory {target} of resource {name!r}", load_object(target))
                if getattr(resource, "name", None) != name:
                    raise ConfigurationError(
                        f"factory {target} built {_what(resource)}, but the config names "
                        f"it {name!r}"
                    )
                built.append(resource)
        return built


def _what(built: object) -> str:
    name = getattr(built, "name", None)
    if isinstance(name, str):
        return f"a resource named {name!r}"
    return f"a {type(built).__name__}, not a resource"


def _called(what: str, factory: Callable[[], Any]) -> Any:
    """Call a factory; anything but a twopc error becomes a one-line `ConfigurationError`."""
    try:
        return factory()
    except TransactionError:
        raise  # already says who must act (a resource that is down is not a configuration error)
    except Exception as exc:
        raise ConfigurationError(f"{what} raised {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def importable_from(folder: Path | None) -> Iterator[None]:
    """``folder`` first on ``sys.path`` for the duration, unless it is there already."""
    entry = None if folder is None else str(folder.resolve())
    if entry is None or entry in sys.path:
        yield
        return
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        raw = _parse(path)
    except FileNotFoundError as exc:
        raise ConfigurationError(
            f"no config file {path} (pass -c PATH; the default is twopc.toml in the current "
            "directory)"
        ) from exc
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
        path.parent,
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
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot load factory {target!r}: {exc} (looked in the config "
            "file's folder, then on sys.path: PYTHONPATH and installed packages)"
        ) from exc
    except Exception as exc:  # the module itself fails: a syntax error, an import-time raise
        raise ConfigurationError(
            f"importing the module of factory {target!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    try:
        obj = getattr(module, attribute)
    except AttributeError as exc:
        raise ConfigurationError(f"cannot load factory {target!r}: {exc}") from exc
    if not callable(obj):
        raise ConfigurationError(f"factory {target!r} is not callable")
    return obj  # type: ignore[no-any-return]
