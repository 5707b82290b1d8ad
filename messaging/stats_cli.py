"""``twopc stats --connect HOST:PORT``: a running log or cursor server's metrics, online.

The same families ``--metrics`` serves over HTTP (`messaging.metrics`), fetched with the
``stats`` administrative request over the authenticated protocol (the secret and TLS flags of the
other admin commands), for a server run without ``--metrics`` or a firewall between. Which kind
of server answers is found out: the request goes as a consumer (a cursor's role) and, if the
server does not serve that role, as a producer (a log's); ``--server log|cursor`` says it
directly (a log then counts no refused handshake).

Output: one row per sample (``metric``, ``labels``, ``value``), or ``--json``: the families with
their help and kind. Exit codes as for the other admin commands (2 usage or configuration, 5 no
server answers).
"""

from __future__ import annotations

import argparse
from typing import Any

from coordinator.cli_output import emit_json, table
from coordinator.errors import ConfigurationError

from .auth import AuthError, TlsConfig
from .cli import client_flags, secret_from
from .connection import parse_address
from .metrics import Family, from_value


def register(sub: Any) -> None:
    """Add ``stats`` (called by `admin_cli.register`: one entry point for the admin commands)."""
    p = sub.add_parser("stats", help="a running log or cursor server's metrics, online")
    p.add_argument("--connect", required=True, metavar="HOST:PORT", help="the server's --listen")
    p.add_argument("--server", choices=("log", "cursor"), help="its kind (default: found out)")
    client_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_stats)


def cmd_stats(args: argparse.Namespace) -> int:
    families = fetch(args)
    if args.json:
        emit_json([
            {"name": f.sample_name, "kind": f.kind, "help": f.help,
             "samples": [{"labels": dict(labels), "value": v} for labels, v in f.samples]}
            for f in families
        ])  # fmt: skip
        return 0
    rows = [
        [f.sample_name, ",".join(f"{k}={v}" for k, v in labels) or "-", _number(value)]
        for f in families
        for labels, value in f.samples
    ]
    print(table(("metric", "labels", "value"), rows))
    return 0


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else f"{value:g}"


def fetch(args: argparse.Namespace) -> list[Family]:
    """The families of the server at ``--connect``, asked as its kind (or each in turn)."""
    kinds = [args.server] if args.server else ["cursor", "log"]
    for kind in kinds:
        try:
            return from_value(_ask(args, kind))
        except AuthError as exc:
            if kind != kinds[-1] and "role" in exc.message:  # not this kind of server
                continue
            raise ConfigurationError(
                f"the server at {args.connect} refused this client: a wrong secret, or not a "
                f"twopc {'/'.join(kinds)} server ({exc.message})"
            ) from exc
    raise AssertionError("unreachable")


def _ask(args: argparse.Namespace, kind: str) -> Any:
    from .remote import RemoteCursor, RemoteMessageLog, RemoteUnavailable  # noqa: PLC0415

    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca).client_context()
    address = parse_address(args.connect)
    remote = (RemoteCursor if kind == "cursor" else RemoteMessageLog)(
        address, secret_from(args), client_id="twopc-admin", tls=tls,
        server_hostname=args.tls_server_name, timeout=args.timeout,
    )  # fmt: skip
    try:
        with remote:
            return remote.server_stats()
    except RemoteUnavailable as exc:
        raise RemoteUnavailable(
            f"no server answers at {args.connect} (is `twopc serve` running?): {exc.message}"
        ) from exc
