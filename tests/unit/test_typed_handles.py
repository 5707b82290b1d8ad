"""``tx.join(resource)`` is typed by the resource: mypy (strict) reveals each handle's own type.

`Resource` is generic in its handle, and `Transaction.join` returns it; `PostgresResource`'s
``handle=`` picks the type by overload. One mypy run over a snippet checks every resource.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SNIPPET = """
from typing import Any
from sqlalchemy import create_engine

from coordinator import Resource, Transaction
from messaging.remote import RemoteCursor, RemoteMessageLog
from resource_managers.cursor import CursorResource
from resource_managers.message_log import MessageLogResource
from resource_managers.postgres import PostgresResource
from resource_managers.redis import RedisResource

engine = create_engine("postgresql+psycopg2://db/x")
pg = PostgresResource(engine, "pg")
core = PostgresResource(engine, "core", handle="connection")


def work(tx: Transaction, r: RedisResource, log: MessageLogResource, cur: CursorResource,
         rlog: RemoteMessageLog, rcur: RemoteCursor, anything: Resource[Any]) -> None:
    reveal_type(tx.join(pg))
    reveal_type(tx.join(core))
    reveal_type(tx.join(r))
    reveal_type(tx.join(log))
    reveal_type(tx.join(cur))
    reveal_type(tx.join(rlog))
    reveal_type(tx.join(rcur))
    reveal_type(tx.join(anything))
"""

EXPECTED = [
    "sqlalchemy.orm.session.Session",
    "sqlalchemy.engine.base.Connection",
    "resource_managers.redis.branch.RedisBranch",
    "resource_managers.message_log.resource.ProducerBranch",
    "resource_managers.cursor.resource.ConsumerBranch",
    "messaging.remote._remote_log.RemoteProducerBranch",
    "messaging.remote._remote_cursor.RemoteConsumerBranch",
    "Any",
]


def test_mypy_reveals_each_resources_handle(tmp_path: Path) -> None:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         "--no-error-summary", str(snippet)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    revealed = re.findall(r'Revealed type is "([^"]+)"', done.stdout)
    assert revealed == EXPECTED, done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert not errors, "\n".join(errors)


SEND_SNIPPET = """
from coordinator import Transaction
from messaging.remote import RemoteMessageLog
from messaging.session import Session
from resource_managers.message_log import MessageLogResource


def work(tx: Transaction, log: MessageLogResource, rlog: RemoteMessageLog, s: Session) -> None:
    tx.join(log).send("orders", b"x", {"h": "1"}, priority=3, ttl=5.0, key="k")
    tx.join(rlog).send_to_list(["a", "b"], b"x", persistent=False, publisher="p")
    s.send("orders", b"x", key="k", admin_queue="errors")
    tx.join(log).send("orders", b"x", prority=3)
    s.send("orders", b"x", publisher="p")
"""


def test_one_send_signature_checks_every_option(tmp_path: Path) -> None:
    """Every producer path takes the options of `SendOptions` by keyword, typed once: a
    misspelt option is an error to mypy, and a session refuses the ones it sets itself."""
    snippet = tmp_path / "send_snippet.py"
    snippet.write_text(SEND_SNIPPET, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         "--no-error-summary", str(snippet)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert {int(line.split(":")[1]) for line in errors} == {12, 13}, done.stdout + done.stderr
    assert '"prority"' in errors[0] and '"publisher"' in errors[1], errors
