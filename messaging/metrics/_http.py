"""`MetricsEndpoint`: ``/metrics`` over HTTP for ``twopc serve log|cursor --metrics HOST:PORT``.

The decision: `prometheus_client`'s own HTTP server when the ``metrics`` extra is installed
(content negotiation, OpenMetrics for a scraper that asks for it, gzip), else a small stdlib
`http.server` that serves the text format 0.0.4. Both serve the same families (`Family`, read at
each scrape), so names and values do not depend on what is installed; only the extras of the
format do. Either runs on daemon threads beside the server's own and is closed with it.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..connection import Address
from ._families import Family, render_text

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


def client_installed() -> bool:
    return importlib.util.find_spec("prometheus_client") is not None


class MetricsEndpoint:
    """Serves ``source()`` at ``http://address/metrics``. ``use_client``: None picks
    `prometheus_client` when installed; False forces the stdlib server. Binding happens in
    the constructor, so a port in use is an `OSError` there, before anything else starts."""

    def __init__(
        self,
        address: Address,
        source: Callable[[], list[Family]],
        use_client: bool | None = None,
    ) -> None:
        self.source = source
        self.uses_client = client_installed() if use_client is None else use_client
        self._thread: threading.Thread | None = None
        self._server: Any
        if self.uses_client:
            self._server = _client_server(address, source)
        else:
            self._server = ThreadingHTTPServer(address, _handler(source))
            self._server.daemon_threads = True
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="twopc-metrics-http", daemon=True
            )
        self.address: Address = self._server.server_address[:2]

    def start(self) -> MetricsEndpoint:
        if self._thread is not None and not self._thread.is_alive():
            self._thread.start()
        return self

    def close(self) -> None:
        if self.uses_client or (self._thread is not None and self._thread.is_alive()):
            self._server.shutdown()  # the client's server thread runs from the start
        self._server.server_close()


def _client_server(address: Address, source: Callable[[], list[Family]]) -> Any:
    """`prometheus_client.start_http_server` on a registry holding only this server's families
    (not the process-wide default registry: its process and platform collectors are the
    client's choice, not ours). Started at once: the client starts its own thread."""
    from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415

    from .prometheus import FamiliesCollector  # noqa: PLC0415 - imports the extra

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FamiliesCollector(source))
    server, _thread = start_http_server(address[1], addr=address[0], registry=registry)
    return server


def _handler(source: Callable[[], list[Family]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            body = render_text(source()).encode()
            self.send_response(200)
            self.send_header("Content-Type", TEXT_FORMAT)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: a scrape every 15 s would otherwise fill stderr."""

    return Handler
