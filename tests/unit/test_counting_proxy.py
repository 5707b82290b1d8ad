"""`bench/counting_proxy.py`: what ``bench/messaging_counts.py`` calls a round trip and a forced
PostgreSQL statement must be what goes on the wire."""

from __future__ import annotations

import socket
import struct
import sys
import threading
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from counting_proxy import CountingProxy, _FrontendParser, classify


def test_classify_tells_commit_from_commit_prepared_and_prepare() -> None:
    sql = "BEGIN; INSERT INTO t VALUES (1); INSERT INTO d VALUES ('c'); COMMIT"
    assert classify(sql) == Counter(commit=1)
    assert classify("PREPARE TRANSACTION 'x'") == Counter(prepare=1)
    assert classify("COMMIT PREPARED 'x'") == Counter(commit_prepared=1)
    assert classify("ROLLBACK PREPARED 'x'") == Counter(rollback=1)
    assert classify("SELECT 1") == Counter()


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!i", 4 + len(body)) + body


def test_frontend_parser_skips_ssl_request_and_startup_and_reads_split_messages() -> None:
    counts: Counter[str] = Counter()
    parser = _FrontendParser(counts)
    ssl = struct.pack("!ii", 8, 80877103)
    startup = struct.pack("!ii", 8 + 5, 196608) + b"user\0"
    stream = ssl + startup + _message(b"Q", b"COMMIT PREPARED 'g'\0")
    stream += _message(b"P", b"\0PREPARE TRANSACTION 'g'\0\0\0")
    for i in range(0, len(stream), 3):  # arrives in pieces
        parser.feed(stream[i : i + 3])
    assert counts == Counter(commit_prepared=1, prepare=1)


def test_round_trips_count_request_bursts_not_sends() -> None:
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data.upper())

    threading.Thread(target=echo, daemon=True).start()
    with CountingProxy(server.getsockname()[:2]) as proxy:
        with socket.create_connection(proxy.address) as client:
            for _ in range(3):  # three requests, each answered before the next
                client.sendall(b"ab")
                assert client.recv(1024) == b"AB"
        assert proxy.snapshot()["round_trips"] == 3
    server.close()
