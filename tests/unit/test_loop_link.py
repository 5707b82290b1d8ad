"""`messaging.remote._loop_link`: a connection on asyncio streams used from another thread, and
the pool that opens one when bound to a running loop. Against a real listener on loopback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import ProgrammingError
from messaging.auth import AuthError, SharedSecret
from messaging.connection import Connection, Listener
from messaging.frames import Ping, Pong
from messaging.remote._loop_link import LoopLink
from messaging.remote._pool import _alive, _Pool
from tests.support.tls import make_certificate

SECRET = SharedSecret(b"loop-link-test-secret-0123456789")
ROLE = "producer"


def slow_echo(conn: Connection) -> None:
    """Answers each Ping with a Pong of its token, after a pause; token 0 closes instead."""
    while (frame := conn.recv()) is not None:
        assert isinstance(frame, Ping)
        if frame.token == 0:
            return
        time.sleep(0.3)
        conn.send(Pong(frame.token))


@pytest.fixture
def listener() -> Iterator[Listener]:
    with Listener(("127.0.0.1", 0), SECRET, "t", {ROLE: slow_echo}).start() as server:
        yield server


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on a thread of its own, as an application's would."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def pool_for(
    listener: Listener, loop: asyncio.AbstractEventLoop, secret: SharedSecret = SECRET
) -> _Pool:
    pool = _Pool(listener.address, secret, client_id="c", role=ROLE, tls=None,
                 server_hostname=None, timeout=5.0)  # fmt: skip
    pool.loop = loop
    return pool


def test_a_bound_pool_opens_loop_links_and_a_timeout_loses_nothing(
    listener: Listener, loop: asyncio.AbstractEventLoop
) -> None:
    pool = pool_for(listener, loop)
    link = pool.acquire()
    assert isinstance(link, LoopLink) and link.loop is loop
    link.send(Ping(7))
    with pytest.raises(TimeoutError):
        link.recv(timeout=0.05)  # the answer is 0.3 s away: the read goes on
    assert link.recv(timeout=5) == Pong(7)  # and this call takes it whole
    assert _alive(link)
    pool.release(link)
    assert pool.acquire() is link  # idle, alive: used again
    link.send(Ping(0))  # the server closes
    deadline = time.monotonic() + 5
    while _alive(link):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert link.recv(timeout=1) is None  # the clean end, read by the same pending read
    link.close()
    pool.close()


def test_without_a_running_loop_or_on_it_the_pool_blocks(
    listener: Listener, loop: asyncio.AbstractEventLoop
) -> None:
    pool = pool_for(listener, loop)

    async def on_the_loop() -> object:
        return pool.acquire()

    conn = asyncio.run_coroutine_threadsafe(on_the_loop(), loop).result(10)
    assert isinstance(conn, Connection)  # a blocking one: the loop cannot wait for itself
    conn.close()
    loop.call_soon_threadsafe(loop.stop)
    time.sleep(0.2)
    conn = pool.acquire()
    assert isinstance(conn, Connection)  # the loop stopped: blocking again
    conn.close()
    pool.close()


def test_a_stopped_loop_is_a_broken_connection(
    listener: Listener, loop: asyncio.AbstractEventLoop
) -> None:
    pool = pool_for(listener, loop)
    link = pool.acquire()
    loop.call_soon_threadsafe(loop.stop)
    time.sleep(0.2)
    with pytest.raises(OSError, match="not running"):
        link.send(Ping(1))
    assert link.closed
    pool.close()


def test_a_link_used_on_its_own_loop_is_refused_and_a_wrong_secret_is_an_auth_error(
    listener: Listener, loop: asyncio.AbstractEventLoop
) -> None:
    link = pool_for(listener, loop).acquire()

    async def recv_on_loop() -> object:
        return link.recv(timeout=1)

    with pytest.raises(ProgrammingError, match="own thread"):
        asyncio.run_coroutine_threadsafe(recv_on_loop(), loop).result(10)
    wrong = pool_for(listener, loop, SharedSecret(b"another-secret-0123456789abcdef"))
    with pytest.raises(AuthError):
        wrong.acquire()
    link.close()


def test_over_tls_with_the_sync_clients_options(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    tls = make_certificate(tmp_path)
    with Listener(
        ("127.0.0.1", 0), SECRET, "t", {ROLE: slow_echo}, tls=tls.server_context()
    ).start() as server:
        pool = _Pool(server.address, SECRET, client_id="c", role=ROLE, tls=tls,
                     server_hostname="localhost", timeout=5.0)  # fmt: skip
        pool.loop = loop
        link = pool.acquire()
        assert isinstance(link, LoopLink)
        link.send(Ping(3))
        assert link.recv(timeout=5) == Pong(3)
        link.close()
        pool.close()
