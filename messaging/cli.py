"""``twopc serve log`` and ``twopc serve cursor``: the stores as servers (and, registered from
here too, the cursor's administration commands of `admin_cli`).

Each prints one line, ``listening on HOST:PORT``, once it accepts connections (scripts and tests
wait for it; a log then prints its durable identity and incarnation), and shuts down cleanly on
SIGTERM or SIGINT: listener closed, transfer stopped, journal flushed. A ``kill -9`` is survived
as well: that is what the journals are for.

The shared secret comes from ``--secret-file`` or the ``TWOPC_SECRET`` environment variable
(never from the command line, where every user of the machine can read it). With ``--clients
FILE`` each client authenticates with its own key (or, with ``--tls-require-client-cert``, its
certificate) and is held to its grants (`messaging.authz`); SIGHUP reloads the file, and so does
a change of it (checked every 2 s).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from coordinator.errors import ConfigurationError
from resource_managers.cursor import DEFAULT_MAX_DELIVERIES, DEFAULT_PRECOUNT
from resource_managers.message_log import DEFAULT_MAX_MESSAGE_BYTES

from .auth import SharedSecret, TlsConfig
from .connection import parse_address
from .expiry import DEFAULT_SWEEP_INTERVAL
from .routes import parse_route
from .topics import DEFAULT_DISPATCH_WORKERS

if TYPE_CHECKING:
    from .metrics import MetricsEndpoint
    from .server import CursorServer, LogServer

_Server = TypeVar("_Server")

#: why a listener cannot bind, in words an operator can act on
_BIND_ERRORS = {
    errno.EADDRINUSE: "address already in use: another process listens there (an earlier "
    "`twopc serve`?); stop it, or choose another --listen",
    errno.EADDRNOTAVAIL: "no interface of this machine has that address; check --listen",
    errno.EACCES: "permission denied: ports below 1024 need privileges; choose another --listen",
}


def register(sub: Any) -> None:
    """Entry point of the ``twopc.commands`` group: ``serve`` (``subscription``, ``dlq``,
    ``queue`` and ``journal`` are entry points of their own, `admin_cli` and `journal_cli`)."""
    serve = sub.add_parser("serve", help="run a message log or a cursor as a server")
    kinds = serve.add_subparsers(dest="serve_kind", required=True)

    log_p = kinds.add_parser("log", help="a message log: producer service and transfer")
    _common(log_p, default_listen="127.0.0.1:7401")
    log_p.add_argument(
        "--cursor", required=True, metavar="HOST:PORT",
        help="the cursor server: where every destination no --route matches goes",
    )  # fmt: skip
    log_p.add_argument(
        "--route", action="append", default=[], metavar="PATTERN=HOST:PORT[,HOST:PORT...]",
        help="send the destinations matching the glob PATTERN (e.g. 'orders.*') to that cursor; "
        "several cursors partition each such destination by message key (BLAKE2b of the key "
        "modulo their number; no key: the first); repeatable, the first match wins; one "
        "transfer per cursor",
    )  # fmt: skip
    log_p.add_argument(
        "--allow-repartition", action="store_true",
        help="start although a destination's partition count changed while the log holds "
        "unacknowledged messages of it (per-key order is not kept across the change, and a "
        "partition whose cursor changes may deliver some messages twice)",
    )  # fmt: skip
    log_p.add_argument("--cursor-id", help="refuse a cursor that names itself otherwise")
    log_p.add_argument(
        "--client-cert", help="PEM certificate this log shows the cursor (mutual TLS; with "
        "--tls-ca): the cursor's clients file maps its name",
    )  # fmt: skip
    log_p.add_argument("--client-key", help="PEM private key of --client-cert")
    log_p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    log_p.add_argument("--max-destination-messages", type=int, default=None)
    log_p.set_defaults(func=run_log)

    cur_p = kinds.add_parser("cursor", help="a cursor: transfer intake and consumer service")
    _common(cur_p, default_listen="127.0.0.1:7402")
    cur_p.add_argument("--max-deliveries", type=int, default=DEFAULT_MAX_DELIVERIES)
    cur_p.add_argument(
        "--precount", type=int, default=DEFAULT_PRECOUNT,
        help="messages per queue a consumer's forced record pre-counts, so their receives "
        "force nothing (0: every receive forces its own record)",
    )  # fmt: skip
    cur_p.add_argument(
        "--dispatch-workers", type=int, default=DEFAULT_DISPATCH_WORKERS,
        help="topic dispatcher threads (0: no topic dispatch; publications wait)",
    )  # fmt: skip
    cur_p.add_argument(
        "--expiry-sweep", type=float, default=DEFAULT_SWEEP_INTERVAL, metavar="SECONDS",
        help="move expired messages from anywhere in a queue to its DLQ this often (0: only "
        "at the head of a queue, when a consumer receives)",
    )  # fmt: skip
    cur_p.set_defaults(func=run_cursor)


def _common(p: argparse.ArgumentParser, default_listen: str) -> None:
    p.add_argument("--dir", required=True, help="the journal directory (created if missing)")
    p.add_argument("--listen", default=default_listen, metavar="HOST:PORT", help="port 0: any")
    p.add_argument("--id", default=None, help="this server's id in the handshake")
    p.add_argument("--secret-file", help="file holding the shared secret (or TWOPC_SECRET)")
    p.add_argument("--tls-cert", help="PEM certificate: serve over TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA: verify peers (and the cursor, for a log)")
    p.add_argument(
        "--trace",
        action="store_true",
        help="OpenTelemetry spans for the messages that carry a trace (the otel extra; the "
        "tracer provider is configured the OpenTelemetry way, e.g. opentelemetry-instrument)",
    )
    p.add_argument(
        "--metrics", metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (prometheus_client's server "
        "with the metrics extra, else a stdlib one; same names)",
    )  # fmt: skip

    p.add_argument(
        "--tls-require-client-cert", action="store_true",
        help="mutual TLS: every client shows a certificate --tls-ca signed; with --clients, a "
        "client is the entry its certificate's CN or SAN names",
    )  # fmt: skip
    p.add_argument(
        "--clients", metavar="FILE",
        help="per-client keys and grants (TOML): each client authenticates as itself and may "
        "touch only its destinations and nodes; reloaded on SIGHUP or when the file changes",
    )  # fmt: skip


def client_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a command that talks to a running server: secret, TLS, timeout."""
    p.add_argument("--secret-file", help="file holding the shared secret (or TWOPC_SECRET)")
    p.add_argument("--tls-ca", help="PEM CA that signed the server's certificate: use TLS")
    p.add_argument("--tls-cert", help="PEM client certificate, if the server asks for one")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-server-name", help="the name the server's certificate carries")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request (online)")


def secret_from(args: argparse.Namespace) -> SharedSecret:
    """The shared secret of ``--secret-file``, else of ``TWOPC_SECRET``: the variable's bytes as
    the environment holds them (UTF-8 for text), so a value that is not valid UTF-8 is still a
    key and not a crash."""
    if args.secret_file:
        return SharedSecret.from_file(args.secret_file)
    env = os.environb.get(b"TWOPC_SECRET") if os.supports_bytes_environ else None
    if env is None and os.environ.get("TWOPC_SECRET"):  # Windows: text only
        env = os.environ["TWOPC_SECRET"].encode()
    if env:
        return SharedSecret(env)
    raise ConfigurationError("no shared secret: pass --secret-file or set TWOPC_SECRET")


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    if args.tls_require_client_cert and not (args.tls_cert and args.tls_ca):
        raise ConfigurationError(
            "--tls-require-client-cert needs --tls-cert (and --tls-key) and --tls-ca (the CA "
            "that signs the clients' certificates)"
        )
    if not args.tls_cert:
        return None
    return TlsConfig(
        args.tls_cert, args.tls_key, args.tls_ca, require_client_cert=args.tls_require_client_cert
    )


def _own_secret(args: argparse.Namespace, needed: bool) -> SharedSecret | None:
    """The server's secret: required unless a clients file (and, for a log's transfer, a client
    certificate) stands in for it."""
    if needed or args.secret_file or os.environ.get("TWOPC_SECRET"):
        return secret_from(args)
    return None


def _serve_until_signalled(
    server: LogServer | CursorServer, address: object, notice: str = "",
    metrics: MetricsEndpoint | None = None,
) -> int:  # fmt: skip
    """Serve until SIGTERM or SIGINT; SIGHUP reloads the clients file (on this main thread, not
    in the signal handler: a reload logs, and logging is not safe inside a handler).

    The main thread waits in steps of half a second, never for good: the kernel may deliver a
    signal to another thread of the process, and Python then runs the handler only when the main
    thread next executes (an untimed ``Event.wait`` would sleep through a SIGTERM)."""
    stop, hup = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
    try:
        with server:
            host, port = address if isinstance(address, tuple) else ("?", "?")
            print(f"listening on {host}:{port}", flush=True)
            if notice:
                print(notice, flush=True)
            if metrics is not None:
                metrics.start()
                mhost, mport = metrics.address
                print(f"metrics on http://{mhost}:{mport}/metrics", flush=True)
            while not stop.wait(0.5):
                if hup.is_set():
                    hup.clear()
                    if server.authoriser is not None:
                        server.authoriser.reload()
    finally:
        if metrics is not None:
            metrics.close()
    print("stopped", flush=True)
    return 0


def _metrics_endpoint(
    args: argparse.Namespace, server: LogServer | CursorServer
) -> MetricsEndpoint | None:
    """The ``--metrics`` endpoint, bound now: a port in use closes the server and is one line."""
    if not args.metrics:
        return None
    from .metrics import MetricsEndpoint  # noqa: PLC0415

    address = parse_address(args.metrics)
    try:
        return MetricsEndpoint(address, server.families)
    except OSError as exc:
        server.close()
        why = _BIND_ERRORS.get(exc.errno or 0, exc.strerror or str(exc))
        raise ConfigurationError(f"cannot serve metrics on {args.metrics}: {why}") from exc


def _built(args: argparse.Namespace, build: Callable[[], _Server]) -> _Server:
    """The server, or a one-line `ConfigurationError` for the operator's mistakes around it: a
    ``--dir`` that is a file, a ``--listen`` address that cannot be bound, ``--trace`` without
    OpenTelemetry."""
    if args.trace:
        try:
            from .tracing import instrument  # noqa: PLC0415 - only with --trace
        except ImportError as exc:
            raise ConfigurationError(f"--trace: {exc}") from exc
        instrument()
    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        raise ConfigurationError(f"--dir {args.dir} is a file, not a journal directory")
    try:
        return build()
    except OSError as exc:
        why = _BIND_ERRORS.get(exc.errno or 0)
        if why is None or exc.filename is not None:  # a file's error: the generic edge says it
            raise
        raise ConfigurationError(f"cannot listen on {args.listen}: {why}") from exc


def run_log(args: argparse.Namespace) -> int:
    from .server import LogServer  # noqa: PLC0415 - `twopc` loads every plugin at start

    tls = _tls(args)
    if args.client_cert and not args.tls_ca:
        raise ConfigurationError("--client-cert needs --tls-ca (the CA of the cursor's cert)")
    client_tls = (
        TlsConfig(args.client_cert, args.client_key, args.tls_ca).client_context()
        if args.tls_ca
        else None
    )
    routes = [parse_route(text) for text in args.route]  # refused before anything is opened
    secret = _own_secret(args, needed=not (args.clients and args.client_cert))
    server = _built(args, lambda: LogServer(
        args.dir,
        secret,
        cursor=parse_address(args.cursor),
        listen=parse_address(args.listen),
        server_id=args.id or "twopc-log",
        tls_server=tls.server_context() if tls else None,
        tls_client=client_tls,
        cursor_id=args.cursor_id,
        max_message_bytes=args.max_message_bytes,
        max_destination_messages=args.max_destination_messages,
        routes=routes,
        allow_repartition=args.allow_repartition,
        clients=args.clients,
    ))  # fmt: skip
    mlog = server.mlog  # the cursor keeps this log's streams under its identity
    notice = f"log identity {mlog.identity} incarnation {mlog.incarnation}"
    metrics = _metrics_endpoint(args, server)
    return _serve_until_signalled(server, server.address, notice, metrics)


def run_cursor(args: argparse.Namespace) -> int:
    from .server import CursorServer  # noqa: PLC0415

    tls = _tls(args)
    if args.expiry_sweep < 0:
        raise ConfigurationError("--expiry-sweep must be >= 0 seconds (0: no sweep)")
    secret = _own_secret(args, needed=not args.clients)
    server = _built(args, lambda: CursorServer(
        args.dir,
        secret,
        listen=parse_address(args.listen),
        server_id=args.id or "twopc-cursor",
        tls_server=tls.server_context() if tls else None,
        max_deliveries=args.max_deliveries,
        dispatch_workers=args.dispatch_workers,
        precount=args.precount,
        sweep_interval=args.expiry_sweep or None,
        clients=args.clients,
    ))  # fmt: skip
    return _serve_until_signalled(server, server.address, metrics=_metrics_endpoint(args, server))
