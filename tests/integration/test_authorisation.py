"""Per-client authorisation against real servers (`LogServer`, `CursorServer` listening on
127.0.0.1, clients over TCP and TLS): each client authenticates as itself (its own secret, or its
certificate under mutual TLS) and may touch only what the server's clients file grants it.

Invariants named here: ``grants_enforced`` (producing or consuming outside a client's globs,
and any verb on a branch of a node it does not act for, is refused with ``unauthorised`` and
counted, and nothing is staged or handed out), ``no_branch_leak`` (recover names only the
caller's nodes' branches), ``revocation`` (a reload reaches the next request of an open
connection; a bad file on reload keeps the old one) and ``certificate_identity`` (a certificate
the file does not map, or one no trusted CA signed, never gets past connect).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator import (
    MemoryDecisionLog,
    Transaction,
    TransactionManager,
    TransactionRolledBack,
    Xid,
)
from messaging.auth import AuthError, SharedSecret, TlsConfig
from messaging.authz import UnauthorisedError
from messaging.connection import connect
from messaging.frames import ErrorFrame
from messaging.remote import RemoteCursor, RemoteMessageLog, RemoteUnavailable
from messaging.server import CursorServer, LogServer
from tests.integration.test_serve import port_of
from tests.support.tls import issue, make_ca

ORDERS, BILLING, LOG = (
    b"orders app secret, 32 bytes long!",
    b"billing app secret, 32 bytes long",
    b"log one's secret, 32 bytes long!!",
)
CLIENTS = f"""
[clients.orders-app]
secret = "{ORDERS.decode()}"
produce = ["orders.*"]
consume = ["orders.*"]
administer = ["orders.*"]
nodes = ["orders-1"]

[clients.billing-app]
secret = "{BILLING.decode()}"
produce = ["billing.*"]
consume = ["billing.*", "topic:billing/*"]
nodes = ["billing-1"]

[clients.log-1]
secret = "{LOG.decode()}"
transfer = true
"""


def refused(tm: TransactionManager, work: Callable[[Transaction], object]) -> UnauthorisedError:
    """Run ``work`` in a transaction that must roll back because the server refused it."""
    with pytest.raises(TransactionRolledBack) as caught, tm.transaction() as tx:
        work(tx)
    cause = caught.value.__cause__
    assert isinstance(cause, UnauthorisedError), repr(cause)
    return cause


def manager(node: str, *resources: object) -> TransactionManager:
    return TransactionManager(node, MemoryDecisionLog(), list(resources),  # type: ignore[arg-type]
                              recovery_interval=None, reaper_interval=None)  # fmt: skip


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[LogServer, CursorServer, Path]]:
    clients = tmp_path / "clients.toml"
    clients.write_text(CLIENTS)
    with (
        CursorServer(tmp_path / "cursor", None, listen=("127.0.0.1", 0), clients=clients,
                     clients_watch=0) as cursor,
        LogServer(tmp_path / "log", SharedSecret(LOG), cursor=cursor.address, server_id="log-1",
                  listen=("127.0.0.1", 0), clients=clients, clients_watch=0) as log,
    ):  # fmt: skip
        yield log, cursor, clients


def remote_log(log: LogServer, who: str, secret: bytes) -> RemoteMessageLog:
    assert log.address is not None
    return RemoteMessageLog(log.address, SharedSecret(secret), client_id=who, lazy_commit=False)


def remote_cursor(cursor: CursorServer, who: str, secret: bytes) -> RemoteCursor:
    return RemoteCursor(cursor.address, SharedSecret(secret), client_id=who, lazy_commit=False)


def test_grants_enforced_producing_outside_the_globs_is_refused_and_counted(
    stack: tuple[LogServer, CursorServer, Path],
) -> None:
    log, cursor, _ = stack
    with remote_log(log, "orders-app", ORDERS) as mlog, manager("orders-1", mlog) as tm:
        with tm.transaction() as tx:
            tx.join(mlog).send("orders.created", b"order 1")
        two = refused(
            tm,
            lambda tx: (
                tx.join(mlog).send("orders.created", b"order 2"),
                tx.join(mlog).send("billing.invoices", b"not yours"),
            ),
        )
        assert "may not produce to 'billing.invoices'" in two.message
        refused(tm, lambda tx: tx.join(mlog).send("billing.x", b"one phase"))
        nack = refused(
            tm,
            lambda tx: tx.join(mlog).send(
                "orders.created", b"its NACK to billing", admin_queue="billing.nacks"
            ),
        )
        assert "'billing.nacks'" in nack.message
    assert log.authoriser is not None and log.listener is not None
    assert log.authoriser.stats["denied_produce"] == 3
    assert log.listener.stats["denied"] == 3  # the listener shows the same counters
    assert log.mlog.stats().prepared == 0  # nothing of a refused request was staged
    assert log.wait_idle(10)  # the log's own transfer is authorised at the cursor (transfer)
    assert [d.body for d in cursor.cursor.available("orders.created")] == [b"order 1"]


def test_grants_enforced_consuming_outside_the_globs_is_refused_and_counted(
    stack: tuple[LogServer, CursorServer, Path],
) -> None:
    log, cursor, _ = stack
    with (
        remote_log(log, "billing-app", BILLING) as mlog,
        manager("billing-1", mlog) as tm,
        tm.transaction() as tx,
    ):
        tx.join(mlog).send("billing.invoices", b"invoice 1")
    assert log.wait_idle(10)
    with remote_cursor(cursor, "orders-app", ORDERS) as rc, manager("orders-1", rc) as tm:
        with pytest.raises(UnauthorisedError, match=r"may not consume 'billing\.invoices'"), \
                tm.transaction() as tx:  # fmt: skip
            tx.join(rc).receive("billing.invoices", timeout=0.5)
        with tm.transaction() as tx:
            assert tx.join(rc).receive("orders.created", timeout=0.1) is None  # its own: fine
        with pytest.raises(UnauthorisedError):  # administration outside its globs
            rc.dead_letters("billing.invoices")
        assert rc.dead_letters() == []  # a listing: filtered, not refused
    assert cursor.authoriser is not None
    assert cursor.authoriser.stats["denied_consume"] == 1
    assert cursor.authoriser.stats["denied_administer"] == 1
    assert [d.body for d in cursor.cursor.available("billing.invoices")] == [b"invoice 1"]


def test_no_branch_leak_another_nodes_branch_cannot_be_finished_or_listed(
    stack: tuple[LogServer, CursorServer, Path],
) -> None:
    log, _, _ = stack
    xid = Xid.branch_of("billing-1:0a0b-1", "mlog")
    with remote_log(log, "billing-app", BILLING) as billing, \
            remote_log(log, "orders-app", ORDERS) as orders:  # fmt: skip
        billing.start(xid).send("billing.invoices", b"prepared, in doubt")
        billing.prepare(xid)
        with pytest.raises(UnauthorisedError, match="may not act for node 'billing-1'"):
            orders.commit(xid)
        with pytest.raises(UnauthorisedError):
            orders.rollback(xid)
        with pytest.raises(UnauthorisedError):
            orders.forget(xid)
        assert orders.recover() == []  # billing-1's branch is not named to orders-app
        assert billing.recover() == [xid]
        billing.commit(xid)
    assert log.authoriser is not None
    assert log.authoriser.stats["denied_node"] == 3
    assert log.authoriser.stats["recover_hidden"] == 1
    assert log.wait_idle(10)


def test_revocation_reaches_an_open_connection_and_a_bad_file_keeps_the_old_one(
    stack: tuple[LogServer, CursorServer, Path],
) -> None:
    log, _, clients = stack
    authoriser = log.authoriser
    assert authoriser is not None
    with remote_log(log, "orders-app", ORDERS) as mlog, manager("orders-1", mlog) as tm:
        with tm.transaction() as tx:
            tx.join(mlog).send("orders.created", b"before")
        clients.write_text("[clients.orders-app\n")  # broken TOML: keep what was loaded
        assert authoriser.reload() is False
        assert authoriser.stats["reload_failures"] == 1
        with tm.transaction() as tx:
            tx.join(mlog).send("orders.created", b"still allowed")
        clients.write_text(CLIENTS[CLIENTS.index("[clients.billing-app]") :])
        assert authoriser.reload() is True
        gone = refused(tm, lambda tx: tx.join(mlog).send("orders.created", b"revoked"))
        assert "not in the server's clients file" in gone.message
        assert authoriser.stats["denied_revoked"] == 2  # the commit, then its rollback
    with remote_log(log, "orders-app", ORDERS) as again, pytest.raises(AuthError):
        again.recover()  # a new connection: the client has no key any more
    assert authoriser.stats["denied_unknown_client"] == 1


def test_certificate_identity_unknown_and_untrusted_certificates_are_refused(
    tmp_path: Path,
) -> None:
    ca = make_ca(tmp_path / "ca")
    server = issue(ca, tmp_path / "certs", "localhost", "DNS:localhost", "IP:127.0.0.1")
    consumer = issue(ca, tmp_path / "certs", "consumer-a", "DNS:consumer-a.internal")
    transfer = issue(ca, tmp_path / "certs", "log-one")
    stranger = issue(ca, tmp_path / "certs", "stranger")
    other_ca = make_ca(tmp_path / "other-ca", "another CA")
    forged = issue(other_ca, tmp_path / "forged", "consumer-a", "DNS:consumer-a.internal")
    clients = tmp_path / "clients.toml"
    clients.write_text(
        '[clients.consumer]\ncertificate = ["consumer-a.internal"]\nconsume = ["orders.*"]\n'
        'nodes = ["orders-1"]\n\n[clients.log]\ncertificate = ["log-one"]\ntransfer = true\n'
    )
    tls = TlsConfig(server.certfile, server.keyfile, ca[0].as_posix(), require_client_cert=True)
    log_tls = TlsConfig(transfer.certfile, transfer.keyfile, ca[0].as_posix()).client_context()
    with (
        CursorServer(tmp_path / "cursor", None, listen=("127.0.0.1", 0), clients=clients,
                     tls_server=tls.server_context(), clients_watch=0) as cursor,
        LogServer(tmp_path / "log", None, cursor=cursor.address, tls_client=log_tls,
                  cursor_hostname="localhost") as log,
        manager("orders-1", log.resource) as producer,
    ):  # fmt: skip
        with producer.transaction() as tx:
            tx.join(log.resource).send("orders.created", b"over mutual TLS")
        assert log.wait_idle(10)  # the log's transfer is known by its certificate

        def remote(cert: TlsConfig) -> RemoteCursor:
            return RemoteCursor(cursor.address, None, client_id="anything", tls=cert,
                                server_hostname="localhost", lazy_commit=False)  # fmt: skip

        with remote(consumer) as rc, manager("orders-1", rc) as tm, tm.transaction() as tx:
            got = tx.join(rc).receive("orders.created", timeout=5)
            assert got is not None and got.body == b"over mutual TLS"
        with remote(stranger) as rc, pytest.raises(AuthError, match="unauthorised"):
            rc.recover()
        with remote(forged) as rc, pytest.raises((AuthError, RemoteUnavailable)):
            rc.recover()
    stats = cursor.listener.stats
    assert stats["denied_unknown_certificate"] == 1
    assert stats["refused_tls"] >= 1  # the forged certificate: no trusted CA signed it


# -- `twopc serve` as real processes: SIGHUP, a changed file, the flags ------------------------

SERVE = "import sys; from coordinator.cli import main; sys.exit(main())"
REPO = Path(__file__).resolve().parents[2]


def serve(*args: str, secret: bytes | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "TWOPC_SECRET"}
    if secret is not None:
        env["TWOPC_SECRET"] = secret.decode()
    return subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
    )  # fmt: skip


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.2)


def sends(address: tuple[str, int]) -> bool:
    """Can orders-app send now (over a fresh connection each time)?"""
    with (
        RemoteMessageLog(address, SharedSecret(ORDERS), client_id="orders-app") as mlog,
        manager("orders-1", mlog) as tm,
    ):
        try:
            with tm.transaction() as tx:
                tx.join(mlog).send("orders.created", b"m")
        except (TransactionRolledBack, AuthError):
            return False
        return True


def test_revocation_by_sighup_and_by_a_changed_file_in_twopc_serve(tmp_path: Path) -> None:
    clients = tmp_path / "clients.toml"
    clients.write_text(CLIENTS)
    cursor = serve("cursor", "--dir", str(tmp_path / "c"), "--listen", "127.0.0.1:0",
                   "--clients", str(clients))  # fmt: skip
    try:
        cursor_port = port_of(cursor)
    except BaseException:
        stop(cursor)
        raise
    log = serve("log", "--dir", str(tmp_path / "l"), "--listen", "127.0.0.1:0",
                "--cursor", f"127.0.0.1:{cursor_port}", "--id", "log-1",
                "--clients", str(clients), secret=LOG)  # fmt: skip
    try:
        address = ("127.0.0.1", port_of(log))
        assert sends(address)
        clients.write_text("[clients.orders-app]\nsecret = 7\n")  # bad: the old one stays
        log.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert sends(address)
        clients.write_text(CLIENTS[CLIENTS.index("[clients.billing-app]") :])
        log.send_signal(signal.SIGHUP)
        eventually(lambda: not sends(address))  # revoked
        clients.write_text(CLIENTS)  # no signal: the server sees the file change
        eventually(lambda: sends(address))
        with (
            RemoteCursor(("127.0.0.1", cursor_port), SharedSecret(ORDERS),
                         client_id="orders-app") as rc,
            manager("orders-1", rc) as tm,
        ):  # fmt: skip
            got: list[bytes] = []
            eventually(lambda: got.extend(_receive(tm, rc)) or len(got) >= 3)
    finally:
        outputs = stop(log, cursor)
    assert log.returncode == 0 and cursor.returncode == 0, outputs
    assert "keeping the clients loaded before" in outputs[0]
    assert "client 'orders-app' has no key here" in outputs[0]  # revoked: not admitted


def stop(*procs: subprocess.Popen[str]) -> list[str]:
    """SIGTERM each, then their outputs; one that does not stop within 30 s is killed and its
    output shown, so a hang reports itself instead of hiding the test's own failure."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=30)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append("did not stop within 30 s:\n" + proc.communicate()[0])
    return outputs


def _receive(tm: TransactionManager, rc: RemoteCursor) -> list[bytes]:
    """What one receive takes; nothing while the cursor refuses the client: it reads the
    changed clients file on its own schedule, after the log may already have."""
    try:
        with tm.transaction() as tx:
            return [d.body for d in tx.join(rc).receive_many("orders.created", 10, timeout=0.5)]
    except AuthError:
        return []


def test_mutual_tls_flags_need_a_ca(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, "serve", "cursor", "--dir", str(tmp_path / "c"),
         "--listen", "127.0.0.1:0", "--tls-require-client-cert", "--clients", "x.toml"],
        capture_output=True, text=True, cwd=REPO, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--tls-require-client-cert needs --tls-cert" in proc.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[clients.a]\nsecret = "0123456789abcdef"\nprodcue = ["x"]\n')
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, "serve", "cursor", "--dir", str(tmp_path / "c"),
         "--listen", "127.0.0.1:0", "--clients", str(bad)],
        capture_output=True, text=True, cwd=REPO, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "client 'a': unknown key 'prodcue'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_branch_leak_at_the_cursor_and_subscriptions_by_grant(
    stack: tuple[LogServer, CursorServer, Path],
) -> None:
    _, cursor, _ = stack
    theirs = Xid.branch_of("billing-1:0c0d-1", "cursor")
    with (
        remote_cursor(cursor, "billing-app", BILLING) as billing,
        remote_cursor(cursor, "orders-app", ORDERS) as orders,
    ):
        billing.start(theirs).receive("billing.invoices", timeout=0)  # billing-1's branch
        with pytest.raises(UnauthorisedError, match="may not act for node 'billing-1'"):
            orders.start(theirs).receive("orders.created", timeout=0)
        assert orders.recover() == []
        with pytest.raises(UnauthorisedError, match="subscription 'topic:orders/audit'"):
            orders.subscribe("topic:orders", "audit")  # orders.* does not cover topic:…
        cursor.cursor.subscribe("topic:billing", "ledger")
        assert orders.subscriptions() == []  # a listing: only what it may consume or administer
        assert [s.name for s in billing.subscriptions()] == ["ledger"]  # topic:billing/*
    assert cursor.authoriser is not None
    assert cursor.authoriser.stats["denied_node"] == 1
    assert cursor.authoriser.stats["denied_consume"] == 1


def test_grants_enforced_a_client_without_transfer_cannot_deliver_as_a_log(
    stack: tuple[LogServer, CursorServer, Path],
) -> None:
    _, cursor, _ = stack
    conn = connect(cursor.address, SharedSecret(ORDERS), "orders-app", "transfer")
    try:
        refusal = conn.recv(timeout=10)
    finally:
        conn.close()
    assert isinstance(refusal, ErrorFrame) and refusal.code == "unauthorised"
    assert "may not deliver as a log" in refusal.message
    assert cursor.listener.stats["denied_transfer"] == 1


def test_operator_ops_need_administer_grants(stack: tuple[LogServer, CursorServer, Path]) -> None:
    """Queue depth, taking a message out of a queue and a server's statistics: a listing shows
    only the client's queues; dropping a message needs ``administer`` on its queue; statistics
    (which name every destination) need an ``administer`` glob matching ``*``."""
    log, cursor, _ = stack
    for node, who, secret, queue in (
        ("orders-1", "orders-app", ORDERS, "orders.created"),
        ("billing-1", "billing-app", BILLING, "billing.invoices"),
    ):
        with (
            remote_log(log, who, secret) as sender,
            manager(node, sender) as tm,
            tm.transaction() as tx,
        ):
            tx.join(sender).send(queue, b"one")
    assert log.wait_idle(10)
    with (
        remote_cursor(cursor, "orders-app", ORDERS) as orders,
        remote_cursor(cursor, "billing-app", BILLING) as billing,
        remote_log(log, "orders-app", ORDERS) as producer,
    ):
        assert {q.queue for q in orders.queues()} == {"orders.created"}  # not billing's
        assert {q.queue for q in billing.queues()} == {"billing.invoices"}
        with pytest.raises(UnauthorisedError, match=r"may not administer 'billing\.invoices'"):
            orders.remove_message("billing.invoices", "0" * 32, "drop")
        with pytest.raises(UnauthorisedError, match="may not administer"):
            billing.remove_message("billing.invoices", "0" * 32, "drop")  # consume is not enough
        with pytest.raises(UnauthorisedError, match=r"may not administer '\*'"):
            orders.server_stats()
        with pytest.raises(UnauthorisedError, match=r"may not administer '\*'"):
            producer.server_stats()
    assert cursor.authoriser is not None and log.authoriser is not None
    assert cursor.authoriser.stats["denied_administer"] == 3
    assert log.authoriser.stats["denied_administer"] == 1
