"""What a Spark write goes to, parsed from the writer's string options.

Why strings, and why parsed here: a Python Data Source sees its options as a dict of strings, and
the streaming commit runs in a fresh process that sees nothing but those options, so everything
the executors and the driver need must be derivable from them alone. Parsing happens once per
call, on whichever side needs it, and fails early and clearly: a missing option, an option of a
target that does not exist (``kafka.url``), or an unknown key of a known target raises
`coordinator.ConfigurationError` naming the option, before anything is written.

Options (keys are case-insensitive, as Spark's are):

- ``appId`` (required), ``txnVersion`` (batch writes: the idempotency key), ``arrow`` (``true``:
  batch tasks get Arrow record batches instead of Spark Rows; ``false``: Rows; not given: Arrow
  where the same values reach the targets either way, see `spark_integration.arrow_choice`).
- Decision log: ``log.url`` (PostgreSQL URL of the `SqlDecisionLog`, required), ``log.node``
  (default ``spark``), ``log.table_prefix`` (``twopc_``), ``log.ledger_name``
  (``spark-ledger``), ``log.grace_seconds`` (900: how long recovery leaves an undecided branch
  alone; match the recovery manager's ``sub_branch_grace``), ``log.acquire_timeout`` (60: how
  long the driver waits for the node's lease), ``log.lease_seconds`` (30: how long a killed
  driver's lease blocks the next one).
- PostgreSQL: ``pg.url``, ``pg.table`` (``table`` or ``schema.table``), ``pg.mode``
  (``insert`` | ``upsert``), ``pg.key`` (comma-separated conflict columns, upsert only),
  ``pg.columns`` (default: the row's fields), ``pg.name`` (resource name, default ``pg``).
- Redis: ``redis.url``, ``redis.op`` (``set`` | ``incrby`` | ``hset``), ``redis.key`` (a
  template such as ``user:{id}``), ``redis.value`` (template; ``set``/``hset``), ``redis.field``
  (template; ``hset``), ``redis.amount`` (a column; ``incrby``, default 1), ``redis.namespace``,
  ``redis.durability`` (``strict``), ``redis.name`` (default ``redis``).
- Message log: ``mlog.address`` (``host:port``), ``mlog.destination``, ``mlog.secret_file`` (or
  the environment variable ``TWOPC_SECRET`` where the write runs), ``mlog.value`` (template of
  the body; default the row as JSON), ``mlog.name`` (default ``mlog``).

At least one of ``pg``, ``redis``, ``mlog`` must be configured. Secrets are never part of the
parsed config (it is pickled to executors): only where to read them.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass

from coordinator import ConfigurationError

from .ids import DEFAULT_NODE, validate_app_id, validate_resource_label

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}\Z")
_NAMESPACES = ("log", "pg", "redis", "mlog")
_TOP = {"appid": "appId", "txnversion": "txnVersion", "arrow": "arrow"}
#: keys Spark itself may pass along to a data source; accepted and ignored
_SPARK_KEYS = {"path", "checkpointlocation", "queryname", "mode"}
_KEYS = {
    "log": {
        "url",
        "node",
        "table_prefix",
        "ledger_name",
        "grace_seconds",
        "acquire_timeout",
        "lease_seconds",
    },
    "pg": {"url", "table", "mode", "key", "columns", "name"},
    "redis": {"url", "op", "key", "value", "field", "amount", "namespace", "durability", "name"},
    "mlog": {"address", "destination", "secret_file", "value", "name"},
}


@dataclass(frozen=True)
class Template:
    """``"user:{id}"``: plain field names only (no ``{x.attr}`` or ``{x[0]}``), checked once."""

    text: str
    fields: tuple[str, ...]

    @classmethod
    def parse(cls, text: str, option: str) -> Template:
        fields: list[str] = []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise ConfigurationError(f"option {option!r} {text!r}: {exc}") from None
        for _literal, field, spec, conversion in parsed:
            if field is None:
                continue
            if not _IDENT.match(field) or spec or conversion:
                raise ConfigurationError(
                    f"option {option!r} {text!r}: use plain column names in braces, like "
                    "'user:{id}' (no attributes, indexes, formats or conversions)"
                )
            fields.append(field)
        return cls(text, tuple(fields))

    def render(self, row: Mapping[str, object]) -> str:
        """The text with the row's columns in it. Straight through ``format_map``: with plain
        names only (checked by `parse`) it reads ``row[name]`` and nothing else, and this runs
        once per row and target (a third of a Redis partition's staging, measured)."""
        try:
            return self.text.format_map(row)
        except KeyError:
            missing = [f for f in self.fields if f not in row]
            if not missing:
                raise
            raise ConfigurationError(
                f"template {self.text!r}: the row has no column {missing[0]!r}"
            ) from None


@dataclass(frozen=True)
class LogTarget:
    url: str
    node: str = DEFAULT_NODE
    table_prefix: str = "twopc_"
    ledger_name: str = "spark-ledger"
    grace_seconds: float = 900.0
    acquire_timeout: float = 60.0
    lease_seconds: float = 30.0


@dataclass(frozen=True)
class PostgresTarget:
    url: str
    schema: str | None
    table: str
    mode: str  # "insert" | "upsert"
    key: tuple[str, ...]
    columns: tuple[str, ...] | None
    name: str = "pg"


@dataclass(frozen=True)
class RedisTarget:
    url: str
    op: str  # "set" | "incrby" | "hset"
    key: Template
    value: Template | None
    field: Template | None
    amount: str | None  # a column name (incrby); None adds 1
    namespace: str = "twopc"
    durability: str = "strict"
    name: str = "redis"


@dataclass(frozen=True)
class MessageLogTarget:
    host: str
    port: int
    destination: str
    secret_file: str | None  # None: the TWOPC_SECRET environment variable where the write runs
    value: Template | None  # None: the row as JSON
    name: str = "mlog"


Target = PostgresTarget | RedisTarget | MessageLogTarget


@dataclass(frozen=True)
class WriteConfig:
    """Everything one write needs; picklable, secret-free."""

    app_id: str
    txn_version: str | None
    log: LogTarget
    targets: tuple[Target, ...]
    #: batch writes take Arrow record batches instead of Rows (``arrow`` = true), or Rows
    #: (false); None (not given): Arrow where it is correct (`spark_integration.arrow_choice`)
    arrow: bool | None = None

    @property
    def resource_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.targets)


def parse_options(options: Mapping[str, str]) -> WriteConfig:
    """Parse and check a writer's options (see the module docstring)."""
    grouped: dict[str, dict[str, str]] = {ns: {} for ns in _NAMESPACES}
    top: dict[str, str] = {}
    for raw_key, value in options.items():
        key = str(raw_key)
        lowered = key.lower()
        namespace, dot, rest = lowered.partition(".")
        if dot:
            if namespace not in grouped:
                raise ConfigurationError(
                    f"option {key!r}: unknown target {namespace!r}; targets are "
                    f"{', '.join(repr(n) for n in _NAMESPACES)}"
                )
            if rest not in _KEYS[namespace]:
                raise ConfigurationError(
                    f"option {key!r}: unknown option of {namespace!r}; expected one of "
                    f"{', '.join(sorted(f'{namespace}.{k}' for k in _KEYS[namespace]))}"
                )
            grouped[namespace][rest] = str(value)
        elif lowered in _TOP:
            top[_TOP[lowered]] = str(value)
        elif lowered not in _SPARK_KEYS:
            raise ConfigurationError(
                f"option {key!r} is not known; expected appId, txnVersion or options of the "
                "targets log.*, pg.*, redis.*, mlog.*"
            )
    app_id = validate_app_id(top.get("appId", ""))
    log = _log(grouped["log"])
    targets: list[Target] = []
    if grouped["pg"]:
        targets.append(_postgres(grouped["pg"]))
    if grouped["redis"]:
        targets.append(_redis(grouped["redis"]))
    if grouped["mlog"]:
        targets.append(_mlog(grouped["mlog"]))
    if not targets:
        raise ConfigurationError(
            "no target: configure at least one of pg.* (pg.url, pg.table), redis.* (redis.url, "
            "redis.op, redis.key) or mlog.* (mlog.address, mlog.destination)"
        )
    names = [t.name for t in targets] + [log.ledger_name]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"resource names must differ: {names}")
    arrow = top.get("arrow")
    if arrow is not None and arrow.strip().lower() not in ("true", "false"):
        raise ConfigurationError(f"option 'arrow' must be true or false, not {arrow!r}")
    return WriteConfig(
        app_id,
        top.get("txnVersion") or None,
        log,
        tuple(targets),
        arrow=None if arrow is None else arrow.strip().lower() == "true",
    )


def _required(opts: Mapping[str, str], ns: str, key: str) -> str:
    value = opts.get(key, "").strip()
    if not value:
        raise ConfigurationError(f"option '{ns}.{key}' is required when {ns}.* is configured")
    return value


def _number(opts: Mapping[str, str], ns: str, key: str, default: float) -> float:
    text = opts.get(key)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigurationError(f"option '{ns}.{key}' {text!r} must be a positive number")
    return value


def _choice(opts: Mapping[str, str], ns: str, key: str, choices: tuple[str, ...]) -> str:
    value = opts.get(key, choices[0]).strip().lower()
    if value not in choices:
        raise ConfigurationError(
            f"option '{ns}.{key}' {value!r}: expected one of {', '.join(choices)}"
        )
    return value


def _identifiers(text: str, option: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [n for n in names if not _IDENT.match(n)]
    if not names or bad:
        raise ConfigurationError(
            f"option {option!r} {text!r}: comma-separated column names (letters, digits, _)"
        )
    return names


def _log(opts: Mapping[str, str]) -> LogTarget:
    prefix = opts.get("table_prefix", "twopc_")
    if not re.match(r"[A-Za-z_][A-Za-z0-9_]{0,40}\Z", prefix):
        raise ConfigurationError(f"option 'log.table_prefix' {prefix!r}: letters, digits, _")
    return LogTarget(
        url=_required(opts, "log", "url"),
        node=opts.get("node", DEFAULT_NODE),
        table_prefix=prefix,
        ledger_name=validate_resource_label(
            opts.get("ledger_name", "spark-ledger"), "log.ledger_name"
        ),
        grace_seconds=_number(opts, "log", "grace_seconds", 900.0),
        acquire_timeout=_number(opts, "log", "acquire_timeout", 60.0),
        lease_seconds=_number(opts, "log", "lease_seconds", 30.0),
    )


def _postgres(opts: Mapping[str, str]) -> PostgresTarget:
    url = _required(opts, "pg", "url")
    table = _required(opts, "pg", "table")
    parts = table.split(".")
    if len(parts) > 2 or not all(_IDENT.match(p) for p in parts):
        raise ConfigurationError(
            f"option 'pg.table' {table!r}: 'table' or 'schema.table', letters, digits and _"
        )
    schema, name = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
    mode = _choice(opts, "pg", "mode", ("insert", "upsert"))
    key: tuple[str, ...] = ()
    if mode == "upsert":
        key = _identifiers(_required(opts, "pg", "key"), "pg.key")
    elif "key" in opts:
        raise ConfigurationError("option 'pg.key' is only for pg.mode=upsert")
    columns = _identifiers(opts["columns"], "pg.columns") if "columns" in opts else None
    if columns is not None and key and not set(key) <= set(columns):
        raise ConfigurationError("option 'pg.key': every key column must be in pg.columns")
    label = validate_resource_label(opts.get("name", "pg"), "pg.name")
    return PostgresTarget(url, schema, name, mode, key, columns, label)


def _redis(opts: Mapping[str, str]) -> RedisTarget:
    url = _required(opts, "redis", "url")
    op = _choice(opts, "redis", "op", ("set", "incrby", "hset"))
    key = Template.parse(_required(opts, "redis", "key"), "redis.key")
    value = field = None
    amount: str | None = None
    if op in ("set", "hset"):
        value = Template.parse(_required(opts, "redis", "value"), "redis.value")
    if op == "hset":
        field = Template.parse(_required(opts, "redis", "field"), "redis.field")
    if op == "incrby" and "amount" in opts:
        amount = _identifiers(opts["amount"], "redis.amount")[0]
    for unused in ("value", "field", "amount"):
        if unused in opts and {"value": value, "field": field, "amount": amount}[unused] is None:
            raise ConfigurationError(f"option 'redis.{unused}' does not apply to redis.op={op}")
    durability = _choice(opts, "redis", "durability", ("strict", "relaxed"))
    namespace = opts.get("namespace", "twopc")
    label = validate_resource_label(opts.get("name", "redis"), "redis.name")
    return RedisTarget(url, op, key, value, field, amount, namespace, durability, label)


def _mlog(opts: Mapping[str, str]) -> MessageLogTarget:
    address = _required(opts, "mlog", "address")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"option 'mlog.address' {address!r}: expected HOST:PORT")
    destination = _required(opts, "mlog", "destination")
    value = Template.parse(opts["value"], "mlog.value") if "value" in opts else None
    label = validate_resource_label(opts.get("name", "mlog"), "mlog.name")
    secret_file = opts.get("secret_file") or None
    return MessageLogTarget(host.strip("[]"), int(port), destination, secret_file, value, label)
