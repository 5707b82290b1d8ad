"""``twopc subscription``, ``twopc dlq`` and ``twopc queue`` as an operator runs them: online
against real ``twopc serve log|cursor`` processes (over TLS), and offline on the cursor's
directory once the servers have stopped.

Seed 003: durable subscriptions are created, listed and removed from the command line. Seed 004:
a queue is marked non-transactional from the command line, and dead letters of both kinds (too
many deliveries; rejected by that queue) are listed with their reason, delivery count, size and
original destination, replayed by id and purged. The errors an operator meets are clear and exit
non-zero: a server that is down, a wrong secret, an unknown subscription, a directory locked by
its running server, a purge that names no messages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from messaging.auth import TlsConfig
from tests.integration.cursor_stack import MAX_DELIVERIES, Stack, poison, twopc, wait_for
from tests.support.msg_cluster import free_port
from tests.support.tls import make_certificate


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def stack(tmp_path: Path, tls: TlsConfig) -> Iterator[Stack]:
    running = Stack(tmp_path, tls)
    try:
        running.start()  # a server that started before another failed to is stopped too
        yield running
    finally:
        running.stop()


def ok(*args: str) -> str:
    done = twopc(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def failed(*args: str, env: dict[str, str] | None = None) -> str:
    done = twopc(*args, env=env)
    assert done.returncode != 0, done.stdout
    assert done.stderr.startswith(("twopc: ", "usage:")), done.stderr
    return done.stderr


def test_subscriptions_from_the_command_line_online_and_offline(stack: Stack) -> None:
    online = stack.connect
    out = ok("subscription", "create", "news", "billing", *online)
    assert "topic:news  billing" in out and "topic:news/billing" in out
    ok("subscription", "create", "topic:news", "audit", *online)
    ok("subscription", "create", "sport", "audit", *online)
    listed = json.loads(ok("subscription", "list", "news", *online, "--json"))
    assert [(s["topic"], s["name"], s["durable"], s["connected"]) for s in listed] == [
        ("topic:news", "audit", True, False), ("topic:news", "billing", True, False)]  # fmt: skip
    assert "removed topic:news/audit" in ok("subscription", "remove", "news", "audit", *online)
    assert "no subscription 'topic:news/audit'" in failed(
        "subscription", "remove", "news", "audit", *online)  # fmt: skip

    offline = ["--dir", str(stack.cursor_dir)]
    locked = failed("subscription", "list", *offline)  # the running server holds the directory
    assert "[log-locked]" in locked and "--connect" in locked
    stack.stop()
    table = ok("subscription", "list", *offline).splitlines()
    assert table[0].split() == ["topic", "name", "durable", "connected", "available",
                                "in_flight", "queue"]  # fmt: skip
    assert [line.split()[:2] for line in table[2:]] == [["topic:news", "billing"],
                                                        ["topic:sport", "audit"]]  # fmt: skip
    removed = json.loads(ok("subscription", "remove", "sport", "audit", *offline, "--json"))
    assert removed == {"topic": "topic:sport", "name": "audit", "dropped": 0}
    ok("subscription", "create", "sport", "scores", *offline)
    names = [s["name"] for s in json.loads(ok("subscription", "list", *offline, "--json"))]
    assert names == ["billing", "scores"]


def test_dead_letters_from_the_command_line_online_and_offline(stack: Stack) -> None:
    online = stack.connect
    assert ok("queue", "set-transactional", "refunds", "false", *online).strip() == (
        "refunds is non-transactional")  # fmt: skip
    poisoned = stack.send("orders", b"poison-1", b"poison-2")
    rejected = stack.send("refunds", b"refund!", admin_queue="admin")[0]
    with stack.cursor() as remote:
        assert {poison(remote, "orders"), poison(remote, "orders")} == set(poisoned)
        wait_for(lambda: len(remote.dead_letters()) == 3)

    rows = {r["id"]: r for r in json.loads(ok("dlq", "list", *online, "--json"))}
    assert set(rows) == {*poisoned, rejected}
    for mid in poisoned:
        assert rows[mid]["dlq"] == "orders.DLQ" and rows[mid]["destination"] == "orders"
        assert rows[mid]["reason"].startswith("max-deliveries:")
        assert rows[mid]["deliveries"] == MAX_DELIVERIES and rows[mid]["size"] == 8
    refund = rows[rejected]
    assert refund["reason"].startswith("rejected:") and refund["deliveries"] == 0
    assert refund["destination"] == "refunds" and refund["dlq"] == "refunds.DLQ"
    table = ok("dlq", "list", "orders", *online).splitlines()
    assert table[0].split() == ["id", "dlq", "reason", "deliveries", "size", "destination"]
    assert len(table) == 4 and all(poisoned[0] in table[2] or poisoned[1] in line
                                   for line in table[2:])  # fmt: skip

    refused = failed("dlq", "purge", "orders.DLQ", *online)  # names nothing: refused
    assert "one of the arguments --id --all is required" in refused
    assert "replayed 1 dead letter of orders.DLQ" in ok(
        "dlq", "replay", "orders", "--id", poisoned[0], *online)  # fmt: skip
    missing = failed("dlq", "replay", "orders", "--id", "gone", *online)
    assert "1 of 1 ids not found among the dead letters waiting in orders.DLQ" in missing

    stack.stop()
    offline = ["--dir", str(stack.cursor_dir)]
    left = json.loads(ok("dlq", "list", *offline, "--json"))
    assert sorted(r["id"] for r in left) == sorted([poisoned[1], rejected])
    purged = json.loads(ok("dlq", "purge", "refunds.DLQ", "--id", rejected, *offline, "--json"))
    assert purged == {"dlq": "refunds.DLQ", "purged": 1, "not_found": 0}
    assert "purged 1 dead letter of orders.DLQ" in ok("dlq", "purge", "orders", "--all", *offline)
    assert ok("dlq", "list", *offline).strip() == "(none)"
    assert ok("queue", "set-transactional", "refunds", "true", *offline, "--json")


def test_command_line_errors_are_clear(stack: Stack, tmp_path: Path) -> None:
    down = failed("subscription", "list", "--connect", f"127.0.0.1:{free_port()}")
    assert "[remote-unavailable] no cursor server answers at" in down
    wrong = failed("subscription", "list", *stack.connect,
                   env={"TWOPC_SECRET": "not the secret, but long enough"})  # fmt: skip
    assert "[configuration]" in wrong and "wrong secret" in wrong
    assert "no cursor directory" in failed("dlq", "list", "--dir", str(tmp_path / "typo"))
    assert "[illegal-state]" in failed("subscription", "remove", "news", "x", *stack.connect)
    assert "invalid subscription name" in failed(
        "subscription", "create", "news", "no spaces", *stack.connect)  # fmt: skip
    usage = failed("queue", "set-transactional", "orders", "maybe", *stack.connect)
    assert "invalid choice" in usage
